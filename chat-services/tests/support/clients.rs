//! A user's side of the API: sending, reading the next live message, tokens in headers,
//! membership, and the odd probe (an entry appended as the relay would, a process's memory).

use std::net::SocketAddr;
use std::time::Duration;

use super::Idp;

/// Send `body` to chat `chat_id` on the service at `addr`; returns the message JSON.
pub(crate) async fn send(addr: SocketAddr, chat_id: i64, body: &str) -> serde_json::Value {
    let reply = testkit::http::post_json(
        addr,
        &format!("/chats/{chat_id}/messages"),
        &serde_json::json!({"body": body}),
        &[],
    )
    .await
    .expect("POST");
    assert_eq!(reply.status, 201, "{}", reply.body);
    reply.json()
}

/// The next `message` event's data as JSON, or a panic after `timeout`.
pub(crate) async fn next_message(
    client: &mut testkit::http::SseClient,
    timeout: Duration,
) -> (String, serde_json::Value) {
    let event = client.next(timeout).await.expect("an SSE message in time");
    assert_eq!(event.event, "message");
    (
        event.id.expect("SSE id"),
        serde_json::from_str(&event.data).expect("JSON data"),
    )
}

/// Append an entry to `stream` with the id right after its top, as the relay would (an
/// automatic `*` id would jump past the relay's LSN-based ids and stop it).
pub(crate) async fn append_after_top(
    redis: &testkit::RedisServer,
    stream: &str,
    fields: &[(&str, &str)],
) -> String {
    let mut conn = redis.connect().await.unwrap();
    let info: redis::streams::StreamInfoStreamReply = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query_async(&mut conn)
        .await
        .unwrap();
    let (ms, seq) = info.last_generated_id.split_once('-').unwrap();
    let id = format!("{ms}-{}", seq.parse::<u64>().unwrap() + 1);
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg(&id);
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query_async::<String>(&mut conn).await.unwrap()
}

/// `Authorization: Bearer <token>`.
pub(crate) fn bearer(token: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {token}"))
}

/// Make `user` a member of `chat_id` on the service at `addr` (with an admin token).
pub(crate) async fn add_member(addr: SocketAddr, idp: &Idp, chat_id: i64, user: &str) {
    let (name, value) = bearer(&idp.admin());
    let reply = testkit::http::request(
        addr,
        "PUT",
        &format!("/chats/{chat_id}/members/{user}"),
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert!(matches!(reply.status, 200 | 201), "{}", reply.body);
}

/// Send `body` to chat `chat_id` as the holder of `token`; the reply.
pub(crate) async fn send_as(
    addr: SocketAddr,
    token: &str,
    chat_id: i64,
    body: &str,
) -> testkit::http::Reply {
    let (name, value) = bearer(token);
    testkit::http::post_json(
        addr,
        &format!("/chats/{chat_id}/messages"),
        &serde_json::json!({"body": body}),
        &[(name, &value)],
    )
    .await
    .unwrap()
}

/// The resident memory of process `pid`, in MiB.
pub(crate) fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb / 1024.0
}

/// The peak resident memory of a process while it is watched, sampled every 50 ms.
pub(crate) struct RssPeak {
    /// Its memory when the watch began, in MiB.
    pub before: f64,
    peak: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    sampler: tokio::task::JoinHandle<()>,
}

impl RssPeak {
    pub(crate) fn watch(pid: u32) -> Self {
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let sampler = {
            let peak = peak.clone();
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(rss_mib(pid) as usize, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        Self {
            before: rss_mib(pid),
            peak,
            sampler,
        }
    }

    /// Stop watching: how far above `before` it went, in MiB.
    pub(crate) fn growth(self) -> f64 {
        self.sampler.abort();
        self.peak.load(std::sync::atomic::Ordering::Relaxed) as f64 - self.before
    }
}
