//! Recovery that never loses a message, each case on real servers with the release-shaped
//! binary: Redis emptied while the relay is quiet, a standby beside a loaded relay,
//! trimming that follows the consumer groups, a failover to a standby that lags behind what
//! the relay published, a point-in-time restore below the stream's top, and a rebuild
//! slowed past its lock's TTL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::{
    insert_txn, metrics, outbox_ids, stream_ids, wait_published, write_noise, Fixture, RelayProcess,
};
use testkit::{shared_postgres, wait_until, PgOptions, PgServer, RedisServer};

fn setup_cli(fx: &Fixture<'_>, database_url: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
        .args([
            "setup",
            "--database-url",
            database_url,
            "--slot",
            &fx.slot,
            "--publication",
            crate::support::PUBLICATION,
            "--outbox-table",
            crate::support::OUTBOX,
            "--redis-url",
            &fx.redis.url(),
            "--stream",
            &fx.stream,
        ])
        .output()
        .expect("run cdc-relay setup")
}

async fn record_field(fx: &Fixture<'_>, field: &str) -> Option<String> {
    let mut conn = fx.redis.connect().await.unwrap();
    redis::cmd("HGET")
        .arg(format!("{}:origin", fx.stream))
        .arg(field)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Every outbox row in the stream exactly once.
async fn assert_every_row_once(fx: &Fixture<'_>, relay: &RelayProcess) {
    let committed = outbox_ids(fx).await;
    wait_published(fx, &committed, relay).await;
    let ids = stream_ids(fx).await;
    let twice: Vec<_> = ids.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "published twice: {twice:?}");
}

