//! Tableless events: `pg_logical_emit_message(true, prefix, content)` of a configured prefix
//! published like an outbox row, once, in commit order (after its transaction's rows), with
//! ids of the transaction's own commit LSN (the same on every Postgres version), across a
//! relay SIGKILL and a Postgres restart; and a shard that cannot confirm holds the slot
//! instead of falling behind, since no table could give its events back.

use std::collections::HashMap;
use std::time::Duration;

use testkit::{wait_until, PgServer, RedisServer};

use crate::support::{parse_stream_id, tail, Fixture, StuckShard};

/// Where a transaction's messages are numbered from (the relay's `FIRST_MESSAGE_SEQ`).
const FIRST_MESSAGE_SEQ: u64 = 1 << 32;

/// Write transaction `i` of four kinds: a lone message; a row, then a message; a message,
/// then a row; and messages that are not published (another prefix, non-transactional).
async fn write(client: &mut tokio_postgres::Client, i: u32) {
    let body = serde_json::json!({ "n": i }).to_string();
    let tx = client.transaction().await.unwrap();
    let emit = |transactional: bool, prefix: &'static str| {
        format!("SELECT pg_logical_emit_message({transactional}, '{prefix}', $1::text)")
    };
    let insert =
        "INSERT INTO consumers.outbox (event, payload) VALUES ('test.event', $1::text::jsonb)";
    match i % 4 {
        0 => {
            tx.execute(&emit(true, "shop"), &[&body]).await.unwrap();
        }
        1 => {
            tx.execute(insert, &[&body]).await.unwrap();
            tx.execute(&emit(true, "audit"), &[&body]).await.unwrap();
        }
        2 => {
            tx.execute(&emit(true, "shop"), &[&body]).await.unwrap();
            tx.execute(insert, &[&body]).await.unwrap();
        }
        _ => {
            tx.execute(&emit(true, "other"), &[&body]).await.unwrap();
            tx.execute(&emit(false, "shop"), &[&body]).await.unwrap();
        }
    }
    tx.commit().await.unwrap();
}

/// What transaction `i` publishes: (event, n) in stream order.
fn expected(i: u32) -> Vec<(&'static str, u32)> {
    match i % 4 {
        0 => vec![("shop", i)],
        1 => vec![("test.event", i), ("audit", i)],
        2 => vec![("test.event", i), ("shop", i)],
        _ => vec![],
    }
}

/// The stream as (id, event, n, outbox_id), in stream order.
async fn published(fx: &Fixture<'_>) -> Vec<(String, String, u32, String)> {
    let mut conn = fx.redis.connect().await.unwrap();
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&fx.stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    reply
        .ids
        .iter()
        .map(|e| {
            let field = |name: &str| -> String {
                e.map
                    .get(name)
                    .map(|v| redis::from_redis_value_ref::<String>(v).unwrap())
                    .unwrap_or_default()
            };
            let payload: serde_json::Value = serde_json::from_str(&field("payload")).unwrap();
            (
                e.id.clone(),
                field("event"),
                payload["n"].as_u64().unwrap() as u32,
                field("outbox_id"),
            )
        })
        .collect()
}

