//! Rolling deploys of the receiving side, as a Deployment does them: a new instance starts
//! and is ready, then the oldest gets SIGTERM, round after round, while messages flow. A
//! handover must neither stall a message for more than about a second nor count as a
//! delivery (so even `--max-deliveries 1` dead-letters nothing).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chat_services::Side;
use testkit::{shared_postgres, Signal};
use tokio_util::sync::CancellationToken;

use crate::support::Stack;

/// Messages sent per second during the deploy.
const RATE: u64 = 150;
const CHATS: i64 = 8;

/// Send to `addr` at [`RATE`] until `stop`; how many were accepted.
fn sender(addr: std::net::SocketAddr, stop: CancellationToken) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let sent = Arc::new(AtomicU64::new(0));
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / RATE));
        let mut pending = Vec::new();
        let mut n = 0i64;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            n += 1;
            let sent = sent.clone();
            pending.push(tokio::spawn(async move {
                let chat = 1 + n % CHATS;
                let reply = testkit::http::post_json(
                    addr,
                    &format!("/chats/{chat}/messages"),
                    &serde_json::json!({"body": format!("m{n}")}),
                    &[],
                )
                .await
                .expect("POST");
                assert_eq!(reply.status, 201, "{}", reply.body);
                sent.fetch_add(1, Ordering::SeqCst);
            }));
        }
        for p in pending {
            p.await.unwrap();
        }
        sent.load(Ordering::SeqCst)
    })
}

async fn deploy_rounds(shards: u32) {
    // GIVEN two Workers instances sharing the Consumers stream, each dead-lettering an entry
    // at its first repeated delivery, and Consumers sending ~150 messages/s
    let stack = Stack::start_sharded(shared_postgres(), shards).await;
    let consumers = stack
        .service_process(Side::Consumers, "consumers-1", &[])
        .await;
    let flags = ["--max-deliveries", "1"];
    let mut workers = VecDeque::new();
    workers.push_back(
        stack
            .service_process(Side::Workers, "workers-1", &flags)
            .await,
    );
    workers.push_back(
        stack
            .service_process_standby(Side::Workers, "workers-2", &flags)
            .await,
    );
    let stop = CancellationToken::new();
    let sending = sender(consumers.addr, stop.clone());
    // (The load runs a moment before the first round: the figures include calm traffic.)
    tokio::time::sleep(Duration::from_secs(1)).await;

    // WHEN six rounds of "start a new instance, wait until it is ready, SIGTERM the oldest"
    for round in 0..6 {
        let name = format!("workers-{}", round + 3);
        workers.push_back(
            stack
                .service_process_standby(Side::Workers, &name, &flags)
                .await,
        );
        // The scenario's pace: each new instance runs a while beside the old ones.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let oldest = workers.pop_front().unwrap();
        let status = oldest
            .child
            .stop_with(Signal::Term, Duration::from_secs(30))
            .unwrap();
        assert!(status.success(), "{name}'s predecessor exited {status:?}");
    }
    stop.cancel();
    let sent = sending.await.unwrap() as i64;

    // THEN every message is recorded once, none waited more than about a second on a
    // handover, and nothing was dead-lettered
    testkit::wait_until(
        Duration::from_secs(30),
        "every message recorded",
        || async {
            match stack.count("SELECT count(*) FROM workers.inbox").await {
                n if n >= sent => Ok(()),
                n => Err(format!("{n} of {sent}")),
            }
        },
    )
    .await;
    assert_eq!(
        stack.count("SELECT count(*) FROM workers.inbox").await,
        sent
    );
    let db = stack.db.connect().await.unwrap();
    let row = db
        .query_one(
            "SELECT extract(epoch FROM percentile_disc(0.5) WITHIN GROUP (ORDER BY received_at - sent_at))::float8,
                    extract(epoch FROM percentile_disc(0.99) WITHIN GROUP (ORDER BY received_at - sent_at))::float8,
                    extract(epoch FROM max(received_at - sent_at))::float8
               FROM workers.inbox",
            &[],
        )
        .await
        .unwrap();
    let (p50, p99, max): (f64, f64, f64) = (row.get(0), row.get(1), row.get(2));
    println!(
        "rolling deploy of the receiving side, {shards} shard(s), {sent} messages at {RATE}/s: send -> recorded p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        p50 * 1e3,
        p99 * 1e3,
        max * 1e3
    );
    assert_eq!(
        stack.dead_letters().await,
        0,
        "healthy messages dead-lettered"
    );
    assert!(max < 2.0, "a message waited {max:.2} s across the deploy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_deploy_of_the_receiving_side_stalls_no_message_and_dead_letters_nothing() {
    deploy_rounds(4).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_deploy_with_one_shard_stalls_no_message_and_dead_letters_nothing() {
    deploy_rounds(1).await
}
