//! The test kit's own promises: servers start, survive kill and restart on their data
//! directory, and migrated databases have the expected shape.

use std::time::Duration;

use testkit::{shared_postgres, PgOptions, PgServer, RedisServer, NEWER_VERSIONS};

#[tokio::test]
async fn every_newer_postgres_starts_as_its_version_logical_and_migrated() {
    for version in NEWER_VERSIONS {
        let pg = PgServer::start_with(PgOptions::default().version(version)).unwrap();
        let db = pg.create_database().await.unwrap();
        let client = db.connect().await.unwrap();
        let row = client
            .query_one(
                "SELECT current_setting('server_version_num')::int / 10000,
                        current_setting('wal_level'),
                        (SELECT count(*) FROM pg_available_extensions WHERE name = 'plpgsql')
                          + (SELECT count(*) FROM pg_tables WHERE schemaname = 'workers')",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, i32>(0) as u32, version);
        assert_eq!(row.get::<_, String>(1), "logical");
        assert!(row.get::<_, i64>(2) > 1, "migrated on {version}");
    }
}

#[tokio::test]
async fn postgres_starts_logical_and_migrated() {
    let db = shared_postgres().create_database().await.unwrap();
    let client = db.connect().await.unwrap();
    let wal_level: String = client
        .query_one("SHOW wal_level", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(wal_level, "logical");
    let tables: Vec<String> = client
        .query(
            "SELECT table_schema || '.' || table_name FROM information_schema.tables
              WHERE table_schema IN ('consumers', 'workers') ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        tables,
        [
            "consumers.chat_members",
            "consumers.chats",
            "consumers.inbox",
            "consumers.inbox_writer",
            "consumers.messages",
            "consumers.outbox",
            "workers.chat_members",
            "workers.chats",
            "workers.inbox",
            "workers.inbox_writer",
            "workers.messages",
            "workers.outbox"
        ]
    );
    // Applying the migrations again changes nothing.
    let mut client = db.connect().await.unwrap();
    let report = outbox_migrations::apply(&mut client).await.unwrap();
    assert!(
        report.applied.is_empty(),
        "re-applied: {:?}",
        report.applied
    );
    assert_eq!(
        report.current_version,
        Some(outbox_migrations::known().len() as i32)
    );
}

#[tokio::test]
async fn postgres_survives_kill_and_restart_with_its_data() {
    let pg = PgServer::start().unwrap();
    let client = pg.connect("postgres").await.unwrap();
    client
        .batch_execute("CREATE TABLE kept (v int); INSERT INTO kept VALUES (42)")
        .await
        .unwrap();
    let first_pid = pg.pid().unwrap();
    pg.kill().unwrap();
    assert!(pg.pid().is_none());
    pg.start_again().unwrap();
    assert_ne!(pg.pid().unwrap(), first_pid);
    let client = pg.connect("postgres").await.unwrap();
    let v: i32 = client
        .query_one("SELECT v FROM kept", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, 42);
    pg.restart_fast().unwrap();
    let client = pg.connect("postgres").await.unwrap();
    let v: i32 = client
        .query_one("SELECT v FROM kept", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, 42);
}

#[tokio::test]
async fn redis_keeps_acknowledged_writes_across_sigkill() {
    let redis = RedisServer::start().unwrap();
    let mut conn = redis.connect().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();
    redis.kill().unwrap();
    assert!(
        redis.connect().await.is_err() || {
            // A connection object may be created lazily; a command must fail.
            let mut c = redis.connect().await.unwrap();
            redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .is_err()
        }
    );
    redis.start_again().unwrap();
    let mut conn = redis.connect().await.unwrap();
    let v: String = redis::cmd("GET")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, "v");
    let appendfsync: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("appendfsync")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(appendfsync, ["appendfsync", "always"]);

    redis.stop().unwrap();
    redis.wipe_data().unwrap();
    redis.start_again().unwrap();
    let mut conn = redis.connect().await.unwrap();
    let v: Option<String> = redis::cmd("GET")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, None);
    let _ = Duration::ZERO;
}
