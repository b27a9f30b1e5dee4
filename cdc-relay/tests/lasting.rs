//! Faults that last, held longer than every timer on their path, on real servers with the
//! relay binary: a shard refusing writes for many times --shard-detach-after while every
//! shard takes traffic and another table writes WAL; a receiver down while three times
//! --stream-max-len messages are sent; SIGTERM to a relay with a stuck shard and a standby
//! waiting; a replication connection black-holed by a middlebox; large rows while a shard is
//! stuck; Redis losing everything after a long retention with a group that had read nearly all.
//!
//! Durations default to what CI can afford and scale with `CDC_LASTING_SECONDS` (the stuck
//! shard's fault) and `CDC_LASTING_ROWS` (the retained rows): `CDC_LASTING_SECONDS=120
//! CDC_LASTING_ROWS=200000 cargo test -p cdc-relay --test main lasting:: -- --nocapture`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{
    assert_caught_up, expected_by_shard, metrics, read_stream, tail, wait_metric, Entry, Fixture,
    RelayProcess, StuckShard,
};
use outbox_core::stream::{shard_key, shard_of};
use testkit::{shared_postgres, wait_until, RedisServer};

const SHARDS: u32 = 4;
const CHATS: i64 = 16;

fn lasting_seconds() -> u64 {
    std::env::var("CDC_LASTING_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(25)
}

fn lasting_rows() -> u64 {
    std::env::var("CDC_LASTING_ROWS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5000)
}

/// The shard chat `chat` lives in.
fn shard_of_chat(chat: i64) -> u32 {
    shard_of(Some(chat.to_string().as_bytes()), SHARDS)
}

/// A steady writer: one row per transaction, over `CHATS` chats in turn, each transaction
/// locking its chat first (as a chat send locks its feed counter), at `per_second`; when each
/// committed, by outbox id.
struct Traffic {
    stop: Arc<AtomicBool>,
    committed: Arc<Mutex<HashMap<String, (Instant, i64)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Traffic {
    async fn start(fx: &Fixture<'_>, per_second: u32) -> Self {
        let mut client = fx.writer().await;
        let stop = Arc::new(AtomicBool::new(false));
        let committed: Arc<Mutex<HashMap<String, (Instant, i64)>>> = Arc::default();
        let task = tokio::spawn({
            let (stop, committed) = (stop.clone(), committed.clone());
            async move {
                let pause = Duration::from_secs(1) / per_second;
                let mut n = 0i64;
                while !stop.load(Ordering::SeqCst) {
                    let chat = 1 + n % CHATS;
                    let tx = client.transaction().await.unwrap();
                    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&chat])
                        .await
                        .unwrap();
                    let payload = serde_json::json!({"chat_id": chat, "n": n});
                    let id: i64 = tx
                        .query_one(
                            "INSERT INTO consumers.outbox (event, payload, partition_key)
                             VALUES ('test.event', $1::text::jsonb, $2) RETURNING id",
                            &[&payload.to_string(), &chat.to_string()],
                        )
                        .await
                        .unwrap()
                        .get(0);
                    tx.commit().await.unwrap();
                    committed
                        .lock()
                        .unwrap()
                        .insert(id.to_string(), (Instant::now(), chat));
                    n += 1;
                    tokio::time::sleep(pause).await;
                }
            }
        });
        Self {
            stop,
            committed,
            task,
        }
    }

    async fn stop(self) -> HashMap<String, (Instant, i64)> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap();
        Arc::try_unwrap(self.committed)
            .unwrap()
            .into_inner()
            .unwrap()
    }
}

