//! Feed positions (the trigger of migrations V7 and V9): every message of a chat, sent or
//! received, takes the next position; a duplicate insert racing the original (a send rerun
//! while the first attempt still runs) waits for it, is skipped and leaves no hole; many
//! concurrent writers to one chat get 1..N exactly.

use std::time::Duration;

use testkit::{shared_postgres, wait_until};

const SEND: &str = "INSERT INTO consumers.messages (id, chat_id, body, idempotency_key)
                    VALUES ($1, $2, 'x', $3) ON CONFLICT DO NOTHING RETURNING pos";
const RECEIVE: &str = "INSERT INTO consumers.inbox (message_id, chat_id, body, sent_at, stream_id)
                       VALUES ($1, $2, 'x', now(), '1-0') ON CONFLICT DO NOTHING RETURNING pos";

/// Positions of chat `chat` in its feed (sent and received), in order.
async fn positions(client: &tokio_postgres::Client, chat: i64) -> Vec<i64> {
    client
        .query(
            "SELECT pos FROM consumers.messages WHERE chat_id = $1
             UNION ALL SELECT pos FROM consumers.inbox WHERE chat_id = $1 ORDER BY 1",
            &[&chat],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_racing_its_original_is_skipped_and_leaves_no_hole() {
    let db = shared_postgres().create_database().await.unwrap();
    for (insert, chat) in [(SEND, 1i64), (RECEIVE, 2)] {
        let mut first = db.connect_as("consumers").await.unwrap();
        let second = db.connect_as("consumers").await.unwrap();
        // The chat has a message already, so the race meets its existing counter row (the
        // path of every message but a chat's first).
        let earlier = uuid::Uuid::now_v7();
        let earlier_key = format!("k-{earlier}");
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = if insert == SEND {
            vec![&earlier, &chat, &earlier_key]
        } else {
            vec![&earlier, &chat]
        };
        first.execute(insert, &params).await.unwrap();
        let id = uuid::Uuid::now_v7();
        let key = format!("k-{id}");
        // GIVEN the original inserted in a transaction still open
        let tx = first.transaction().await.unwrap();
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = if insert == SEND {
            vec![&id, &chat, &key]
        } else {
            vec![&id, &chat]
        };
        let original = tx.query_opt(insert, &params).await.unwrap();
        assert_eq!(original.map(|r| r.get::<_, i64>(0)), Some(2));
        // WHEN the duplicate runs meanwhile (it waits on the chat's counter row, locked by
        // the original's bump) ...
        let pid: i32 = second
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        let racing = {
            let params: Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>> = if insert == SEND
            {
                vec![Box::new(id), Box::new(chat), Box::new(key.clone())]
            } else {
                vec![Box::new(id), Box::new(chat)]
            };
            tokio::spawn(async move {
                let refs: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
                    .iter()
                    .map(|p| p.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
                    .collect();
                let row = second.query_opt(insert, &refs).await.unwrap();
                (second, row.map(|r| r.get::<_, i64>(0)))
            })
        };
        let watcher = db.connect().await.unwrap();
        wait_until(Duration::from_secs(10), "the duplicate waiting", || async {
            let waiting: Option<String> = watcher
                .query_one(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                    &[&pid],
                )
                .await
                .unwrap()
                .get(0);
            match waiting.as_deref() {
                Some("Lock") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
        // ... and the original commits
        tx.commit().await.unwrap();
        let (second, duplicate) = racing.await.unwrap();
        // THEN the duplicate wrote nothing, and the next message takes position 3
        assert_eq!(duplicate, None, "the duplicate was skipped");
        let next = uuid::Uuid::now_v7();
        let next_key = format!("k-{next}");
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = if insert == SEND {
            vec![&next, &chat, &next_key]
        } else {
            vec![&next, &chat]
        };
        let row = second.query_opt(insert, &params).await.unwrap();
        assert_eq!(row.map(|r| r.get::<_, i64>(0)), Some(3), "no hole");
        assert_eq!(positions(&second, chat).await, [1, 2, 3]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_to_one_chat_take_every_position_once() {
    let db = shared_postgres().create_database().await.unwrap();
    let mut writers = Vec::new();
    for w in 0..6 {
        let client = db.connect_as("consumers").await.unwrap();
        writers.push(tokio::spawn(async move {
            for i in 0..50 {
                let id = uuid::Uuid::now_v7();
                if (w + i) % 2 == 0 {
                    let key = format!("k-{id}");
                    client.execute(SEND, &[&id, &7i64, &key]).await.unwrap();
                } else {
                    client.execute(RECEIVE, &[&id, &7i64]).await.unwrap();
                }
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let client = db.connect().await.unwrap();
    assert_eq!(positions(&client, 7).await, (1..=300).collect::<Vec<i64>>());
}
