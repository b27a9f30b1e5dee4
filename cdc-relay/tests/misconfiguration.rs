//! Misconfiguration is refused at start with one line that says what to change; `setup`
//! creates the slot once and refuses to create it before the publication exists.

use std::process::{Command, Output};
use std::time::Duration;

use crate::support::{assert_refused, Fixture};
use testkit::{shared_postgres, shared_redis, unique_name, wait_until, PgOptions, PgServer};

fn relay(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run cdc-relay")
}

fn run_args(fx: &Fixture<'_>, overrides: &[&str]) -> Vec<String> {
    let mut args = vec!["run".to_string()];
    args.extend(fx.flags(overrides));
    args
}

/// `setup` with the connection flags `run` takes (tuning flags are `run`'s alone).
fn setup_args(fx: &Fixture<'_>, overrides: &[&str]) -> Vec<String> {
    let mut args = vec!["setup".to_string()];
    let flags = fx.flags(overrides);
    for pair in flags.chunks(2) {
        if matches!(
            pair[0].as_str(),
            "--database-url"
                | "--slot"
                | "--publication"
                | "--outbox-table"
                | "--redis-url"
                | "--stream"
        ) {
            args.extend_from_slice(pair);
        }
    }
    args
}

#[tokio::test]
async fn missing_publication_names_the_migrations() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let out = relay(&run_args(&fx, &["--publication", "no_such_pub"]));
    assert_refused(&out, &["publication no_such_pub does not exist: run the migrations (`migrate`), then `cdc-relay setup`"]);
    let out = relay(&setup_args(
        &fx,
        &["--publication", "no_such_pub", "--slot", &unique_name("s")],
    ));
    assert_refused(&out, &["publication no_such_pub does not exist"]);
}

#[tokio::test]
async fn missing_slot_gives_the_setup_hint() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let out = relay(&run_args(&fx, &["--slot", "never_created"]));
    assert_refused(
        &out,
        &["replication slot never_created does not exist: create it with `cdc-relay setup`"],
    );
}

#[tokio::test]
async fn wal_level_not_logical_says_how_to_fix_it() {
    let pg = PgServer::start_with(PgOptions::default().setting("wal_level", "replica")).unwrap();
    let db = pg.create_database().await.unwrap();
    let args: Vec<String> = [
        "setup",
        "--database-url",
        &db.url("consumers_relay"),
        "--slot",
        "s",
        "--publication",
        "consumers_outbox",
        "--outbox-table",
        "consumers.outbox",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = relay(&args);
    assert_refused(
        &out,
        &[
            "wal_level is 'replica' but logical decoding needs 'logical'",
            "on Postgres 19+, 'replica' is enough",
            "set wal_level = logical",
        ],
    );
}

#[tokio::test]
async fn invalid_flags_are_refused_before_connecting() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let out = relay(&run_args(&fx, &["--outbox-table", "outbox"]));
    assert_refused(&out, &["--outbox-table 'outbox' is not schema.table"]);
    let out = relay(&run_args(&fx, &["--slot", "Has-Dash"]));
    assert_refused(&out, &["--slot 'Has-Dash' is not a valid name"]);
}

