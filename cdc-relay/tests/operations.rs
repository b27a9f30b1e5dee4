//! What operators see and what the relay recovers from: slot metrics that follow the world,
//! the slot commands, the stream command, a slot invalidated by max_slot_wal_keep_size, and Redis losing data.
//! The slot metrics, the slot commands and the lost slot run on Postgres 16, 17 and 18 too.

use std::process::{Command, Output};
use std::time::Duration;

use crate::support::{
    insert_txn, metrics, outbox_ids, stream_ids, wait_metric, wait_published, write_noise, Fixture,
};
use testkit::{shared_postgres, shared_redis, wait_until, PgOptions, PgServer, RedisServer};

fn cli(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
        .args(args)
        .output()
        .expect("run cdc-relay")
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// `slot` as `cdc-relay slots --json` shows it, if listed.
fn slot_json(url: &str, slot: &str) -> Option<serde_json::Value> {
    let out = cli(&args(&["slots", "--database-url", url, "--json"]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json.as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == slot)
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_metrics_follow_the_world_and_pass_promtool() {
    slot_metrics(shared_postgres()).await
}

on_newer_versions!(server: slot_metrics,
    slot_metrics_follow_the_world_and_pass_promtool_on_postgres_16 => 16,
    slot_metrics_follow_the_world_and_pass_promtool_on_postgres_17 => 17,
    slot_metrics_follow_the_world_and_pass_promtool_on_postgres_18 => 18,
);

async fn slot_metrics(pg: &PgServer) {
    // GIVEN a relay reading slot health every 100 ms
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(pg, &redis).await;
    let relay = fx.spawn_relay("relay", &["--slot-metrics-interval", "100ms"]);
    relay.wait_streaming().await;
    wait_metric(
        &relay,
        "cdc_relay_slot_held",
        "this relay holds the slot",
        |v| v == 1.0,
    )
    .await;
    wait_metric(
        &relay,
        "cdc_relay_slot_wal_status{status=\"reserved\"}",
        "reserved",
        |v| v == 1.0,
    )
    .await;

    // WHEN the relay cannot deliver (Redis down) while writes continue
    redis.stop().unwrap();
    let mut writer = fx.writer().await;
    for txn in 0..50 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    write_noise(&fx.db.connect().await.unwrap(), 3).await;
    // THEN the lag grows
    wait_metric(&relay, "cdc_relay_slot_lag_bytes", "lag over 1 MB", |v| {
        v > 1e6
    })
    .await;
    wait_metric(
        &relay,
        "cdc_relay_slot_retained_wal_bytes",
        "retained WAL over 1 MB",
        |v| v > 1e6,
    )
    .await;
    // AND when it can again, it catches up and the lag returns near zero
    redis.start_again().unwrap();
    wait_metric(
        &relay,
        "cdc_relay_slot_lag_bytes",
        "lag back under 64 kB",
        |v| v < 65536.0,
    )
    .await;
    let m = metrics(&relay).await;
    assert_eq!(m["cdc_relay_events_published_total"], 50.0);
    assert!(m["cdc_relay_redis_errors_total"] >= 1.0);
    assert_eq!(m["cdc_relay_slot_active"], 1.0);
    assert_eq!(m["cdc_relay_postgres_up"], 1.0);
    assert!(m["cdc_relay_acknowledged_lsn"] > 0.0);
    // The newer servers' slot columns: NaN where the server has none.
    let major = server_major(&fx).await;
    let known = |name: &str| !m[name].is_nan();
    assert_eq!(known("cdc_relay_slot_conflicting"), major >= 17);
    assert_eq!(known("cdc_relay_slot_failover"), major >= 17);
    assert_eq!(known("cdc_relay_slot_inactive_seconds"), major >= 17);
    if major >= 17 {
        assert_eq!(m["cdc_relay_slot_failover"], 0.0);
        assert_eq!(m["cdc_relay_slot_inactive_seconds"], 0.0, "active");
    }

    // The exposition passes promtool's lint.
    let (_, body) = testkit::http::get(relay.admin, "/metrics").await.unwrap();
    testkit::http::promtool_check_metrics(&body).unwrap();
    relay.stop();
}

/// The server's major version (15, 16, ...).
async fn server_major(fx: &Fixture<'_>) -> i32 {
    fx.db
        .connect()
        .await
        .unwrap()
        .query_one(
            "SELECT current_setting('server_version_num')::int / 10000",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// A server whose slots are lost once 16 MB of WAL lie behind them and a checkpoint runs.
fn small_wal_server() -> PgServer {
    small_wal_server_with(PgOptions::default())
}

fn small_wal_server_with(options: PgOptions) -> PgServer {
    PgServer::start_with(
        options
            .setting("max_slot_wal_keep_size", "16MB")
            .setting("max_wal_size", "1GB")
            .setting("checkpoint_timeout", "1h"),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_rebuilt_from_the_outbox_with_recover() {
    lost_slot_rebuilt(PgOptions::default()).await
}

on_newer_versions!(options: lost_slot_rebuilt,
    a_lost_slot_is_rebuilt_from_the_outbox_with_recover_on_postgres_16 => 16,
    a_lost_slot_is_rebuilt_from_the_outbox_with_recover_on_postgres_17 => 17,
    a_lost_slot_is_rebuilt_from_the_outbox_with_recover_on_postgres_18 => 18,
);

async fn lost_slot_rebuilt(options: PgOptions) {
    // GIVEN a relay allowed to recover, on a server with a small max_slot_wal_keep_size (on
    // 17+ asked for a failover slot, which the rebuild must create)
    let pg = small_wal_server_with(options);
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(&pg, &redis).await;
    let major = server_major(&fx).await;
    let mut flags = vec![
        "--on-lost-slot",
        "recover",
        "--slot-metrics-interval",
        "100ms",
    ];
    if major >= 17 {
        flags.extend(["--failover", "true"]);
    }
    let relay = fx.spawn_relay("relay", &flags);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..10 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(10, Duration::from_secs(10)).await;
    wait_metric(
        &relay,
        "cdc_relay_slot_wal_status{status=\"reserved\"}",
        "reserved",
        |v| v == 1.0,
    )
    .await;

    // WHEN the relay cannot deliver while messages are written and WAL piles up
    redis.stop().unwrap();
    for txn in 10..30 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let admin = fx.db.connect().await.unwrap();
    write_noise(&admin, 40).await;
    // THEN the slot is first unreserved (its WAL is kept only until the next checkpoint)
    wait_metric(
        &relay,
        "cdc_relay_slot_wal_status{status=\"unreserved\"}",
        "unreserved",
        |v| v == 1.0,
    )
    .await;
    // ... then lost once a checkpoint removes it
    admin.batch_execute("CHECKPOINT").await.unwrap();
    wait_metric(
        &relay,
        "cdc_relay_slot_wal_status{status=\"lost\"}",
        "lost",
        |v| v == 1.0,
    )
    .await;
    // Postgres 17+ says why; `slots` and `check` show it.
    if server_major(&fx).await >= 17 {
        let url = fx.db.url("consumers_relay");
        let ours = slot_json(&url, &fx.slot).expect("the slot in `slots --json`");
        assert_eq!(ours["invalidation_reason"], "wal_removed", "{ours}");
        let out = cli(&args(&[
            "check",
            "--database-url",
            &url,
            "--slot",
            &fx.slot,
            "--max-lag-bytes",
            "1000000000000",
            "--max-inactive-seconds",
            "3600",
        ]));
        let line = String::from_utf8_lossy(&out.stdout);
        assert!(line.contains("invalidated: wal_removed"), "{line}");
    }
    wait_until(
        Duration::from_secs(10),
        "/readyz reports the lost slot",
        || async {
            match relay.readyz().await {
                Some((503, body)) if body.contains("\"reason\":\"slot_lost\"") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    // AND once Redis is back, the relay recreates the slot and every message is in the stream
    redis.start_again().unwrap();
    relay.wait_streaming().await;
    for txn in 30..35 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let committed = outbox_ids(&fx).await;
    assert_eq!(committed.len(), 35);
    wait_published(&fx, &committed, &relay).await;
    let ids = stream_ids(&fx).await;
    assert!(
        ids.values().all(|n| *n == 1),
        "none published twice: {ids:?}"
    );
    crate::support::wait_rebuild_counted(&relay, "lost_slot").await;
    let m = metrics(&relay).await;
    assert_eq!(m["cdc_relay_rebuilds_total{reason=\"lost_slot\"}"], 1.0);
    assert_eq!(m["cdc_relay_republished_events_total"], 20.0);
    wait_metric(
        &relay,
        "cdc_relay_slot_wal_status{status=\"reserved\"}",
        "reserved again",
        |v| v == 1.0,
    )
    .await;
    if major >= 17 {
        let failover: bool = admin
            .query_one(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
                &[&fx.slot],
            )
            .await
            .unwrap()
            .get(0);
        assert!(failover, "the recreated slot is a failover slot");
    }
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_failover_creates_a_failover_slot_on_17_and_later_and_is_refused_before() {
    for version in testkit::NEWER_VERSIONS {
        let pg = PgServer::start_with(PgOptions::default().version(version)).unwrap();
        let fx = Fixture::new(&pg, shared_redis()).await;
        let url = fx.db.url("consumers_relay");
        let setup = |slot: &str| {
            cli(&args(&[
                "setup",
                "--database-url",
                &url,
                "--slot",
                slot,
                "--publication",
                crate::support::PUBLICATION,
                "--outbox-table",
                crate::support::OUTBOX,
                "--failover",
            ]))
        };
        let out = setup("failover_slot");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if version < 17 {
            assert!(!out.status.success(), "{said}");
            assert!(said.contains("--failover needs Postgres 17"), "{said}");
            continue;
        }
        assert!(out.status.success(), "{said}");
        let admin = fx.db.connect().await.unwrap();
        let failover: bool = admin
            .query_one(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = 'failover_slot'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert!(failover, "Postgres {version}");
        // Again: nothing to do.
        assert!(setup("failover_slot").status.success());
        // The fixture's ordinary slot, held by a relay: refused, saying how.
        let relay = fx.spawn_relay("relay", &[]);
        relay.wait_streaming().await;
        let out = setup(&fx.slot);
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("stop the side's relays"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // ... with its relay stopped: made a failover slot, where it stood.
        relay.stop();
        let is_failover = || async {
            admin
                .query_one(
                    "SELECT failover, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                    &[&fx.slot],
                )
                .await
                .unwrap()
        };
        let before = is_failover().await;
        assert!(!before.get::<_, bool>(0));
        wait_until(Duration::from_secs(10), "the walsender gone", || async {
            let out = setup(&fx.slot);
            if out.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).into_owned())
            }
        })
        .await;
        let after = is_failover().await;
        assert!(after.get::<_, bool>(0), "Postgres {version}");
        assert_eq!(
            after.get::<_, String>(1),
            before.get::<_, String>(1),
            "position kept"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_postgres_18_invalidates_as_idle_is_rebuilt_like_any_lost_slot() {
    // GIVEN Postgres 18 invalidating slots idle for a second, and a relay allowed to recover
    let pg = PgServer::start_with(
        PgOptions::default()
            .version(18)
            .setting("idle_replication_slot_timeout", "1s"),
    )
    .unwrap();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(&pg, &redis).await;
    let flags = [
        "--on-lost-slot",
        "recover",
        "--slot-metrics-interval",
        "100ms",
    ];
    let relay = fx.spawn_relay("relay", &flags);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..10 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(10, Duration::from_secs(10)).await;

    // WHEN the relay is down long enough for a checkpoint to invalidate its idle slot while
    // messages are written
    relay.stop();
    for txn in 10..20 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let admin = fx.db.connect().await.unwrap();
    wait_until(
        Duration::from_secs(20),
        "the slot invalidated as idle",
        || async {
            admin.batch_execute("CHECKPOINT").await.unwrap();
            let reason: Option<String> = admin
                .query_one(
                    "SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = $1",
                    &[&fx.slot],
                )
                .await
                .unwrap()
                .get(0);
            match reason.as_deref() {
                Some("idle_timeout") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let out = cli(&args(&[
        "check",
        "--database-url",
        &fx.db.url("consumers_relay"),
        "--slot",
        &fx.slot,
        "--max-lag-bytes",
        "1000000000000",
        "--max-inactive-seconds",
        "3600",
    ]));
    let line = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{line}");
    assert!(line.contains("invalidated: idle_timeout"), "{line}");

    // THEN the relay started again recreates the slot, rebuilds from the outbox, and every
    // message is in the stream once
    let relay = fx.spawn_relay("relay-2", &flags);
    relay.wait_streaming().await;
    for txn in 20..25 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let committed = outbox_ids(&fx).await;
    assert_eq!(committed.len(), 25);
    wait_published(&fx, &committed, &relay).await;
    let ids = stream_ids(&fx).await;
    assert!(ids.values().all(|n| *n == 1), "none twice: {ids:?}");
    crate::support::wait_rebuild_counted(&relay, "lost_slot").await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_stops_the_relay_naming_the_recovery_option_by_default() {
    let pg = small_wal_server();
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(&pg, &redis).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    redis.stop().unwrap();
    let mut writer = fx.writer().await;
    for txn in 0..5 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let admin = fx.db.connect().await.unwrap();
    write_noise(&admin, 40).await;
    admin.batch_execute("CHECKPOINT").await.unwrap();
    let status = relay.child.wait_exit(Duration::from_secs(30)).unwrap();
    assert!(!status.success());
    let log = relay.child.log();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("is lost") && last.contains("--on-lost-slot recover"),
        "{}",
        crate::support::tail(&log)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_without_its_data_gets_every_message_again() {
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..20 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(20, Duration::from_secs(10)).await;
    // WHEN Redis restarts with nothing (no AOF) while messages keep coming
    redis.kill().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    for txn in 20..30 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    // THEN every committed message is in the new stream, once
    let committed = outbox_ids(&fx).await;
    wait_published(&fx, &committed, &relay).await;
    assert!(stream_ids(&fx).await.values().all(|n| *n == 1));
    // Redis lost everything, its record included: the relay (still running) had never read a
    // consumer group, so every retained row was compared, and every one published again but
    // those of the new ones that came live after the catch-up handed over.
    crate::support::wait_caught_up(&relay, "everything").await;
    let m = metrics(&relay).await;
    assert_eq!(m["cdc_relay_catch_ups_total{mode=\"everything\"}"], 1.0);
    let republished = m["cdc_relay_republished_events_total"];
    assert!((20.0..=30.0).contains(&republished), "{republished}");
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_stream_is_republished() {
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    for txn in 0..10 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(10, Duration::from_secs(10)).await;
    let mut conn = redis.connect().await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(&fx.stream)
        .query_async(&mut conn)
        .await
        .unwrap();
    for txn in 10..15 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let committed = outbox_ids(&fx).await;
    wait_published(&fx, &committed, &relay).await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_exits_0_1_2_and_the_slot_commands_work() {
    check_and_slot_commands(shared_postgres()).await
}

on_newer_versions!(server: check_and_slot_commands,
    check_exits_0_1_2_and_the_slot_commands_work_on_postgres_16 => 16,
    check_exits_0_1_2_and_the_slot_commands_work_on_postgres_17 => 17,
    check_exits_0_1_2_and_the_slot_commands_work_on_postgres_18 => 18,
);

async fn check_and_slot_commands(pg: &PgServer) {
    let fx = Fixture::new(pg, shared_redis()).await;
    let major = server_major(&fx).await;
    let url = fx.db.url("consumers_relay");
    let state = testkit::scratch_dir("check-state");
    let check = |max_lag: &str, warn_lag: &str| {
        args(&[
            "check",
            "--database-url",
            &url,
            "--slot",
            &fx.slot,
            "--max-lag-bytes",
            max_lag,
            "--warn-lag-bytes",
            warn_lag,
            "--max-inactive-seconds",
            "3600",
            "--state-dir",
            state.to_str().unwrap(),
        ])
    };
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    // OK: active, caught up.
    let out = cli(&check("100000000", "50000000"));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        line.starts_with("CDC-RELAY OK - slot ") && line.contains(" active (pid "),
        "{line}"
    );
    assert_eq!(line.lines().count(), 1);

    // With the relay stopped, writes make lag.
    relay.stop();
    let admin = fx.db.connect().await.unwrap();
    wait_until(Duration::from_secs(10), "the walsender gone", || async {
        let active: bool = admin
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&fx.slot],
            )
            .await
            .unwrap()
            .get(0);
        if active {
            Err("still active".to_string())
        } else {
            Ok(())
        }
    })
    .await;
    let mut writer = fx.writer().await;
    for txn in 0..20 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    // WARNING: lag over the warning threshold only.
    let out = cli(&check("100000000", "100"));
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("CDC-RELAY WARNING - lag "));
    // CRITICAL: lag over the limit.
    let out = cli(&check("200", "100"));
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("CDC-RELAY CRITICAL - lag "));
    // CRITICAL: inactive longer than allowed. Before Postgres 17 the check remembers since
    // when in its state file; 17+ says so itself (`inactive_since`) and the file is ignored.
    std::fs::write(
        state.join(format!("cdc-relay-check.{}.inactive-since", fx.slot)),
        "1000",
    )
    .unwrap();
    let out = cli(&check("100000000", "50000000"));
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    if major < 17 {
        assert_eq!(out.status.code(), Some(2), "{line}");
        assert!(line.contains("inactive for"), "{line}");
    } else {
        assert_eq!(out.status.code(), Some(0), "the server's own clock: {line}");
        assert!(line.contains(" inactive for "), "{line}");
        let mut short = check("100000000", "50000000");
        let limit = short
            .iter()
            .position(|a| a == "--max-inactive-seconds")
            .unwrap()
            + 1;
        short[limit] = "1".into();
        wait_until(Duration::from_secs(10), "inactive past 1 s", || async {
            let out = cli(&short);
            let line = String::from_utf8_lossy(&out.stdout).to_string();
            match out.status.code() {
                Some(2) if line.contains("inactive for") => Ok(()),
                _ => Err(line),
            }
        })
        .await;
    }
    // A state directory the check cannot write (a read-only root in a pod): before 17 the
    // inactive slot's age is unknown, and the check says so and what to change (before: OK).
    let unwritable = state.join("a-file-not-a-directory");
    std::fs::write(&unwritable, "").unwrap();
    let mut blind = check("100000000", "50000000");
    let dir_arg = blind.iter().position(|a| a == "--state-dir").unwrap() + 1;
    blind[dir_arg] = unwritable.display().to_string();
    let out = cli(&blind);
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    if major < 17 {
        assert_eq!(out.status.code(), Some(3), "{line}");
        assert!(
            line.starts_with("CDC-RELAY UNKNOWN - ")
                && line.contains("inactive for an unknown time: cannot ")
                && line.contains("CDC_CHECK_STATE_DIR"),
            "{line}"
        );
    } else {
        assert_eq!(out.status.code(), Some(0), "17+ needs no state: {line}");
    }
    // CRITICAL: no such slot.
    let out = cli(&args(&[
        "check",
        "--database-url",
        &url,
        "--slot",
        "nope",
        "--max-lag-bytes",
        "1",
        "--max-inactive-seconds",
        "1",
    ]));
    assert_eq!(out.status.code(), Some(2));

    // slots: a table and JSON with every logical slot of the database.
    let out = cli(&args(&["slots", "--database-url", &url]));
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains(&fx.slot) && table.contains(&fx.witness) && table.contains("pgoutput"),
        "{table}"
    );
    let ours = slot_json(&url, &fx.slot).expect("the slot in `slots --json`");
    assert_eq!(ours["active"], false);
    assert!(ours["lag_bytes"].as_i64().unwrap() > 0);
    assert_eq!(ours["wal_status"], "reserved");
    // The newer servers' columns: null where the server has none.
    assert_eq!(ours["conflicting"].is_null(), major < 17, "{ours}");
    assert_eq!(ours["failover"].is_null(), major < 17, "{ours}");
    assert_eq!(ours["inactive_seconds"].is_null(), major < 17, "{ours}");
    if major >= 17 {
        assert_eq!(ours["conflicting"], false);
        assert_eq!(ours["failover"], false);
        assert!(ours["inactive_seconds"].as_f64().unwrap() >= 0.0);
    }

    // drop-slot: refused while active or without --yes; done otherwise.
    let relay = fx.spawn_relay("relay-2", &[]);
    relay.wait_streaming().await;
    let out = cli(&args(&[
        "drop-slot",
        "--database-url",
        &url,
        "--slot",
        &fx.slot,
        "--yes",
    ]));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is active"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    relay.stop();
    let out = cli(&args(&[
        "drop-slot",
        "--database-url",
        &url,
        "--slot",
        &fx.slot,
    ]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pass --yes"));
    let out = cli(&args(&[
        "drop-slot",
        "--database-url",
        &url,
        "--slot",
        &fx.slot,
        "--yes",
    ]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(slot_json(&url, &fx.slot).is_none());
}

/// `cdc-relay streams` (issue 26): a group that stopped reading shows its lag (entries not
/// yet delivered), its pending entries and how long the oldest waits, its consumers and its
/// dead letters, as JSON and as a table; the relay holding the slot exports the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_reports_a_stopped_groups_lag_pending_and_dead_letters() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let relay = fx.spawn_relay("relay", &["--slot-metrics-interval", "100ms"]);
    relay.wait_streaming().await;
    let mut conn = fx.redis.connect().await.unwrap();
    let group = testkit::unique_name("readers");
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&fx.stream)
        .arg(&group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut writer = fx.writer().await;
    for txn in 0..5 {
        insert_txn(&mut writer, 0, txn, 1, true).await.unwrap();
    }
    let committed = outbox_ids(&fx).await;
    wait_published(&fx, &committed, &relay).await;
    // Two delivered to a consumer that then stopped, none acknowledged; one dead letter.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&group)
        .arg("stopped-consumer")
        .arg("COUNT")
        .arg(2)
        .arg("STREAMS")
        .arg(&fx.stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: String = redis::cmd("XADD")
        .arg(format!("deadletter:{group}"))
        .arg("*")
        .arg("reason")
        .arg("test")
        .query_async(&mut conn)
        .await
        .unwrap();
    let redis_url = fx.redis.url();
    let streams = |json: bool| {
        let mut list = vec!["streams", "--redis-url", &redis_url, "--stream", &fx.stream];
        if json {
            list.push("--json");
        }
        cli(&args(&list))
    };
    let out = streams(true);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let shard = &report[0];
    let length = stream_ids(&fx).await.len() as u64;
    assert_eq!(shard["key"], fx.stream.as_str());
    assert_eq!(shard["length"], length);
    let g = shard["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == group.as_str())
        .expect("the group");
    assert_eq!(g["lag"], length - 2, "{g}");
    assert_eq!(g["pending"], 2, "{g}");
    assert_eq!(g["consumers"], 1, "{g}");
    assert_eq!(g["dead_letters"], 1, "{g}");
    assert!(
        g["oldest_pending_idle_seconds"].as_f64().unwrap() >= 0.0,
        "{g}"
    );
    let table = String::from_utf8_lossy(&streams(false).stdout).to_string();
    assert!(
        table.contains(&fx.stream) && table.contains(&group),
        "{table}"
    );

    // The relay exports the same, for the lag alerts.
    let of_group = |name: &str, samples: &std::collections::HashMap<String, f64>| {
        samples
            .iter()
            .find(|(k, _)| {
                k.starts_with(&format!("{name}{{")) && k.contains(&format!("group=\"{group}\""))
            })
            .map(|(_, v)| *v)
    };
    wait_until(
        Duration::from_secs(30),
        "the relay's stream gauges",
        || async {
            let samples = metrics(&relay).await;
            let lag = of_group("cdc_relay_stream_group_lag_entries", &samples);
            let pending = of_group("cdc_relay_stream_group_pending_entries", &samples);
            let age = of_group(
                "cdc_relay_stream_group_oldest_pending_idle_seconds",
                &samples,
            );
            match (lag, pending, age) {
                (Some(l), Some(2.0), Some(a)) if l == (length - 2) as f64 && a >= 0.0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    relay.stop();
}
