//! A cluster target given one seed node learns the others: every connection it makes
//! later reaches the cluster through any node that is up, even once the seed is gone.

use std::time::Duration;

use outbox_core::connect::redis_target;
use testkit::RedisCluster;

async fn ping(target: &outbox_core::connect::RedisTarget) -> redis::RedisResult<String> {
    let mut conn = target.connect(Duration::from_secs(2)).await?;
    redis::cmd("PING").query_async(&mut conn).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_seeded_with_one_node_connects_after_that_node_is_gone() {
    // GIVEN a target that was told of node 0 only, and connected once
    let cluster = RedisCluster::start().unwrap();
    let target = redis_target(
        &cluster.url(),
        true,
        None,
        None,
        "--redis-url",
        Duration::from_secs(2),
    )
    .unwrap();
    assert_eq!(ping(&target).await.unwrap(), "PONG");

    // WHEN node 0 dies for good (its replica takes over)
    tokio::task::block_in_place(|| cluster.kill_node(0).unwrap());

    // THEN a new connection still reaches the cluster, through the nodes it learned
    let answer = ping(&target).await;
    assert_eq!(answer.as_deref().ok(), Some("PONG"), "{answer:?}");
}
