//! The whole system on a real Redis Cluster (3 masters with a replica each, on loopback):
//! 8 shards per side spread over the masters, two instances per side sharing them, live
//! hints over sharded pub/sub. A master SIGKILLed while both sides send (its replica takes
//! over), a receiving instance SIGKILLed, a manual failover and a resharding of the hint
//! channel's slot lose nothing, show
//! nothing twice and keep each chat's order, at the inboxes and at the tabs of every
//! instance, with hints as the only live path between instances.

use std::time::Duration;

use crate::support::{assert_received_in_sent_order, send, Stack, Viewer};
use chat_services::Side;
use testkit::shared_postgres;
use tokio_util::sync::CancellationToken;

const SHARDS: u32 = 8;
const CHATS: i64 = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_keep_every_chat_once_in_order_across_a_master_failover_and_an_instance_kill() {
    // GIVEN a Redis Cluster, 8 shards per side, relays waiting for a replica on every
    // batch, two Consumers instances and three Workers instances, with tabs on both sides
    let stack = Stack::start_cluster(shared_postgres(), SHARDS).await;
    // No feed polling within the test: tabs are shown what other instances commit by hints
    // over the sharded channel alone (and the resyncs that cover their gaps).
    let hints_only = ["--feed-check-interval", "1h"];
    let c1 = stack
        .service_process(Side::Consumers, "consumers-1", &hints_only)
        .await;
    let c2 = stack
        .service_process_standby(Side::Consumers, "consumers-2", &hints_only)
        .await;
    let w1 = stack
        .service_process(Side::Workers, "workers-1", &hints_only)
        .await;
    let w2 = stack
        .service_process_standby(Side::Workers, "workers-2", &hints_only)
        .await;
    let w3 = stack
        .service_process_standby(Side::Workers, "workers-3", &hints_only)
        .await;
    // Tabs on two instances per chat: at most one of them holds the chat's shard, so the
    // other is shown what comes in, and what the other side's instances send, by hints.
    let mut tabs = Vec::new();
    for (side, chat, instances) in [
        (
            Side::Workers,
            2,
            [("workers-2", w2.addr), ("workers-3", w3.addr)],
        ),
        (
            Side::Workers,
            3,
            [("workers-2", w2.addr), ("workers-3", w3.addr)],
        ),
        (
            Side::Consumers,
            4,
            [("consumers-1", c1.addr), ("consumers-2", c2.addr)],
        ),
    ] {
        for (name, addr) in instances {
            tabs.push((
                side,
                chat,
                Viewer::start(&format!("{name} tab on chat {chat}"), addr, chat),
            ));
        }
    }
    let roaming = Viewer::start_balanced("roaming tab", &[w2.addr, w1.addr, w3.addr], 5);

    // WHEN both sides send to 12 chats all along (each through two instances), while the
    // master holding Workers' hint channel and shards is SIGKILLed (its replica promoted),
    // workers-1 is SIGKILLed, the dead node comes back as a replica, an operator fails the
    // slot back over to it, and a resharding moves the channel's slot to another master
    let sending = CancellationToken::new();
    let senders: Vec<_> = [[c1.addr, c2.addr], [w2.addr, w3.addr]]
        .into_iter()
        .zip(["c", "w"])
        .map(|(addrs, prefix)| {
            let sending = sending.clone();
            tokio::spawn(async move {
                let mut i = 0i64;
                while !sending.is_cancelled() {
                    send(
                        addrs[i as usize % 2],
                        1 + i % CHATS,
                        &format!("{prefix}{i}"),
                    )
                    .await;
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                i
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let cluster = stack.cluster.as_ref().unwrap();
    let master = cluster.master_of("feed:workers").unwrap();
    tokio::task::block_in_place(|| cluster.kill_node(master)).unwrap();
    w1.child.kill().unwrap();
    // The promoted replica has no replica of its own, so WAIT 1 holds publishing (safety
    // over availability) until the dead node is back, as a replica: a pod restarted.
    tokio::task::block_in_place(|| cluster.restart_node(master)).unwrap();
    tokio::task::block_in_place(|| cluster.failover_to(master)).unwrap();
    assert_eq!(cluster.master_of("feed:workers").unwrap(), master);
    // A resharding moves the channel's slot to another master: the server drops the
    // channel's subscriptions there.
    let elsewhere = *cluster.masters().iter().find(|m| **m != master).unwrap();
    tokio::task::block_in_place(|| cluster.move_slot_of("feed:workers", elsewhere)).unwrap();
    // Traffic after the last move, so hints must flow on the channel's new node.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sending.cancel();
    for sender in senders {
        assert!(sender.await.unwrap() > 100, "messages sent all along");
    }

    // THEN every chat's messages, both ways, were recorded once in the order sent
    for chat in 1..=CHATS {
        assert_received_in_sent_order(&stack, Side::Consumers, chat).await;
        assert_received_in_sent_order(&stack, Side::Workers, chat).await;
    }
    // AND every tab shows its chat's feed once, in order
    for (side, chat, tab) in &tabs {
        tab.assert_shows_feed(&stack.db, *side, *chat).await;
    }
    roaming.assert_shows_feed(&stack.db, Side::Workers, 5).await;
    // AND nothing is left pending in any shard, and nothing was dead-lettered
    for k in 0..SHARDS {
        for (stream, group) in [
            ("outbox:consumers", "workers"),
            ("outbox:workers", "consumers"),
        ] {
            let stream = outbox_core::stream::shard_key(stream, k, SHARDS);
            assert_eq!(stack.pending(&stream, group).await, 0, "{stream}");
        }
    }
    assert_eq!(stack.dead_letters().await, 0);
    drop((c1, c2, w2, w3));
}

/// Seconds a frozen master stays frozen (`CHAT_LASTING_SECONDS`, default 30).
fn lasting() -> Duration {
    Duration::from_secs(
        std::env::var("CHAT_LASTING_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_delays_only_its_own_shards_even_for_an_instance_started_meanwhile() {
    // GIVEN a Redis Cluster that serves the slots it can when a master is down
    // (cluster-require-full-coverage no), 8 shards per side, one instance per side
    let stack = Stack::start_cluster(shared_postgres(), SHARDS).await;
    let cluster = stack.cluster.as_ref().unwrap();
    for i in 0..6 {
        cluster
            .cli(
                cluster.port(i),
                &["CONFIG", "SET", "cluster-require-full-coverage", "no"],
            )
            .unwrap();
    }
    let c1 = stack
        .service_process(Side::Consumers, "consumers-1", &[])
        .await;
    let w1 = stack.service_process(Side::Workers, "workers-1", &[]).await;
    // The master of the keys a Workers instance reads beyond its shards' own: its member
    // set and the Consumers stream's unsharded record (the other layout's). Chats whose
    // shard lives elsewhere are the healthy ones.
    let frozen = cluster.master_of("inbox-members:workers").unwrap();
    assert_eq!(
        cluster.master_of("outbox:consumers:origin").unwrap(),
        frozen,
        "both keys on one master (fixed hash slots)"
    );
    let shard_master = |chat: i64| {
        let k = outbox_core::stream::shard_of(Some(chat.to_string().as_bytes()), SHARDS);
        cluster
            .master_of(&outbox_core::stream::shard_key(
                "outbox:consumers",
                k,
                SHARDS,
            ))
            .unwrap()
    };
    let chats: Vec<i64> = (1..=CHATS).collect();
    let healthy: Vec<i64> = chats
        .iter()
        .copied()
        .filter(|c| shard_master(*c) != frozen)
        .collect();
    assert!(
        !healthy.is_empty() && healthy.len() < chats.len(),
        "chats on both kinds of master"
    );
    for chat in &chats {
        send(c1.addr, *chat, "before").await;
    }
    for chat in &chats {
        assert_received_in_sent_order(&stack, Side::Consumers, *chat).await;
    }

    // WHEN that master and its replica freeze (SIGSTOP: they keep their connections and
    // answer nothing), the Workers instance is SIGKILLed and a new one starts meanwhile,
    // while Consumers sends to every chat all along
    let replica = cluster.replica_of(frozen).unwrap();
    cluster.pause_node(frozen).unwrap();
    cluster.pause_node(replica).unwrap();
    let froze = std::time::Instant::now();
    w1.child.kill().unwrap();
    let w2 = stack.spawn_service(Side::Workers, "workers-2", &[], &[]);
    let db = stack.db.connect().await.unwrap();
    let mut i = 0usize;
    let mut worst = Duration::ZERO;
    // The first healthy chat's message waits for the killed holder's leases to expire
    // (--lease-ttl, 10 s) and the new instance's cluster connections (its client's slot
    // refreshes wait out the frozen nodes' connection timeout); before, an instance that
    // could not read the member set or the other layout's record took no shard at all.
    // Messages to healthy chats sent after that must each be recorded within 2 s.
    let mut taken_over: Option<std::time::Instant> = None;
    while froze.elapsed() < lasting() {
        let chat = chats[i % chats.len()];
        i += 1;
        let sent = send(c1.addr, chat, &format!("frozen {i}")).await;
        if !healthy.contains(&chat) {
            continue;
        }
        let id = sent["id"].as_str().unwrap().to_string();
        let sent_at = std::time::Instant::now();
        let recorded = loop {
            let n: i64 = db
                .query_one(
                    "SELECT count(*) FROM workers.inbox WHERE message_id::text = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .get(0);
            if n == 1 {
                break sent_at.elapsed();
            }
            assert!(
                froze.elapsed() < Duration::from_secs(25) || taken_over.is_some(),
                "the new instance recorded no healthy chat's message within 25 s of the freeze: {}",
                w2.child.log()
            );
            if taken_over.is_some() && sent_at.elapsed() > Duration::from_secs(2) {
                panic!(
                    "chat {chat} (a healthy master's shard) waited {:?} with a master frozen: {}",
                    sent_at.elapsed(),
                    w2.child.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        match taken_over {
            Some(_) => worst = worst.max(recorded),
            None => {
                taken_over = Some(std::time::Instant::now());
                println!(
                    "healthy shards recorded by the new instance {:?} after the freeze",
                    froze.elapsed()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "{i} messages over {:?} with a master frozen; healthy chats recorded within {worst:?} at worst",
        lasting()
    );

    // THEN once the master thaws, every chat's messages were recorded once, in order
    cluster.resume_node(frozen).unwrap();
    cluster.resume_node(replica).unwrap();
    for chat in &chats {
        assert_received_in_sent_order(&stack, Side::Consumers, *chat).await;
    }
    drop((c1, w2));
    stack.stop().await;
}
