//! Trace context on a send with spans off (issue 26): a service continues a client's
//! `traceparent` only with `--trust-traceparent`, writes it to the outbox row in its
//! canonical form, and the relay copies it into the stream entry beside `published_at`;
//! an untrusted or invalid one goes nowhere.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::Stack;
use chat_services::Side;
use outbox_core::stream::entry;
use testkit::shared_postgres;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// POST with `traceparent` (if any); the message id.
async fn post(addr: std::net::SocketAddr, body: &str, traceparent: Option<&str>) -> String {
    let headers: Vec<(&str, &str)> = traceparent
        .map(|t| ("traceparent", t))
        .into_iter()
        .collect();
    let reply = testkit::http::post_json(
        addr,
        "/chats/5/messages",
        &serde_json::json!({ "body": body }),
        &headers,
    )
    .await
    .unwrap();
    assert_eq!(reply.status, 201, "{}", reply.body);
    reply.json()["id"].as_str().unwrap().to_string()
}

/// The outbox row's `traceparent` of message `id`.
async fn stored(stack: &Stack<'_>, id: &str) -> Option<String> {
    let db = stack.db.connect().await.unwrap();
    db.query_one(
        "SELECT traceparent FROM consumers.outbox WHERE payload->>'id' = $1",
        &[&id],
    )
    .await
    .unwrap()
    .get(0)
}

/// The stream entry of message `id`, once the relay published it.
async fn published(stack: &Stack<'_>, id: &str) -> std::collections::HashMap<String, String> {
    let conn = stack.redis_conn().await;
    testkit::wait_until(Duration::from_secs(20), "the entry published", || {
        let mut conn = conn.clone();
        async move {
            let entries: Vec<(String, std::collections::HashMap<String, String>)> =
                redis::cmd("XRANGE")
                    .arg(Side::Consumers.outbox_stream())
                    .arg("-")
                    .arg("+")
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
            entries
                .into_iter()
                .map(|(_, fields)| fields)
                .find(|f| f.get(entry::PAYLOAD).is_some_and(|p| p.contains(id)))
                .ok_or_else(|| "not yet".to_string())
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_trusted_valid_traceparent_is_carried_into_the_stream() {
    let stack = Stack::start(shared_postgres()).await;
    let before = SystemTime::now();

    let untrusting = stack.service(Side::Consumers, &[]).await;
    let ignored = post(untrusting.addr, "from a stranger", Some(TRACEPARENT)).await;
    untrusting.stop().await;
    assert_eq!(stored(&stack, &ignored).await, None);
    let fields = published(&stack, &ignored).await;
    assert_eq!(fields.get(entry::TRACEPARENT), None, "{fields:?}");

    let trusting = stack
        .service(Side::Consumers, &["--trust-traceparent"])
        .await;
    let carried = post(trusting.addr, "behind the gateway", Some(TRACEPARENT)).await;
    let invalid = post(
        trusting.addr,
        "bad header",
        Some("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01"),
    )
    .await;
    let none = post(trusting.addr, "no header", None).await;
    trusting.stop().await;
    assert_eq!(stored(&stack, &carried).await.as_deref(), Some(TRACEPARENT));
    assert_eq!(stored(&stack, &invalid).await, None);
    assert_eq!(stored(&stack, &none).await, None);

    let fields = published(&stack, &carried).await;
    assert_eq!(
        fields.get(entry::TRACEPARENT).map(String::as_str),
        Some(TRACEPARENT)
    );
    // Stamped by Redis while the test ran (one machine, one clock).
    let micros = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_micros();
    let at: u128 = fields[entry::PUBLISHED_AT].parse().unwrap();
    assert!(
        micros(before) <= at && at <= micros(SystemTime::now()),
        "{fields:?}"
    );
    for id in [&invalid, &none] {
        let fields = published(&stack, id).await;
        assert_eq!(fields.get(entry::TRACEPARENT), None, "{fields:?}");
        assert!(fields.contains_key(entry::PUBLISHED_AT), "{fields:?}");
    }
    stack.stop().await;
}