async fn messages_once(pg: &PgServer) {
    // GIVEN a relay publishing the messages of two prefixes beside the outbox's rows
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(pg, &redis).await;
    let flags = ["--message-prefixes", "shop,audit"];
    let relay = fx.spawn_relay("msg-1", &flags);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;

    // WHEN transactions of every kind are written, the relay is SIGKILLed in the middle and
    // started again, and Postgres restarts (fast) before the last ones
    for i in 0..120 {
        write(&mut writer, i).await;
        if i == 60 {
            relay.child.kill().unwrap();
        }
    }
    let relay = fx.spawn_relay("msg-2", &flags);
    relay.wait_streaming().await;
    pg.restart_fast().unwrap();
    let mut writer = fx.writer().await;
    for i in 120..200 {
        write(&mut writer, i).await;
    }

    // THEN every published message and row is in the stream once, in commit order, each
    // transaction's rows before its messages
    let want: Vec<(&str, u32)> = (0..200).flat_map(expected).collect();
    wait_until(Duration::from_secs(60), "every entry published", || async {
        let n = published(&fx).await.len();
        if n >= want.len() {
            Ok(())
        } else {
            Err(format!(
                "{n} of {}; log: {}",
                want.len(),
                tail(&relay.child.log())
            ))
        }
    })
    .await;
    let got = published(&fx).await;
    let order: Vec<(&str, u32)> = got.iter().map(|(_, e, n, _)| (e.as_str(), *n)).collect();
    assert_eq!(order, want, "once each, in commit order");
    // AND a message's id is its transaction's commit LSN with a position above every row's,
    // and its outbox_id names both
    let mut rows_at: HashMap<u64, u64> = HashMap::new();
    for (id, event, _, outbox_id) in &got {
        let (lsn, seq) = parse_stream_id(id);
        if event == "test.event" {
            assert!(seq < FIRST_MESSAGE_SEQ, "{id}");
            rows_at.insert(lsn, seq);
        } else {
            assert_eq!(
                seq, FIRST_MESSAGE_SEQ,
                "the transaction's first message: {id}"
            );
            assert!(outbox_id.ends_with(":0"), "{outbox_id}");
        }
    }
    for (id, event, n, _) in &got {
        let (lsn, _) = parse_stream_id(id);
        if event != "test.event" && n % 4 != 0 {
            assert!(
                rows_at.contains_key(&lsn),
                "message {id} shares its row's commit LSN"
            );
        }
    }
    let skipped = relay
        .metric("cdc_relay_messages_skipped_total")
        .await
        .unwrap_or(0.0);
    assert!(
        skipped >= 1.0,
        "non-transactional messages counted: {skipped}"
    );
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_published_once_in_commit_order_across_a_relay_kill_and_a_postgres_restart() {
    let pg = PgServer::start().unwrap();
    messages_once(&pg).await;
}

on_newer_versions!(server: messages_once,
    messages_are_published_once_on_postgres_16 => 16,
    messages_are_published_once_on_postgres_17 => 17,
    messages_are_published_once_on_postgres_18 => 18,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_messages_a_shard_refusing_writes_holds_the_slot_and_falls_behind_not() {
    // GIVEN a relay publishing messages, allowed 1 s before a shard would fall behind
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(testkit::shared_postgres(), &redis).await;
    let relay = fx.spawn_relay(
        "msg-stuck",
        &[
            "--message-prefixes",
            "shop,audit",
            "--shard-detach-after",
            "1s",
        ],
    );
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    write(&mut writer, 0).await;
    wait_until(Duration::from_secs(30), "the first message", || async {
        let n = published(&fx).await.len();
        if n == 1 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    })
    .await;

    // WHEN the stream refuses every write for ten times that, while messages and rows come
    let stuck = StuckShard::start(&redis, &fx.stream).await;
    for i in 1..40 {
        write(&mut writer, i).await;
    }
    // (Refused again and again, backing off at most 500 ms: fifteen refusals span several
    // times the 1 s after which a shard without messages would have fallen behind.)
    wait_until(Duration::from_secs(60), "fifteen refusals", || async {
        let errors = relay
            .metric("cdc_relay_redis_errors_total")
            .await
            .unwrap_or(0.0);
        if errors >= 15.0 {
            Ok(())
        } else {
            Err(format!("{errors} refusals"))
        }
    })
    .await;

    // THEN the shard did not fall behind, and the slot was not acknowledged past what the
    // stream holds
    let behind = relay
        .metric("cdc_relay_shards_fell_behind_total{reason=\"failing\"}")
        .await
        .unwrap_or(0.0);
    assert_eq!(behind, 0.0, "log: {}", tail(&relay.child.log()));
    let first_refused = fx
        .witness()
        .await
        .into_iter()
        .find(|t| {
            t.events
                .iter()
                .any(|e| serde_json::from_slice::<serde_json::Value>(&e.payload).unwrap()["n"] == 1)
        })
        .expect("the witness saw transaction 1");
    let confirmed = fx.confirmed_flush_lsn().await;
    assert!(
        confirmed < first_refused.end_lsn,
        "the slot was acknowledged at {confirmed}, past the refused transaction ending at {}",
        first_refused.end_lsn
    );

    // AND once the stream takes writes again every entry arrives once, in order
    stuck.release().await;
    let want: Vec<(&str, u32)> = (0..40).flat_map(expected).collect();
    wait_until(Duration::from_secs(30), "every entry published", || async {
        let got = published(&fx).await;
        let order: Vec<(&str, u32)> = got.iter().map(|(_, e, n, _)| (e.as_str(), *n)).collect();
        if order == want {
            Ok(())
        } else {
            Err(format!("{} of {} entries", order.len(), want.len()))
        }
    })
    .await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_written_while_redis_loses_its_data_are_published_once_beside_the_rebuilt_rows() {
    wipe_case("msg-wipe", &[], 20, false).await;
}

/// More messages come while the shards are behind (Redis lost everything) than a lane may
/// keep: reading waits for the catch-up instead of starting the session again, which would
/// be sent the same messages by the slot and overflow again, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_messages_than_a_behind_lane_may_keep_wait_for_its_catch_up_and_are_published_once() {
    let small = [
        "--lane-max-bytes",
        "2048",
        "--batch-max-bytes",
        "2048",
        "--max-row-bytes",
        "1024",
    ];
    wipe_case("msg-wipe-overflow", &small, 200, true).await;
}

/// Publish 40 transactions of [`write`], lose Redis's data, write `away` more while it is
/// down and 40 after it is back: every row once, every message since the wipe once, in
/// commit order; `overflow`: reading waited for a shard behind that kept too many.
async fn wipe_case(name: &str, extra: &[&str], away: u32, overflow: bool) {
    // GIVEN a relay publishing messages beside the outbox's rows, everything published
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(testkit::shared_postgres(), &redis).await;
    let mut flags = vec!["--message-prefixes", "shop,audit"];
    flags.extend_from_slice(extra);
    let relay = fx.spawn_relay(name, &flags);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for i in 0..40 {
        write(&mut writer, i).await;
    }
    let before: Vec<(&str, u32)> = (0..40).flat_map(expected).collect();
    wait_until(
        Duration::from_secs(60),
        "the first 40 published",
        || async {
            let n = published(&fx).await.len();
            if n >= before.len() {
                Ok(())
            } else {
                Err(format!("{n} of {}", before.len()))
            }
        },
    )
    .await;

    // WHEN Redis loses everything (its functions too) and transactions of every kind come
    // while it is away and after it is back
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    let back = 40 + away;
    let end = back + 40;
    for i in 40..back {
        write(&mut writer, i).await;
    }
    redis.start_again().unwrap();
    for i in back..end {
        write(&mut writer, i).await;
    }

    // THEN every row is rebuilt from the table once, and every message emitted since the
    // wipe is there once (those Redis held are gone with it, but for any the slot was not yet
    // told of, which come again): none dropped while its shard was caught up
    let rows: Vec<u32> = (0..end).filter(|i| i % 4 == 1 || i % 4 == 2).collect();
    let since_wipe: Vec<(&str, u32)> = (40..end)
        .flat_map(expected)
        .filter(|(e, _)| *e != "test.event")
        .collect();
    wait_until(
        Duration::from_secs(90),
        "every row and every later message",
        || async {
            let got = published(&fx).await;
            let got_rows = got.iter().filter(|(_, e, _, _)| e == "test.event").count();
            let got_messages = got
                .iter()
                .filter(|(_, e, n, _)| e != "test.event" && *n >= 40)
                .count();
            if got_rows >= rows.len() && got_messages >= since_wipe.len() {
                Ok(())
            } else {
                Err(format!(
                    "{got_rows} of {} rows, {got_messages} of {} messages; log: {}",
                    rows.len(),
                    since_wipe.len(),
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    let got = published(&fx).await;
    let mut seen = std::collections::HashSet::new();
    for (id, event, n, _) in &got {
        assert!(seen.insert((event.clone(), *n)), "{event} {n} twice ({id})");
    }
    let mut got_rows: Vec<u32> = got
        .iter()
        .filter(|(_, e, _, _)| e == "test.event")
        .map(|(_, _, n, _)| *n)
        .collect();
    got_rows.sort_unstable();
    assert_eq!(got_rows, rows, "every row once");
    // Messages keep their commit order among themselves.
    let messages: Vec<(&str, u32)> = got
        .iter()
        .filter(|(_, e, _, _)| e != "test.event")
        .map(|(_, e, n, _)| (e.as_str(), *n))
        .collect();
    let first = messages.first().map_or(0, |(_, n)| *n);
    let want: Vec<(&str, u32)> = (first..end)
        .flat_map(expected)
        .filter(|(e, _)| *e != "test.event")
        .collect();
    assert_eq!(
        messages, want,
        "messages once each, in commit order, from the first kept"
    );
    assert!(first < 40 || messages.ends_with(&since_wipe));
    let pauses = relay
        .metric("cdc_relay_messages_pauses_total")
        .await
        .unwrap_or(0.0);
    assert_eq!(
        pauses >= 1.0,
        overflow,
        "reading waited {pauses} times; log: {}",
        tail(&relay.child.log())
    );
    relay.stop();
}

/// While reading waits for a shard behind (it keeps `--lane-max-bytes` of messages and its
/// catch-up cannot end: the outbox table is locked), Postgres is stopped: the server waits
/// for the relay's confirmations, which the paused session would withhold forever. The relay
/// notices that the server refuses connections and ends the session, so the server stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stopping_while_reading_waits_for_a_behind_shard_is_not_held() {
    // GIVEN a relay with messages and a small lane budget on a server of the test's own
    let pg = PgServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(&pg, &redis).await;
    let flags = [
        "--message-prefixes",
        "shop,audit",
        "--lane-max-bytes",
        "2048",
        "--batch-max-bytes",
        "2048",
        "--max-row-bytes",
        "1024",
    ];
    let relay = fx.spawn_relay("msg-pause-stop", &flags);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    write(&mut writer, 0).await;

    // WHEN Redis loses its data while many messages are written, the outbox table is locked
    // (the catch-up that would bring the shard back cannot read it), Redis comes back, and
    // reading waits for the shard
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    for i in 1..200 {
        // Messages only: the lock below must not hold the writer.
        let body = serde_json::json!({ "n": i }).to_string();
        writer
            .execute(
                "SELECT pg_logical_emit_message(true, 'shop', $1::text)",
                &[&body],
            )
            .await
            .unwrap();
    }
    let mut locker = pg.connect(&fx.db.name).await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE consumers.outbox IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    redis.start_again().unwrap();
    wait_until(Duration::from_secs(60), "reading waits", || async {
        match relay.metric("cdc_relay_messages_pauses_total").await {
            Some(n) if n >= 1.0 => Ok(()),
            other => Err(format!("{other:?}; log: {}", tail(&relay.child.log()))),
        }
    })
    .await;

    // THEN a fast shutdown completes (the relay lets go of the slot's walsender)
    let stopped = pg.stop_fast_within(Duration::from_secs(30));
    assert!(
        stopped.is_ok(),
        "Postgres did not stop within 30 s: {stopped:?}; relay log: {}",
        tail(&relay.child.log())
    );
    drop(lock);
    relay.stop();
}
