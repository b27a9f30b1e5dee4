//! The case the original design lost: the receiver crashes after recording a message in its
//! inbox and before acknowledging it (so before showing it live).

use std::time::Duration;

use crate::support::{next_message, send, Stack};
use chat_services::Side;
use testkit::http::SseClient;
use testkit::shared_postgres;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_inbox_commit_before_xack_the_message_is_redelivered_skipped_and_shown_once() {
    // GIVEN Workers as a real process that SIGKILLs itself right after committing the
    // second received message to its inbox, before XACK (and before any live push)
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack
        .service_process(
            Side::Workers,
            "workers-1",
            &[
                "--consumer-name",
                "workers",
                "--crash-after-inbox-commit",
                "2",
            ],
        )
        .await;
    let mut client = SseClient::connect(workers.addr, "/chats/21/events", None)
        .await
        .unwrap();
    send(consumers.addr, 21, "first").await;
    let (last_event_id, _) = next_message(&mut client, Duration::from_secs(10)).await;

    // WHEN the second message arrives, Workers records it and dies
    let second = send(consumers.addr, 21, "second").await;
    let status = workers.child.wait_exit(Duration::from_secs(20)).unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "killed by SIGKILL"
    );
    assert!(
        client.next(Duration::from_millis(500)).await.is_none(),
        "not shown live before the crash"
    );
    let db = stack.db.connect().await.unwrap();
    let recorded: i64 = db
        .query_one(
            "SELECT count(*) FROM workers.inbox WHERE message_id = $1::text::uuid",
            &[&second["id"].as_str().unwrap()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 1, "recorded before the crash");

    // ... and restarts under the same consumer name
    let workers = stack
        .service_process(Side::Workers, "workers-2", &["--consumer-name", "workers"])
        .await;
    // THEN the entry was redelivered and skipped as a duplicate, and acknowledged
    testkit::wait_until(
        Duration::from_secs(10),
        "redelivered entry skipped",
        || async {
            let (_, metrics) = testkit::http::get(workers.admin, "/metrics")
                .await
                .map_err(|e| e.to_string())?;
            match testkit::http::metric_value(&metrics, "chat_duplicates_skipped_total") {
                Some(1.0) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert_eq!(stack.pending("outbox:consumers", "workers").await, 0);
    // AND a client reconnecting with its Last-Event-ID receives it exactly once
    let mut client = SseClient::connect(workers.addr, "/chats/21/events", Some(&last_event_id))
        .await
        .unwrap();
    let (_, shown) = next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(shown["id"], second["id"]);
    let third = send(consumers.addr, 21, "third").await;
    let (_, shown) = next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(shown["id"], third["id"]);
    assert!(
        client.next(Duration::from_millis(300)).await.is_none(),
        "shown exactly once"
    );
    assert_eq!(stack.count("SELECT count(*) FROM workers.inbox").await, 3);
    consumers.stop().await;
    stack.stop().await;
}
