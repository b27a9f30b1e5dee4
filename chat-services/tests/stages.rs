//! Where a message's time goes, by stage (issue 26): each message sent is counted once in
//! each of the receiver's histograms (outbox write → shown, published → recorded, recorded
//! → pushed to its one stream), and each request in the sender's HTTP histogram under its
//! route and status.

use std::time::Duration;

use crate::support::{next_message, send, Stack};
use chat_services::Side;
use testkit::http::SseClient;
use testkit::shared_postgres;

/// The value of the sample of `name` whose labels include every one of `labels`.
fn sample(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    testkit::http::metric_samples(metrics)
        .into_iter()
        .find(|(k, _)| k.split('{').next() == Some(name) && labels.iter().all(|l| k.contains(l)))
        .map(|(_, v)| v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_stage_histogram_counts_every_message_once() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    // Without the 2 s feed check: a check that lands between an inbox commit and its hint
    // makes the stream read that message from the database, which the push histogram does
    // not count (the safety net has tests of its own).
    let workers = stack
        .service(Side::Workers, &["--feed-check-interval", "1h"])
        .await;
    let mut on_workers = SseClient::connect(workers.addr, "/chats/11/events", None)
        .await
        .unwrap();
    const SENT: usize = 12;
    for i in 0..SENT {
        send(consumers.addr, 11, &format!("stage {i}")).await;
    }
    for _ in 0..SENT {
        next_message(&mut on_workers, Duration::from_secs(10)).await;
    }
    let (_, received) = testkit::http::get(workers.admin, "/metrics").await.unwrap();
    // One SSE stream: each message is pushed live once.
    for histogram in [
        "chat_delivery_seconds_count",
        "chat_published_to_recorded_seconds_count",
        "chat_recorded_to_pushed_seconds_count",
    ] {
        assert_eq!(
            sample(&received, histogram, &[]),
            Some(SENT as f64),
            "{histogram}"
        );
    }
    // Published → recorded took some time, and less than outbox write → shown, which
    // contains it (a unit or clock mistake would not); the push comes after both ended.
    let total = sample(&received, "chat_delivery_seconds_sum", &[]).unwrap();
    let recorded = sample(&received, "chat_published_to_recorded_seconds_sum", &[]).unwrap();
    assert!(0.0 < recorded && recorded < total, "{recorded} of {total}");
    let pushed = sample(&received, "chat_recorded_to_pushed_seconds_sum", &[]).unwrap();
    assert!(0.0 < pushed && pushed < 1.0, "{pushed}");
    let (_, sent) = testkit::http::get(consumers.admin, "/metrics")
        .await
        .unwrap();
    let posts = sample(
        &sent,
        "chat_http_request_duration_seconds_count",
        &[
            r#"route="/chats/{id}/messages""#,
            r#"method="POST""#,
            r#"status="201""#,
        ],
    );
    assert_eq!(posts, Some(SENT as f64), "{sent}");
    let streams = sample(
        &received,
        "chat_http_request_duration_seconds_count",
        &[r#"route="/chats/{id}/events""#, r#"status="200""#],
    );
    assert_eq!(streams, Some(1.0));
    testkit::http::promtool_check_metrics(&received).unwrap();
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}