#[tokio::test]
async fn setup_creates_the_slot_once() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let slot = unique_name("fresh");
    let first = relay(&setup_args(&fx, &["--slot", &slot]));
    assert!(first.status.success(), "{first:?}");
    assert!(String::from_utf8_lossy(&first.stdout)
        .starts_with(&format!("created replication slot {slot} (pgoutput) at ")));
    let second = relay(&setup_args(&fx, &["--slot", &slot]));
    assert!(second.status.success(), "{second:?}");
    // The stream already had a record (the fixture's): neither call touches it.
    let said = String::from_utf8_lossy(&second.stdout);
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines[0], format!("replication slot {slot} already exists"));
    assert!(
        lines[1].contains("record left alone (the slot existed before)"),
        "{said}"
    );
    assert!(String::from_utf8_lossy(&first.stdout)
        .contains("record left alone (the stream already has a record)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_at_start_keeps_retrying_and_says_so() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let missing = testkit::scratch_dir("no-redis").join("nothing.sock");
    let url = format!("redis+unix://{}", missing.display());
    let relay = fx.spawn_relay("relay", &["--redis-url", &url]);
    wait_until(Duration::from_secs(20), "two retries logged", || async {
        let log = relay.child.log();
        let retries = log.matches("redis unreachable; retrying").count();
        if retries >= 2 {
            Ok(())
        } else {
            Err(format!(
                "{retries} retries; log: {}",
                crate::support::tail(&log)
            ))
        }
    })
    .await;
    assert!(relay.child.is_running());
    match relay.readyz().await {
        Some((503, body)) => assert!(body.contains("redis_unavailable"), "{body}"),
        other => panic!("readyz {other:?}"),
    }
    let status = relay.stop();
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publication_dropped_while_streaming_stops_the_relay_with_the_hint() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let admin = fx.db.connect().await.unwrap();
    admin
        .batch_execute("DROP PUBLICATION consumers_outbox")
        .await
        .unwrap();
    let mut writer = fx.writer().await;
    crate::support::insert_txn(&mut writer, 0, 0, 1, true)
        .await
        .unwrap();
    let status = relay.child.wait_exit(Duration::from_secs(20)).unwrap();
    assert!(!status.success());
    let log = relay.child.log();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(
            "cdc-relay: publication consumers_outbox does not exist: run the migrations"
        ),
        "{}",
        crate::support::tail(&log)
    );
    assert_eq!(fx.stream_len().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_writer_moving_the_stream_top_stops_the_relay_instead_of_dropping_messages() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    crate::support::insert_txn(&mut writer, 0, 0, 1, true)
        .await
        .unwrap();
    fx.wait_stream_len(1, Duration::from_secs(10)).await;
    // Someone else XADDs with an automatic id (a millisecond timestamp, far above LSNs).
    let mut conn = fx.redis.connect().await.unwrap();
    let _: String = redis::cmd("XADD")
        .arg(&fx.stream)
        .arg("*")
        .arg("event")
        .arg("intruder")
        .query_async(&mut conn)
        .await
        .unwrap();
    crate::support::insert_txn(&mut writer, 0, 1, 1, true)
        .await
        .unwrap();
    let status = relay.child.wait_exit(Duration::from_secs(20)).unwrap();
    assert!(!status.success());
    let log = relay.child.log();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("diverged from the replication slot") && last.contains("another writer"),
        "{}",
        crate::support::tail(&log)
    );
}

/// `setup` run before Redis is up (an init container or a compose start racing Redis; seen
/// in CI as `cdc-relay: redis: timed out`) waits for it, says so, and records the stream
/// once it answers, instead of failing the whole start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_waits_for_a_redis_that_is_not_up_yet() {
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let redis = testkit::RedisServer::start().unwrap();
    redis.stop().unwrap();
    let slot = unique_name("late_redis");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cdc-relay"));
    cmd.args(setup_args(
        &fx,
        &["--slot", &slot, "--redis-url", &redis.url()],
    ));
    let dir = testkit::scratch_dir("late-redis");
    let setup = testkit::ChildProcess::spawn("setup", cmd, &dir.join("setup.log")).unwrap();
    wait_until(
        Duration::from_secs(30),
        "setup waiting for Redis",
        || async {
            if setup.log().contains("waiting for Redis: ") {
                Ok(())
            } else if !setup.is_running() {
                panic!("setup exited without waiting: {}", setup.log());
            } else {
                Err(setup.log())
            }
        },
    )
    .await;
    redis.start_again().unwrap();
    let status = setup.wait_exit(Duration::from_secs(60)).unwrap();
    let log = setup.log();
    assert!(status.success(), "{log}");
    assert!(
        log.contains(&format!(
            "stream {} starts at the slot's position",
            fx.stream
        )),
        "{log}"
    );
}
