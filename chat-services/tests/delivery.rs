//! Messages from one side to the other: live over SSE, once, in order, through faults.

use std::time::Duration;

use crate::support::{next_message, send, Stack};
use chat_services::Side;
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
    assert_eq!(format!("p{}", shown["pos"]), id);

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

/// The fields of `stream`'s first entry, in order (the template of a copy appended by hand).
async fn first_entry_fields(stack: &Stack<'_>, stream: &str) -> Vec<(String, String)> {
    let mut redis = stack.redis().connect().await.unwrap();
    let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query_async(&mut redis)
        .await
        .unwrap();
    entries.ids[0]
        .map
        .iter()
        .map(|(k, v)| (k.clone(), redis::from_redis_value_ref::<String>(v).unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_entry_delivered_twice_is_recorded_and_shown_once() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;
    let mut client = SseClient::connect(workers.addr, "/chats/3/events", None)
        .await
        .unwrap();
    let sent = send(consumers.addr, 3, "only once").await;
    let (_, first) = next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(first["id"], sent["id"]);

    // WHEN the same entry is delivered again (a copy appended to the stream, as a replay
    // beyond the stream's own deduplication would)
    let original = first_entry_fields(&stack, "outbox:consumers").await;
    let fields: Vec<(&str, &str)> = original
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    crate::support::append_after_top(stack.redis(), "outbox:consumers", &fields).await;
    // ... followed by a new message, so we know the copy was processed before it
    let after = send(consumers.addr, 3, "after the copy").await;

    // THEN the copy is skipped: the next thing shown is the new message
    let (_, next) = next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(next["id"], after["id"]);
    assert_eq!(
        stack
            .count("SELECT count(*) FROM workers.inbox WHERE chat_id = 3")
            .await,
        2
    );
    let (_, metrics) = testkit::http::get(workers.admin, "/metrics").await.unwrap();
    assert_eq!(
        testkit::http::metric_value(&metrics, "chat_duplicates_skipped_total"),
        Some(1.0)
    );
    // Both entries of the message were acknowledged.
    assert_eq!(stack.pending("outbox:consumers", "workers").await, 0);
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_with_altered_content_shows_what_the_inbox_recorded() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    // No feed check during the test: what the viewer is shown comes from announcements.
    let workers = stack
        .service(Side::Workers, &["--feed-check-interval", "10m"])
        .await;
    // A real entry as the template of the altered copy (and the stream made by the relay).
    send(consumers.addr, 99, "template").await;
    testkit::wait_until(Duration::from_secs(20), "template recorded", || async {
        match stack.count("SELECT count(*) FROM workers.inbox").await {
            1 => Ok(()),
            n => Err(format!("{n} recorded")),
        }
    })
    .await;
    let mut viewer = SseClient::connect(workers.addr, "/chats/4/events", None)
        .await
        .unwrap();
    // A message recorded and never announced (its writer killed between the two)...
    let id = uuid::Uuid::now_v7();
    let db = stack.db.connect().await.unwrap();
    db.execute(
        "INSERT INTO workers.inbox (message_id, chat_id, body, sent_at, stream_id)
         VALUES ($1, 4, 'as recorded', now(), '0-1')",
        &[&id],
    )
    .await
    .unwrap();
    // ... delivered again with other content (a republished or tampered entry).
    let mut fields = first_entry_fields(&stack, "outbox:consumers").await;
    for (name, value) in &mut fields {
        if name == "payload" {
            let mut payload: serde_json::Value = serde_json::from_str(value).unwrap();
            payload["id"] = serde_json::json!(id);
            payload["chat_id"] = serde_json::json!(4);
            payload["body"] = serde_json::json!("altered in flight");
            *value = payload.to_string();
        }
    }
    let fields: Vec<(&str, &str)> = fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    crate::support::append_after_top(stack.redis(), "outbox:consumers", &fields).await;

    // THEN the viewer is shown the message as the inbox holds it.
    let (event_id, shown) = next_message(&mut viewer, Duration::from_secs(10)).await;
    assert_eq!(event_id, "p1");
    assert_eq!(shown["id"], serde_json::json!(id));
    assert_eq!(shown["body"], "as recorded");
    assert_eq!(
        stack
            .count("SELECT count(*) FROM workers.inbox WHERE body = 'altered in flight'")
            .await,
        0
    );
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_entry_is_dead_lettered_and_messages_after_it_flow() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;
    let mut client = SseClient::connect(workers.addr, "/chats/5/events", None)
        .await
        .unwrap();

    // WHEN an entry whose payload is not a message lands in the stream
    // (the relay must have created the stream first)
    send(consumers.addr, 5, "before the poison").await;
    let _ = next_message(&mut client, Duration::from_secs(10)).await;
    let mut redis = stack.redis().connect().await.unwrap();
    let poison_id = crate::support::append_after_top(
        stack.redis(),
        "outbox:consumers",
        &[
            ("event", "message.created"),
            ("payload", "{not json"),
            ("outbox_id", "0"),
            ("created_at", "2026-01-01T00:00:00Z"),
        ],
    )
    .await;
    let sent = send(consumers.addr, 5, "after the poison").await;

    // THEN the next message still arrives
    let (_, shown) = next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(shown["id"], sent["id"]);
    // AND the poison entry is in the dead-letter stream with the reason, and acknowledged
    let dead: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg("deadletter:workers")
        .arg("-")
        .arg("+")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(dead.ids.len(), 1);
    let field = |name: &str| redis::from_redis_value_ref::<String>(&dead.ids[0].map[name]).unwrap();
    assert_eq!(field("id"), poison_id);
    assert_eq!(field("stream"), "outbox:consumers");
    assert!(
        field("reason").starts_with("payload is not a valid message"),
        "{}",
        field("reason")
    );
    assert_eq!(field("entry.payload"), "{not json");
    assert_eq!(stack.pending("outbox:consumers", "workers").await, 0);
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_succeed_while_redis_is_down_and_everything_arrives_in_order_after() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;
    let mut client = SseClient::connect(workers.addr, "/chats/9/events", None)
        .await
        .unwrap();
    let mut sent = vec![send(consumers.addr, 9, "before").await["id"].clone()];
    let (_, first) = next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(first["id"], sent[0]);

    // WHEN Redis is down, sends keep succeeding (and quickly: nothing on the request path
    // talks to Redis)
    stack.redis().stop().unwrap();
    for i in 0..20 {
        let started = std::time::Instant::now();
        sent.push(send(consumers.addr, 9, &format!("during outage {i}")).await["id"].clone());
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "send took {:?}",
            started.elapsed()
        );
    }
    let (status, body) = testkit::http::get(consumers.admin, "/readyz")
        .await
        .unwrap();
    assert_eq!(
        status, 200,
        "a Redis outage does not make sends unready: {body}"
    );

    // THEN after Redis returns, every message arrives, in order, once
    stack.redis().start_again().unwrap();
    for (i, expected) in sent.iter().enumerate().skip(1) {
        let (_, shown) = next_message(&mut client, Duration::from_secs(30)).await;
        assert_eq!(&shown["id"], expected, "message #{i}");
    }
    assert!(
        client.next(Duration::from_millis(300)).await.is_none(),
        "nothing more"
    );
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_resuming_with_last_event_id_gets_what_it_missed_then_live() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;
    let mut client = SseClient::connect(workers.addr, "/chats/11/events", None)
        .await
        .unwrap();
    send(consumers.addr, 11, "one").await;
    let (seen, _) = next_message(&mut client, Duration::from_secs(10)).await;
    drop(client);

    // WHILE the client is away, three more arrive (one in another chat)
    let mut missed = Vec::new();
    for body in ["two", "three"] {
        missed.push(send(consumers.addr, 11, body).await["id"].clone());
    }
    send(consumers.addr, 12, "other chat").await;
    let db = stack.db.connect().await.unwrap();
    testkit::wait_until(Duration::from_secs(10), "recorded", || async {
        let n: i64 = db
            .query_one("SELECT count(*) FROM workers.inbox", &[])
            .await
            .unwrap()
            .get(0);
        if n == 4 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    })
    .await;

    // THEN resuming with Last-Event-ID replays exactly the missed ones, then continues live
    let mut client = SseClient::connect(workers.addr, "/chats/11/events", Some(&seen))
        .await
        .unwrap();
    for expected in &missed {
        let (_, shown) = next_message(&mut client, Duration::from_secs(10)).await;
        assert_eq!(&shown["id"], expected);
    }
    let live = send(consumers.addr, 11, "four").await;
    let (_, shown) = next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(shown["id"], live["id"]);
    assert!(
        client.next(Duration::from_millis(300)).await.is_none(),
        "no duplicate at the seam"
    );
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_loses_its_data_every_message_is_shown_once() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;
    let mut client = SseClient::connect(workers.addr, "/chats/13/events", None)
        .await
        .unwrap();
    let mut sent = Vec::new();
    for i in 0..5 {
        sent.push(send(consumers.addr, 13, &format!("before {i}")).await["id"].clone());
    }
    for expected in &sent {
        let (_, shown) = next_message(&mut client, Duration::from_secs(10)).await;
        assert_eq!(&shown["id"], expected);
    }
    // WHEN Redis comes back empty (no AOF): streams, groups and the relays' records are gone
    stack.redis().kill().unwrap();
    stack.redis().wipe_data().unwrap();
    stack.redis().start_again().unwrap();
    for i in 0..5 {
        sent.push(send(consumers.addr, 13, &format!("after {i}")).await["id"].clone());
    }
    // THEN the relay republishes from the outbox, Workers recreates its group, and the
    // inbox absorbs what it already had: each new message is shown once, in order
    for expected in &sent[5..] {
        let (_, shown) = next_message(&mut client, Duration::from_secs(30)).await;
        assert_eq!(&shown["id"], expected);
    }
    assert!(
        client.next(Duration::from_millis(500)).await.is_none(),
        "nothing shown twice"
    );
    assert_eq!(stack.count("SELECT count(*) FROM workers.inbox").await, 10);
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_resumed_too_far_back_replays_a_bounded_tail_and_says_what_it_skipped() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack
        .service(Side::Consumers, &["--sse-max-replay", "10"])
        .await;
    let mut sent = Vec::new();
    for n in 0..30 {
        sent.push(send(consumers.addr, 6, &format!("m{n}")).await);
    }
    // From the start, in this scheme (`p0`) and the previous one (a bare `0`).
    for resume in ["p0", "0"] {
        let mut client = SseClient::connect(consumers.addr, "/chats/6/events", Some(resume))
            .await
            .unwrap();
        let skipped = client
            .next(Duration::from_secs(10))
            .await
            .expect("an event");
        assert_eq!(skipped.event, "skipped", "{resume}: {skipped:?}");
        assert_eq!(skipped.id.as_deref(), Some("p20"));
        let said: serde_json::Value = serde_json::from_str(&skipped.data).unwrap();
        assert_eq!(said, serde_json::json!({"after": "p0", "until": "p20"}));
        // Then the newest ten, in order, and nothing before them.
        for expected in &sent[20..] {
            let (_, shown) = next_message(&mut client, Duration::from_secs(10)).await;
            assert_eq!(shown["id"], expected["id"], "{resume}");
        }
    }
    // Within the bound nothing is skipped.
    let mut client = SseClient::connect(consumers.addr, "/chats/6/events", Some("p25"))
        .await
        .unwrap();
    let (id, _) = next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(id, "p26");
    consumers.stop().await;
    stack.stop().await;
}
