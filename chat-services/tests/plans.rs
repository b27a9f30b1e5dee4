//! The services' statements keep their index plans as the tables grow. A prepared statement
//! that ran a few times while its table was nearly empty keeps a generic plan made then for
//! the connection's life; a sequential scan chosen that way costs more with every row (seen
//! in the lab: the inbox write's lookup of already-recorded messages scanned the whole inbox
//! on each batch, and sustained 2,800 messages/s fell behind within 20 s).

use std::time::Duration;

use chat_services::test_support::{Received, Store};
use chat_services::Message;
use chat_services::Side;
use testkit::{shared_postgres, wait_until};

fn message(chat_id: i64) -> Received {
    Received {
        stream_id: "1-0".into(),
        message: Message {
            id: uuid::Uuid::now_v7(),
            chat_id,
            body: "x".into(),
            created_at: time::OffsetDateTime::now_utc(),
            side: Side::Consumers,
            sender: None,
        },
    }
}

/// (sequential scans, index scans) of `workers.inbox` so far, as the statistics have them.
async fn scans(admin: &tokio_postgres::Client) -> (i64, i64) {
    let row = admin
        .query_one(
            "SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0) FROM pg_stat_user_tables
              WHERE schemaname = 'workers' AND relname = 'inbox'",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_write_keeps_its_index_plan_after_the_inbox_grew() {
    let db = shared_postgres().create_database().await.unwrap();
    let endpoint = outbox_core::connect::PgEndpoint::parse(&db.url("workers")).unwrap();
    // One connection, so every call runs the statement prepared on it.
    let store = Store::new(&endpoint, Side::Workers, 1).unwrap();
    let epoch = store.claim_inbox_writer("writer", 0).await.unwrap();
    let admin = db.connect().await.unwrap();
    // GIVEN a nearly empty inbox, analyzed (as autovacuum does once 50 rows came in) ...
    for chat in 0..30 {
        let batch = [message(chat), message(chat)];
        store.record_inbox(&batch, 0, epoch).await.unwrap();
    }
    admin.batch_execute("ANALYZE workers.inbox").await.unwrap();
    // ... and the statement run often enough then for Postgres to settle on a plan for the
    // connection (a generic plan after five runs)
    for chat in 0..10 {
        let batch = [message(chat), message(chat)];
        store.record_inbox(&batch, 0, epoch).await.unwrap();
    }
    // AND the inbox grown since to a size where a scan of it is a real cost (autovacuum
    // looks again a minute later at the earliest)
    admin
        .batch_execute(
            "INSERT INTO workers.inbox (message_id, chat_id, body, sent_at, stream_id)
             SELECT gen_random_uuid(), 1000 + g % 100, 'x', now(), '1-0'
               FROM generate_series(1, 20000) g",
        )
        .await
        .unwrap();
    let (seq_before, idx_before) = scans(&admin).await;
    // WHEN the writer goes on recording (until the statistics show its lookups: a backend
    // reports them at most once a second)
    let chats = std::sync::atomic::AtomicI64::new(0);
    wait_until(
        Duration::from_secs(30),
        "the inbox writes' scans in the statistics",
        || async {
            let chat = chats.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % 7;
            let batch = [message(chat), message(chat), message(chat)];
            store.record_inbox(&batch, 0, epoch).await.unwrap();
            let (seq, idx) = scans(&admin).await;
            if seq > seq_before || idx >= idx_before + 20 {
                Ok(())
            } else {
                Err(format!(
                    "{} sequential and {} index scans",
                    seq - seq_before,
                    idx - idx_before
                ))
            }
        },
    )
    .await;
    // THEN every lookup of the inbox went by its index
    let (seq_after, idx_after) = scans(&admin).await;
    assert_eq!(
        seq_after - seq_before,
        0,
        "the inbox write scanned the whole inbox ({} sequential scans; {} index scans)",
        seq_after - seq_before,
        idx_after - idx_before
    );
}
