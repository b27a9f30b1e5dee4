//! The relay binary as a real process under real faults: SIGKILL, Redis stopped, Postgres
//! restarted, a second relay waiting for the slot, and one very large transaction. The
//! SIGKILL runs on Postgres 16, 17 and 18 too.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{assert_same_entries, insert_txn, Fixture};
use testkit::{shared_postgres, shared_redis, wait_until, PgServer, RedisServer, Signal};

/// Inserts single-row outbox transactions in a loop until stopped, reconnecting after
/// errors (a Postgres restart); counts the commits that returned Ok.
struct Writer {
    stop: Arc<AtomicBool>,
    committed: Arc<AtomicU32>,
    failed: Arc<AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    fn start(url: String, pause: Duration) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicU32::new(0));
        let failed = Arc::new(AtomicU32::new(0));
        let task = {
            let (stop, committed, failed) = (stop.clone(), committed.clone(), failed.clone());
            tokio::spawn(async move {
                let mut txn = 0;
                'outer: while !stop.load(Ordering::Relaxed) {
                    let Ok((mut client, conn)) =
                        tokio_postgres::connect(&url, tokio_postgres::NoTls).await
                    else {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    };
                    tokio::spawn(conn);
                    while !stop.load(Ordering::Relaxed) {
                        txn += 1;
                        match insert_txn(&mut client, 0, txn, 1, true).await {
                            Ok(()) => committed.fetch_add(1, Ordering::Relaxed),
                            Err(_) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                                continue 'outer;
                            }
                        };
                        if !pause.is_zero() {
                            tokio::time::sleep(pause).await;
                        }
                    }
                }
            })
        };
        Writer {
            stop,
            committed,
            failed,
            task,
        }
    }

    fn committed(&self) -> u32 {
        self.committed.load(Ordering::Relaxed)
    }

    /// Wait (30 s at most) until at least `n` transactions committed.
    async fn wait_committed(&self, n: u32) {
        wait_until(Duration::from_secs(30), &format!("{n} commits"), || async {
            let committed = self.committed();
            if committed >= n {
                Ok(())
            } else {
                Err(format!("{committed}"))
            }
        })
        .await
    }

    async fn stop(self) -> (u32, u32) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        (
            self.committed.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

async fn wait_stream_complete(fx: &Fixture<'_>) {
    let expected = fx.expected_entries().await;
    fx.wait_stream_len(expected.len(), Duration::from_secs(60))
        .await;
    assert_same_entries(&fx.stream_entries().await, &expected);
}

/// Number of Redis clients connected right now.
async fn redis_clients(redis: &RedisServer) -> u64 {
    let mut conn = redis.connect().await.unwrap();
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(&mut conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_and_duplicates_nothing() {
    sigkill_mid_stream(shared_postgres()).await
}

on_newer_versions!(server: sigkill_mid_stream,
    sigkill_mid_stream_loses_and_duplicates_nothing_on_postgres_16 => 16,
    sigkill_mid_stream_loses_and_duplicates_nothing_on_postgres_17 => 17,
    sigkill_mid_stream_loses_and_duplicates_nothing_on_postgres_18 => 18,
);

async fn sigkill_mid_stream(pg: &PgServer) {
    // GIVEN a relay process streaming while a writer commits continuously (own Redis, so
    // the only other client is ours)
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(pg, &redis).await;
    let relay = fx.spawn_relay("relay-1", &["--status-interval", "2s"]);
    relay.wait_streaming().await;
    let writer = Writer::start(fx.db.url("consumers"), Duration::from_millis(1));
    fx.wait_stream_len(200, Duration::from_secs(30)).await;

    // WHEN the relay is killed mid-stream
    relay.child.kill().unwrap();
    // Redis has processed everything the dead relay sent once it saw its connection close.
    wait_until(
        Duration::from_secs(10),
        "the dead relay's connections closed",
        || async {
            let n = redis_clients(&redis).await;
            if n == 1 {
                Ok(())
            } else {
                Err(format!("{n} clients"))
            }
        },
    )
    .await;
    let confirmed = fx.confirmed_flush_lsn().await;
    let before_restart = fx.stream_entries().await;

    // ... and restarted while the writer continues
    let relay = fx.spawn_relay("relay-2", &[]);
    relay.wait_streaming().await;
    writer
        .wait_committed(before_restart.len() as u32 + 300)
        .await;
    let (_, failed) = writer.stop().await;
    assert_eq!(failed, 0);

    // THEN the stream holds every committed insert exactly once, in commit order
    wait_stream_complete(&fx).await;
    // AND every entry Postgres re-sent that the stream already had was counted as a
    // rejected duplicate: those are the entries of transactions not acknowledged before
    // the kill that had reached Redis.
    let witness = fx.witness().await;
    let unacknowledged_in_redis = witness
        .iter()
        .filter(|t| t.end_lsn > confirmed)
        .flat_map(|t| (0..t.events.len()).map(move |k| format!("{}-{k}", t.commit_lsn)))
        .filter(|id| before_restart.iter().any(|e| &e.id == id))
        .count();
    assert!(
        unacknowledged_in_redis > 0,
        "scenario: some published entries were not yet acknowledged at the kill"
    );
    wait_until(Duration::from_secs(10), "duplicates counted", || async {
        let dups = relay
            .metric("cdc_relay_duplicates_rejected_total")
            .await
            .unwrap_or(-1.0);
        if dups as usize == unacknowledged_in_redis {
            Ok(())
        } else {
            Err(format!("{dups} of {unacknowledged_in_redis}"))
        }
    })
    .await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_holds_acknowledgements_and_loses_nothing() {
    // GIVEN a relay process and a writer committing every few milliseconds
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let writer = Writer::start(fx.db.url("consumers"), Duration::from_millis(3));
    fx.wait_stream_len(50, Duration::from_secs(30)).await;

    // WHEN Redis is stopped for three seconds while inserts continue
    redis.stop().unwrap();
    let committed_at_stop = writer.committed();
    let outage = Instant::now();
    let mut max_confirmed = 0;
    while outage.elapsed() < Duration::from_secs(3) {
        max_confirmed = max_confirmed.max(fx.confirmed_flush_lsn().await);
        tokio::time::sleep(Duration::from_millis(20)).await; // sampling period of the outage scenario
    }
    // Inserts kept succeeding.
    assert!(
        writer.committed() > committed_at_stop + 100,
        "writes continued during the outage"
    );
    // Freeze the relay while Redis comes back, to read what Redis has before it resumes.
    relay.child.signal(Signal::Stop).unwrap();
    redis.start_again().unwrap();
    let in_redis = fx.stream_entries().await;
    relay.child.signal(Signal::Cont).unwrap();

    // THEN during the outage the slot was never acknowledged past what Redis had: every
    // transaction that ends at or before the highest confirmed_flush_lsn seen is in Redis
    let witness = fx.witness().await;
    for txn in witness.iter().filter(|t| t.end_lsn <= max_confirmed) {
        for k in 0..txn.events.len() {
            let id = format!("{}-{k}", txn.commit_lsn);
            assert!(
                in_redis.iter().any(|e| e.id == id),
                "acknowledged {id} (confirmed {max_confirmed:X}) is not in Redis"
            );
        }
    }
    // AND after Redis returns everything arrives, in order
    let (_, failed) = writer.stop().await;
    assert_eq!(failed, 0);
    wait_stream_complete(&fx).await;
    let errors = relay.metric("cdc_relay_redis_errors_total").await.unwrap();
    assert!(errors >= 1.0, "the outage was seen: {errors} redis errors");
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_fast_restart_under_load_loses_and_duplicates_nothing() {
    // GIVEN a relay on a server of its own and a writer committing continuously
    let pg = PgServer::start().unwrap();
    let fx = Fixture::new(&pg, shared_redis()).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let writer = Writer::start(fx.db.url("consumers"), Duration::from_millis(1));
    fx.wait_stream_len(100, Duration::from_secs(30)).await;

    // WHEN Postgres is restarted (fast shutdown) under load
    pg.restart_fast().unwrap();
    let after_restart = writer.committed();
    writer.wait_committed(after_restart + 300).await;
    writer.stop().await;

    // THEN the relay reconnected and the stream holds each committed insert exactly once
    wait_stream_complete(&fx).await;
    let reconnects = relay.metric("cdc_relay_reconnects_total").await.unwrap();
    assert!(reconnects >= 1.0, "{reconnects}");
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_relay_stands_by_and_takes_over_on_sigterm() {
    // GIVEN two relays on one slot and a writer
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let first = fx.spawn_relay("relay-a", &[]);
    first.wait_streaming().await;
    let second = fx.spawn_relay("relay-b", &["--standby-retry", "200ms"]);
    // THEN the second waits as standby
    wait_until(
        Duration::from_secs(20),
        "second relay reports standby",
        || async {
            match second.readyz().await {
                Some((503, body)) if body.contains("\"reason\":\"standby\"") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let writer = Writer::start(fx.db.url("consumers"), Duration::from_millis(2));
    fx.wait_stream_len(100, Duration::from_secs(30)).await;

    // WHEN the first gets SIGTERM (a rolling deploy)
    let terminated = Instant::now();
    let status = first
        .child
        .stop_with(Signal::Term, Duration::from_secs(15))
        .unwrap();
    assert!(
        status.success(),
        "first relay exit: {status:?}\n{}",
        first.child.log()
    );
    // THEN the second takes over within 2 s
    wait_until(
        Duration::from_secs(10),
        "second relay streaming",
        || async {
            match second.readyz().await {
                Some((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let takeover = terminated.elapsed();
    println!("takeover after SIGTERM: {takeover:?}");
    assert!(takeover < Duration::from_secs(2), "took {takeover:?}");

    // AND the stream shows neither gap nor duplicate
    let committed = writer.committed();
    writer.wait_committed(committed + 200).await;
    writer.stop().await;
    wait_stream_complete(&fx).await;
    second.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100k_row_transaction_is_published_with_bounded_memory() {
    // GIVEN a relay process
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    // WHEN one transaction inserts 100,000 outbox rows of ~1 KB (about 100 MB of payload)
    let client = fx.writer().await;
    client
        .batch_execute(
            "INSERT INTO consumers.outbox (event, payload)
             SELECT 'bulk', jsonb_build_object('n', n, 'pad', repeat('x', 1000))
               FROM generate_series(0, 99999) AS n",
        )
        .await
        .unwrap();
    // THEN all are published, as <commit_lsn>-0 .. -99999
    fx.wait_stream_len(100_000, Duration::from_secs(120)).await;
    let entries = fx.stream_entries().await;
    let lsn = entries[0].id.split_once('-').unwrap().0.to_string();
    for (k, e) in entries.iter().enumerate() {
        assert_eq!(e.id, format!("{lsn}-{k}"));
        assert_eq!(e.payload["n"], k as u64);
    }
    // AND the relay's memory stayed bounded (well under the transaction's size)
    let status = std::fs::read_to_string(format!("/proc/{}/status", relay.child.pid())).unwrap();
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap();
    println!(
        "relay peak RSS for a 100,000-row (~100 MB) transaction: {} MiB",
        peak_kib / 1024
    );
    assert!(peak_kib < 80 * 1024, "peak RSS {peak_kib} KiB");
    let commit_lsn: u64 = lsn.parse().unwrap();
    wait_until(
        Duration::from_secs(10),
        "the slot acknowledged past the transaction",
        || async {
            let confirmed = fx.confirmed_flush_lsn().await;
            if confirmed > commit_lsn {
                Ok(())
            } else {
                Err(format!("{confirmed:X} <= {commit_lsn:X}"))
            }
        },
    )
    .await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stops_fast_while_redis_is_down() {
    // GIVEN a relay streaming from a Postgres and into a Redis of their own
    let pg = PgServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(&pg, &redis).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    insert_txn(&mut writer, 0, 1, 1, true).await.unwrap();
    fx.wait_stream_len(1, Duration::from_secs(30)).await;

    // WHEN Postgres is stopped (fast) while everything works
    // THEN the relay confirms the end of WAL and the server stops
    tokio::task::block_in_place(|| pg.stop_fast_within(Duration::from_secs(30)))
        .expect("a healthy relay held Postgres' fast shutdown");
    pg.start_again().unwrap();
    let mut writer = fx.writer().await;
    insert_txn(&mut writer, 0, 2, 1, true).await.unwrap();
    fx.wait_stream_len(2, Duration::from_secs(30)).await;
    let overdue = relay
        .metric("cdc_relay_confirmations_overdue_total")
        .await
        .unwrap();
    assert_eq!(overdue, 0.0, "a healthy relay confirmed instead of leaving");

    // GIVEN Redis gone while a committed row waits to be published
    redis.stop().unwrap();
    insert_txn(&mut writer, 0, 3, 1, true).await.unwrap();
    drop(writer);

    // WHEN Postgres is stopped (fast) for maintenance
    // THEN the relay, which cannot confirm what the server sent, lets the server stop
    // (a fast shutdown waits for every walsender's client to confirm the end of WAL)
    let started = Instant::now();
    tokio::task::block_in_place(|| pg.stop_fast_within(Duration::from_secs(30)))
        .expect("the relay held Postgres' fast shutdown");
    eprintln!("fast stop took {:?}", started.elapsed());

    // AND once both are back, the row is published once, and the relay says why it left
    redis.start_again().unwrap();
    pg.start_again().unwrap();
    fx.wait_stream_len(3, Duration::from_secs(60)).await;
    wait_stream_complete(&fx).await;
    let overdue = relay
        .metric("cdc_relay_confirmations_overdue_total")
        .await
        .unwrap();
    assert!(overdue >= 1.0, "{overdue}");
    relay.stop();
}
