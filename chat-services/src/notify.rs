//! Live notifications between instances of one side. Only the instance holding the inbox
//! lease records messages; it tells its own SSE clients directly and the other instances
//! through a Redis pub/sub channel. A notification is only a shortcut: when the feed breaks
//! (Redis restarted, connection lost), every SSE stream re-reads the inbox, the truth.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cdc_relay::backoff::Backoff;
use futures::StreamExt;
use redis::aio::ConnectionManager;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::hub::Hub;
use crate::side::Side;

/// Instance id in notifications, so an instance skips its own.
fn instance_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| uuid::Uuid::new_v4().simple().to_string())
}

fn channel(side: Side) -> String {
    format!("inbox:{side}")
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Notification {
    from: String,
    chat_id: i64,
    seq: i64,
    frame: String,
    /// The inbox changed writer: every stream re-reads the inbox.
    #[serde(default)]
    resync: bool,
}

/// Tell the other instances of this side that a message was recorded (best effort).
pub async fn publish(
    conn: &mut ConnectionManager,
    side: Side,
    chat_id: i64,
    seq: i64,
    frame: &Bytes,
) {
    let note = Notification {
        from: instance_id().to_string(),
        chat_id,
        seq,
        frame: String::from_utf8_lossy(frame).into_owned(),
        resync: false,
    };
    send(conn, side, &note).await;
}

/// PUBLISH a notification (best effort: whoever misses it catches up from the inbox).
async fn send(conn: &mut ConnectionManager, side: Side, note: &Notification) {
    let payload = serde_json::to_string(note).expect("notification serializes");
    let sent: redis::RedisResult<i64> = redis::cmd("PUBLISH")
        .arg(channel(side))
        .arg(payload)
        .query_async(conn)
        .await;
    if let Err(e) = sent {
        debug!(error = %e, "live notification not sent; other instances catch up from the inbox");
    }
}

/// Tell every instance of this side to re-read the inbox (a new writer took over: what the
/// previous one recorded and never announced is shown now).
pub async fn publish_resync(conn: &mut ConnectionManager, side: Side) {
    let note = Notification {
        from: instance_id().to_string(),
        chat_id: 0,
        seq: 0,
        frame: String::new(),
        resync: true,
    };
    send(conn, side, &note).await;
}

/// Feed notifications of other instances into the local hub until `shutdown`.
pub async fn follow(client: redis::Client, side: Side, hub: Arc<Hub>, shutdown: CancellationToken) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        let session = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(channel(side)).await?;
            // Anything published while we were not subscribed is in the inbox.
            hub.resync_all();
            backoff.reset();
            let mut messages = pubsub.on_message();
            while let Some(msg) = messages.next().await {
                let Ok(payload) = msg.get_payload::<String>() else {
                    continue;
                };
                let Ok(note) = serde_json::from_str::<Notification>(&payload) else {
                    continue;
                };
                if note.resync {
                    hub.resync_all();
                } else if note.from != instance_id() {
                    hub.publish(note.chat_id, note.seq, Bytes::from(note.frame));
                }
            }
            redis::RedisResult::Ok(())
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            ended = session => {
                if let Err(e) = ended {
                    warn!(error = %e, "live notification feed interrupted");
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}