/// When each outbox id was first seen in any shard, read every 50 ms.
struct Seen {
    stop: Arc<AtomicBool>,
    at: Arc<Mutex<HashMap<String, Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Seen {
    fn start(redis: &RedisServer, stream: &str) -> Self {
        let url = redis.url();
        let keys: Vec<String> = (0..SHARDS).map(|k| shard_key(stream, k, SHARDS)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let at: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let task = tokio::spawn({
            let (stop, at) = (stop.clone(), at.clone());
            async move {
                let client = redis::Client::open(url).unwrap();
                let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                let mut after: Vec<String> = vec!["-".into(); keys.len()];
                while !stop.load(Ordering::SeqCst) {
                    for (k, key) in keys.iter().enumerate() {
                        let page: redis::RedisResult<redis::streams::StreamRangeReply> =
                            redis::cmd("XRANGE")
                                .arg(key)
                                .arg(&after[k])
                                .arg("+")
                                .query_async(&mut conn)
                                .await;
                        let Ok(page) = page else { continue };
                        let now = Instant::now();
                        let mut at = at.lock().unwrap();
                        for e in &page.ids {
                            if let Some(id) = e.map.get("outbox_id") {
                                let id = redis::from_redis_value_ref::<String>(id).unwrap();
                                at.entry(id).or_insert(now);
                            }
                            after[k] = format!("({}", e.id);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
        Self { stop, at, task }
    }

    async fn stop(self) -> HashMap<String, Instant> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap();
        Arc::try_unwrap(self.at).unwrap().into_inner().unwrap()
    }
}

/// Consumer group `g` on `stream` (made if missing), reading nothing yet; a connection to use.
async fn group_that_reads_nothing_yet(
    redis: &RedisServer,
    stream: &str,
) -> redis::aio::MultiplexedConnection {
    let mut conn = redis.connect().await.unwrap();
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg("g")
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    conn
}

/// ~1 MB of WAL a second into a table outside the publication (another service's traffic).
fn noise(fx: &Fixture<'_>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let db = fx.db.clone();
    tokio::spawn(async move {
        let admin = db.connect().await.unwrap();
        while !stop.load(Ordering::SeqCst) {
            crate::support::write_noise(&admin, 1).await;
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
    })
}

/// The relay slot's lag behind the server (current WAL minus confirmed_flush_lsn) and the WAL
/// it retains (minus restart_lsn), in bytes.
async fn slot_wal(admin: &tokio_postgres::Client, slot: &str) -> (i64, i64) {
    let row = admin
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Every shard but `stuck` holds exactly what committed (its commits' ids, commit order);
/// `stuck` holds each of its rows once, each chat in commit order.
async fn assert_every_shard(fx: &Fixture<'_>, stuck: u32, relay: &RelayProcess) {
    assert_every_shard_of(fx, &[stuck], relay).await;
}

/// Every shard not in `caught_up` holds exactly what committed (its commits' ids, commit
/// order); those in it hold each of their rows once, each chat in commit order.
async fn assert_every_shard_of(fx: &Fixture<'_>, caught_up: &[u32], relay: &RelayProcess) {
    let expected = expected_by_shard(&fx.witness().await, SHARDS);
    let want: usize = expected.iter().map(Vec::len).sum();
    let mut have: Vec<Vec<Entry>> = Vec::new();
    wait_until(Duration::from_secs(60), "every row in its shard", || {
        let fx = &fx;
        async move {
            let mut n = 0;
            for k in 0..SHARDS {
                n += read_stream(fx.redis, &shard_key(&fx.stream, k, SHARDS))
                    .await
                    .map_err(|e| e.to_string())?
                    .len();
            }
            if n >= want {
                Ok(())
            } else {
                Err(format!("{n} of {want}; log: {}", tail(&relay.child.log())))
            }
        }
    })
    .await;
    for k in 0..SHARDS {
        have.push(
            read_stream(fx.redis, &shard_key(&fx.stream, k, SHARDS))
                .await
                .unwrap(),
        );
    }
    for k in 0..SHARDS as usize {
        if caught_up.contains(&(k as u32)) {
            assert_caught_up(&have[k], &expected[k], &format!("shard {k}"));
        } else {
            assert_eq!(have[k], expected[k], "shard {k}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_refusing_writes_for_long_delays_only_its_own_chats_and_pins_no_wal() {
    // GIVEN a relay on 4 shards with the shipped defaults, 40 messages a second over 16 chats
    // on every shard, and another table writing ~1 MB of WAL a second, on a Postgres of its
    // own: the slot's lag is measured in bytes of WAL, and other tests' writes (up to 210 MB
    // in a burst) on a shared server would count in it
    let redis = RedisServer::start().unwrap();
    let pg = testkit::PgServer::start().unwrap();
    let fx = Fixture::sharded(&pg, &redis, SHARDS).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let admin = fx.db.connect().await.unwrap();
    let stop_noise = Arc::new(AtomicBool::new(false));
    let noise = noise(&fx, stop_noise.clone());
    let seen = Seen::start(&redis, &fx.stream);
    let traffic = Traffic::start(&fx, 40).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // WHEN the shard of chat 1 refuses every write for many times --shard-detach-after (5 s)
    let stuck = shard_of_chat(1);
    let fault = Duration::from_secs(lasting_seconds());
    let refusing = StuckShard::start(&redis, &shard_key(&fx.stream, stuck, SHARDS)).await;
    let began = Instant::now();
    let mut max_lag = 0i64;
    let mut max_retained = 0i64;
    let mut samples = Vec::new();
    while began.elapsed() < fault {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (lag, retained) = slot_wal(&admin, &fx.slot).await;
        samples.push((began.elapsed().as_millis(), lag / 1024, retained / 1024));
        // Once it fell behind (5 s and a call's timeout), the slot must not wait for it.
        if began.elapsed() > Duration::from_secs(10) {
            max_lag = max_lag.max(lag);
            max_retained = max_retained.max(retained);
        }
    }
    assert_eq!(
        relay
            .metric(&format!("cdc_relay_shard_behind{{shard=\"{stuck}\"}}"))
            .await,
        Some(1.0),
        "{}",
        tail(&relay.child.log())
    );
    refusing.release().await;

    // THEN once it accepts again it is caught up and live, and everything is in its shard
    wait_metric(
        &relay,
        &format!("cdc_relay_shard_behind{{shard=\"{stuck}\"}}"),
        "the stuck shard live again",
        |v| v == 0.0,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let committed = traffic.stop().await;
    stop_noise.store(true, Ordering::SeqCst);
    noise.await.unwrap();
    assert_every_shard(&fx, stuck, &relay).await;
    let seen = seen.stop().await;

    // ... the healthy shards' chats were shown within 2 s of their commit throughout
    let mut healthy: Vec<Duration> = committed
        .iter()
        .filter(|(_, (_, chat))| shard_of_chat(*chat) != stuck)
        .map(|(id, (at, _))| {
            seen.get(id)
                .map(|s| s.saturating_duration_since(*at))
                .unwrap_or(Duration::MAX)
        })
        .collect();
    healthy.sort();
    let worst = *healthy.last().unwrap();
    // ... and the slot never held WAL for the stuck shard
    println!(
        "stuck shard for {fault:?} at 40 msg/s + ~1 MB/s of other WAL: {} messages to healthy shards, publish latency p50 {:?} p99 {:?} max {worst:?}; slot lag max {} KiB, retained WAL max {} KiB; {} rows caught up",
        healthy.len(),
        percentile(&healthy, 0.5),
        percentile(&healthy, 0.99),
        max_lag / 1024,
        max_retained / 1024,
        relay.metric("cdc_relay_republished_events_total").await.unwrap_or(0.0)
    );
    assert!(
        worst < Duration::from_secs(2),
        "a healthy shard's message took {worst:?}"
    );
    assert!(
        max_lag < 8 << 20,
        "the slot lagged {max_lag} bytes; (ms, lag KiB, retained KiB): {samples:?}"
    );
    assert!(
        max_retained < 64 << 20,
        "the slot retained {max_retained} bytes; (ms, lag KiB, retained KiB): {samples:?}"
    );
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_for_three_caps_of_messages_loses_none_and_nothing_unread_is_trimmed() {
    // GIVEN a relay whose streams may hold 200 unread entries, and a group that does not read
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let mut conn = group_that_reads_nothing_yet(&redis, &fx.stream).await;
    let relay = fx.spawn_relay("relay", &["--stream-max-len", "200"]);
    relay.wait_streaming().await;

    // WHEN 600 messages are sent
    let mut writer = fx.writer().await;
    let mut longest = 0usize;
    for txn in 0..600 {
        crate::support::insert_txn(&mut writer, 0, txn, 1, true)
            .await
            .unwrap();
        if txn % 50 == 0 {
            longest = longest.max(fx.stream_len().await);
        }
    }

    // THEN the stream stops at the cap (the shard falls behind, the slot moves on)
    wait_metric(
        &relay,
        "cdc_relay_shards_fell_behind_total{reason=\"full\"}",
        "the stream full",
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
    longest = longest.max(fx.stream_len().await);
    assert!(longest <= 200, "the stream held {longest} entries");

    // ... and once the receiver reads, it gets every message once, in order
    let mut got: Vec<u32> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while got.len() < 600 {
        assert!(
            Instant::now() < deadline,
            "{} of 600 read; log: {}",
            got.len(),
            tail(&relay.child.log())
        );
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("c")
            .arg("COUNT")
            .arg(100)
            .arg("BLOCK")
            .arg(200)
            .arg("STREAMS")
            .arg(&fx.stream)
            .arg(">")
            .query_async(&mut conn)
            .await
            .unwrap();
        for key in reply.keys {
            for e in key.ids {
                let payload: serde_json::Value = serde_json::from_str(
                    &redis::from_redis_value_ref::<String>(&e.map["payload"]).unwrap(),
                )
                .unwrap();
                got.push(payload["txn"].as_u64().unwrap() as u32);
                let _: i64 = redis::cmd("XACK")
                    .arg(&fx.stream)
                    .arg("g")
                    .arg(&e.id)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
        }
    }
    assert_eq!(got, (0..600).collect::<Vec<u32>>());
    relay.stop();
}

/// SIGTERM to the active relay `stuck_for` into a stuck shard, a standby waiting; how long
/// until the standby streams.
async fn sigterm_with_a_stuck_shard(stuck_for: Duration) -> Duration {
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &redis, SHARDS).await;
    // The shipped defaults (the fixture's faster reconnects put back).
    let defaults = ["--reconnect-max-backoff", "1s", "--redis-timeout", "5s"];
    let a = fx.spawn_relay("relay-a", &defaults);
    a.wait_streaming().await;
    let b = fx.spawn_relay("relay-b", &defaults);
    wait_until(Duration::from_secs(30), "relay-b standing by", || async {
        match b.readyz().await {
            Some((503, body)) if body.contains("standby") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let traffic = Traffic::start(&fx, 40).await;
    let stuck = shard_of_chat(1);
    let refusing = StuckShard::start(&redis, &shard_key(&fx.stream, stuck, SHARDS)).await;
    tokio::time::sleep(stuck_for).await;

    let asked = Instant::now();
    a.child.signal(testkit::Signal::Term).unwrap();
    wait_until(Duration::from_secs(30), "relay-b streaming", || async {
        match b.readyz().await {
            Some((200, _)) => Ok(()),
            other => Err(format!("{other:?}; a: {}", tail(&a.child.log()))),
        }
    })
    .await;
    let handover = asked.elapsed();
    let status = a.child.wait_exit(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status:?}: {}", tail(&a.child.log()));
    refusing.release().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    traffic.stop().await;
    assert_every_shard(&fx, stuck, &b).await;
    b.stop();
    handover
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_a_relay_with_a_stuck_shard_hands_over_within_two_seconds() {
    // GIVEN a relay whose shard refuses writes (before it fell behind, and long after), a
    // standby relay waiting, steady traffic
    // WHEN the relay is sent SIGTERM
    // THEN the standby streams within 2 s, and every message arrives once, in order
    let early = sigterm_with_a_stuck_shard(Duration::from_secs(2)).await;
    let late = sigterm_with_a_stuck_shard(Duration::from_secs(10)).await;
    println!("handover with a stuck shard: {early:?} (stuck 2 s, still held), {late:?} (stuck 10 s, behind)");
    assert!(early < Duration::from_secs(2), "{early:?}");
    assert!(late < Duration::from_secs(2), "{late:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_replication_connection_is_given_up_within_the_replication_timeout() {
    // GIVEN a relay reaching Postgres through a middlebox, with a 4 s replication timeout
    let redis = RedisServer::start().unwrap();
    let pg = shared_postgres();
    let fx = Fixture::new(pg, &redis).await;
    let link =
        testkit::proxy::Proxy::to_unix(pg.socket_dir().join(format!(".s.PGSQL.{}", pg.port())))
            .await
            .unwrap();
    let url = format!(
        "postgres://consumers_relay@{}/{}?sslmode=disable",
        link.addr(),
        fx.db.name
    );
    let relay = fx.spawn_relay(
        "relay",
        &["--database-url", &url, "--replication-timeout", "4s"],
    );
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    crate::support::insert_txn(&mut writer, 0, 0, 1, true)
        .await
        .unwrap();
    fx.wait_stream_len(1, Duration::from_secs(10)).await;

    // WHEN the middlebox keeps the relay's connections open but forwards nothing more (new
    // connections pass), and messages are sent
    link.black_hole();
    let cut = Instant::now();
    for txn in 1..6 {
        crate::support::insert_txn(&mut writer, 0, txn, 1, true)
            .await
            .unwrap();
    }

    // THEN the relay gives the silent connection up within the timeout, connects again, and
    // the messages arrive
    fx.wait_stream_len(6, Duration::from_secs(30)).await;
    let recovered = cut.elapsed();
    println!("black-holed replication connection: messages in the stream {recovered:?} after the cut (timeout 4 s)");
    assert!(
        relay
            .metric("cdc_relay_replication_silent_total")
            .await
            .is_some_and(|n| n >= 1.0),
        "{}",
        tail(&relay.child.log())
    );
    // The timeout, the walsender's own timeout freeing the slot, and a reconnect.
    assert!(recovered < Duration::from_secs(15), "{recovered:?}");
    relay.stop();
}

/// The resident set's high-water mark of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_rows_while_a_shard_is_stuck_keep_the_relay_under_its_memory_limit() {
    // GIVEN a relay taking rows of up to 1 MiB (--max-row-bytes), one shard refusing writes
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &redis, SHARDS).await;
    let relay = fx.spawn_relay("relay", &["--max-row-bytes", "1048576"]);
    relay.wait_streaming().await;
    let stuck = shard_of_chat(1);
    let refusing = StuckShard::start(&redis, &shard_key(&fx.stream, stuck, SHARDS)).await;

    // WHEN 240 rows of ~900 KB (about 210 MB) are sent over every shard's chats
    let writer = fx.writer().await;
    let pad = "x".repeat(900_000);
    for n in 0..240i64 {
        let chat = 1 + n % CHATS;
        let payload = serde_json::json!({"chat_id": chat, "n": n, "pad": pad});
        writer
            .execute(
                "INSERT INTO consumers.outbox (event, payload, partition_key) VALUES ('test.event', $1::text::jsonb, $2)",
                &[&payload.to_string(), &chat.to_string()],
            )
            .await
            .unwrap();
    }
    // ... and the stuck shard accepts again, and is caught up from the table
    wait_metric(
        &relay,
        &format!("cdc_relay_shard_behind{{shard=\"{stuck}\"}}"),
        "the stuck shard behind",
        |v| v == 1.0,
    )
    .await;
    refusing.release().await;
    wait_metric(
        &relay,
        &format!("cdc_relay_shard_behind{{shard=\"{stuck}\"}}"),
        "the stuck shard live again",
        |v| v == 0.0,
    )
    .await;
    assert_every_shard(&fx, stuck, &relay).await;

    // THEN the relay never held more than the container's documented 256 MiB, with room
    let peak = peak_rss(relay.child.pid());
    println!(
        "relay peak RSS with ~900 KB rows and a stuck shard: {} MiB",
        peak >> 20
    );
    assert!(peak < 200 << 20, "peak RSS {} MiB", peak >> 20);
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_losing_everything_after_a_long_retention_gets_back_only_what_was_not_consumed() {
    // GIVEN a relay streaming a stream whose group has read all its rows (a day's worth,
    // scaled), then 100 more it has not read yet
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let admin = fx.db.connect().await.unwrap();
    let rows = lasting_rows() as i64;
    admin
        .batch_execute(&format!(
            "INSERT INTO consumers.outbox (event, payload)
             SELECT 'test.event', jsonb_build_object('writer', 0, 'txn', g) FROM generate_series(1, {rows}) g"
        ))
        .await
        .unwrap();
    fx.wait_stream_len(rows as usize, Duration::from_secs(120))
        .await;
    let mut conn = redis.connect().await.unwrap();
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&fx.stream)
        .arg("g")
        .arg("$")
        .query_async(&mut conn)
        .await
        .unwrap();
    // (Created at the top: it read and acknowledged everything so far.) After a watermark or
    // two, one more row, read and acknowledged, tells the relay how far the group got; then,
    // after a watermark or two more, 100 rows it does not read.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let mut writer = fx.writer().await;
    crate::support::insert_txn(&mut writer, 1, 0, 1, true)
        .await
        .unwrap();
    wait_until(Duration::from_secs(10), "the row published", || async {
        match fx.stream_entries().await.last() {
            Some(e) if e.payload["writer"] == 1 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("c")
        .arg("STREAMS")
        .arg(&fx.stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("XACK")
        .arg(&fx.stream)
        .arg("g")
        .arg(&read.keys[0].ids[0].id)
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for txn in 1..101 {
        crate::support::insert_txn(&mut writer, 1, txn, 1, true)
            .await
            .unwrap();
    }
    // (The stream holds what the group has not read, and the row it read last.)
    fx.wait_stream_len(101, Duration::from_secs(10)).await;

    // WHEN Redis loses everything while new messages keep coming
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    let began = Instant::now();
    for txn in 101..111 {
        crate::support::insert_txn(&mut writer, 1, txn, 1, true)
            .await
            .unwrap();
    }

    // THEN the stream gets back about what the group had not consumed, new messages within
    // seconds, each once, in order
    let want: Vec<u64> = (1..111).collect();
    wait_until(
        Duration::from_secs(60),
        "the unconsumed rows back",
        || async {
            let got: Vec<u64> = fx
                .stream_entries()
                .await
                .iter()
                .filter(|e| e.payload["writer"] == 1 && e.payload["txn"] != 0)
                .map(|e| e.payload["txn"].as_u64().unwrap())
                .collect();
            if got.len() >= want.len() {
                Ok(())
            } else {
                Err(format!("{} of {}", got.len(), want.len()))
            }
        },
    )
    .await;
    let took = began.elapsed();
    let got: Vec<u64> = fx
        .stream_entries()
        .await
        .iter()
        .filter(|e| e.payload["writer"] == 1 && e.payload["txn"] != 0)
        .map(|e| e.payload["txn"].as_u64().unwrap())
        .collect();
    assert_eq!(got, want, "the unread and the new rows, once, in order");
    let republished = relay
        .metric("cdc_relay_republished_events_total")
        .await
        .unwrap();
    let len = fx.stream_len().await;
    println!(
        "Redis lost everything after {rows} consumed rows and 100 unread: {republished} rows republished, stream {len} entries, the new ones there {took:?} after the loss"
    );
    assert!(len < 200, "{len} entries: it republished what was consumed");
    assert!(took < Duration::from_secs(10), "{took:?}");
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_of_every_retained_row_stopped_by_sigterm_resumes_where_it_stopped() {
    // GIVEN retained rows in the outbox and a Redis that lost everything while no relay ran
    // (so every retained row is owed), a cap that makes the catch-up go at the group's pace,
    // and a group that reads slowly
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let admin = fx.db.connect().await.unwrap();
    let rows = (lasting_rows() / 5).max(1000) as i64;
    admin
        .batch_execute(&format!(
            "INSERT INTO consumers.outbox (event, payload)
             SELECT 'test.event', jsonb_build_object('writer', 0, 'txn', g) FROM generate_series(1, {rows}) g"
        ))
        .await
        .unwrap();
    let mut conn = redis.connect().await.unwrap();
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&fx.stream)
        .arg("g")
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    let flags = ["--stream-max-len", "400"];
    let relay = fx.spawn_relay("relay-1", &flags);
    relay.wait_streaming().await;
    let stop = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn({
        let (stop, url, stream) = (stop.clone(), redis.url(), fx.stream.clone());
        async move {
            let mut conn = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let mut got: Vec<u64> = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let reply: redis::RedisResult<redis::streams::StreamReadReply> =
                    redis::cmd("XREADGROUP")
                        .arg("GROUP")
                        .arg("g")
                        .arg("c")
                        .arg("COUNT")
                        .arg(10)
                        .arg("BLOCK")
                        .arg(100)
                        .arg("STREAMS")
                        .arg(&stream)
                        .arg(">")
                        .query_async(&mut conn)
                        .await;
                let Ok(reply) = reply else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                for key in reply.keys {
                    for e in key.ids {
                        let payload: serde_json::Value = serde_json::from_str(
                            &redis::from_redis_value_ref::<String>(&e.map["payload"]).unwrap(),
                        )
                        .unwrap();
                        got.push(payload["txn"].as_u64().unwrap());
                        let _: i64 = redis::cmd("XACK")
                            .arg(&stream)
                            .arg("g")
                            .arg(&e.id)
                            .query_async(&mut conn)
                            .await
                            .unwrap();
                    }
                }
                // A slow receiver: about 200 entries a second.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            got
        }
    });

    // WHEN the relay is stopped midway through the catch-up, and another one starts
    wait_until(Duration::from_secs(60), "the catch-up midway", || async {
        match relay.metric("cdc_relay_republished_events_total").await {
            Some(n) if n >= (rows / 3) as f64 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    relay.stop();
    let relay = fx.spawn_relay("relay-2", &flags);

    // THEN the group reads every row once, in order: the second catch-up went on from where
    // the first stopped
    crate::support::wait_caught_up(&relay, "everything").await;
    let want = rows as usize;
    wait_until(Duration::from_secs(120), "every row read", || async {
        let len = fx.stream_len().await;
        let info: redis::streams::StreamInfoGroupsReply = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&fx.stream)
            .query_async(&mut redis.connect().await.unwrap())
            .await
            .unwrap();
        let lag = info.groups.first().and_then(|g| g.lag).unwrap_or(1);
        if lag == 0 && len <= 400 {
            Ok(())
        } else {
            Err(format!("lag {lag}, {len} in the stream of {want}"))
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let got = reader.await.unwrap();
    assert_eq!(got, (1..=rows as u64).collect::<Vec<u64>>());
    relay.stop();
}

/// A commit that waits for the synchronous standby (which never comes): written to the WAL,
/// sent to the relay (waited for), invisible to every snapshot until its wait is cancelled.
/// Answers the backend's pid; the commit's task ends when the wait is cancelled.
async fn commit_waiting_for_a_standby(
    fx: &Fixture<'_>,
    relay: &RelayProcess,
    chat: i64,
) -> (i32, tokio::task::JoinHandle<()>) {
    let received = relay
        .metric("cdc_relay_transactions_total")
        .await
        .unwrap_or(0.0);
    let mut client = fx.writer().await;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let task = tokio::spawn(async move {
        let tx = client.transaction().await.unwrap();
        tx.batch_execute("SET LOCAL synchronous_commit = on")
            .await
            .unwrap();
        let payload = serde_json::json!({"chat_id": chat, "waits": "for a standby"});
        tx.execute(
            "INSERT INTO consumers.outbox (event, payload, partition_key)
             VALUES ('test.event', $1::text::jsonb, $2)",
            &[&payload.to_string(), &chat.to_string()],
        )
        .await
        .unwrap();
        // Cancelled, the wait ends with a warning: the commit stands (locally).
        tx.commit().await.unwrap();
    });
    wait_metric(
        relay,
        "cdc_relay_transactions_total",
        "the waiting commit received",
        |v| v > received,
    )
    .await;
    (pid, task)
}

/// End the wait of the commit `commit_waiting_for_a_standby` left (backend `pid`, its task
/// `waiting`): it stands, and becomes visible.
async fn let_the_commit_through(fx: &Fixture<'_>, pid: i32, waiting: tokio::task::JoinHandle<()>) {
    let admin = fx.db.connect().await.unwrap();
    admin
        .execute("SELECT pg_cancel_backend($1)", &[&pid])
        .await
        .unwrap();
    waiting.await.unwrap();
}

/// A primary whose commits with `synchronous_commit = on` wait for a synchronous standby
/// that never comes: the window between a commit's WAL and its visibility, held open.
fn primary_with_a_ghost_standby() -> testkit::PgServer {
    testkit::PgServer::start_with(
        testkit::PgOptions::default()
            .setting("synchronous_standby_names", "ghost")
            .setting("synchronous_commit", "local"),
    )
    .unwrap()
}

/// One committed row for `chat`, its own transaction.
async fn send_to(fx: &Fixture<'_>, chat: i64, n: i64) {
    fx.writer()
        .await
        .execute(
            "INSERT INTO consumers.outbox (event, payload, partition_key)
             VALUES ('test.event', $1::text::jsonb, $2)",
            &[
                &serde_json::json!({"chat_id": chat, "n": n}).to_string(),
                &chat.to_string(),
            ],
        )
        .await
        .unwrap();
}

/// A transaction the relay received (and dropped: its shard was behind) while no snapshot
/// showed it yet, when the shard is handed back to live streaming; `restart`: the relay is
/// SIGKILLed and started again in between. Panics if the row never reaches its shard.
async fn a_commit_not_yet_visible_at_the_hand_over(restart: bool) {
    // GIVEN a primary whose commits may wait for a synchronous standby that never comes (the
    // window between a commit's WAL and its visibility, held open), a relay on 4 shards
    let pg = primary_with_a_ghost_standby();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(&pg, &redis, SHARDS).await;
    let flags = ["--shard-detach-after", "1s"];
    let mut relay = fx.spawn_relay("relay", &flags);
    relay.wait_streaming().await;
    let chat = 1;
    let stuck = shard_of_chat(chat);
    let other = (2..=CHATS).find(|c| shard_of_chat(*c) != stuck).unwrap();
    let behind = format!("cdc_relay_shard_behind{{shard=\"{stuck}\"}}");
    // ... the shard of chat 1 refusing writes until it fell behind
    let refusing = StuckShard::start(&redis, &shard_key(&fx.stream, stuck, SHARDS)).await;
    send_to(&fx, chat, 0).await;
    wait_metric(&relay, &behind, "the shard behind", |v| v == 1.0).await;

    // WHEN a transaction of that shard commits but stays invisible (its commit waits for the
    // standby), and the relay receives it: the other shards' acknowledgements move on
    let (pid, waiting) = commit_waiting_for_a_standby(&fx, &relay, chat).await;
    send_to(&fx, other, 1).await;
    if restart {
        relay.child.signal(testkit::Signal::Kill).unwrap();
        relay.child.wait_exit(Duration::from_secs(10)).unwrap();
        relay = fx.spawn_relay("relay-again", &flags);
        relay.wait_streaming().await;
    }
    // ... and the shard accepts again: its catch-up runs while the commit is still invisible
    refusing.release().await;
    wait_until(
        Duration::from_secs(30),
        "the hand-over rejoined or waits for the commit",
        || async {
            let m = metrics(&relay).await;
            let waits = m
                .get("cdc_relay_catch_up_waiting_for_commits")
                .copied()
                .unwrap_or(0.0);
            match m.get(&behind) {
                Some(v) if *v == 0.0 || waits == 1.0 => Ok(()),
                other => Err(format!("behind {other:?}, waiting for commits {waits}")),
            }
        },
    )
    .await;
    // ... then the commit's wait is cancelled (it becomes visible), and more is sent
    let_the_commit_through(&fx, pid, waiting).await;
    send_to(&fx, chat, 2).await;
    send_to(&fx, other, 3).await;

    // THEN every row is in its shard once, in order: the invisible one too
    assert_every_shard(&fx, stuck, &relay).await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_visible_at_the_hand_over_but_not_yet_received_is_published_once() {
    // GIVEN a relay on 4 shards, the shard of chat 1 refusing writes until it fell behind
    let pg = shared_postgres();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(pg, &redis, SHARDS).await;
    // (The paused walsender must not end the session: then the restart, not the hand-over,
    // would decide what is sent.)
    let relay = fx.spawn_relay(
        "relay",
        &[
            "--shard-detach-after",
            "1s",
            "--replication-timeout",
            "120s",
        ],
    );
    relay.wait_streaming().await;
    let chat = 1;
    let stuck = shard_of_chat(chat);
    let behind = format!("cdc_relay_shard_behind{{shard=\"{stuck}\"}}");
    let refusing = StuckShard::start(&redis, &shard_key(&fx.stream, stuck, SHARDS)).await;
    send_to(&fx, chat, 0).await;
    wait_metric(&relay, &behind, "the shard behind", |v| v == 1.0).await;
    let sessions = metrics(&relay)
        .await
        .get("cdc_relay_reconnects_total")
        .copied();

    // WHEN the relay's walsender pauses: a row of that shard commits, visible to every
    // snapshot from now on, and the relay has not received it
    let walsender: i32 = fx
        .writer()
        .await
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0);
    pg.pause_backend(walsender).unwrap();
    send_to(&fx, chat, 1).await;
    // ... and the shard accepts again: its catch-up publishes that row and hands the shard
    // back to live streaming before the relay has read the row's transaction
    refusing.release().await;
    wait_metric(&relay, &behind, "the shard live again", |v| v == 0.0).await;
    pg.resume_backend(walsender).unwrap();
    send_to(&fx, chat, 2).await;

    // THEN the row the relay received late is not published again: each row once, and all
    // in the session that did the hand-over
    assert_every_shard(&fx, stuck, &relay).await;
    assert_eq!(
        metrics(&relay)
            .await
            .get("cdc_relay_reconnects_total")
            .copied(),
        sessions
    );
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_invisible_when_its_shard_rejoins_is_published_once_visible() {
    a_commit_not_yet_visible_at_the_hand_over(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_invisible_across_a_relay_restart_is_published_once_visible() {
    a_commit_not_yet_visible_at_the_hand_over(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_live_again_before_the_slot_passed_its_dropped_rows_streams_after_a_restart() {
    live_again_before_the_slot_passed_its_dropped_rows(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_live_again_before_the_slot_passed_its_dropped_rows_streams_after_a_postgres_restart(
) {
    live_again_before_the_slot_passed_its_dropped_rows(true).await;
}

/// A shard caught up and live again while the slot is still below the rows its catch-up
/// wrote; the relay SIGKILLed (and Postgres restarted, with `restart_postgres`) and started
/// again: the slot's replay of those rows must be recognised, not refused as another writer's.
async fn live_again_before_the_slot_passed_its_dropped_rows(restart_postgres: bool) {
    // GIVEN a primary whose commits may wait for a synchronous standby that never comes, a
    // relay on 4 shards, and two chats of different shards
    let pg = primary_with_a_ghost_standby();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(&pg, &redis, SHARDS).await;
    let flags = ["--shard-detach-after", "1s"];
    let relay = fx.spawn_relay("relay", &flags);
    relay.wait_streaming().await;
    let (pinned_chat, rejoining_chat) = (
        1,
        (2..=CHATS)
            .find(|c| shard_of_chat(*c) != shard_of_chat(1))
            .unwrap(),
    );
    let (pinned, rejoining) = (shard_of_chat(pinned_chat), shard_of_chat(rejoining_chat));
    let behind = |k: u32| format!("cdc_relay_shard_behind{{shard=\"{k}\"}}");
    // ... one shard behind, holding the slot back with a commit no snapshot shows yet
    let pinning = StuckShard::start(&redis, &shard_key(&fx.stream, pinned, SHARDS)).await;
    send_to(&fx, pinned_chat, 0).await;
    wait_metric(&relay, &behind(pinned), "the pinned shard behind", |v| {
        v == 1.0
    })
    .await;
    let (pid, waiting) = commit_waiting_for_a_standby(&fx, &relay, pinned_chat).await;
    // ... and another shard that falls behind later, drops a row, catches up and is live
    // again with a live entry above the one its catch-up wrote (the slot still below it)
    let refusing = StuckShard::start(&redis, &shard_key(&fx.stream, rejoining, SHARDS)).await;
    send_to(&fx, rejoining_chat, 1).await;
    wait_metric(&relay, &behind(rejoining), "the second shard behind", |v| {
        v == 1.0
    })
    .await;
    refusing.release().await;
    wait_metric(
        &relay,
        &behind(rejoining),
        "the second shard live again",
        |v| v == 0.0,
    )
    .await;
    send_to(&fx, rejoining_chat, 2).await;
    let rejoining_key = shard_key(&fx.stream, rejoining, SHARDS);
    wait_until(
        Duration::from_secs(30),
        "the live entry in its shard",
        || async {
            let n = read_stream(fx.redis, &rejoining_key)
                .await
                .map_err(|e| e.to_string())?
                .len();
            if n >= 2 {
                Ok(())
            } else {
                Err(format!("{n} entries"))
            }
        },
    )
    .await;

    // WHEN the relay is SIGKILLed and started again: the slot sends the dropped row again, to
    // a shard that is live and holds it under its catch-up's id
    relay.child.signal(testkit::Signal::Kill).unwrap();
    relay.child.wait_exit(Duration::from_secs(10)).unwrap();
    // ... (with Postgres restarted meanwhile: the slot is where it was acknowledged, and
    // every watermark the records hold was taken before the restart)
    let mut waiting = Some(waiting);
    if restart_postgres {
        let_the_commit_through(&fx, pid, waiting.take().expect("once")).await;
        pg.restart_fast().unwrap();
    }
    let relay = fx.spawn_relay("relay-again", &flags);
    relay.wait_streaming().await;
    send_to(&fx, rejoining_chat, 3).await;
    // ... and the first shard accepts again, its commit visible
    pinning.release().await;
    if let Some(waiting) = waiting.take() {
        let_the_commit_through(&fx, pid, waiting).await;
    }
    send_to(&fx, pinned_chat, 4).await;

    // THEN the relay streams on (the replay is recognised as held), and every row is in its
    // shard once, in order
    assert_every_shard_of(&fx, &[pinned, rejoining], &relay).await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_still_waiting_past_the_outbox_retention_is_counted() {
    // GIVEN a relay whose services keep outbox rows 3 s (--outbox-retention), a stream capped
    // at 20 unread entries, and a consumer group that reads nothing
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    group_that_reads_nothing_yet(&redis, &fx.stream).await;
    let relay = fx.spawn_relay(
        "relay",
        &["--stream-max-len", "20", "--outbox-retention", "3s"],
    );
    relay.wait_streaming().await;

    // WHEN more than the cap is sent: the shard falls behind at once, and its catch-up waits
    // for the group (behind less than the retention when it began)
    let mut writer = fx.writer().await;
    for txn in 0..40 {
        crate::support::insert_txn(&mut writer, 0, txn, 1, true)
            .await
            .unwrap();
    }
    wait_metric(
        &relay,
        "cdc_relay_catch_up_waiting_for_consumers",
        "the catch-up waiting for the group",
        |v| v == 1.0,
    )
    .await;

    // THEN once it has waited past the retention (the table's cleanup may delete what it
    // still owes), the relay counts it: the one way this design can lose a message is said
    wait_metric(
        &relay,
        "cdc_relay_catch_up_past_retention_total",
        "a catch-up counted past the retention",
        |v| v >= 1.0,
    )
    .await;
    assert!(
        relay
            .child
            .log()
            .contains("fell behind longer ago than --outbox-retention"),
        "{}",
        tail(&relay.child.log())
    );
    relay.stop();
}
