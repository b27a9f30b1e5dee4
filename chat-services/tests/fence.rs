//! The inbox consumer's lease is fenced where the writes land: a new holder's claim waits
//! for the old holder's in-flight write, and any later write of the old holder is refused
//! with nothing written. Then the whole thing with real processes: the holder SIGSTOPped
//! past its lease, again and again, while messages stream in.

use std::time::Duration;

use crate::support::{send, Stack, Viewer};
use chat_services::test_support::{Received, Store, StoreError};
use chat_services::Message;
use chat_services::Side;
use testkit::{shared_postgres, wait_until, Signal};

fn message(chat_id: i64, body: &str) -> Received {
    Received {
        stream_id: "1-0".into(),
        message: Message {
            id: uuid::Uuid::now_v7(),
            chat_id,
            body: body.into(),
            created_at: time::OffsetDateTime::now_utc(),
            side: Side::Consumers,
            sender: None,
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_writer_is_refused_and_a_claim_waits_for_its_write() {
    let db = shared_postgres().create_database().await.unwrap();
    let endpoint = outbox_core::connect::PgEndpoint::parse(&db.url("workers")).unwrap();
    let old = Store::new(&endpoint, Side::Workers, 2).unwrap();
    let new = Store::new(&endpoint, Side::Workers, 2).unwrap();
    let old_epoch = old.claim_inbox_writer("old", 0).await.unwrap();
    let first = old
        .record_inbox(&[message(1, "by the first holder")], 0, old_epoch)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);

    // An in-flight write of the old holder (its share lock on the writer row, held open).
    let mut writer = db.connect_as("workers").await.unwrap();
    let in_flight = writer.transaction().await.unwrap();
    in_flight
        .query_one(
            "SELECT epoch FROM workers.inbox_writer WHERE shard = 0 FOR SHARE",
            &[],
        )
        .await
        .unwrap();

    // WHEN the new holder claims, it waits for that write...
    let claim =
        tokio::spawn(async move { new.claim_inbox_writer("new", 0).await.map(|e| (e, new)) });
    let admin = db.connect().await.unwrap();
    wait_until(
        Duration::from_secs(10),
        "the claim waiting on the lock",
        || async {
            let waiting: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO workers.inbox_writer%'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if waiting == 1 {
                Ok(())
            } else {
                Err(format!("{waiting} waiting"))
            }
        },
    )
    .await;
    assert!(!claim.is_finished());
    in_flight.commit().await.unwrap();
    let (new_epoch, new) = claim.await.unwrap().unwrap();
    assert_eq!(new_epoch, old_epoch + 1);

    // THEN the old holder's next write is refused, with nothing written, and the new one's
    // goes through
    let stale = old
        .record_inbox(&[message(1, "by the paused holder")], 0, old_epoch)
        .await;
    assert!(
        matches!(stale, Err(StoreError::Fenced { ours, current }) if ours == old_epoch && current == new_epoch),
        "{stale:?}"
    );
    let count = |body: &'static str| {
        let admin = &admin;
        async move {
            admin
                .query_one(
                    "SELECT count(*) FROM workers.inbox WHERE body = $1",
                    &[&body],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    assert_eq!(count("by the paused holder").await, 0);
    new.record_inbox(&[message(1, "by the new holder")], 0, new_epoch)
        .await
        .unwrap();
    assert_eq!(count("by the new holder").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_paused_past_their_lease_keep_each_message_once_and_in_order() {
    // GIVEN two Workers instances (one holds the lease) and a steady stream of messages
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let flags = ["--lease-ttl", "1s", "--claim-idle", "500ms"];
    let a = stack
        .service_process(Side::Workers, "workers-a", &flags)
        .await;
    let b = stack
        .service_process_standby(Side::Workers, "workers-b", &flags)
        .await;
    let tabs = [
        (Side::Workers, Viewer::start("workers-a tab", a.addr, 9)),
        (Side::Workers, Viewer::start("workers-b tab", b.addr, 9)),
        (
            Side::Consumers,
            Viewer::start("consumers tab", consumers.addr, 9),
        ),
    ];
    let sender = {
        let addr = consumers.addr;
        tokio::spawn(async move {
            let mut sent = Vec::new();
            for i in 0..400 {
                let m = send(addr, 9, &format!("m{i}")).await;
                sent.push(m["id"].as_str().unwrap().to_string());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            sent
        })
    };

    // WHEN the holder is SIGSTOPped past its lease, the other takes over, and the paused
    // one resumes, four times over
    for round in 0..4 {
        let (held, other) = if round % 2 == 0 { (&a, &b) } else { (&b, &a) };
        held.child.signal(Signal::Stop).unwrap();
        other.wait_consuming().await;
        let recorded = stack.count("SELECT count(*) FROM workers.inbox").await;
        wait_until(
            Duration::from_secs(20),
            "the new holder recording",
            || async {
                let now = stack.count("SELECT count(*) FROM workers.inbox").await;
                if now >= recorded + 10 {
                    Ok(())
                } else {
                    Err(format!("{now}"))
                }
            },
        )
        .await;
        held.child.signal(Signal::Cont).unwrap();
    }
    let sent = sender.await.unwrap();

    // THEN every message is in the inbox once, in the order it was sent
    wait_until(
        Duration::from_secs(60),
        "every message recorded",
        || async {
            let n = stack
                .count("SELECT count(*) FROM workers.inbox WHERE chat_id = 9")
                .await;
            if n as usize >= sent.len() {
                Ok(())
            } else {
                Err(format!("{n} of {}", sent.len()))
            }
        },
    )
    .await;
    let db = stack.db.connect().await.unwrap();
    let recorded: Vec<String> = db
        .query(
            "SELECT message_id::text FROM workers.inbox WHERE chat_id = 9 ORDER BY pos",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(recorded, sent, "inbox order differs from the send order");
    // AND every tab, on the paused instances too, shows each message once, in order
    for (side, tab) in &tabs {
        tab.assert_shows_feed(&stack.db, *side, 9).await;
    }
    consumers.stop().await;
    stack.stop().await;
}
