//! Migrations of several databases of one fresh cluster at once (what a test run or a
//! cluster hosting several deployments does): roles are cluster-wide, so the runs meet.

use testkit::PgServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_of_one_fresh_cluster_migrate_at_once() {
    // Before: about one run in two failed with `role "consumers_owner" does not exist` (V19).
    for _ in 0..3 {
        let pg = PgServer::start().unwrap();
        let runs = (0..6).map(|_| pg.create_database());
        for result in futures::future::join_all(runs).await {
            result.expect("every database migrated");
        }
    }
}

/// `migrate --wait` as a service's own role (the init container of deploy/k8s): it waits
/// while the database is not migrated (no history yet, or one its role cannot read), gives
/// up at its deadline saying why, exits 0 once the migration ran, and does not take another
/// migration of the same number for this release's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_wait_holds_a_pod_back_until_the_migrations_ran() {
    let pg = testkit::shared_postgres();
    // Roles exist cluster-wide once one database is migrated.
    let _migrated = pg.create_database().await.unwrap();
    let name = testkit::unique_name("wait");
    let admin = pg.connect("postgres").await.unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let wait = |timeout: &str| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_migrate"));
        cmd.args(["--wait", "--wait-timeout", timeout, "--database-url"])
            .arg(pg.url("consumers", &name))
            .env_remove("DATABASE_URL");
        cmd
    };
    let out = wait("2s").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("gave up waiting after --wait-timeout")
            && stderr.contains("the database lacks migrations [1, 2, 3,"),
        "{stderr}"
    );

    // Waiting while the migration Job runs: done once it is.
    let dir = testkit::scratch_dir("migrate-wait");
    let waiter =
        testkit::ChildProcess::spawn("migrate-wait", wait("60s"), &dir.join("wait.log")).unwrap();
    let mut client = pg.connect(&name).await.unwrap();
    outbox_migrations::apply(&mut client).await.unwrap();
    let status = waiter
        .wait_exit(std::time::Duration::from_secs(30))
        .unwrap();
    assert!(status.success(), "{}", waiter.log());
    assert!(
        waiter.log().contains("every migration this release needs"),
        "{}",
        waiter.log()
    );

    // A migration of the same number but not this release's (migrate refuses it as
    // divergent) does not count as applied.
    client
        .execute(
            "UPDATE refinery_schema_history SET checksum = '1' WHERE version = 20",
            &[],
        )
        .await
        .unwrap();
    let out = wait("2s").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("lacks migrations [20]"), "{stderr}");

    // And `--wait` sets no passwords.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_migrate"))
        .args([
            "--wait",
            "--role-password",
            "consumers=/dev/null",
            "--database-url",
        ])
        .arg(pg.url("consumers", &name))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "clap refuses the combination");
}

/// `migrate --side-database`: one database per side, created when missing, migrated, and
/// open to that side's roles only; run again, it changes nothing and still succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_database_per_side_is_made_and_opened_to_its_side_only() {
    let pg = PgServer::start().unwrap();
    let consumers_db = testkit::unique_name("sidec");
    let workers_db = testkit::unique_name("sidew");
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_migrate"))
            .arg("--database-url")
            .arg(pg.url("postgres", "postgres"))
            .arg("--side-database")
            .arg(format!("consumers={consumers_db}"))
            .arg("--side-database")
            .arg(format!("workers={workers_db}"))
            .env_remove("DATABASE_URL")
            .output()
            .unwrap()
    };
    for attempt in ["first", "again"] {
        let out = run();
        assert!(
            out.status.success(),
            "{attempt}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for (database, own, other) in [
        (
            &consumers_db,
            ["consumers", "consumers_relay"],
            ["workers", "workers_relay"],
        ),
        (
            &workers_db,
            ["workers", "workers_relay"],
            ["consumers", "consumers_relay"],
        ),
    ] {
        for role in own {
            let client = pg.connect_as(role, database).await;
            assert!(client.is_ok(), "{role} into {database}: {:?}", client.err());
        }
        // The relay's catch-up compares the stream with the table in a temporary table of
        // its own: its role keeps the right to make one (it is PUBLIC's by default, and
        // PUBLIC's rights are revoked).
        let relay = pg.connect_as(own[1], database).await.unwrap();
        relay
            .batch_execute("CREATE TEMPORARY TABLE present (id bigint)")
            .await
            .unwrap_or_else(|e| panic!("{} in {database}: {e:#}", own[1]));
        for role in other {
            let refused = pg.connect_as(role, database).await.err();
            let message = format!("{:#}", refused.expect("the other side connected"));
            assert!(
                message.contains("permission denied for database"),
                "{role} into {database}: {message}"
            );
        }
    }
    // One database for both sides is no isolation: refused.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_migrate"))
        .arg("--database-url")
        .arg(pg.url("postgres", "postgres"))
        .args([
            "--side-database",
            "consumers=chat",
            "--side-database",
            "workers=chat",
        ])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("repeats consumers's side or database"));
    // A name that is not a plain identifier is refused before anything is done.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_migrate"))
        .arg("--database-url")
        .arg(pg.url("postgres", "postgres"))
        .args(["--side-database", "consumers=chat; DROP DATABASE x"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be 1-63 of a-z"));
}