/// A relay (`relay-1`) that published 20 rows, and the writer that committed them.
async fn relay_that_published_20_rows(fx: &Fixture<'_>) -> (RelayProcess, tokio_postgres::Client) {
    let relay = fx.spawn_relay("relay-1", &[]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..20 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(20, Duration::from_secs(10)).await;
    (relay, writer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_emptied_while_the_relay_is_quiet_gets_every_row_back() {
    // GIVEN a relay that published 20 rows, then restarted (a new session, nothing sent yet)
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let (relay, mut writer) = relay_that_published_20_rows(&fx).await;
    relay.stop();
    let relay = fx.spawn_relay("relay-2", &["--status-interval", "50ms"]);
    relay.wait_streaming().await;

    // WHEN Redis restarts empty, other tables write WAL (keepalives), then 5 more rows
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    let admin = fx.db.connect().await.unwrap();
    write_noise(&admin, 2).await;
    for txn in 20..25 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }

    // THEN all 25 rows are in the stream, once, and the catch-up says why
    assert_every_row_once(&fx, &relay).await;
    assert_eq!(stream_ids(&fx).await.len(), 25);
    crate::support::wait_caught_up(&relay, "everything").await;
    let m = metrics(&relay).await;
    assert_eq!(m["cdc_relay_catch_ups_total{mode=\"everything\"}"], 1.0);
    assert!(m["cdc_relay_shards_fell_behind_total{reason=\"lost\"}"] >= 1.0);
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_emptied_then_setup_and_a_restart_gets_every_row_back() {
    // GIVEN a relay that published 20 rows
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let (relay, mut writer) = relay_that_published_20_rows(&fx).await;

    // WHEN Redis restarts empty while the relay is down, rows keep coming, and the pod
    // restarts as Kubernetes does it: `setup` (the init container), then `run`
    relay.stop();
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    for txn in 20..30 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let out = setup_cli(&fx, &fx.db.url("consumers_relay"));
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("left alone"), "{said}");
    assert_eq!(
        record_field(&fx, "system_id").await,
        None,
        "setup wrote a record"
    );
    let relay = fx.spawn_relay("relay-2", &[]);

    // THEN all 30 rows are in the stream, once
    assert_every_row_once(&fx, &relay).await;
    assert_eq!(stream_ids(&fx).await.len(), 30);
    relay.stop();
}

/// Single-row commits at about `per_second` from several connections until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    committed: Arc<AtomicU32>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(url: String, connections: u32, per_second: u32) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicU32::new(0));
        let period = Duration::from_secs_f64(connections as f64 / per_second as f64);
        let tasks = (0..connections)
            .map(|writer| {
                let (url, stop, committed) = (url.clone(), stop.clone(), committed.clone());
                tokio::spawn(async move {
                    let (mut client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                        .await
                        .unwrap();
                    tokio::spawn(conn);
                    let mut tick = tokio::time::interval(period);
                    let mut txn = 0;
                    while !stop.load(Ordering::Relaxed) {
                        tick.tick().await;
                        insert_txn(&mut client, writer, txn, 1, true).await.unwrap();
                        committed.fetch_add(1, Ordering::Relaxed);
                        txn += 1;
                    }
                })
            })
            .collect();
        Load {
            stop,
            committed,
            tasks,
        }
    }

    async fn stop(self) -> u32 {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
        self.committed.load(Ordering::Relaxed)
    }
}

/// How long the standby test loads the relay (`CDC_STANDBY_LOAD_SECONDS`; the lab's soak
/// runs it for minutes).
fn standby_load_seconds() -> u64 {
    std::env::var("CDC_STANDBY_LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_beside_a_loaded_relay_never_rebuilds() {
    // GIVEN an active relay and a standby on one slot, and ~1,500 single-row commits/s
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    // Frequent acknowledgements and retries: the slot's position moves between any two reads.
    let flags = ["--standby-retry", "10ms", "--status-interval", "10ms"];
    let active = fx.spawn_relay("active", &flags);
    active.wait_streaming().await;
    let standby = fx.spawn_relay("standby", &flags);
    wait_until(
        Duration::from_secs(30),
        "the second relay standing by",
        || async {
            match standby.readyz().await {
                Some((503, body)) if body.contains("standby") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let load = Load::start(fx.db.url("consumers"), 8, 1500);

    // WHEN the load runs for a while, then the active relay gets SIGTERM (a rolling deploy)
    let seconds = standby_load_seconds();
    let until = tokio::time::Instant::now() + Duration::from_secs(seconds);
    while tokio::time::Instant::now() < until {
        assert_eq!(
            record_field(&fx, "rebuilding").await,
            None,
            "a rebuild marker appeared; standby log: {}",
            crate::support::tail(&standby.child.log())
        );
        // (the scenario's sampling period: the marker is watched for the whole load)
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    active.stop();
    standby.wait_streaming().await;
    let after = load.committed.load(Ordering::Relaxed);
    wait_until(
        Duration::from_secs(30),
        "500 commits after the handover",
        || async {
            let n = load.committed.load(Ordering::Relaxed);
            if n >= after + 500 {
                Ok(())
            } else {
                Err(format!("{n}"))
            }
        },
    )
    .await;
    let committed = load.stop().await;

    // THEN nothing was rebuilt, no marker was left, and the stream is exactly the commits,
    // with LSN-derived ids, in commit order
    let expected = fx.expected_entries().await;
    assert_eq!(expected.len(), committed as usize);
    fx.wait_stream_len(expected.len(), Duration::from_secs(60))
        .await;
    crate::support::assert_same_entries(&fx.stream_entries().await, &expected);
    assert_eq!(record_field(&fx, "rebuilding").await, None);
    for relay in [&standby] {
        let m = metrics(relay).await;
        let rebuilds: f64 = m
            .iter()
            .filter(|(k, _)| k.starts_with("cdc_relay_rebuilds_total"))
            .map(|(_, v)| v)
            .sum();
        assert_eq!(rebuilds, 0.0, "{m:?}");
    }
    for log in [active.child.log(), standby.child.log()] {
        assert!(
            !log.contains("rebuilding the stream"),
            "{}",
            crate::support::tail(&log)
        );
    }
    eprintln!("standby under load: {committed} commits in {seconds} s, handover clean");
    standby.stop();
}

async fn xcmd<T: redis::FromRedisValue>(fx: &Fixture<'_>, args: &[&str]) -> T {
    let mut conn = fx.redis.connect().await.unwrap();
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut conn).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trimming_never_deletes_what_a_group_has_not_acknowledged() {
    // GIVEN a consumer group that read 100 entries and acknowledged 80 of them, and a relay
    // whose last-resort cap is far away
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let _: () = xcmd(&fx, &["XGROUP", "CREATE", &fx.stream, "g", "0", "MKSTREAM"]).await;
    let relay = fx.spawn_relay("relay", &["--stream-max-len", "1000"]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..300 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(300, Duration::from_secs(30)).await;
    let read: redis::streams::StreamReadReply = xcmd(
        &fx,
        &[
            "XREADGROUP",
            "GROUP",
            "g",
            "c",
            "COUNT",
            "100",
            "STREAMS",
            &fx.stream,
            ">",
        ],
    )
    .await;
    let delivered: Vec<String> = read.keys[0].ids.iter().map(|e| e.id.clone()).collect();
    let mut ack = vec!["XACK", fx.stream.as_str(), "g"];
    ack.extend(delivered[..80].iter().map(String::as_str));
    let _: i64 = xcmd(&fx, &ack).await;

    // WHEN more entries are published for a few seconds (each batch trims, and the shard's
    // watermark, below which nothing is trimmed, moves on with them)
    for txn in 300..350 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    wait_until(
        Duration::from_secs(30),
        "the acknowledged entries trimmed and the new ones published",
        || async {
            // Both: the trim can land before the last of the 50 new entries is published.
            let entries = fx.stream_entries().await;
            let first = entries.first().map(|e| e.id.clone());
            let published = entries.len() + 80 >= 350;
            match first {
                Some(id) if id == delivered[80] && published => Ok(()),
                other => Err(format!(
                    "first entry {other:?} of {}, want {} of 270",
                    entries.len(),
                    delivered[80]
                )),
            }
        },
    )
    .await;

    // THEN exactly the 80 acknowledged entries went: the pending and unread ones stay
    let entries = fx.stream_entries().await;
    assert_eq!(entries.len(), 350 - 80);
    relay.stop();

    // AND WHEN the group stops reading and the stream holds more unread entries than a
    // relay's cap allows, new rows are not added and nothing is trimmed: the shard falls
    // behind, and the slot moves on
    let relay = fx.spawn_relay("relay-capped", &["--stream-max-len", "100"]);
    relay.wait_streaming().await;
    for txn in 350..360 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    crate::support::wait_metric(
        &relay,
        "cdc_relay_shards_fell_behind_total{reason=\"full\"}",
        "the shard full",
        |v| v >= 1.0,
    )
    .await;
    let last_end = fx.witness().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(30),
        "the slot past the last commit",
        || async {
            match fx.confirmed_flush_lsn().await {
                c if c >= last_end => Ok(()),
                c => Err(format!("{c:X} < {last_end:X}")),
            }
        },
    )
    .await;
    assert_eq!(fx.stream_len().await, 270, "nothing trimmed, nothing added");

    // ... and once the group has read, the rows come from the outbox table, each once
    let mut read_all = vec![
        "XREADGROUP",
        "GROUP",
        "g",
        "c",
        "STREAMS",
        fx.stream.as_str(),
        "0",
    ];
    let pending: redis::streams::StreamReadReply = xcmd(&fx, &read_all).await;
    read_all[6] = ">";
    let unread: redis::streams::StreamReadReply = xcmd(&fx, &read_all).await;
    let mut ack = vec!["XACK".to_string(), fx.stream.clone(), "g".to_string()];
    for reply in [&pending, &unread] {
        ack.extend(
            reply
                .keys
                .iter()
                .flat_map(|k| k.ids.iter().map(|e| e.id.clone())),
        );
    }
    let ack: Vec<&str> = ack.iter().map(String::as_str).collect();
    let _: i64 = xcmd(&fx, &ack).await;
    crate::support::wait_caught_up(&relay, "since").await;
    let expected: Vec<String> = (350..360).map(|t| t.to_string()).collect();
    let got: Vec<String> = fx
        .stream_entries()
        .await
        .iter()
        .filter_map(|e| e.payload.get("txn").map(|t| t.to_string()))
        .filter(|t| t.parse::<u32>().is_ok_and(|t| t >= 350))
        .collect();
    assert_eq!(got, expected, "the held-back rows, once, in order");
    relay.stop();
}

/// The stream's payloads (`writer`, `txn`), with how many times each appears.
async fn stream_payloads(fx: &Fixture<'_>) -> HashMap<(u64, u64), usize> {
    let mut counts = HashMap::new();
    for e in fx.stream_entries().await {
        let key = (
            e.payload["writer"].as_u64().unwrap(),
            e.payload["txn"].as_u64().unwrap(),
        );
        *counts.entry(key).or_default() += 1;
    }
    counts
}

/// The pod restarted against `db` (a promoted standby, a restored cluster) as Kubernetes
/// does it (`setup`, then `run`), 100 messages committed there; returns the relay once every
/// one of them is in the stream exactly once, with ids above `top_before`.
async fn restart_on_new_history(
    fx: &Fixture<'_>,
    db: &testkit::TestDb,
    name: &str,
    top_before: &str,
) -> RelayProcess {
    let out = setup_cli(fx, &db.url("consumers_relay"));
    assert!(out.status.success(), "{out:?}");
    let relay = fx.spawn_relay(name, &["--database-url", &db.url("consumers_relay")]);
    relay.wait_streaming().await;
    let mut writer = db.connect_as("consumers").await.unwrap();
    for txn in 0..100 {
        insert_txn(&mut writer, 3, txn, 1, true).await.unwrap();
    }
    wait_until(
        Duration::from_secs(60),
        "the new history's messages",
        || async {
            let payloads = stream_payloads(fx).await;
            let missing = (0..100)
                .filter(|t| !payloads.contains_key(&(3, *t)))
                .count();
            if missing == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{missing} of 100 missing; log: {}",
                    crate::support::tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    let payloads = stream_payloads(fx).await;
    for txn in 0..100 {
        assert_eq!(payloads[&(3, txn)], 1, "new message {txn} published twice");
    }
    let entries = fx.stream_entries().await;
    let first_new = entries
        .iter()
        .position(|e| e.payload["writer"] == 3)
        .unwrap();
    assert!(
        crate::support::parse_stream_id(&entries[first_new].id)
            > crate::support::parse_stream_id(top_before)
    );
    relay
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_a_standby_behind_the_stream_loses_no_new_message() {
    failover_behind(PgOptions::default()).await
}

// Without failover slots (16 has none): the same rebuild.
on_newer_versions!(options: failover_behind,
    failover_to_a_standby_behind_the_stream_loses_no_new_message_on_postgres_16 => 16,
);

async fn failover_behind(options: PgOptions) {
    // GIVEN a primary with a streaming standby, and a relay on the primary
    let primary = PgServer::start_with(options).unwrap();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(&primary, &redis).await;
    let relay = fx.spawn_relay("relay-primary", &[]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..50 {
        insert_txn(&mut writer, 1, txn, 1, true).await.unwrap();
    }
    let standby = PgServer::standby_of(&primary).unwrap();
    // (Where the standby is a cold copy, the primary restarted meanwhile.)
    let mut writer = fx.writer().await;
    let target = primary.wal_position().await.unwrap();
    wait_until(Duration::from_secs(30), "the standby caught up", || async {
        match standby.wal_position().await {
            Ok(at) if at >= target => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // WHEN the standby falls behind by 100 commits the relay already published,
    standby.stop_fast().unwrap();
    for txn in 0..100 {
        insert_txn(&mut writer, 2, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(150, Duration::from_secs(30)).await;
    let top_before = fx.stream_entries().await.last().unwrap().id.clone();
    // the primary dies, the standby is promoted, and the pod restarts against it
    primary.kill().unwrap();
    relay.child.kill().unwrap();
    standby.start_again().unwrap();
    standby.promote().await.unwrap();
    let db = fx.db.on(&standby);

    // THEN every message committed on the new timeline reaches the stream, once, after
    // everything that was there before
    let relay = restart_on_new_history(&fx, &db, "relay-promoted", &top_before).await;
    let payloads = stream_payloads(&fx).await;
    for txn in 0..50 {
        assert!(payloads.contains_key(&(1, txn)), "old message {txn} lost");
    }
    crate::support::wait_rebuild_counted(&relay, "timeline").await;
    let m = metrics(&relay).await;
    assert_eq!(m["cdc_relay_rebuilds_total{reason=\"timeline\"}"], 1.0);
    assert!(relay
        .child
        .log()
        .contains("forked before what the stream acknowledged"));
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_point_in_time_restore_below_the_stream_loses_no_new_message() {
    // GIVEN a primary archiving its WAL, a base backup, and a relay that published 100 rows
    let archive = PgServer::archive_dir().unwrap();
    let primary = PgServer::start_with(PgOptions::default().archiving(&archive)).unwrap();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(&primary, &redis).await;
    let backup = primary.base_backup().unwrap();
    let relay = fx.spawn_relay("relay-primary", &[]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..50 {
        insert_txn(&mut writer, 1, txn, 1, true).await.unwrap();
    }
    let admin = fx.db.connect().await.unwrap();
    let target: String = admin
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    for txn in 0..50 {
        insert_txn(&mut writer, 2, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(100, Duration::from_secs(30)).await;
    let top_before = fx.stream_entries().await.last().unwrap().id.clone();
    primary.archive_current_wal().await.unwrap();

    // WHEN the cluster is restored to the point after the first 50 (same system, a new
    // timeline, LSNs below the stream's top) and the pod restarts against it
    relay.stop();
    primary.stop_fast().unwrap();
    let restored = PgServer::restore(&primary, &backup, &archive, &target)
        .await
        .unwrap();
    let db = fx.db.on(&restored);

    // THEN every message committed after the restore is in the stream, once, above the
    // old top, and the rebuild says why
    let relay = restart_on_new_history(&fx, &db, "relay-restored", &top_before).await;
    crate::support::wait_rebuild_counted(&relay, "timeline").await;
    let m = metrics(&relay).await;
    assert_eq!(m["cdc_relay_rebuilds_total{reason=\"timeline\"}"], 1.0);
    relay.stop();
}

/// A slot dropped while no relay held it (between two sessions) by another role with
/// REPLICATION, which Postgres allows for every slot of the cluster from any database: the
/// stream's records say it existed, so it is a lost slot, not a missing one. Without
/// `--on-lost-slot recover` the relay stops and says what to do; with it the slot is made
/// anew and every row committed meanwhile is published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_dropped_between_sessions_is_made_anew_with_recover() {
    // GIVEN a relay that published 20 rows and stopped
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let (relay, mut writer) = relay_that_published_20_rows(&fx).await;
    relay.stop();

    // WHEN the other side's relay role, connected to another database, drops the slot and
    // 10 more rows are written
    let elsewhere = fx
        .db
        .url("workers_relay")
        .replace(&format!("/{}", fx.db.name), "/postgres");
    let (other, connection) = tokio_postgres::connect(&elsewhere, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    other
        .execute("SELECT pg_drop_replication_slot($1)", &[&fx.slot])
        .await
        .unwrap();
    for txn in 20..30 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }

    // THEN a relay given another slot name (a typo) makes no slot, even with recover: the
    // stream was read from the dropped one, so this is a missing slot, not a dropped one
    let typo = fx.spawn_relay(
        "relay-typo",
        &["--slot", "typo_slot", "--on-lost-slot", "recover"],
    );
    let status = typo.child.wait_exit(Duration::from_secs(30)).unwrap();
    assert!(!status.success());
    let log = typo.child.log();
    assert!(
        log.contains("replication slot typo_slot does not exist: create it with `cdc-relay setup`"),
        "{}",
        crate::support::tail(&log)
    );
    let admin = fx.db.connect().await.unwrap();
    let made: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'typo_slot'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(made, 0);
    // AND a relay that may not recover stops, naming the option
    let refusing = fx.spawn_relay("relay-fail", &[]);
    let status = refusing.child.wait_exit(Duration::from_secs(30)).unwrap();
    assert!(!status.success());
    let log = refusing.child.log();
    assert!(
        log.contains("is gone though the stream was streaming from it")
            && log.contains("--on-lost-slot recover"),
        "{}",
        crate::support::tail(&log)
    );
    // AND one that may makes the slot anew: all 30 rows in the stream, once
    let relay = fx.spawn_relay("relay-recover", &["--on-lost-slot", "recover"]);
    relay.wait_streaming().await;
    let committed = outbox_ids(&fx).await;
    assert_eq!(committed.len(), 30);
    wait_published(&fx, &committed, &relay).await;
    let ids = stream_ids(&fx).await;
    assert!(
        ids.values().all(|n| *n == 1),
        "none published twice: {ids:?}"
    );
    crate::support::wait_rebuild_counted(&relay, "slot_dropped").await;
    relay.stop();
}

/// Leave the stream as a relay leaves it when it dies making the slot anew: the records
/// marked, the slot dropped.
async fn die_while_making_the_slot_anew(fx: &Fixture<'_>) {
    let _: i64 = xcmd(
        fx,
        &[
            "HSET",
            &format!("{}:origin", fx.stream),
            "rebuilding",
            "since",
        ],
    )
    .await;
    let admin = fx.db.connect().await.unwrap();
    admin
        .execute("SELECT pg_drop_replication_slot($1)", &[&fx.slot])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_slowed_past_its_lock_ttl_keeps_the_lock() {
    // GIVEN a relay that died making the slot anew (records marked, no slot), and an open
    // transaction that makes CREATE_REPLICATION_SLOT wait
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let (relay, mut writer) = relay_that_published_20_rows(&fx).await;
    relay.stop();
    die_while_making_the_slot_anew(&fx).await;
    let mut blocker = fx.writer().await;
    let open = blocker.transaction().await.unwrap();
    open.execute(
        "INSERT INTO consumers.outbox (event, payload) VALUES ('test.event', '{\"writer\": 9, \"txn\": 0, \"row\": 0}')",
        &[],
    )
    .await
    .unwrap();

    // WHEN a relay makes it with a 1 s lock TTL while a second relay keeps trying
    let flags = ["--rebuild-lock-ttl", "1s", "--standby-retry", "50ms"];
    let first = fx.spawn_relay("first", &flags);
    wait_until(Duration::from_secs(30), "making the slot anew", || async {
        if first.child.log().contains("making the slot anew") {
            Ok(())
        } else {
            Err(crate::support::tail(&first.child.log()))
        }
    })
    .await;
    let second = fx.spawn_relay("second", &flags);
    // The scenario itself: the open transaction holds the slot creation for four TTLs
    // while the second relay keeps trying to take over.
    tokio::time::sleep(Duration::from_secs(4)).await;
    open.commit().await.unwrap();

    // THEN the first relay finishes, the second never made a slot, and every row is there once
    first.wait_streaming().await;
    for txn in 20..30 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    assert_every_row_once(&fx, &first).await;
    assert!(
        !second.child.log().contains("making the slot anew"),
        "{}",
        crate::support::tail(&second.child.log())
    );
    crate::support::wait_rebuild_counted(&first, "resumed").await;
    first.stop();
    second.stop();
}

/// The outbox ids seen so far by a consumer group `workers` reading `stream` and
/// acknowledging what it read, as the receiving service does (re-creating its group from
/// the start when Redis lost it), until `stop`.
fn group_reader(
    redis: &RedisServer,
    stream: String,
    stop: Arc<AtomicBool>,
) -> (
    Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    tokio::task::JoinHandle<()>,
) {
    let url = redis.url();
    let seen = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let task = tokio::spawn({
        let seen = seen.clone();
        async move {
            let client = redis::Client::open(url).unwrap();
            while !stop.load(Ordering::SeqCst) {
                let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let _: redis::RedisResult<()> = redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(&stream)
                    .arg("workers")
                    .arg("0")
                    .arg("MKSTREAM")
                    .query_async(&mut conn)
                    .await;
                while !stop.load(Ordering::SeqCst) {
                    let read: redis::RedisResult<redis::streams::StreamReadReply> =
                        redis::cmd("XREADGROUP")
                            .arg("GROUP")
                            .arg("workers")
                            .arg("reader")
                            .arg("COUNT")
                            .arg(20)
                            .arg("BLOCK")
                            .arg(100)
                            .arg("STREAMS")
                            .arg(&stream)
                            .arg(">")
                            .query_async(&mut conn)
                            .await;
                    let Ok(reply) = read else { break };
                    for key in reply.keys {
                        for entry in key.ids {
                            if let Some(id) = entry.map.get("outbox_id") {
                                let id = redis::from_redis_value_ref::<String>(id).unwrap();
                                seen.lock().unwrap().insert(id);
                            }
                            let _: redis::RedisResult<i64> = redis::cmd("XACK")
                                .arg(&stream)
                                .arg("workers")
                                .arg(&entry.id)
                                .query_async(&mut conn)
                                .await;
                        }
                    }
                }
            }
        }
    });
    (seen, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_losing_more_than_its_cap_after_a_day_republishes_at_the_groups_pace() {
    // GIVEN a relay capped at 100 entries and a group that read and acknowledged 150 rows
    // (the stream holds few of them: trimming followed the group)
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let relay = fx.spawn_relay("relay-1", &["--stream-max-len", "100"]);
    relay.wait_streaming().await;
    let stop = Arc::new(AtomicBool::new(false));
    let (seen, reader) = group_reader(&redis, fx.stream.clone(), stop.clone());
    let mut writer = fx.writer().await;
    for txn in 0..150 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    wait_until(Duration::from_secs(30), "150 rows read", || async {
        match seen.lock().unwrap().len() {
            150 => Ok(()),
            n => Err(format!("{n} read")),
        }
    })
    .await;
    assert!(
        fx.stream_len().await < 150,
        "trimming did not follow the group"
    );

    // WHEN Redis restarts without its data and 10 new rows commit
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    for txn in 150..160 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }

    // THEN the group receives every retained row and the new ones, the relay never trims
    // an unread entry, and it keeps running
    let committed = outbox_ids(&fx).await;
    assert_eq!(committed.len(), 160);
    wait_until(
        Duration::from_secs(60),
        "all 160 rows read by the group",
        || async {
            assert!(
                relay.child.is_running(),
                "the relay exited: {}",
                crate::support::tail(&relay.child.log())
            );
            let seen = seen.lock().unwrap();
            match committed.iter().filter(|id| !seen.contains(*id)).count() {
                0 => Ok(()),
                n => Err(format!(
                    "{n} never read; log: {}",
                    crate::support::tail(&relay.child.log())
                )),
            }
        },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    reader.await.unwrap();
    let m = metrics(&relay).await;
    assert_eq!(m["cdc_relay_catch_up_waiting_for_consumers"], 0.0, "{m:?}");
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_making_the_slot_behind_an_open_transaction_stops_at_sigterm_and_the_next_resumes()
{
    // GIVEN a relay that died making the slot anew, while a transaction that wrote is held
    // open (making the slot again waits for it)
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let (relay, mut writer) = relay_that_published_20_rows(&fx).await;
    relay.stop();
    die_while_making_the_slot_anew(&fx).await;
    let mut holder = fx.writer().await;
    let open = holder.transaction().await.unwrap();
    open.execute(
        "INSERT INTO consumers.outbox (event, payload) VALUES ('test.event', '{\"held\": true}')",
        &[],
    )
    .await
    .unwrap();

    // WHEN the next relay, waiting for that transaction, is sent SIGTERM
    let relay = fx.spawn_relay("relay-2", &[]);
    wait_until(Duration::from_secs(30), "making the slot anew", || async {
        if relay.child.log().contains("making the slot anew") {
            Ok(())
        } else {
            Err(crate::support::tail(&relay.child.log()))
        }
    })
    .await;
    let asked = std::time::Instant::now();
    relay.child.signal(testkit::Signal::Term).expect("SIGTERM");
    let status = relay.child.wait_exit(Duration::from_secs(10)).unwrap();

    // THEN it leaves at once, and the next relay resumes: every row once
    let took = asked.elapsed();
    assert!(
        status.success(),
        "{status:?}: {}",
        crate::support::tail(&relay.child.log())
    );
    assert!(took < Duration::from_secs(3), "took {took:?} to stop");
    open.commit().await.unwrap();
    insert_txn(&mut writer, 0, 20, 1, true).await.unwrap();
    let relay = fx.spawn_relay("relay-3", &[]);
    assert_every_row_once(&fx, &relay).await;
    assert_eq!(stream_ids(&fx).await.len(), 22);
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_behind_an_open_transaction_hands_over_and_loses_nothing() {
    // GIVEN a relay that published 20 rows, stopped, Redis restarted without its data, and
    // a transaction that wrote a row held open
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let (relay, mut writer) = relay_that_published_20_rows(&fx).await;
    relay.stop();
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    let mut holder = fx.writer().await;
    let open = holder.transaction().await.unwrap();
    open.execute(
        "INSERT INTO consumers.outbox (event, payload) VALUES ('test.event', '{\"held\": true}')",
        &[],
    )
    .await
    .unwrap();

    // WHEN the next relay catches the stream up (the open transaction shows in none of its
    // snapshots) and then the transaction commits
    let relay = fx.spawn_relay("relay-2", &[]);
    crate::support::wait_caught_up(&relay, "everything").await;
    assert_eq!(
        stream_ids(&fx).await.len(),
        20,
        "the open row is not published yet"
    );
    open.commit().await.unwrap();
    insert_txn(&mut writer, 0, 20, 1, true).await.unwrap();

    // THEN it comes live, after the caught-up rows: every row once
    assert_every_row_once(&fx, &relay).await;
    assert_eq!(stream_ids(&fx).await.len(), 22);
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_off_mid_publish_writes_nothing_after_another_took_over_and_rebuilt() {
    // GIVEN relay A publishing through a link that will hold its next batch (a partition),
    // with 5 rows published
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let link = testkit::proxy::Proxy::to_unix(redis.socket().to_path_buf())
        .await
        .unwrap();
    let via_link = format!("redis://{}", link.addr());
    let a = fx.spawn_relay(
        "relay-a",
        &["--redis-url", &via_link, "--redis-timeout", "60s"],
    );
    a.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..5 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(5, Duration::from_secs(10)).await;

    // WHEN A's batch of one more row is held on the link, A is paused and loses the slot,
    // the stream's record goes, and relay B takes over (rebuilding: the held row is
    // republished under a new id)
    link.hold_when(b"zombie-row");
    writer
        .execute(
            "INSERT INTO consumers.outbox (event, payload) VALUES ('test.event', '{\"note\": \"zombie-row\"}')",
            &[],
        )
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "A's batch held on the link",
        || async {
            if link.holding() {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        },
    )
    .await;
    a.child.signal(testkit::Signal::Stop).unwrap();
    let admin = fx.db.connect().await.unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap();
    let mut conn = redis.connect().await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(format!("{}:origin", fx.stream))
        .query_async(&mut conn)
        .await
        .unwrap();
    let b = fx.spawn_relay("relay-b", &[]);
    b.wait_streaming().await;
    // ... and then the link heals and A goes on: its held batch reaches Redis
    link.release();
    a.child.signal(testkit::Signal::Cont).unwrap();

    // THEN the late batch of the superseded session is refused: every row once. (Nothing
    // new is committed before it is answered: a later row B published first would put the
    // stream's top above the late batch, which the script then skips as a duplicate, also
    // writing nothing, but without the refusal this test waits for.)
    wait_until(
        Duration::from_secs(30),
        "A's late batch answered",
        || async {
            let twice = stream_ids(&fx).await.values().any(|n| *n > 1);
            // (Redis counts the script's refusals by their code.)
            let errors: String = redis::cmd("INFO")
                .arg("errorstats")
                .query_async(&mut redis.connect().await.unwrap())
                .await
                .unwrap();
            // Refused as fenced, or (reaching Redis before B made the record again) as
            // writing a stream without a record.
            if twice || errors.contains("errorstat_FENCED") || errors.contains("errorstat_NORECORD")
            {
                Ok(())
            } else {
                let record: Vec<String> = redis::cmd("HGETALL")
                    .arg(format!("{}:origin", fx.stream))
                    .query_async(&mut redis.connect().await.unwrap())
                    .await
                    .unwrap();
                Err(format!(
                    "{errors}; record {record:?}; stream {:?}; holding {}; A: {}\nB: {}",
                    stream_ids(&fx).await,
                    link.holding(),
                    crate::support::tail(&a.child.log()),
                    crate::support::tail(&b.child.log())
                ))
            }
        },
    )
    .await;
    insert_txn(&mut writer, 0, 5, 1, true).await.unwrap();
    assert_every_row_once(&fx, &b).await;
    assert_eq!(stream_ids(&fx).await.len(), 7);
    assert!(
        b.child.is_running(),
        "{}",
        crate::support::tail(&b.child.log())
    );
    b.stop();
    a.stop();
}
