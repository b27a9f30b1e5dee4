//! Messages from one side to the other: live over SSE, once, in order, through faults.

mod common;

use std::time::Duration;

use chat_services::Side;
use common::{next_message, send, Stack};
use testkit::http::SseClient;
use testkit::shared_postgres;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_sent_on_one_side_is_shown_live_on_the_other() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;

    // Consumers → Workers
    let mut on_workers = SseClient::connect(workers.addr, "/chats/7/events", None)
        .await
        .unwrap();
    let sent = send(consumers.addr, 7, "hello workers").await;
    let (id, shown) = next_message(&mut on_workers, Duration::from_secs(10)).await;
    assert_eq!(shown["id"], sent["id"]);
    assert_eq!(shown["body"], "hello workers");
    assert_eq!(shown["side"], "consumers");
    assert_eq!(shown["seq"].to_string(), id);

    // Workers → Consumers
    let mut on_consumers = SseClient::connect(consumers.addr, "/chats/7/events", None)
        .await
        .unwrap();
    let sent = send(workers.addr, 7, "hello consumers").await;
    let (_, shown) = next_message(&mut on_consumers, Duration::from_secs(10)).await;
    assert_eq!(shown["id"], sent["id"]);
    assert_eq!(shown["side"], "workers");

    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}
