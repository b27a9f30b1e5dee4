//! Postgres high availability: the primary SIGKILLed under load and its streaming standby
//! promoted. With a failover slot (Postgres 17+) synced to the standby, the relay pointed at
//! the new primary streams on from the synced slot: every committed message in the stream
//! once, in order, no rebuild. And a relay decoding on a standby (16+) streams, and goes on
//! through that standby's promotion.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{insert_txn, metrics, stream_ids, Fixture};
use testkit::{wait_until, PgOptions, PgServer, RedisServer, TestDb};

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
    let relay = fx.spawn_relay("relay", &["--failover", "true"]);
    relay.wait_streaming().await;
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(AtomicU32::new(0));
    let writer = tokio::spawn({
        let (stop, committed, mut client) = (stop.clone(), committed.clone(), fx.writer().await);
        async move {
            let mut txn = 0;
            while !stop.load(Ordering::SeqCst) {
                if insert_txn(&mut client, 0, txn, 1, true).await.is_err() {
                    break;
                }
                committed.fetch_add(1, Ordering::SeqCst);
                txn += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });
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

    // WHEN the primary is SIGKILLed mid-load and the standby promoted
    let before_kill = committed.load(Ordering::SeqCst);
    pg.kill().unwrap();
    stop.store(true, Ordering::SeqCst);
    writer.await.unwrap();
    relay.stop();
    let promoting = Instant::now();
    standby.promote().await.unwrap();
    let promoted_in = promoting.elapsed();

    // ... and the relay pointed at the new primary
    let started = Instant::now();
    let relay = fx.spawn_relay(
        "relay-2",
        &[
            "--database-url",
            &fx.db.on(&standby).url("consumers_relay"),
            "--failover",
            "true",
        ],
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failover_with_failover_slots_loses_nothing_on_postgres_17() {
    failover_with_failover_slots(17).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failover_with_failover_slots_loses_nothing_on_postgres_18() {
    failover_with_failover_slots(18).await
}

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
    let fx = Fixture::on_database(&standby, &redis, db.on(&standby)).await;
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
