//! Postgres high availability: the primary SIGKILLed under load and its streaming standby
//! promoted. With a failover slot (Postgres 17+) synced to the standby, the relay pointed at
//! the new primary streams on from the synced slot: every committed message in the stream
//! once, in order, no rebuild. Without failover slots (15, 16) the relays, reaching Postgres
//! through a name the failover switches, find no slot on the new primary and rebuild the
//! stream from its outbox, losing nothing, whether the standby had caught up or its WAL
//! stream stalled while the relay published. And a relay decoding on a standby (16+)
//! streams, and goes on through that standby's promotion.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{insert_txn, metrics, stream_ids, Fixture, RelayProcess};
use testkit::proxy::Proxy;
use testkit::{wait_until, PgOptions, PgServer, RedisServer, Signal, TestDb};

/// The outbox ids `server` holds for the fixture's database, in commit (id) order.
async fn outbox_ids_on(fx: &Fixture<'_>, server: &PgServer) -> Vec<String> {
    fx.db
        .on(server)
        .connect()
        .await
        .unwrap()
        .query(
            "SELECT id::text AS outbox_id FROM consumers.outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// A writer committing single-row transactions of writer 0 (txn 0, 1, ...) on the fixture's
/// primary every 2 ms until `stop` or its first error; `committed` counts them, and the task
/// hands its connection back.
async fn steady_writer(
    fx: &Fixture<'_>,
) -> (
    Arc<AtomicBool>,
    Arc<AtomicU32>,
    tokio::task::JoinHandle<tokio_postgres::Client>,
) {
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(AtomicU32::new(0));
    let writer = tokio::spawn({
        let (stop, committed, mut client) = (stop.clone(), committed.clone(), fx.writer().await);
        async move {
            while !stop.load(Ordering::SeqCst) {
                let txn = committed.load(Ordering::SeqCst);
                if insert_txn(&mut client, 0, txn, 1, true).await.is_err() {
                    break;
                }
                committed.fetch_add(1, Ordering::SeqCst);
                // The pace of the load (the scenario), not a wait for something.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            client
        }
    });
    (stop, committed, writer)
}

/// A streaming standby of `pg` with `hot_standby_feedback` through the physical slot
/// `standby1` on the primary (what decoding on or syncing slots to a standby needs), plus
/// `settings`.
async fn standby_with_slot(pg: &PgServer, db: &TestDb, settings: &[&str]) -> PgServer {
    db.connect()
        .await
        .unwrap()
        .batch_execute("SELECT pg_create_physical_replication_slot('standby1')")
        .await
        .unwrap();
    let mut all = vec!["hot_standby_feedback=on", "primary_slot_name=standby1"];
    all.extend(settings);
    pg.standby_by_copy(&db.name, &all).unwrap()
}

async fn failover_with_failover_slots(version: u32) {
    // GIVEN a primary whose relay slot is a failover slot, a standby syncing it (through a
    // physical slot the primary waits for), and the relay streaming under a steady writer
    let pg = PgServer::start_with(PgOptions::default().version(version)).unwrap();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::with_setup(&pg, &redis, 1, &["--failover", "true"]).await;
    let standby = standby_with_slot(&pg, &fx.db, &["sync_replication_slots=on"]).await;
    // Set on the primary only, after the copy: a promoted standby that inherited it would
    // hold logical decoding back for a slot it does not have.
    let admin = fx.db.connect().await.unwrap();
    for sql in [
        "ALTER SYSTEM SET synchronized_standby_slots = 'standby1'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    drop(admin);
    let standby_url = fx.db.on(&standby).url("consumers_relay");
    let relay = fx.spawn_relay(
        "relay",
        &["--failover", "true", "--standby-url", &standby_url],
    );
    relay.wait_streaming().await;
    let (stop, committed, writer) = steady_writer(&fx).await;
    let on_standby = fx.db.on(&standby).connect().await.unwrap();
    wait_until(
        Duration::from_secs(60),
        "the relay slot synced to the standby",
        || async {
            let synced: Option<bool> = on_standby
                .query_opt(
                    // A synced slot stays temporary (dropped at promotion) until it caught up
                    // with the primary's.
                    "SELECT synced AND NOT temporary FROM pg_replication_slots WHERE slot_name = $1",
                    &[&fx.slot],
                )
                .await
                .unwrap()
                .map(|r| r.get(0));
            match synced {
                Some(true) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    wait_until(Duration::from_secs(30), "load flowing", || async {
        match committed.load(Ordering::SeqCst) {
            n if n >= 300 => Ok(()),
            n => Err(format!("{n} committed")),
        }
    })
    .await;
    // (What the alert on an unsynced copy reads agrees.)
    wait_standby_metric(&relay, "cdc_relay_standby_slot_ready", 1.0).await;

    // WHEN the primary is SIGKILLed mid-load, a relay is pointed at the standby before its
    // promotion (the name moved first: it meets the synced copy, unusable until then), and
    // the standby is promoted 3 s later
    let before_kill = committed.load(Ordering::SeqCst);
    pg.kill().unwrap();
    stop.store(true, Ordering::SeqCst);
    writer.await.unwrap();
    relay.stop();
    let relay = fx.spawn_relay(
        "relay-2",
        &[
            "--database-url",
            &fx.db.on(&standby).url("consumers_relay"),
            "--failover",
            "true",
        ],
    );
    // The scenario's pace: the promotion comes 3 s after the switch.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        relay.child.is_running(),
        "the relay exited while the name pointed at a standby: {}",
        crate::support::tail(&relay.child.log())
    );
    let promoting = Instant::now();
    standby.promote().await.unwrap();
    let promoted_in = promoting.elapsed();
    let started = Instant::now();
    relay.wait_streaming().await;
    let streaming_in = started.elapsed();
    let mut writer = fx.db.on(&standby).connect_as("consumers").await.unwrap();
    for txn in 0..20 {
        insert_txn(&mut writer, 1, txn, 1, true).await.unwrap();
    }

    // THEN every message the new primary holds is in the stream once, in commit order, and
    // no rebuild was needed
    let expected = outbox_ids_on(&fx, &standby).await;
    wait_until(
        Duration::from_secs(30),
        "every row of the new primary in the stream",
        || async {
            let ids = stream_ids(&fx).await;
            match expected.iter().filter(|id| !ids.contains_key(*id)).count() {
                0 => Ok(()),
                missing => Err(format!("{missing} of {} missing", expected.len())),
            }
        },
    )
    .await;
    let in_stream: Vec<String> = fx
        .stream_entries()
        .await
        .into_iter()
        .map(|e| e.outbox_id)
        .collect();
    // (Compared whole, reported briefly: thousands of ids.)
    let first_difference = in_stream.iter().zip(&expected).position(|(a, b)| a != b);
    assert!(
        in_stream.len() == expected.len() && first_difference.is_none(),
        "once each, in commit order: {} in the stream, {} expected, first difference at {first_difference:?}",
        in_stream.len(),
        expected.len()
    );
    let m = metrics(&relay).await;
    let rebuilds: f64 = m
        .iter()
        .filter(|(k, _)| k.starts_with("cdc_relay_rebuilds_total"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(rebuilds, 0.0, "no rebuild: {m:?}");
    println!(
        "Postgres {version}: {before_kill} messages committed before the kill, {} on the promoted standby before the relay moved; promotion {} ms; promotion to streaming again {} ms",
        expected.len() - 20,
        promoted_in.as_millis(),
        streaming_in.as_millis()
    );
    relay.stop();
}

/// Wait until the relay's only sample of a `{standby}` series is `value`.
async fn wait_standby_metric(relay: &RelayProcess, name: &str, value: f64) {
    wait_standby_sample(relay, name, &format!("= {value}"), |v| v == value).await
}

/// Wait until the relay's only sample of a `{standby}` series satisfies `ok`.
async fn wait_standby_sample(
    relay: &RelayProcess,
    name: &str,
    what: &str,
    ok: impl Fn(f64) -> bool,
) {
    wait_until(
        Duration::from_secs(30),
        &format!("{name} {what}"),
        || async {
            let m = metrics(relay).await;
            let samples: Vec<f64> = m
                .iter()
                .filter(|(k, _)| k.starts_with(&format!("{name}{{")))
                .map(|(_, v)| *v)
                .collect();
            match samples[..] {
                [v] if ok(v) => Ok(()),
                _ => Err(format!("{samples:?}")),
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_watched_by_the_relay_reports_whether_its_failover_slot_copy_is_ready() {
    // GIVEN a failover slot, a standby that does not sync slots, and a relay watching it
    let pg = PgServer::start_with(PgOptions::default().version(17)).unwrap();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::with_setup(&pg, &redis, 1, &["--failover", "true"]).await;
    let standby = standby_with_slot(&pg, &fx.db, &[]).await;
    let standby_url = fx.db.on(&standby).url("consumers_relay");
    let relay = fx.spawn_relay(
        "relay",
        &[
            "--failover",
            "true",
            "--standby-url",
            &standby_url,
            "--slot-metrics-interval",
            "200ms",
        ],
    );
    relay.wait_streaming().await;
    // THEN the copy is not ready (a promotion now would lose the slot), the standby is up
    wait_standby_metric(&relay, "cdc_relay_standby_up", 1.0).await;
    wait_standby_metric(&relay, "cdc_relay_standby_slot_ready", 0.0).await;

    // WHEN the standby starts syncing slots
    let on_standby = fx.db.on(&standby).connect().await.unwrap();
    for sql in [
        "ALTER SYSTEM SET sync_replication_slots = on",
        "SELECT pg_reload_conf()",
    ] {
        on_standby.batch_execute(sql).await.unwrap();
    }
    let mut writer = fx.writer().await;
    for txn in 0..20 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    // THEN its copy becomes ready, and says how far behind the primary's it is
    wait_standby_metric(&relay, "cdc_relay_standby_slot_ready", 1.0).await;
    wait_standby_sample(
        &relay,
        "cdc_relay_standby_slot_behind_bytes",
        "finite, not negative",
        |v| v.is_finite() && v >= 0.0,
    )
    .await;

    // WHEN the standby goes away, THEN nobody can say it is ready
    drop(on_standby);
    standby.stop_fast().unwrap();
    wait_standby_metric(&relay, "cdc_relay_standby_up", 0.0).await;
    wait_standby_metric(&relay, "cdc_relay_standby_slot_ready", 0.0).await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failover_with_failover_slots_loses_nothing_on_postgres_17() {
    failover_with_failover_slots(17).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failover_with_failover_slots_loses_nothing_on_postgres_18() {
    failover_with_failover_slots(18).await
}

/// Where the standby stands when the primary dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standby {
    /// It replayed everything the primary committed (the relays, stopped, had not published
    /// the last 100 commits yet).
    CaughtUp,
    /// Its WAL stream stalled while the relays went on publishing.
    Stalled,
    /// Caught up, and the name switched to it seconds before its promotion (DNS or a VIP
    /// moved first): the relays meet a standby without the slot for a while.
    SwitchedBeforePromotion,
}

fn socket_of(pg: &PgServer) -> std::path::PathBuf {
    pg.socket_dir().join(format!(".s.PGSQL.{}", pg.port()))
}

/// (writer, txn) of each outbox row `server` holds, in id (commit) order.
async fn outbox_keys_on(fx: &Fixture<'_>, server: &PgServer) -> Vec<(u64, u64)> {
    fx.db
        .on(server)
        .connect()
        .await
        .unwrap()
        .query(
            "SELECT (payload->>'writer')::bigint, (payload->>'txn')::bigint FROM consumers.outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, i64>(0) as u64, r.get::<_, i64>(1) as u64))
        .collect()
}

/// (writer, txn) of each stream entry, in stream order.
async fn stream_keys(fx: &Fixture<'_>) -> Vec<(u64, u64)> {
    fx.stream_entries()
        .await
        .iter()
        .map(|e| {
            (
                e.payload["writer"].as_u64().unwrap(),
                e.payload["txn"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// A series summed over relays (0 where absent).
async fn summed(relays: &[&RelayProcess], series: &str) -> f64 {
    let mut total = 0.0;
    for relay in relays {
        total += metrics(relay).await.get(series).copied().unwrap_or(0.0);
    }
    total
}

async fn failover_without_failover_slots(options: PgOptions, standby_state: Standby) {
    // GIVEN a primary and a streaming standby whose WAL stream passes a proxy, two relays
    // (the manifests' replicas) reaching Postgres through a name the failover switches (a
    // second proxy), and a steady writer
    let pg = PgServer::start_with(options).unwrap();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(&pg, &redis).await;
    let wal = Proxy::to_unix(socket_of(&pg)).await.unwrap();
    let conninfo = format!(
        "primary_conninfo=host=127.0.0.1 port={} user=postgres dbname=postgres",
        wal.addr().port()
    );
    let standby = PgServer::standby_of_with(&pg, &[&conninfo]).unwrap();
    let dns = Proxy::to_unix(socket_of(&pg)).await.unwrap();
    let url = format!(
        "postgres://consumers_relay@{}/{}?sslmode=disable",
        dns.addr(),
        fx.db.name
    );
    let flags = ["--database-url", url.as_str(), "--standby-retry", "200ms"];
    let relays = [
        fx.spawn_relay("relay-a", &flags),
        fx.spawn_relay("relay-b", &flags),
    ];
    let relay_refs: Vec<&RelayProcess> = relays.iter().collect();
    wait_until(Duration::from_secs(30), "one relay streaming", || async {
        for relay in &relays {
            if matches!(relay.readyz().await, Some((200, _))) {
                return Ok(());
            }
        }
        Err(crate::support::tail(&relays[0].child.log()))
    })
    .await;
    let (stop, committed, writer) = steady_writer(&fx).await;
    fx.wait_stream_len(200, Duration::from_secs(60)).await;

    // WHEN the standby is left where the scenario says
    let mut published_meanwhile = 0;
    let writer = match standby_state {
        Standby::CaughtUp | Standby::SwitchedBeforePromotion => {
            stop.store(true, Ordering::SeqCst);
            let mut client = writer.await.unwrap();
            for relay in &relays {
                relay.child.signal(Signal::Stop).unwrap();
            }
            let from = committed.load(Ordering::SeqCst);
            for txn in from..from + 100 {
                insert_txn(&mut client, 0, txn, 1, true).await.unwrap();
                committed.fetch_add(1, Ordering::SeqCst);
            }
            let target = pg.wal_position().await.unwrap();
            wait_until(Duration::from_secs(30), "the standby caught up", || async {
                match standby.wal_position().await {
                    Ok(at) if at >= target => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            })
            .await;
            None
        }
        Standby::Stalled => {
            wal.sever();
            let before = fx.stream_len().await;
            fx.wait_stream_len(before + 200, Duration::from_secs(60))
                .await;
            published_meanwhile = fx.stream_len().await - before;
            Some(writer)
        }
    };
    // ... the primary is SIGKILLed, the standby promoted, and the name switched to it
    pg.kill().unwrap();
    stop.store(true, Ordering::SeqCst);
    if let Some(writer) = writer {
        drop(writer.await.unwrap());
    }
    let before_kill = committed.load(Ordering::SeqCst);
    if standby_state == Standby::SwitchedBeforePromotion {
        dns.retarget(socket_of(&standby));
        for relay in &relays {
            relay.child.signal(Signal::Cont).unwrap();
        }
        // The scenario's pace: the promotion comes 5 s after the switch.
        tokio::time::sleep(Duration::from_secs(5)).await;
        for relay in &relays {
            assert!(
                relay.child.is_running(),
                "a relay exited while the name pointed at a standby: {}",
                crate::support::tail(&relay.child.log())
            );
        }
    }
    let promoting = Instant::now();
    standby.promote().await.unwrap();
    let promoted_in = promoting.elapsed();
    let switched = Instant::now();
    if standby_state != Standby::SwitchedBeforePromotion {
        dns.retarget(socket_of(&standby));
        for relay in &relays {
            relay.child.signal(Signal::Cont).unwrap();
        }
    }
    let mut client = fx.db.on(&standby).connect_as("consumers").await.unwrap();
    insert_txn(&mut client, 1, 0, 1, true).await.unwrap();

    // THEN the relays stream again from the new primary
    wait_until(
        Duration::from_secs(60),
        "the new primary's first message in the stream",
        || async {
            if stream_keys(&fx).await.contains(&(1, 0)) {
                Ok(())
            } else {
                Err(format!(
                    "relay-a: {}\nrelay-b: {}",
                    crate::support::tail(&relays[0].child.log()),
                    crate::support::tail(&relays[1].child.log())
                ))
            }
        },
    )
    .await;
    let streaming_in = switched.elapsed();
    for txn in 1..100 {
        insert_txn(&mut client, 1, txn, 1, true).await.unwrap();
    }
    // ... and every row the new primary holds is in the stream once
    let expected = outbox_keys_on(&fx, &standby).await;
    wait_until(
        Duration::from_secs(30),
        "every row of the new primary in the stream",
        || async {
            let in_stream = stream_keys(&fx).await;
            match expected.iter().filter(|k| !in_stream.contains(k)).count() {
                0 => Ok(()),
                missing => Err(format!("{missing} of {} missing", expected.len())),
            }
        },
    )
    .await;
    let in_stream = stream_keys(&fx).await;
    for key in &expected {
        let n = in_stream.iter().filter(|k| *k == key).count();
        assert_eq!(n, 1, "{key:?} in the stream {n} times");
    }
    // ... in commit order: the new primary's rows keep their order in the stream, and what
    // it committed after the failover comes after everything from before
    let of_expected: Vec<(u64, u64)> = in_stream
        .iter()
        .filter(|k| expected.contains(k))
        .copied()
        .collect();
    assert!(
        of_expected == expected,
        "stream order differs from commit order"
    );
    let first_new = in_stream.iter().position(|k| k.0 == 1).unwrap();
    assert!(in_stream[first_new..].iter().all(|k| k.0 == 1));
    let lost_by_failover = in_stream.len() - expected.len();
    let (reason, why) = match standby_state {
        Standby::CaughtUp | Standby::SwitchedBeforePromotion => {
            // The standby had everything: the stream is exactly the new primary's outbox.
            assert_eq!(lost_by_failover, 0);
            ("failover", "failed over to a server without the slot")
        }
        Standby::Stalled => {
            // What the relays published past the standby stays in the stream (it was
            // delivered) though the new primary never had it.
            assert!(
                lost_by_failover > 0,
                "the standby was not behind the stream"
            );
            ("timeline", "forked before what the stream acknowledged")
        }
    };
    // ... one rebuild, by one relay, saying why; neither relay stopped
    let series = format!("cdc_relay_rebuilds_total{{reason=\"{reason}\"}}");
    wait_until(Duration::from_secs(10), "the rebuild counted", || async {
        match summed(&relay_refs, &series).await {
            n if n >= 1.0 => Ok(()),
            n => Err(format!(
                "{n}; relay-a: {}\nrelay-b: {}",
                crate::support::tail(&relays[0].child.log()),
                crate::support::tail(&relays[1].child.log())
            )),
        }
    })
    .await;
    let mut all_rebuilds = 0.0;
    for relay in &relays {
        all_rebuilds += metrics(relay)
            .await
            .iter()
            .filter(|(k, _)| k.starts_with("cdc_relay_rebuilds_total"))
            .map(|(_, v)| v)
            .sum::<f64>();
    }
    assert_eq!(all_rebuilds, 1.0, "exactly one rebuild");
    assert!(
        relays.iter().any(|r| r.child.log().contains(why)),
        "no relay said why"
    );
    let republished = summed(&relay_refs, "cdc_relay_republished_events_total").await;
    if standby_state != Standby::Stalled {
        // The 100 commits the stopped relays had not published came from the outbox, but for
        // those they still had in their sockets when they went on (published from there before
        // the old primary's connection broke); so may the new primary's first ones, committed
        // while the catch-up ran. Some, and nothing more.
        assert!(
            republished > 0.0 && republished <= 200.0,
            "{republished} republished"
        );
    }
    for relay in &relays {
        assert!(
            relay.child.is_running(),
            "{}",
            crate::support::tail(&relay.child.log())
        );
    }
    println!(
        "failover without failover slots, standby {standby_state:?}: {before_kill} commits on the old primary, {published_meanwhile} published past the stalled standby ({lost_by_failover} of them not on the new primary), {republished} republished from the outbox, promotion {} ms, switch to the first new message in the stream {} ms",
        promoted_in.as_millis(),
        streaming_in.as_millis()
    );
    for relay in &relays {
        relay.stop();
    }
}

async fn failover_to_a_caught_up_standby(options: PgOptions) {
    failover_without_failover_slots(options, Standby::CaughtUp).await
}

async fn failover_to_a_stalled_standby(options: PgOptions) {
    failover_without_failover_slots(options, Standby::Stalled).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_reaching_a_standby_before_its_promotion_wait_for_it_and_lose_nothing() {
    failover_without_failover_slots(PgOptions::default(), Standby::SwitchedBeforePromotion).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failover_without_failover_slots_to_a_caught_up_standby_loses_nothing() {
    failover_to_a_caught_up_standby(PgOptions::default()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failover_without_failover_slots_to_a_stalled_standby_loses_nothing() {
    failover_to_a_stalled_standby(PgOptions::default()).await
}

on_newer_versions!(options: failover_to_a_caught_up_standby,
    a_primary_failover_without_failover_slots_to_a_caught_up_standby_loses_nothing_on_postgres_16 => 16,
);

on_newer_versions!(options: failover_to_a_stalled_standby,
    a_primary_failover_without_failover_slots_to_a_stalled_standby_loses_nothing_on_postgres_16 => 16,
);

/// Decoding on a standby (Postgres 16+): the relay reads its slot on the standby, and goes on
/// reading it when that standby is promoted.
async fn relay_on_a_standby(version: u32) {
    // GIVEN a primary and its streaming standby (hot_standby_feedback, a physical slot), the
    // relay's slot set up on the standby and the relay reading it there
    let pg = PgServer::start_with(PgOptions::default().version(version)).unwrap();
    let redis = RedisServer::start().unwrap();
    let db = pg.create_database().await.unwrap();
    let standby = standby_with_slot(&pg, &db, &[]).await;
    // A slot created on a standby waits for the primary's next running-transactions record.
    let primary_admin = db.connect().await.unwrap();
    let nudger = tokio::spawn(async move {
        loop {
            let _ = primary_admin
                .batch_execute("SELECT pg_log_standby_snapshot()")
                .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let fx = Fixture::on_database(&redis, db.on(&standby)).await;
    nudger.abort();
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;

    // WHEN messages are committed on the primary
    let mut writer = db.connect_as("consumers").await.unwrap();
    for txn in 0..50 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    // THEN the relay on the standby publishes them
    fx.wait_stream_len(50, Duration::from_secs(30)).await;

    // AND when the standby is promoted (the primary gone), it streams on, nothing twice
    pg.kill().unwrap();
    standby.promote().await.unwrap();
    let mut writer = fx.db.connect_as("consumers").await.unwrap();
    for txn in 50..70 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let expected = outbox_ids_on(&fx, &standby).await;
    assert_eq!(expected.len(), 70);
    wait_until(
        Duration::from_secs(30),
        "every row in the stream",
        || async {
            let ids = stream_ids(&fx).await;
            match expected.iter().filter(|id| !ids.contains_key(*id)).count() {
                0 => Ok(()),
                missing => Err(format!("{missing} missing")),
            }
        },
    )
    .await;
    let ids = stream_ids(&fx).await;
    assert!(ids.values().all(|n| *n == 1), "none twice");
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_decoding_on_a_standby_streams_and_survives_its_promotion_on_postgres_16() {
    relay_on_a_standby(16).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_decoding_on_a_standby_streams_and_survives_its_promotion_on_postgres_17() {
    relay_on_a_standby(17).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_decoding_on_a_standby_streams_and_survives_its_promotion_on_postgres_18() {
    relay_on_a_standby(18).await
}
