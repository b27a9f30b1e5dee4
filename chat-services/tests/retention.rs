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
