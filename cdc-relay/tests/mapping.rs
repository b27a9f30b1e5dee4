//! Another team's outbox: Debezium's documented table, unmodified but for the two columns a
//! catch-up needs (which producers never name), read with `--outbox-preset debezium` into a
//! sharded stream. Every row once, in order per key, with its key and extra column as
//! fields, through a relay SIGKILL, a Redis restart and a Redis that lost everything.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use redis::streams::StreamRangeReply;
use testkit::{shared_postgres, wait_until, RedisServer};

use crate::support::{tail, Fixture};

const SHARDS: u32 = 4;
const TYPES: [&str; 3] = ["order", "customer", "invoice"];

/// Debezium's outbox DDL (its documentation's, as is), the catch-up's two columns added the
/// way the migration guide says, its publication, and the relay's read grant.
const DDL: &str = "
    CREATE SCHEMA shop;
    CREATE TABLE shop.outbox (
        id uuid NOT NULL PRIMARY KEY,
        aggregatetype varchar(255) NOT NULL,
        aggregateid varchar(255) NOT NULL,
        type varchar(255) NOT NULL,
        payload jsonb
    );
    ALTER TABLE shop.outbox ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY;
    ALTER TABLE shop.outbox ADD COLUMN tx xid8 DEFAULT pg_current_xact_id();
    CREATE INDEX ON shop.outbox (tx) WHERE tx IS NOT NULL;
    CREATE PUBLICATION shop_outbox FOR TABLE shop.outbox WITH (publish = 'insert');
    GRANT USAGE ON SCHEMA shop TO consumers_relay;
    GRANT SELECT ON shop.outbox TO consumers_relay;
";

const FLAGS: [&str; 8] = [
    "--outbox-table",
    "shop.outbox",
    "--publication",
    "shop_outbox",
    "--outbox-preset",
    "debezium",
    // Debezium's own option name and placement syntax.
    "--table-fields-additional-placement",
    "aggregatetype:header:aggregate_type",
];

/// One entry as the test compares it.
#[derive(Debug, Clone)]
struct Seen {
    /// The stream (before sharding) it is in.
    stream: String,
    shard: u32,
    fields: HashMap<String, String>,
}

/// Where a test's relay writes: one stream of `shards`, or one per aggregate type.
#[derive(Clone)]
struct Streams {
    /// `None`: the fixture's one stream.
    template: Option<String>,
    shards: u32,
}

impl Streams {
    fn one(shards: u32) -> Self {
        Self {
            template: None,
            shards,
        }
    }

    /// The stream a row of `aggregate_type` belongs in (a `char(n)` column's padding is not
    /// part of the route).
    fn of(&self, fx: &Fixture<'_>, aggregate_type: &str) -> String {
        match &self.template {
            Some(t) => t.replace("${routedByValue}", aggregate_type.trim_end()),
            None => fx.stream.clone(),
        }
    }

    fn all(&self, fx: &Fixture<'_>) -> Vec<String> {
        match &self.template {
            Some(_) => TYPES.iter().map(|t| self.of(fx, t)).collect(),
            None => vec![fx.stream.clone()],
        }
    }
}

async fn read_stream(fx: &Fixture<'_>, stream: &str, shards: u32) -> Vec<Seen> {
    let mut conn = fx.redis.connect().await.unwrap();
    let mut all = Vec::new();
    for shard in 0..shards {
        let key = outbox_core::stream::shard_key(stream, shard, shards);
        let reply: StreamRangeReply = redis::cmd("XRANGE")
            .arg(&key)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        for item in reply.ids {
            let fields = item
                .map
                .iter()
                .map(|(k, v)| (k.clone(), redis::from_redis_value_ref::<String>(v).unwrap()))
                .collect();
            all.push(Seen {
                stream: stream.to_string(),
                shard,
                fields,
            });
        }
    }
    all
}

async fn read_all(fx: &Fixture<'_>, streams: &Streams) -> Vec<Seen> {
    let mut all = Vec::new();
    for stream in streams.all(fx) {
        all.extend(read_stream(fx, &stream, streams.shards).await);
    }
    all
}

