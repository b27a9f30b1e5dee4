//! The relay on a real Redis Cluster (3 masters with a replica each, on loopback): a
//! stream of 8 shards spreads over the masters, and a master SIGKILLed while rows are
//! committed loses nothing with --redis-wait-replicas 1 (no rebuild needed); the relay
//! refuses a cluster with a one-shard stream.

use std::time::Duration;

use crate::support::{tail, Entry, Fixture};
use outbox_core::stream::shard_key;
use testkit::{shared_postgres, wait_until, RedisCluster, RedisServer};

const SHARDS: u32 = 8;

async fn cluster_entries(cluster: &RedisCluster, stream: &str) -> Vec<Vec<Entry>> {
    cluster_entries_via(&cluster.urls().join(","), stream).await
}

/// Every shard's entries, read through the nodes at `urls` (comma-separated).
async fn cluster_entries_via(urls: &str, stream: &str) -> Vec<Vec<Entry>> {
    let client =
        redis::cluster::ClusterClient::new(urls.split(',').map(str::to_string).collect::<Vec<_>>())
            .unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    let mut all = Vec::new();
    for k in 0..SHARDS {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(shard_key(stream, k, SHARDS))
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        all.push(
            reply
                .ids
                .iter()
                .map(|item| {
                    let field = |name: &str| -> String {
                        item.map
                            .get(name)
                            .map(|v| redis::from_redis_value_ref::<String>(v).unwrap_or_default())
                            .unwrap_or_default()
                    };
                    Entry {
                        id: item.id.clone(),
                        outbox_id: field("outbox_id"),
                        event: field("event"),
                        payload: serde_json::from_str(&field("payload"))
                            .unwrap_or(serde_json::Value::Null),
                        created_at: field("created_at"),
                    }
                })
                .collect(),
        );
    }
    all
}

/// Every shard holds exactly what committed, with the ids of its commits; but a shard that
/// fell behind (the relay's log says so: a failover that took longer than
/// --shard-detach-after) holds each row once, each chat in commit order, under the ids its
/// catch-up gave them.
fn assert_shards_hold(have: &[Vec<Entry>], expected: &[Vec<Entry>], log: &str) {
    for k in 0..SHARDS as usize {
        let fell_behind = log
            .lines()
            .any(|l| l.contains("shard falls behind") && l.contains(&format!(" shard={k} ")));
        if fell_behind {
            crate::support::assert_caught_up(&have[k], &expected[k], &format!("shard {k}"));
        } else {
            assert_eq!(have[k], expected[k], "shard {k}");
        }
    }
}

/// Wait until the shards hold as many entries as rows committed (`log`: the relay's, for the
/// message); what each shard must hold.
async fn every_row_in_its_shard(
    cluster: &RedisCluster,
    fx: &Fixture<'_>,
    log: impl Fn() -> String,
) -> Vec<Vec<Entry>> {
    let expected = crate::support::expected_by_shard(&fx.witness().await, SHARDS);
    let want: usize = expected.iter().map(Vec::len).sum();
    wait_until(
        Duration::from_secs(60),
        "every row in its shard",
        || async {
            let have: usize = cluster_entries(cluster, &fx.stream)
                .await
                .iter()
                .map(Vec::len)
                .sum();
            if have >= want {
                Ok(())
            } else {
                Err(format!("{have} of {want}; log: {}", tail(&log())))
            }
        },
    )
    .await;
    expected
}

async fn write_rows(fx: &Fixture<'_>, round: u32, txns: u32) {
    write_rows_with(fx.writer().await, round, txns).await
}

