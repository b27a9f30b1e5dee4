//! The whole system on a real Redis Cluster (3 masters with a replica each, on loopback):
//! 8 shards per side spread over the masters, two instances per side sharing them, live
//! hints over sharded pub/sub. A master SIGKILLed while both sides send (its replica takes
//! over) and a receiving instance SIGKILLed lose nothing, show nothing twice and keep each
//! chat's order, at the inboxes and at the tabs of every instance.

mod common;

use std::time::Duration;

use chat_services::Side;
use common::{assert_received_in_sent_order, send, Stack, Viewer};
use testkit::shared_postgres;

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
    // Tabs on an instance other than the sender's: what they show came by the inbox or by
    // a hint over the sharded channel.
    let worker_tabs: Vec<Viewer> = [2, 3]
        .iter()
        .map(|chat| Viewer::start(&format!("workers-3 tab on chat {chat}"), w3.addr, *chat))
        .collect();
    let consumer_tab = Viewer::start("consumers-2 tab on chat 4", c2.addr, 4);
    let roaming = Viewer::start_balanced("roaming tab", &[w2.addr, w1.addr, w3.addr], 5);

    // WHEN both sides send to 12 chats all along (Consumers through both instances,
    // Workers through workers-3), while the master holding Workers' hint channel and
    // shards is SIGKILLed (its replica promoted), workers-1 is SIGKILLed, and the dead
    // node comes back
    let senders = [
        tokio::spawn({
            let addrs = [c1.addr, c2.addr];
            async move {
                for i in 0..300i64 {
                    send(addrs[i as usize % 2], 1 + i % CHATS, &format!("c{i}")).await;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }),
        tokio::spawn({
            let addr = w3.addr;
            async move {
                for i in 0..300i64 {
                    send(addr, 1 + i % CHATS, &format!("w{i}")).await;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }),
    ];
    tokio::time::sleep(Duration::from_millis(800)).await;
    let cluster = stack.cluster.as_ref().unwrap();
    let master = cluster.master_of("feed:workers").unwrap();
    tokio::task::block_in_place(|| cluster.kill_node(master)).unwrap();
    w1.child.kill().unwrap();
    // The promoted replica has no replica of its own, so WAIT 1 holds publishing (safety
    // over availability) until the dead node is back, as a replica: a pod restarted.
    tokio::task::block_in_place(|| cluster.restart_node(master)).unwrap();
    for sender in senders {
        sender.await.unwrap();
    }

    // THEN every chat's messages, both ways, were recorded once in the order sent
    for chat in 1..=CHATS {
        assert_received_in_sent_order(&stack, Side::Consumers, chat).await;
        assert_received_in_sent_order(&stack, Side::Workers, chat).await;
    }
    // AND every tab shows its chat's feed once, in order
    for (tab, chat) in worker_tabs.iter().zip([2, 3]) {
        tab.assert_shows_feed(&stack.db, Side::Workers, chat).await;
    }
    roaming.assert_shows_feed(&stack.db, Side::Workers, 5).await;
    consumer_tab
        .assert_shows_feed(&stack.db, Side::Consumers, 4)
        .await;
    // AND nothing is left pending in any shard, and nothing was dead-lettered
    for k in 0..SHARDS {
        for (stream, group) in [
            ("outbox:consumers", "workers"),
            ("outbox:workers", "consumers"),
        ] {
            let stream = cdc_relay::shard::shard_key(stream, k, SHARDS);
            assert_eq!(stack.pending(&stream, group).await, 0, "{stream}");
        }
    }
    assert_eq!(stack.dead_letters().await, 0);
    drop((c1, c2, w2, w3));
}
