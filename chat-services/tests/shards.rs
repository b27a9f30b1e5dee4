//! Streams split into 8 shards, received by several instances that share them: one lease
//! per shard, a fair split that follows instances joining and dying, and per-chat order
//! kept because a chat lives in one shard. Real processes, SIGKILL among them.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::{assert_received_in_sent_order, send, ServiceProcess, Stack, Viewer};
use chat_services::Side;
use testkit::shared_postgres;

const SHARDS: u32 = 8;
const CHATS: i64 = 16;

/// The shards an instance holds, from /readyz.
async fn held(admin: SocketAddr) -> Option<Vec<u32>> {
    let (status, body) = testkit::http::get(admin, "/readyz").await.ok()?;
    if status != 200 {
        return None;
    }
    let json: serde_json::Value = serde_json::from_str(&body).ok()?;
    Some(
        json["shards"]
            .as_array()?
            .iter()
            .filter_map(|s| s.as_u64().map(|s| s as u32))
            .collect(),
    )
}

/// Wait until `instances` hold every shard between them, each once, each instance its fair
/// share (the count differs by at most one).
async fn wait_fair_split(instances: &[&ServiceProcess]) {
    wait_split(instances, SHARDS).await
}

async fn wait_split(instances: &[&ServiceProcess], shards: u32) {
    testkit::wait_until(
        Duration::from_secs(60),
        "the shards split fairly over the live instances",
        || async {
            let mut all = Vec::new();
            let mut counts = Vec::new();
            for i in instances {
                let shards = held(i.admin).await.unwrap_or_default();
                counts.push(shards.len());
                all.extend(shards);
            }
            all.sort_unstable();
            let fair = counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1;
            if all == (0..shards).collect::<Vec<_>>() && fair {
                Ok(())
            } else {
                Err(format!("held {all:?}, per instance {counts:?}"))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_share_eight_shards_and_keep_each_chat_once_in_order_across_kills() {
    // GIVEN 8 shards per side, one Consumers instance sending and three Workers instances
    // receiving, with tabs on every Workers instance
    let stack = Stack::start_sharded(shared_postgres(), SHARDS).await;
    let c1 = stack
        .service_process(Side::Consumers, "consumers-1", &[])
        .await;
    let w1 = stack
        .service_process_standby(Side::Workers, "workers-1", &[])
        .await;
    let w2 = stack
        .service_process_standby(Side::Workers, "workers-2", &[])
        .await;
    let w3 = stack
        .service_process_standby(Side::Workers, "workers-3", &[])
        .await;
    wait_fair_split(&[&w1, &w2, &w3]).await;
    let tabs: Vec<Viewer> = [3, 4]
        .iter()
        .map(|chat| Viewer::start(&format!("workers-3 tab on chat {chat}"), w3.addr, *chat))
        .collect();
    // A tab that moves between instances on every reconnect.
    let roaming = Viewer::start_balanced("roaming tab", &[w2.addr, w1.addr, w3.addr], 5);

    // WHEN messages to 16 chats flow all along while one instance is SIGKILLed, a new one
    // joins, and another is SIGKILLed
    let sender = tokio::spawn({
        let addr = c1.addr;
        async move {
            for i in 0..400i64 {
                send(addr, 1 + i % CHATS, &format!("m{i}")).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    w2.child.kill().unwrap();
    wait_fair_split(&[&w1, &w3]).await;
    let w4 = stack
        .service_process_standby(Side::Workers, "workers-4", &[])
        .await;
    wait_fair_split(&[&w1, &w3, &w4]).await;
    w1.child.kill().unwrap();
    wait_fair_split(&[&w3, &w4]).await;
    sender.await.unwrap();

    // THEN every chat's messages were recorded once, in the order they were sent
    for chat in 1..=CHATS {
        assert_received_in_sent_order(&stack, Side::Consumers, chat).await;
    }
    // AND the tabs on an instance that lived through it all, and the one that roamed, show
    // their feed
    // once, in order
    for (tab, chat) in tabs.iter().zip([3, 4]) {
        tab.assert_shows_feed(&stack.db, Side::Workers, chat).await;
    }
    roaming.assert_shows_feed(&stack.db, Side::Workers, 5).await;
    // AND nothing is left pending in any shard
    for k in 0..SHARDS {
        let stream = outbox_core::stream::shard_key("outbox:consumers", k, SHARDS);
        assert_eq!(stack.pending(&stream, "workers").await, 0, "{stream}");
    }
    drop(w3);
    drop(w4);
    drop(c1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_cannot_reach_postgres_gives_its_shards_to_the_others() {
    // GIVEN 4 shards per side and two Workers instances, the second reaching Postgres
    // through a proxy
    let stack = Stack::start_sharded(shared_postgres(), 4).await;
    let c1 = stack
        .service_process(Side::Consumers, "consumers-1", &[])
        .await;
    let w1 = stack
        .service_process_standby(Side::Workers, "workers-1", &[])
        .await;
    let proxy = testkit::proxy::Proxy::to_unix(stack.pg.socket_dir().join(".s.PGSQL.5432"))
        .await
        .unwrap();
    let url = format!(
        "postgres://workers@{}/{}?sslmode=disable",
        proxy.addr(),
        stack.db.name
    );
    let w2 = stack
        .service_process_standby(Side::Workers, "workers-2", &["--database-url", &url])
        .await;
    wait_split(&[&w1, &w2], 4).await;

    // WHEN the second loses Postgres (a partition of that one pod) while messages flow
    proxy.sever();
    for i in 0..40i64 {
        send(c1.addr, 1 + i % 8, &format!("m{i}")).await;
    }

    // THEN the first takes every shard and records every message once, in order
    wait_held(&w1, 4).await;
    for chat in 1..=8 {
        assert_received_in_sent_order(&stack, Side::Consumers, chat).await;
    }

    // AND when the partition heals, the shards are shared again
    proxy.restore();
    wait_split(&[&w1, &w2], 4).await;
    for i in 40..60i64 {
        send(c1.addr, 1 + i % 8, &format!("m{i}")).await;
    }
    for chat in 1..=8 {
        assert_received_in_sent_order(&stack, Side::Consumers, chat).await;
    }
}

/// Until `instance` holds `n` shards.
async fn wait_held(instance: &ServiceProcess, n: usize) {
    testkit::wait_until(Duration::from_secs(60), "shards taken over", || async {
        match held(instance.admin).await {
            Some(shards) if shards.len() == n => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}

/// The shards an instance says it holds, whatever its readiness (a 503 while Postgres is
/// down still names them).
async fn held_any(admin: SocketAddr) -> Vec<u32> {
    let Ok(Ok((_, body))) =
        tokio::time::timeout(Duration::from_secs(1), testkit::http::get(admin, "/readyz")).await
    else {
        return Vec::new();
    };
    serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|json| {
            json["shards"].as_array().map(|shards| {
                shards
                    .iter()
                    .filter_map(|s| s.as_u64().map(|s| s as u32))
                    .collect()
            })
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_for_every_instance_moves_no_shard() {
    // GIVEN 4 shards per side on a Postgres of their own, two Workers instances sharing
    // them, a message delivered on every shard
    let pg = testkit::PgServer::start().unwrap();
    let stack = Stack::start_sharded(&pg, 4).await;
    let c1 = stack
        .service_process(Side::Consumers, "consumers-1", &[])
        .await;
    let w1 = stack
        .service_process_standby(Side::Workers, "workers-1", &[])
        .await;
    let w2 = stack
        .service_process_standby(Side::Workers, "workers-2", &[])
        .await;
    wait_split(&[&w1, &w2], 4).await;
    for i in 0..8i64 {
        send(c1.addr, 1 + i, &format!("before {i}")).await;
    }
    for chat in 1..=8 {
        assert_received_in_sent_order(&stack, Side::Consumers, chat).await;
    }
    let before = [held_any(w1.admin).await, held_any(w2.admin).await];
    // Every shard each instance is seen holding from now on.
    let watch = tokio_util::sync::CancellationToken::new();
    let seen = tokio::spawn({
        let (admins, watch) = ([w1.admin, w2.admin], watch.clone());
        async move {
            let mut seen = [std::collections::BTreeSet::new(), Default::default()];
            while !watch.is_cancelled() {
                for (k, admin) in admins.iter().enumerate() {
                    seen[k].extend(held_any(*admin).await);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        }
    });

    // WHEN every Postgres process is SIGSTOPped for three lease TTLs (3 s each): long past
    // the point where an instance that alone cannot reach Postgres leaves the member set
    pg.freeze().unwrap();
    tokio::time::sleep(Duration::from_secs(9)).await;
    pg.thaw().unwrap();

    // THEN, once it answers again, every message sent is recorded once, in order
    for i in 8..16i64 {
        send(c1.addr, 1 + i % 8, &format!("after {i}")).await;
    }
    for chat in 1..=8 {
        assert_received_in_sent_order(&stack, Side::Consumers, chat).await;
    }
    wait_split(&[&w1, &w2], 4).await;
    watch.cancel();
    let seen = seen.await.unwrap();
    // AND no shard changed hands, not even for a moment: an outage nobody could consume
    // through gave nobody's shards to anybody (each move is a hand-over after the outage,
    // while the shard's messages wait)
    for k in 0..2 {
        assert_eq!(
            seen[k].iter().copied().collect::<Vec<_>>(),
            before[k],
            "workers-{} held only its own shards throughout",
            k + 1
        );
    }
    assert_eq!([held_any(w1.admin).await, held_any(w2.admin).await], before);
}
