//! Outbox retention: old rows are deleted by the service that owns them, and the deletes
//! never reach the stream.

use std::time::Duration;

use crate::support::{send, Stack};
use chat_services::Side;
use testkit::{shared_postgres, wait_until};

async fn stream_len(stack: &Stack<'_>) -> usize {
    let mut redis = stack.redis().connect().await.unwrap();
    redis::cmd("XLEN")
        .arg("outbox:consumers")
        .query_async(&mut redis)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_outbox_rows_are_deleted_and_nothing_is_published_for_it() {
    let stack = Stack::start(shared_postgres()).await;
    let db = stack.db.connect().await.unwrap();
    // Five events written two days ago (published as they were inserted).
    db.batch_execute(
        "INSERT INTO consumers.outbox (event, payload, created_at)
         SELECT 'message.created', jsonb_build_object('n', n), now() - interval '2 days'
           FROM generate_series(1, 5) AS n",
    )
    .await
    .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the old rows published",
        || async {
            let n = stream_len(&stack).await;
            if n == 5 {
                Ok(())
            } else {
                Err(format!("{n}"))
            }
        },
    )
    .await;

    let svc = stack
        .service(
            Side::Consumers,
            &[
                "--outbox-retention",
                "1h",
                "--outbox-retention-interval",
                "100ms",
            ],
        )
        .await;
    send(svc.addr, 7, "recent").await;
    wait_until(Duration::from_secs(10), "old rows deleted, the recent one kept", || async {
        let row = db
            .query_one(
                "SELECT count(*) FILTER (WHERE created_at < now() - interval '1 hour'), count(*) FROM consumers.outbox",
                &[],
            )
            .await
            .unwrap();
        let (old, all): (i64, i64) = (row.get(0), row.get(1));
        if old == 0 && all == 1 { Ok(()) } else { Err(format!("{old} old of {all}")) }
    })
    .await;
    let (_, metrics) = testkit::http::get(svc.admin, "/metrics").await.unwrap();
    assert_eq!(
        testkit::http::metric_value(&metrics, "chat_outbox_deleted_total"),
        Some(5.0)
    );

    // The deletes added nothing to the stream, and the relay carries on.
    send(svc.addr, 7, "after retention").await;
    wait_until(
        Duration::from_secs(10),
        "the next message published",
        || async {
            let n = stream_len(&stack).await;
            if n == 7 {
                Ok(())
            } else {
                Err(format!("{n}"))
            }
        },
    )
    .await;
    svc.stop().await;
    stack.stop().await;
}

/// A UUIDv7 of `days` ago, as a message id written then.
fn id_days_ago(days: u64) -> uuid::Uuid {
    let then = std::time::SystemTime::now() - Duration::from_secs(days * 24 * 3600);
    let since = then.duration_since(std::time::UNIX_EPOCH).unwrap();
    uuid::Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        since.as_secs(),
        since.subsec_nanos(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_messages_are_deleted_and_a_resuming_client_misses_nothing_newer() {
    let stack = Stack::start(shared_postgres()).await;
    let db = stack.db.connect().await.unwrap();
    // Ten days ago: three messages sent and two received in chat 3.
    for n in 0..3 {
        db.execute(
            "INSERT INTO workers.messages (id, chat_id, body, created_at, idempotency_key)
             VALUES ($1, 3, 'old sent', now() - interval '10 days', $2)",
            &[&id_days_ago(10), &format!("old-{n}")],
        )
        .await
        .unwrap();
    }
    for n in 0..2 {
        db.execute(
            "INSERT INTO workers.inbox (message_id, chat_id, body, sent_at, stream_id, received_at)
             VALUES ($1, 3, 'old received', now() - interval '10 days', $2, now() - interval '9 days')",
            &[&id_days_ago(10), &format!("0-{n}")],
        )
        .await
        .unwrap();
    }
    // Sent ten days ago and recorded only now (its consumer was down): its row is what
    // keeps a redelivery out, so it stays.
    db.execute(
        "INSERT INTO workers.inbox (message_id, chat_id, body, sent_at, stream_id)
         VALUES ($1, 3, 'late received', now() - interval '10 days', '0-9')",
        &[&id_days_ago(10)],
    )
    .await
    .unwrap();
    let flags = [
        "--message-retention",
        "7d",
        "--outbox-retention",
        "1h",
        "--outbox-retention-interval",
        "100ms",
    ];
    // Refused below what the inbox must remember.
    let mut argv = vec!["chat-service".to_string()];
    argv.extend(stack.service_args(Side::Workers, &["--message-retention", "1d"]));
    let refused = <chat_services::Cli as clap::Parser>::try_parse_from(argv)
        .unwrap()
        .validate()
        .expect_err("a day is too short")
        .to_string();
    assert!(
        refused.contains("--message-retention 1day is below 2days"),
        "{refused}"
    );

    let workers = stack.service(Side::Workers, &flags).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let recent = send(workers.addr, 3, "recent sent").await;
    let received = send(consumers.addr, 3, "recent received").await;
    wait_until(
        Duration::from_secs(20),
        "the old deleted, the recent kept",
        || async {
            let row = db
                .query_one(
                    "SELECT (SELECT count(*) FROM workers.messages WHERE chat_id = 3),
                        (SELECT count(*) FROM workers.inbox WHERE chat_id = 3)",
                    &[],
                )
                .await
                .unwrap();
            let (sent, got): (i64, i64) = (row.get(0), row.get(1));
            if (sent, got) == (1, 2) {
                Ok(())
            } else {
                Err(format!("sent {sent}, received {got}"))
            }
        },
    )
    .await;
    // History and a stream resuming from the start show what remains, in feed order.
    let (_, history) = testkit::http::get(workers.addr, "/chats/3/messages")
        .await
        .unwrap();
    let history: serde_json::Value = serde_json::from_str(&history).unwrap();
    let bodies: Vec<&str> = history["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["body"].as_str().unwrap())
        .collect();
    assert_eq!(bodies, ["late received", "recent sent", "recent received"]);
    // After the late one (position 6): the two recent ones, in order.
    let mut feed = testkit::http::SseClient::connect(workers.addr, "/chats/3/events", Some("p6"))
        .await
        .unwrap();
    for want in [&recent, &received] {
        let (_, shown) = crate::support::next_message(&mut feed, Duration::from_secs(10)).await;
        assert_eq!(shown["id"], want["id"]);
    }
    let metrics = testkit::http::get(workers.admin, "/metrics")
        .await
        .unwrap()
        .1;
    assert_eq!(
        testkit::http::metric_value(&metrics, "chat_messages_deleted_total{what=\"sent\"}"),
        Some(3.0)
    );
    assert_eq!(
        testkit::http::metric_value(&metrics, "chat_messages_deleted_total{what=\"received\"}"),
        Some(2.0)
    );
    workers.stop().await;
    consumers.stop().await;
}