/// The table as the truth: (id, aggregatetype, aggregateid, type, payload) in `seq` order.
async fn table_rows(fx: &Fixture<'_>) -> Vec<(String, String, String, String, String)> {
    let admin = fx.db.connect().await.unwrap();
    admin
        .query(
            "SELECT id::text, aggregatetype, aggregateid, type, payload::text FROM shop.outbox ORDER BY seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect()
}

/// Every row of the table is in its stream exactly once, in the shard of its key, with its
/// fields; the entries of each key are in the table's (commit) order.
async fn assert_every_row_once_in_key_order(fx: &Fixture<'_>, streams: &Streams, what: &str) {
    let shards = streams.shards;
    let rows = table_rows(fx).await;
    wait_until(Duration::from_secs(60), what, || async {
        let n = read_all(fx, streams).await.len();
        if n >= rows.len() {
            Ok(())
        } else {
            Err(format!("{n} of {} rows in the stream", rows.len()))
        }
    })
    .await;
    let seen = read_all(fx, streams).await;
    let mut by_id: HashMap<&str, &Seen> = HashMap::new();
    for entry in &seen {
        let id = entry.fields["outbox_id"].as_str();
        assert!(by_id.insert(id, entry).is_none(), "{what}: {id} twice");
    }
    assert_eq!(seen.len(), rows.len(), "{what}: entries that are no row");
    let mut order: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (id, aggregate_type, key, event_type, payload) in &rows {
        let entry = by_id
            .get(id.as_str())
            .unwrap_or_else(|| panic!("{what}: row {id} is not in the stream"));
        let f = &entry.fields;
        assert_eq!(
            (entry.stream.as_str(), entry.shard),
            (
                streams.of(fx, aggregate_type).as_str(),
                outbox_core::stream::shard_of(Some(key.as_bytes()), shards)
            ),
            "{what}: {id} in the wrong stream or shard"
        );
        assert_eq!(f["key"], *key, "{what}: key of {id}");
        assert_eq!(f["aggregate_type"], *aggregate_type);
        assert_eq!(f["event"], *event_type);
        let stored: serde_json::Value = serde_json::from_str(payload).unwrap();
        let published: serde_json::Value = serde_json::from_str(&f["payload"]).unwrap();
        assert_eq!(published, stored, "{what}: payload of {id}");
        assert!(
            !f.contains_key("created_at"),
            "no timestamp column: no created_at"
        );
        assert!(f.contains_key("published_at"));
        order.entry(key.as_str()).or_default().push(id.as_str());
    }
    // Within a shard, entries are in stream order; each key's must be the table's.
    for (key, ids) in order {
        let shard = outbox_core::stream::shard_of(Some(key.as_bytes()), shards);
        let in_stream: Vec<&str> = seen
            .iter()
            .filter(|e| e.shard == shard && e.fields["key"] == key)
            .map(|e| e.fields["outbox_id"].as_str())
            .collect();
        assert_eq!(in_stream, ids, "{what}: order of key {key}");
    }
}

/// Writers, one per aggregate type, each writing `count` single-row transactions over its
/// own five aggregates in turn (so each key's rows are written one after another).
async fn write(fx: &Fixture<'_>, from: u32, count: u32) {
    let mut tasks = Vec::new();
    for aggregate_type in TYPES {
        let client = fx.db.connect().await.unwrap();
        tasks.push(tokio::spawn(async move {
            for n in from..from + count {
                let key = format!("{aggregate_type}-{}", n % 5);
                client
                    .execute(
                        "INSERT INTO shop.outbox (id, aggregatetype, aggregateid, type, payload)
                         VALUES (gen_random_uuid(), $1, $2, $3, $4::text::jsonb)",
                        &[
                            &aggregate_type,
                            &key,
                            &format!("{aggregate_type}.changed"),
                            &serde_json::json!({"n": n, "aggregate": key}).to_string(),
                        ],
                    )
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_outbox_is_relayed_once_in_key_order_through_kill_restart_and_wipe() {
    relay_through_kill_restart_and_wipe(Streams::one(SHARDS), &FLAGS, &[]).await;
}

/// Debezium's routing: `route.by.field` (aggregatetype) into `route.topic.replacement`, one
/// stream per aggregate type, each created on its first row; and logical messages of a
/// prefix into a stream of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_outbox_routed_by_aggregate_type_is_relayed_once_per_stream_through_kill_restart_and_wipe(
) {
    let template = format!(
        "outbox.{}.${{routedByValue}}",
        testkit::unique_name("event")
    );
    let mut flags = FLAGS.to_vec();
    flags.extend([
        "--stream",
        &template,
        "--stream-shards",
        "2",
        // Debezium's option name for the route column (its default, said anyway).
        "--route-by-field",
        "aggregatetype",
        "--message-prefixes",
        "audit",
    ]);
    let streams = Streams {
        template: Some(template.clone()),
        shards: 2,
    };
    relay_through_kill_restart_and_wipe(streams, &flags, &["audit"]).await;
}

/// Messages of `prefix` emitted `count` times in transactions of their own.
async fn emit(fx: &Fixture<'_>, prefix: &str, from: u32, count: u32) {
    let client = fx.db.connect().await.unwrap();
    for n in from..from + count {
        client
            .execute(
                "SELECT pg_logical_emit_message(true, $1, $2::text)",
                &[&prefix, &format!("audit {n}")],
            )
            .await
            .unwrap();
    }
}

/// The contents of the messages of `prefix` in its stream (shard 0: a message has no key),
/// in stream order.
async fn messages(fx: &Fixture<'_>, streams: &Streams, prefix: &str) -> Vec<String> {
    read_stream(fx, &streams.of(fx, prefix), streams.shards)
        .await
        .into_iter()
        .map(|e| {
            assert_eq!(e.fields["event"], prefix);
            e.fields["payload"].clone()
        })
        .collect()
}

/// Each prefix's stream holds messages `from..to` once each, in order, where `from` is at most
/// `want.start` and at least `earliest` (after a wipe, the slot sends again what it was not yet
/// told of, which Redis lost: those come back, in order).
async fn assert_messages(
    fx: &Fixture<'_>,
    streams: &Streams,
    prefixes: &[&str],
    earliest: u32,
    want: std::ops::Range<u32>,
    what: &str,
) {
    for prefix in prefixes {
        wait_until(Duration::from_secs(60), what, || async {
            let got = messages(fx, streams, prefix).await;
            let ok = (earliest..=want.start).any(|from| {
                got.iter()
                    .eq((from..want.end).map(|n| format!("audit {n}")).collect::<Vec<_>>().iter())
            });
            if ok {
                Ok(())
            } else {
                Err(format!("{what}: want audit {earliest}..{} (from at most {}) once each in order, got {got:?}", want.end, want.start))
            }
        })
        .await;
    }
}

/// Rows written while the relay is SIGKILLed, while Redis restarts, and after Redis lost
/// everything: every row once, in its stream and shard, in key order; every message once,
/// in order (those a wiped Redis held are gone with it, and only those).
/// A fresh database with [`DDL`] (`char(n)` for the route and key columns when `padded`).
async fn debezium_db(padded: bool) -> testkit::TestDb {
    let db = shared_postgres().create_database().await.unwrap();
    let ddl = if padded {
        DDL.replace("aggregatetype varchar(255)", "aggregatetype char(12)")
            .replace("aggregateid varchar(255)", "aggregateid char(16)")
    } else {
        DDL.to_string()
    };
    db.connect()
        .await
        .unwrap()
        .batch_execute(&ddl)
        .await
        .unwrap();
    db
}

/// A routed template of a name of its own, and the flags of a relay routing into it.
fn routed(shards: u32) -> (Streams, Vec<String>) {
    let template = format!(
        "outbox.{}.${{routedByValue}}",
        testkit::unique_name("event")
    );
    let mut flags: Vec<String> = FLAGS.iter().map(|f| f.to_string()).collect();
    flags.extend([
        "--stream".to_string(),
        template.clone(),
        "--stream-shards".to_string(),
        shards.to_string(),
    ]);
    let streams = Streams {
        template: Some(template),
        shards,
    };
    (streams, flags)
}

/// `char(n)` route and key columns: pgoutput sends them padded, `::text` trims them. A row
/// caught up from the table lands in the stream and shard, with the key, it had live, and
/// the padding is not part of the route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn padded_route_and_key_columns_land_alike_live_and_from_the_table() {
    // GIVEN Debezium's table with char(n) columns, routed into two shards per route
    let redis = RedisServer::start().unwrap();
    let db = debezium_db(true).await;
    let (streams, flags) = routed(2);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let fx = Fixture::set_up(&redis, db, streams.shards, &FLAGS).await;
    let relay = fx.spawn_relay("padded-1", &flags);
    relay.wait_streaming().await;
    // WHEN rows come live
    write(&fx, 0, 10).await;
    // THEN each is in its route's stream (padding dropped) and its padded key's shard
    assert_every_row_once_in_key_order(&fx, &streams, "live").await;

    // WHEN Redis loses everything and more rows come: all are caught up from the table
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    write(&fx, 10, 5).await;
    // THEN they land exactly as live ones did
    assert_every_row_once_in_key_order(&fx, &streams, "caught up from the table").await;
    relay.stop();
}

/// Redis evicted (or someone deleted) the route registry and every key of one route, while
/// the anchor's record beside the registry survived: the routes are found in the table again
/// and the lost one is caught up from it, not started empty at the slot's position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_lost_with_the_registry_is_caught_up_from_the_table() {
    // GIVEN a routed relay that published rows of three routes, stopped
    let redis = RedisServer::start().unwrap();
    let db = debezium_db(false).await;
    let (streams, flags) = routed(2);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let fx = Fixture::set_up(&redis, db, streams.shards, &FLAGS).await;
    let relay = fx.spawn_relay("evicted-1", &flags);
    relay.wait_streaming().await;
    write(&fx, 0, 10).await;
    assert_every_row_once_in_key_order(&fx, &streams, "before").await;
    relay.stop();

    // WHEN the registry and every key of the `order` route go, and the relay starts again
    let template = streams.template.clone().unwrap();
    let mut conn = redis.connect().await.unwrap();
    let mut gone: Vec<String> = Vec::new();
    for pattern in [
        template.replace("${routedByValue}", "_routes*"),
        template.replace("${routedByValue}", "order*"),
    ] {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut conn)
            .await
            .unwrap();
        gone.extend(keys);
    }
    assert!(gone.len() >= 2, "keys to delete: {gone:?}");
    let _: i64 = redis::cmd("DEL")
        .arg(&gone)
        .query_async(&mut conn)
        .await
        .unwrap();
    let relay = fx.spawn_relay("evicted-2", &flags);
    relay.wait_streaming().await;
    // (A new row of the lost route too: it must not make the route start empty.)
    write(&fx, 10, 3).await;

    // THEN every row is there once again, the lost route's caught up from the table
    assert_every_row_once_in_key_order(&fx, &streams, "after the registry was lost").await;
    relay.stop();
}

async fn relay_through_kill_restart_and_wipe(streams: Streams, flags: &[&str], prefixes: &[&str]) {
    // GIVEN Debezium's outbox table and a relay reading it with the debezium preset
    let redis = RedisServer::start().unwrap();
    let db = debezium_db(false).await;
    let fx = Fixture::set_up(&redis, db, streams.shards, &FLAGS).await;
    let relay = fx.spawn_relay("dbz-1", flags);
    relay.wait_streaming().await;
    if streams.template.is_some() {
        // WHEN each aggregate type's first row comes, one after another
        let client = fx.db.connect().await.unwrap();
        for aggregate_type in TYPES {
            client
                .execute(
                    "INSERT INTO shop.outbox (id, aggregatetype, aggregateid, type, payload)
                     VALUES (gen_random_uuid(), $1, $2, 'created', '{}')",
                    &[&aggregate_type, &format!("{aggregate_type}-first")],
                )
                .await
                .unwrap();
            let stream = streams.of(&fx, aggregate_type);
            wait_until(Duration::from_secs(30), "the route's first row", || async {
                match read_stream(&fx, &stream, streams.shards).await.len() {
                    1 => Ok(()),
                    n => Err(format!("{n} entries in {stream}")),
                }
            })
            .await;
        }
        // THEN its stream is made, starting at the slot's position: nothing was caught up
        // from the table
        for mode in ["everything", "since"] {
            let caught_up = relay
                .metric(&format!("cdc_relay_catch_ups_total{{mode=\"{mode}\"}}"))
                .await
                .unwrap_or(0.0);
            assert_eq!(caught_up, 0.0, "{mode}; log: {}", tail(&relay.child.log()));
        }
    }

    // WHEN rows (and messages) are written, the relay is SIGKILLed meanwhile and started again
    let writing = async {
        tokio::join!(write(&fx, 0, 60), async {
            for prefix in prefixes {
                emit(&fx, prefix, 0, 20).await;
            }
        });
    };
    let killing = async {
        wait_until(Duration::from_secs(30), "some rows published", || async {
            let n = read_all(&fx, &streams).await.len();
            if n >= 20 {
                Ok(())
            } else {
                Err(format!("{n} published"))
            }
        })
        .await;
        relay.child.kill().unwrap();
    };
    tokio::join!(writing, killing);
    let relay = fx.spawn_relay("dbz-2", flags);
    relay.wait_streaming().await;
    // THEN every row is there once, in order per key, with its key and extra column
    assert_every_row_once_in_key_order(&fx, &streams, "after the relay was killed").await;
    assert_messages(
        &fx,
        &streams,
        prefixes,
        0,
        0..20,
        "messages after the relay was killed",
    )
    .await;

    // WHEN Redis is killed and restarted on its AOF while rows are written
    let writing = write(&fx, 60, 40);
    let restarting = async {
        redis.kill().unwrap();
        redis.start_again().unwrap();
    };
    tokio::join!(writing, restarting);
    for prefix in prefixes {
        emit(&fx, prefix, 20, 10).await;
    }
    // THEN the same holds
    assert_every_row_once_in_key_order(&fx, &streams, "after Redis restarted").await;
    assert_messages(
        &fx,
        &streams,
        prefixes,
        0,
        0..30,
        "messages after Redis restarted",
    )
    .await;

    // WHEN Redis loses everything (its functions too) and more rows come
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    write(&fx, 100, 20).await;
    for prefix in prefixes {
        emit(&fx, prefix, 30, 10).await;
    }
    // THEN the relay rebuilds each shard from the table: every row once, in key order
    assert_every_row_once_in_key_order(&fx, &streams, "after Redis lost its data").await;
    // The messages Redis held are gone with it (no table holds them), but for those the slot
    // was not yet told of; every later one is there.
    assert_messages(
        &fx,
        &streams,
        prefixes,
        20,
        30..40,
        "messages after Redis lost its data",
    )
    .await;
    let rebuilt = relay
        .metric("cdc_relay_catch_ups_total{mode=\"everything\"}")
        .await
        .unwrap_or(0.0);
    assert!(
        rebuilt >= 1.0,
        "no catch-up counted; log: {}",
        tail(&relay.child.log())
    );
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapping_that_names_a_missing_column_is_refused_at_start_saying_which() {
    let redis = RedisServer::start().unwrap();
    let db = shared_postgres().create_database().await.unwrap();
    db.connect()
        .await
        .unwrap()
        .batch_execute(DDL)
        .await
        .unwrap();
    let fx = Fixture::set_up(&redis, db, SHARDS, &FLAGS).await;
    let mut flags = FLAGS.to_vec();
    flags.extend(["--outbox-timestamp-column", "occurred_at"]);
    let relay = fx.spawn_relay("dbz-bad", &flags);
    let status = relay.child.wait_exit(Duration::from_secs(30)).unwrap();
    assert!(!status.success());
    let log = relay.child.log();
    assert!(
        log.contains("shop.outbox has no column 'occurred_at', which the outbox mapping reads as the timestamp"),
        "{}",
        tail(&log)
    );
}

/// Debezium's documented DDL exactly (no catch-up columns), producers free to delete rows.
const UNMODIFIED_DDL: &str = "
    CREATE SCHEMA shop;
    CREATE TABLE shop.outbox (
        id uuid NOT NULL PRIMARY KEY,
        aggregatetype varchar(255) NOT NULL,
        aggregateid varchar(255) NOT NULL,
        type varchar(255) NOT NULL,
        payload jsonb
    );
    CREATE PUBLICATION shop_outbox FOR TABLE shop.outbox WITH (publish = 'insert');
    GRANT USAGE ON SCHEMA shop TO consumers_relay;
    GRANT SELECT ON shop.outbox TO consumers_relay;
";

/// Every row whose `n` is at least `required_from` is in its stream and shard; no row is there
/// twice, nothing is there that is no row, and each key's rows are in the order written.
async fn assert_rows_once_in_key_order(
    fx: &Fixture<'_>,
    streams: &Streams,
    required_from: i64,
    what: &str,
) {
    let admin = fx.db.connect().await.unwrap();
    let rows: HashMap<String, (String, String, i64)> = admin
        .query(
            "SELECT id::text, aggregatetype, aggregateid, coalesce((payload->>'n')::bigint, -1)
               FROM shop.outbox",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3))))
        .collect();
    let required: Vec<&String> = rows
        .iter()
        .filter(|(_, (_, _, n))| *n >= required_from)
        .map(|(id, _)| id)
        .collect();
    wait_until(Duration::from_secs(60), what, || async {
        let seen = read_all(fx, streams).await;
        let ids: std::collections::HashSet<&str> = seen
            .iter()
            .map(|e| e.fields["outbox_id"].as_str())
            .collect();
        let missing = required
            .iter()
            .filter(|id| !ids.contains(id.as_str()))
            .count();
        if missing == 0 {
            Ok(())
        } else {
            Err(format!(
                "{missing} of {} required rows missing",
                required.len()
            ))
        }
    })
    .await;
    let seen = read_all(fx, streams).await;
    let mut last_n: HashMap<&str, i64> = HashMap::new();
    let mut once = std::collections::HashSet::new();
    for entry in &seen {
        let id = entry.fields["outbox_id"].as_str();
        assert!(once.insert(id), "{what}: {id} twice");
        let (aggregate_type, key, n) = rows
            .get(id)
            .unwrap_or_else(|| panic!("{what}: {id} is no row"));
        assert_eq!(
            (entry.stream.as_str(), entry.shard),
            (
                streams.of(fx, aggregate_type).as_str(),
                outbox_core::stream::shard_of(Some(key.as_bytes()), streams.shards)
            ),
            "{what}: {id} in the wrong stream or shard"
        );
        assert_eq!(entry.fields["key"], *key);
        let last = last_n.entry(key.as_str()).or_insert(i64::MIN);
        assert!(
            *n > *last,
            "{what}: key {key} out of order ({n} after {last})"
        );
        *last = *n;
    }
}

/// Debezium's unmodified table, routed, with `--outbox-recovery slot-only`: every row once, in
/// key order, across a relay SIGKILL and a Redis restart; after Redis lost its data, every row
/// it was not yet told of and every later one (nothing comes back from the table), none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmodified_debezium_outbox_is_relayed_from_the_slot_alone() {
    let redis = RedisServer::start().unwrap();
    let db = shared_postgres().create_database().await.unwrap();
    db.connect()
        .await
        .unwrap()
        .batch_execute(UNMODIFIED_DDL)
        .await
        .unwrap();
    let template = format!("outbox.{}.${{routedByValue}}", testkit::unique_name("raw"));
    let mut flags = FLAGS.to_vec();
    flags.extend([
        "--outbox-recovery",
        "slot-only",
        "--stream",
        &template,
        "--stream-shards",
        "2",
    ]);
    let streams = Streams {
        template: Some(template.clone()),
        shards: 2,
    };
    let fx = Fixture::set_up(&redis, db, 2, &flags).await;
    let relay = fx.spawn_relay("raw-1", &flags);
    relay.wait_streaming().await;

    // WHEN rows are written and the relay is SIGKILLed meanwhile, then started again
    let killing = async {
        wait_until(Duration::from_secs(30), "some rows published", || async {
            let n = read_all(&fx, &streams).await.len();
            if n >= 20 {
                Ok(())
            } else {
                Err(format!("{n} published"))
            }
        })
        .await;
        relay.child.kill().unwrap();
    };
    tokio::join!(write(&fx, 0, 60), killing);
    let relay = fx.spawn_relay("raw-2", &flags);
    relay.wait_streaming().await;
    // THEN every row is there once, in key order
    assert_rows_once_in_key_order(&fx, &streams, i64::MIN, "after the relay was killed").await;

    // WHEN Redis restarts on its AOF while rows are written
    let restarting = async {
        redis.kill().unwrap();
        redis.start_again().unwrap();
    };
    tokio::join!(write(&fx, 60, 40), restarting);
    assert_rows_once_in_key_order(&fx, &streams, i64::MIN, "after Redis restarted").await;

    // WHEN Redis loses everything, and more rows come
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    write(&fx, 100, 20).await;
    // THEN every later row is there once, in key order (what Redis held is gone)
    assert_rows_once_in_key_order(&fx, &streams, 100, "after Redis lost its data").await;
    // (Its shards went live again through a catch-up that read no table.)
    let caught_up = relay
        .metric("cdc_relay_catch_ups_total{mode=\"everything\"}")
        .await
        .unwrap_or(0.0);
    assert!(caught_up >= 1.0, "log: {}", tail(&relay.child.log()));
    relay.stop();
}
