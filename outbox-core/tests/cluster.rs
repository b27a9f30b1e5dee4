//! A cluster target given one seed node learns the others: every connection it makes
//! later reaches the cluster through any node that is up, even once the seed is gone.

use std::time::Duration;

use outbox_core::connect::redis_target;
use testkit::RedisCluster;

async fn ping(target: &outbox_core::connect::RedisTarget) -> redis::RedisResult<String> {
    let mut conn = target.connect(Duration::from_secs(2)).await?;
    redis::cmd("PING").query_async(&mut conn).await
}

/// A cluster target told of `cluster`'s first node only.
fn target_of(cluster: &RedisCluster) -> outbox_core::connect::RedisTarget {
    target_with_timeout(cluster, Duration::from_secs(2))
}

/// The same, with `timeout` for each request.
fn target_with_timeout(
    cluster: &RedisCluster,
    timeout: Duration,
) -> outbox_core::connect::RedisTarget {
    redis_target(&cluster.url(), true, None, None, "--redis-url", timeout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_seeded_with_one_node_connects_after_that_node_is_gone() {
    // GIVEN a target that was told of node 0 only, and connected once
    let cluster = RedisCluster::start().unwrap();
    let target = target_of(&cluster);
    assert_eq!(ping(&target).await.unwrap(), "PONG");

    // WHEN node 0 dies for good (its replica takes over)
    tokio::task::block_in_place(|| cluster.kill_node(0).unwrap());

    // THEN a new connection still reaches the cluster, through the nodes it learned
    let answer = ping(&target).await;
    assert_eq!(answer.as_deref().ok(), Some("PONG"), "{answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_lost_every_node_at_once_answers_again_once_they_are_back() {
    // GIVEN a connection to a cluster, in use
    let cluster = RedisCluster::start().unwrap();
    let target = target_of(&cluster);
    let mut conn = target.connect(Duration::from_secs(2)).await.unwrap();
    let () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();

    // WHEN every node stops at once and starts again on its data, the connection in use all
    // along (every 5 ms, as a busy service's is)
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = tokio::spawn({
        let (mut conn, stop) = (conn.clone(), stop.clone());
        async move {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let _: redis::RedisResult<Option<String>> =
                    redis::cmd("GET").arg("k").query_async(&mut conn).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    tokio::task::block_in_place(|| {
        cluster.stop_all().unwrap();
        cluster.start_all().unwrap();
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    busy.await.unwrap();

    // THEN the same connection (and its clones) answers again within seconds
    let back = std::time::Instant::now();
    let mut last = None;
    while back.elapsed() < Duration::from_secs(20) {
        let got: redis::RedisResult<String> =
            redis::cmd("GET").arg("k").query_async(&mut conn).await;
        match got {
            Ok(v) => {
                assert_eq!(v, "v");
                println!(
                    "cluster connection answered {:?} after the nodes were back",
                    back.elapsed()
                );
                return;
            }
            Err(e) => last = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no answer 20 s after every node was back: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sent_during_a_whole_cluster_restart_are_answered_soon_after_it_is_ok() {
    // GIVEN a connection to a cluster, with the shipped 5 s deadline
    let cluster = RedisCluster::start().unwrap();
    let target = target_with_timeout(&cluster, Duration::from_secs(5));
    let conn = target.connect(Duration::from_secs(5)).await.unwrap();
    let () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query_async(&mut conn.clone())
        .await
        .unwrap();

    // WHEN every node stops, a request is sent every 100 ms meanwhile, and the nodes start
    // again on their data
    tokio::task::block_in_place(|| cluster.stop_all().unwrap());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sender = tokio::spawn({
        let (conn, stop) = (conn.clone(), stop.clone());
        async move {
            let mut requests = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let mut conn = conn.clone();
                requests.push(tokio::spawn(async move {
                    let sent = std::time::Instant::now();
                    let got: redis::RedisResult<String> =
                        redis::cmd("GET").arg("k").query_async(&mut conn).await;
                    (sent, std::time::Instant::now(), got)
                }));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            requests
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let cluster = std::sync::Arc::new(cluster);
    let starting = tokio::task::spawn_blocking({
        let cluster = cluster.clone();
        move || cluster.start_all().unwrap()
    });
    // The cluster is ok again when a new client's request is answered.
    let give_up = std::time::Instant::now() + Duration::from_secs(60);
    let ok_at = loop {
        assert!(
            std::time::Instant::now() < give_up,
            "no new client answered 60 s after the nodes were started"
        );
        let fresh = async {
            let mut c = target.connect(Duration::from_millis(300)).await?;
            redis::cmd("GET")
                .arg("k")
                .query_async::<String>(&mut c)
                .await
        };
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(500), fresh).await {
            break std::time::Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    starting.await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let requests = sender.await.unwrap();

    // THEN each of them ended (answered, or refused to be retried by its caller) within half a
    // second of the cluster being ok, or of its sending if later
    let mut latest = Duration::ZERO;
    let mut answered = 0;
    for request in requests {
        let (sent, ended, got) = request.await.unwrap();
        let late = ended.saturating_duration_since(sent.max(ok_at));
        latest = latest.max(late);
        assert!(
            late <= Duration::from_millis(500),
            "a request sent {:?} before the cluster was ok ended {late:?} after it: {got:?}",
            ok_at.saturating_duration_since(sent)
        );
        if got.is_ok() {
            answered += 1;
        }
    }
    println!("requests ended at most {latest:?} after the cluster was ok; {answered} answered");
    assert!(answered > 0, "no request was answered");
}