async fn write_rows_with(mut client: tokio_postgres::Client, round: u32, txns: u32) {
    for t in 0..txns {
        let tx = client.transaction().await.unwrap();
        for r in 0..3u32 {
            let chat = 1 + (round * 1000 + t * 3 + r) % 40;
            let payload = serde_json::json!({"chat_id": chat, "round": round, "txn": t, "row": r});
            tx.execute(
                "INSERT INTO consumers.outbox (event, payload, partition_key) VALUES ('test.event', $1::text::jsonb, $2)",
                &[&payload.to_string(), &chat.to_string()],
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_failover_with_wait_replicas_loses_nothing() {
    // GIVEN a Redis Cluster and a relay writing 8 shards to it, waiting for one replica
    let cluster = RedisCluster::start().unwrap();
    let scratch = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &scratch, SHARDS).await;
    fx.init_records_on_cluster(&cluster.url()).await;
    let relay = fx.spawn_relay(
        "relay",
        &[
            "--redis-url",
            &cluster.url(),
            "--redis-cluster",
            "true",
            "--redis-wait-replicas",
            "1",
        ],
    );
    relay.wait_streaming().await;
    write_rows(&fx, 0, 30).await;

    // WHEN the master holding shard 3 is SIGKILLed while rows are committed, its replica
    // takes over, and the old master comes back (as the new master's replica)
    let victim = cluster
        .master_of(&shard_key(&fx.stream, 3, SHARDS))
        .unwrap();
    let writer = tokio::spawn(write_rows_with(fx.writer().await, 1, 60));
    tokio::task::block_in_place(|| {
        cluster.kill_node(victim).unwrap();
        cluster.restart_node(victim).unwrap();
    });
    writer.await.unwrap();
    write_rows(&fx, 2, 30).await;

    // THEN every shard holds exactly what committed, in commit order, once
    let expected = crate::support::expected_by_shard(&fx.witness().await, SHARDS);
    let want: usize = expected.iter().map(Vec::len).sum();
    wait_until(
        Duration::from_secs(90),
        "every row in its shard",
        || async {
            let have: usize = cluster_entries(&cluster, &fx.stream)
                .await
                .iter()
                .map(Vec::len)
                .sum();
            if have >= want {
                Ok(())
            } else {
                Err(format!(
                    "{have} of {want}; log: {}",
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    assert_shards_hold(
        &cluster_entries(&cluster, &fx.stream).await,
        &expected,
        &relay.child.log(),
    );
    // AND no shard had to be rebuilt for lost data
    let metrics = crate::support::metrics(&relay).await;
    let lost: f64 = metrics
        .iter()
        .filter(|(k, _)| k.starts_with("cdc_relay_rebuilds_total") && !k.contains("no_record"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(lost, 0.0, "rebuilds: {metrics:?}");
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_a_one_shard_stream_is_refused() {
    let scratch = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &scratch).await;
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
        .arg("run")
        .args(fx.flags(&[
            "--redis-url",
            "redis://127.0.0.1:7000",
            "--redis-cluster",
            "true",
        ]))
        .output()
        .unwrap();
    crate::support::assert_refused(
        &output,
        &["--redis-cluster needs --stream-shards 2 or more"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_the_server_ends_with_unblocked_is_sent_again_not_fatal() {
    // GIVEN a relay on a cluster that waits for a replica on every batch, with the replica
    // of shard 0's master paused, so a WAIT blocks on that master
    let cluster = RedisCluster::start().unwrap();
    let scratch = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &scratch, SHARDS).await;
    fx.init_records_on_cluster(&cluster.url()).await;
    let relay = fx.spawn_relay(
        "relay",
        &[
            "--redis-url",
            &cluster.url(),
            "--redis-cluster",
            "true",
            "--redis-wait-replicas",
            "1",
            "--redis-timeout",
            "20s",
        ],
    );
    relay.wait_streaming().await;
    let master = cluster
        .master_of(&shard_key(&fx.stream, 0, SHARDS))
        .unwrap();
    let replica = cluster.replica_of(master).unwrap();
    cluster.pause_node(replica).unwrap();
    write_rows(&fx, 0, 20).await;

    // WHEN the master ends that WAIT with -UNBLOCKED, as a master turning replica (a
    // CLUSTER FAILOVER) does to every client blocked on it
    let port = cluster.port(master);
    let waiting = wait_until(
        Duration::from_secs(20),
        "a WAIT blocked on shard 0's master",
        || async {
            let clients = cluster
                .cli(port, &["CLIENT", "LIST"])
                .map_err(|e| e.to_string())?;
            clients
                .lines()
                // Blocked now (flag b): each shard has its own connection, and another
                // shard's on this master may have just come back from its WAIT.
                .find(|l| {
                    l.contains("cmd=wait")
                        && l.split_whitespace()
                            .any(|f| f.strip_prefix("flags=").is_some_and(|f| f.contains('b')))
                })
                .and_then(|l| l.split_whitespace().find_map(|f| f.strip_prefix("id=")))
                .map(str::to_string)
                .ok_or_else(|| "no client blocked in WAIT".to_string())
        },
    )
    .await;
    let unblocked = cluster
        .cli(port, &["CLIENT", "UNBLOCK", &waiting, "ERROR"])
        .unwrap();
    assert_eq!(unblocked.trim(), "1", "CLIENT UNBLOCK {waiting}");
    cluster.resume_node(replica).unwrap();
    write_rows(&fx, 1, 20).await;

    // THEN the relay sends the batch again and every shard holds exactly what committed
    let expected = crate::support::expected_by_shard(&fx.witness().await, SHARDS);
    let want: usize = expected.iter().map(Vec::len).sum();
    wait_until(
        Duration::from_secs(60),
        "every row in its shard",
        || async {
            if !relay.child.is_running() {
                return Err(format!(
                    "the relay exited; log: {}",
                    tail(&relay.child.log())
                ));
            }
            let have: usize = cluster_entries(&cluster, &fx.stream)
                .await
                .iter()
                .map(Vec::len)
                .sum();
            if have >= want {
                Ok(())
            } else {
                Err(format!(
                    "{have} of {want}; log: {}",
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    assert_eq!(cluster_entries(&cluster, &fx.stream).await, expected);
    assert!(relay.child.is_running(), "{}", tail(&relay.child.log()));
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_seeded_with_one_node_keeps_publishing_after_that_node_is_gone_for_good() {
    // GIVEN a relay that was told of one cluster node only (node 0), streaming
    let cluster = RedisCluster::start().unwrap();
    let scratch = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &scratch, SHARDS).await;
    fx.init_records_on_cluster(&cluster.url()).await;
    let relay = fx.spawn_relay(
        "relay",
        &["--redis-url", &cluster.url(), "--redis-cluster", "true"],
    );
    relay.wait_streaming().await;
    write_rows(&fx, 0, 10).await;

    // WHEN node 0 dies for good (its replica takes over), and later every other node
    // restarts (so every connection the relay had is gone)
    tokio::task::block_in_place(|| {
        cluster.kill_node(0).unwrap();
        cluster.stop_all().unwrap();
        cluster.start_all_but(0).unwrap();
    });
    write_rows(&fx, 1, 10).await;

    // THEN the relay, which learned the other nodes, publishes everything once, in order
    let expected = crate::support::expected_by_shard(&fx.witness().await, SHARDS);
    let want: usize = expected.iter().map(Vec::len).sum();
    wait_until(
        Duration::from_secs(90),
        "every row in its shard",
        || async {
            assert!(
                relay.child.is_running(),
                "the relay exited; log: {}",
                tail(&relay.child.log())
            );
            let have: usize = cluster_entries_via(&cluster.urls()[1], &fx.stream)
                .await
                .iter()
                .map(Vec::len)
                .sum();
            if have >= want {
                Ok(())
            } else {
                Err(format!(
                    "{have} of {want}; log: {}",
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    assert_shards_hold(
        &cluster_entries_via(&cluster.urls()[1], &fx.stream).await,
        &expected,
        &relay.child.log(),
    );
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_cannot_confirm_holds_back_only_its_own_rows() {
    shard_that_cannot_confirm(&[], 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_cannot_confirm_past_the_detach_bound_falls_behind_and_catches_up() {
    let log = shard_that_cannot_confirm(&["--shard-detach-after", "1s"], 100).await;
    assert!(log.contains("shard falls behind"), "{}", tail(&log));
    assert!(
        log.contains("caught up from the outbox table"),
        "{}",
        tail(&log)
    );
}

/// The scenario of a shard that cannot confirm, with `flags` for the relay and `txns`
/// transactions (3 rows each) committed while it cannot; the relay's log.
async fn shard_that_cannot_confirm(flags: &[&str], txns: u32) -> String {
    // GIVEN a relay writing 8 shards to a cluster, waiting for a replica on every call
    let cluster = RedisCluster::start().unwrap();
    let scratch = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &scratch, SHARDS).await;
    fx.init_records_on_cluster(&cluster.url()).await;
    let url = cluster.url();
    let mut relay_flags = vec![
        "--redis-url",
        url.as_str(),
        "--redis-cluster",
        "true",
        "--redis-wait-replicas",
        "1",
    ];
    relay_flags.extend_from_slice(flags);
    let relay = fx.spawn_relay("relay", &relay_flags);
    relay.wait_streaming().await;
    write_rows(&fx, 0, 10).await;

    // WHEN the master holding shard 3 dies and its replica takes over: that master has no
    // replica now, so no call there can be confirmed; rows keep coming for every shard
    let victim = cluster
        .master_of(&shard_key(&fx.stream, 3, SHARDS))
        .unwrap();
    tokio::task::block_in_place(|| cluster.kill_node(victim).unwrap());
    let promoted = cluster
        .master_of(&shard_key(&fx.stream, 3, SHARDS))
        .unwrap();
    let stuck: Vec<u32> = (0..SHARDS)
        .filter(|k| {
            cluster
                .master_of(&shard_key(&fx.stream, *k, SHARDS))
                .unwrap()
                == promoted
        })
        .collect();
    write_rows(&fx, 1, txns).await;

    // THEN every other shard receives all its rows while that master cannot confirm
    let expected = crate::support::expected_by_shard(&fx.witness().await, SHARDS);
    wait_until(
        Duration::from_secs(30),
        "every row of the shards that can confirm",
        || async {
            let have = cluster_entries(&cluster, &fx.stream).await;
            let behind: Vec<u32> = (0..SHARDS)
                .filter(|k| {
                    !stuck.contains(k) && have[*k as usize].len() < expected[*k as usize].len()
                })
                .collect();
            if behind.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "shards {behind:?} behind (stuck: {stuck:?}); log: {}",
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    // ... and once the dead node is back (a replica again), every shard holds what committed,
    // once, in commit order (a stuck shard that fell behind got its rows from the outbox
    // table, under ids of their own)
    tokio::task::block_in_place(|| cluster.restart_node(victim).unwrap());
    write_rows(&fx, 2, 10).await;
    let expected = every_row_in_its_shard(&cluster, &fx, || relay.child.log()).await;
    assert_shards_hold(
        &cluster_entries(&cluster, &fx.stream).await,
        &expected,
        &relay.child.log(),
    );
    assert!(relay.child.is_running(), "{}", tail(&relay.child.log()));
    relay.stop();
    relay.child.log()
}

/// Every row committed so far for the shards in `shards` is in its shard (read through `urls`,
/// nodes that answer).
async fn wait_shards_have(
    fx: &Fixture<'_>,
    urls: &str,
    shards: &[u32],
    within: Duration,
    log: impl Fn() -> String,
) {
    let expected = crate::support::expected_by_shard(&fx.witness().await, SHARDS);
    wait_until(within, "every row of the shards that answer", || async {
        let client = redis::cluster::ClusterClient::builder(
            urls.split(',').map(str::to_string).collect::<Vec<_>>(),
        )
        .response_timeout(Duration::from_millis(500))
        .build()
        .map_err(|e| e.to_string())?;
        let mut conn = client
            .get_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        let mut short = Vec::new();
        for &k in shards {
            let len: usize = redis::cmd("XLEN")
                .arg(shard_key(&fx.stream, k, SHARDS))
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            if len < expected[k as usize].len() {
                short.push((k, len, expected[k as usize].len()));
            }
        }
        if short.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "(shard, have, want): {short:?}; log: {}",
                tail(&log())
            ))
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_shard_0s_master_is_frozen_streams_the_other_shards() {
    // GIVEN a relay writing 8 shards to a cluster that serves the slots it can
    // (cluster-require-full-coverage no)
    let cluster = RedisCluster::start().unwrap();
    for i in 0..6 {
        cluster
            .cli(
                cluster.port(i),
                &["CONFIG", "SET", "cluster-require-full-coverage", "no"],
            )
            .unwrap();
    }
    let scratch = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &scratch, SHARDS).await;
    fx.init_records_on_cluster(&cluster.url()).await;
    let url = cluster.url();
    let flags = ["--redis-url", url.as_str(), "--redis-cluster", "true"];
    let relay = fx.spawn_relay("relay", &flags);
    relay.wait_streaming().await;
    write_rows(&fx, 0, 10).await;

    // WHEN the master holding shard 0 (the rebuild lock's shard) and its replica freeze (a
    // host that vanished: no failover), the relay is SIGKILLed and started again, and rows
    // keep coming for every shard
    let frozen = cluster
        .master_of(&shard_key(&fx.stream, 0, SHARDS))
        .unwrap();
    let replica = cluster.replica_of(frozen).unwrap();
    let healthy: Vec<u32> = (0..SHARDS)
        .filter(|k| {
            cluster
                .master_of(&shard_key(&fx.stream, *k, SHARDS))
                .unwrap()
                != frozen
        })
        .collect();
    let others: Vec<String> = (0..6)
        .filter(|i| *i != frozen && *i != replica)
        .map(|i| format!("redis://127.0.0.1:{}", cluster.port(i)))
        .collect();
    cluster.pause_node(frozen).unwrap();
    cluster.pause_node(replica).unwrap();
    relay.child.signal(testkit::Signal::Kill).unwrap();
    relay.child.wait_exit(Duration::from_secs(10)).unwrap();
    let started = std::time::Instant::now();
    let again = fx.spawn_relay("relay-again", &flags);
    write_rows(&fx, 1, 20).await;

    // THEN the shards on the other masters get their rows within seconds
    wait_shards_have(
        &fx,
        &others.join(","),
        &healthy,
        Duration::from_secs(60),
        || again.child.log(),
    )
    .await;
    let took = started.elapsed();
    println!("relay started with shard 0's master frozen: the other shards' rows in {took:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    // ... and once the node is back, every shard holds what committed, once, in order
    cluster.resume_node(frozen).unwrap();
    cluster.resume_node(replica).unwrap();
    write_rows(&fx, 2, 10).await;
    let expected = every_row_in_its_shard(&cluster, &fx, || again.child.log()).await;
    // (The frozen master's shards started behind: their catch-up gave the rows ids of their own.)
    let have = cluster_entries(&cluster, &fx.stream).await;
    for k in 0..SHARDS as usize {
        if healthy.contains(&(k as u32)) {
            assert_eq!(have[k], expected[k], "shard {k}");
        } else {
            crate::support::assert_caught_up(&have[k], &expected[k], &format!("shard {k}"));
        }
    }
    again.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_confirming_shard_does_not_slow_the_others() {
    // GIVEN a relay writing 8 shards to a cluster, waiting for a replica on every call
    let cluster = RedisCluster::start().unwrap();
    let scratch = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &scratch, SHARDS).await;
    fx.init_records_on_cluster(&cluster.url()).await;
    let url = cluster.url();
    let relay = fx.spawn_relay(
        "relay",
        &[
            "--redis-url",
            url.as_str(),
            "--redis-cluster",
            "true",
            "--redis-wait-replicas",
            "1",
            "--redis-timeout",
            "5s",
        ],
    );
    relay.wait_streaming().await;
    let slow_master = cluster
        .master_of(&shard_key(&fx.stream, 3, SHARDS))
        .unwrap();
    let healthy: Vec<u32> = (0..SHARDS)
        .filter(|k| {
            cluster
                .master_of(&shard_key(&fx.stream, *k, SHARDS))
                .unwrap()
                != slow_master
        })
        .collect();

    // WHEN shard 3's master confirms every write late but within its deadline (its replica
    // freezes for 2 s, thaws for a moment, again and again: each WAIT there takes up to 2 s)
    // while rows are committed for every shard, 20 a second for 15 s
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let replica = cluster.replica_of(slow_master).unwrap();
    let cluster = std::sync::Arc::new(cluster);
    let slowing = std::thread::spawn({
        let (cluster, stop) = (cluster.clone(), stop.clone());
        move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                cluster.pause_node(replica).unwrap();
                std::thread::sleep(Duration::from_secs(2));
                cluster.resume_node(replica).unwrap();
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
    let committed: std::sync::Arc<std::sync::Mutex<Vec<(String, u32, std::time::Instant)>>> =
        Default::default();
    let writer = tokio::spawn({
        let committed = committed.clone();
        let client = fx.writer().await;
        async move {
            for n in 0..300i64 {
                let chat = 1 + n % 40;
                let id: i64 = client
                    .query_one(
                        "INSERT INTO consumers.outbox (event, payload, partition_key)
                         VALUES ('test.event', $1::text::jsonb, $2) RETURNING id",
                        &[
                            &serde_json::json!({"chat_id": chat, "n": n}).to_string(),
                            &chat.to_string(),
                        ],
                    )
                    .await
                    .unwrap()
                    .get(0);
                let shard =
                    outbox_core::stream::shard_of(Some(chat.to_string().as_bytes()), SHARDS);
                committed
                    .lock()
                    .unwrap()
                    .push((id.to_string(), shard, std::time::Instant::now()));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    let mut seen: std::collections::HashMap<String, std::time::Instant> = Default::default();
    // Read from each healthy shard's master directly (a cluster client of the test's own
    // would have its own pauses to explain).
    let mut conns = std::collections::HashMap::new();
    for &k in &healthy {
        let master = cluster
            .master_of(&shard_key(&fx.stream, k, SHARDS))
            .unwrap();
        let client =
            redis::Client::open(format!("redis://127.0.0.1:{}", cluster.port(master))).unwrap();
        conns.insert(k, client.get_multiplexed_async_connection().await.unwrap());
    }
    let mut after: Vec<String> = vec!["-".into(); SHARDS as usize];
    while !writer.is_finished() {
        for &k in &healthy {
            let page: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(shard_key(&fx.stream, k, SHARDS))
                .arg(&after[k as usize])
                .arg("+")
                .query_async(conns.get_mut(&k).unwrap())
                .await
                .unwrap();
            let now = std::time::Instant::now();
            for e in &page.ids {
                if let Some(id) = e.map.get("outbox_id") {
                    seen.entry(redis::from_redis_value_ref::<String>(id).unwrap())
                        .or_insert(now);
                }
                after[k as usize] = format!("({}", e.id);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writer.await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    slowing.join().unwrap();

    // THEN the other shards' rows arrive as if nothing were slow (each within a second;
    // the slow shard's WAITs take up to 2 s)
    let committed = committed.lock().unwrap().clone();
    let mut late: Vec<Duration> = committed
        .iter()
        .filter(|(_, shard, _)| healthy.contains(shard))
        .filter_map(|(id, _, at)| seen.get(id).map(|s| s.saturating_duration_since(*at)))
        .collect();
    late.sort();
    let healthy_rows = committed
        .iter()
        .filter(|(_, s, _)| healthy.contains(s))
        .count();
    println!(
        "healthy shards beside a slow one: {} of {healthy_rows} rows seen while writing, p50 {:?}, max {:?}",
        late.len(),
        late.get(late.len() / 2),
        late.last()
    );
    assert!(
        late.last().is_some_and(|max| *max < Duration::from_secs(1)),
        "max {:?}; log: {}",
        late.last(),
        tail(&relay.child.log())
    );
    // ... and every row is in its shard once, in order
    let expected = every_row_in_its_shard(&cluster, &fx, || relay.child.log()).await;
    assert_shards_hold(
        &cluster_entries(&cluster, &fx.stream).await,
        &expected,
        &relay.child.log(),
    );
    relay.stop();
}
