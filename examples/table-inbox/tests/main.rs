//! The example consumer records every entry of a two-shard stream exactly once, each
//! shard in stream order, with two instances sharing the shards, while one instance is
//! SIGKILLed (and started again) and Redis is SIGKILLed and restarted on its AOF in the
//! middle of the stream's writes.

use std::process::Command;
use std::time::Duration;

use outbox_core::stream::{shard_key, shard_of};
use testkit::{wait_until, ChildProcess, RedisServer, Signal};

const ENTRIES: i64 = 600;
const SHARDS: u32 = 2;
const STREAM: &str = "outbox:orders";

fn start(name: &str, postgres: &str, redis: &RedisServer) -> ChildProcess {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_table-inbox"));
    cmd.args(["--postgres-url", postgres, "--redis-url", &redis.url()])
        .args(["--stream", STREAM, "--shards", &SHARDS.to_string()])
        .args(["--consumer", name]);
    let log = testkit::scratch_dir("table-inbox").join(format!("{name}.log"));
    ChildProcess::spawn(name, cmd, &log).expect("start table-inbox")
}

/// Publish entry `n` as the relay would (explicit id, the contract's fields), again and
/// again until Redis has it (30 s at most): after a restart an XADD of an id it holds is
/// refused, which means it is in.
async fn publish(redis: &RedisServer, n: i64) {
    let shard = shard_of(Some(format!("customer-{}", n % 7).as_bytes()), SHARDS);
    let key = shard_key(STREAM, shard, SHARDS);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let added: anyhow::Result<String> = async {
            let mut conn = redis.connect().await?;
            Ok(redis::cmd("XADD")
                .arg(&key)
                .arg(format!("{n}-0"))
                .arg(&["event", "order.placed", "outbox_id", &n.to_string()])
                .arg(&["payload", &format!("{{\"order\": {n}}}")])
                .arg(&["created_at", "2026-12-04T09:00:00.000000Z"])
                .query_async(&mut conn)
                .await?)
        }
        .await;
        match added {
            Ok(_) => return,
            Err(e) if e.to_string().contains("equal or smaller") => return,
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "entry {n} not published within 30 s: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_entry_is_recorded_once_in_order_through_a_consumer_kill_and_a_redis_restart() {
    let db = testkit::shared_postgres().create_database().await.unwrap();
    let redis = RedisServer::start().unwrap();
    let postgres = db.url("postgres");
    let a = start("billing-a", &postgres, &redis);
    let mut b = start("billing-b", &postgres, &redis);
    for n in 1..=ENTRIES {
        publish(&redis, n).await;
        if n == ENTRIES / 3 {
            b.signal(Signal::Kill).unwrap();
            b.wait_exit(Duration::from_secs(10)).unwrap();
            b = start("billing-b", &postgres, &redis);
        }
        if n == 2 * ENTRIES / 3 {
            redis.kill().unwrap();
            redis.start_again().unwrap();
        }
        // Spread over seconds, so both faults land while entries are being recorded.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let client = testkit::shared_postgres().connect(&db.name).await.unwrap();
    wait_until(Duration::from_secs(60), "every entry recorded", || async {
        let row = client
            .query_one("SELECT count(*) FROM inbox.received", &[])
            .await;
        match row.map(|r| r.get::<_, i64>(0)) {
            Ok(n) if n == ENTRIES => Ok(()),
            Ok(n) => Err(format!("{n} of {ENTRIES} recorded")),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    // Each shard's entries were recorded in stream order (ids grow with n in a shard).
    let rows = client
        .query(
            "SELECT shard, outbox_id FROM inbox.received ORDER BY seq",
            &[],
        )
        .await
        .unwrap();
    let mut last = [0i64; SHARDS as usize];
    for row in rows {
        let (shard, id): (i32, i64) = (row.get(0), row.get(1));
        let before = last[shard as usize];
        assert!(id > before, "shard {shard}: {id} recorded after {before}");
        last[shard as usize] = id;
    }
    // Everything acknowledged (just after its commit), nothing dead-lettered.
    wait_until(
        Duration::from_secs(30),
        "every entry acknowledged",
        || async {
            let mut conn = redis.connect().await.map_err(|e| e.to_string())?;
            let mut left = Vec::new();
            for shard in 0..SHARDS {
                let summary: redis::Value = redis::cmd("XPENDING")
                    .arg(shard_key(STREAM, shard, SHARDS))
                    .arg("billing")
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                let pending: u64 = match summary {
                    redis::Value::Array(parts) => {
                        redis::from_redis_value_ref(&parts[0]).unwrap_or(0)
                    }
                    other => return Err(format!("XPENDING: {other:?}")),
                };
                let dead: u64 = redis::cmd("XLEN")
                    .arg(shard_key("deadletter:billing", shard, SHARDS))
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                assert_eq!(dead, 0, "shard {shard} dead-lettered entries");
                if pending > 0 {
                    left.push((shard, pending));
                }
            }
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("pending (shard, entries): {left:?}"))
            }
        },
    )
    .await;
    drop((a, b));
}

/// The same test, run again by this test binary against Valkey 8.1 (`deploy/install-deps.sh`
/// installs it): the consumer's leases, claims, attempt records and fenced inbox writes on
/// the other server the relay supports.
#[test]
fn the_same_passes_on_valkey() {
    if std::env::var_os(testkit::REDIS_SERVER_ENV).is_some() {
        return;
    }
    let (passed, output) = testkit::run_on_valkey(&[
        "every_entry_is_recorded_once_in_order_through_a_consumer_kill_and_a_redis_restart",
    ])
    .expect("run on Valkey");
    assert!(passed, "failed on Valkey:\n{output}");
}
