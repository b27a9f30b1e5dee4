//! What users are shown: a browser tab that reconnects like EventSource ([`Viewer`]), a
//! chat's feed as the database holds it, and the check that a side received what the other
//! sent, once and in order.

use std::net::SocketAddr;
use std::time::Duration;

use chat_services::Side;
use testkit::TestDb;

use super::Stack;

/// A browser tab on one chat: an SSE stream from the start of the feed that reconnects
/// with its Last-Event-ID whenever the stream ends (like EventSource), recording the id of
/// every message it was shown, in order.
pub(crate) struct Viewer {
    pub name: String,
    shown: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Viewer {
    pub(crate) fn start(name: &str, addr: SocketAddr, chat_id: i64) -> Self {
        Self::start_balanced(name, &[addr], chat_id)
    }

    /// A tab behind a load balancer: each reconnect goes to the next of `addrs`.
    pub(crate) fn start_balanced(name: &str, addrs: &[SocketAddr], chat_id: i64) -> Self {
        let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let addrs = addrs.to_vec();
        let task = tokio::spawn({
            let shown = shown.clone();
            async move {
                let path = format!("/chats/{chat_id}/events?after=p0");
                let mut last: Option<String> = None;
                for addr in addrs.iter().cycle() {
                    let Ok(mut client) =
                        testkit::http::SseClient::connect(*addr, &path, last.as_deref()).await
                    else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    loop {
                        match client.next(Duration::from_millis(500)).await {
                            Some(event) => {
                                assert_eq!(
                                    event.event, "message",
                                    "a viewer is shown messages only: {event:?}"
                                );
                                let message: serde_json::Value =
                                    serde_json::from_str(&event.data).expect("JSON data");
                                shown
                                    .lock()
                                    .unwrap()
                                    .push(message["id"].as_str().unwrap().to_string());
                                last = event.id;
                            }
                            None if client.is_closed() => break,
                            None => {}
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        Self {
            name: name.to_string(),
            shown,
            task,
        }
    }

    pub(crate) fn shown(&self) -> Vec<String> {
        self.shown.lock().unwrap().clone()
    }

    /// Wait until the tab shows as many messages as `side`'s feed of the chat holds, then
    /// assert it shows exactly that feed: every message once, in feed order.
    pub(crate) async fn assert_shows_feed(&self, db: &TestDb, side: Side, chat_id: i64) {
        let feed = feed(db, side, chat_id).await;
        testkit::wait_until(
            Duration::from_secs(30),
            &format!(
                "{} showing the {} messages of the feed",
                self.name,
                feed.len()
            ),
            || async {
                let n = self.shown().len();
                if n >= feed.len() {
                    Ok(())
                } else {
                    Err(format!("{n} shown"))
                }
            },
        )
        .await;
        let shown = self.shown();
        let missing: Vec<_> = feed.iter().filter(|id| !shown.contains(id)).collect();
        assert_eq!(
            shown,
            feed,
            "{}: must show the feed once, in order ({} missing)",
            self.name,
            missing.len()
        );
    }
}

impl Drop for Viewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Chat `chat_id` as `side` shows it: message ids of sent and received, in feed order.
pub(crate) async fn feed(db: &TestDb, side: Side, chat_id: i64) -> Vec<String> {
    db.connect()
        .await
        .unwrap()
        .query(
            &format!(
                "SELECT id::text FROM (
                   SELECT id, pos FROM {side}.messages WHERE chat_id = $1
                   UNION ALL
                   SELECT message_id, pos FROM {side}.inbox WHERE chat_id = $1) f
                 ORDER BY pos"
            ),
            &[&chat_id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Every message `from` sent to `chat` is in the other side's inbox once, in the order it
/// was sent (the chat's feed order on the sending side).
pub(crate) async fn assert_received_in_sent_order(stack: &Stack<'_>, from: Side, chat: i64) {
    stack.assert_relays_running();
    let db = stack.db.connect().await.unwrap();
    let to = from.other();
    let ids = |sql: String| {
        let db = &db;
        async move {
            db.query(&sql, &[&chat])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
        }
    };
    let sent = ids(format!(
        "SELECT id::text FROM {from}.messages WHERE chat_id = $1 ORDER BY pos"
    ))
    .await;
    testkit::wait_until(
        Duration::from_secs(60),
        &format!(
            "chat {chat}: all {} messages from {from} received",
            sent.len()
        ),
        || async {
            stack.assert_relays_running();
            let n = stack
                .count(&format!(
                    "SELECT count(*) FROM {to}.inbox WHERE chat_id = {chat}"
                ))
                .await as usize;
            if n >= sent.len() {
                Ok(())
            } else {
                Err(format!("{n} received"))
            }
        },
    )
    .await;
    let received = ids(format!(
        "SELECT message_id::text FROM {to}.inbox WHERE chat_id = $1 ORDER BY pos"
    ))
    .await;
    assert_eq!(received, sent, "chat {chat}: received once, in sent order");
}
