//! Live fan-out of a chat's feed (sent and received messages) to the SSE clients of each
//! chat on this instance.
//!
//! The database is the source of truth; the hub only carries hints of what was just
//! committed: a message with its feed position, the newest position of a chat (a tip), or
//! "re-read everything" (resync). A stream that sees a position beyond the next one, a tip
//! beyond what it sent, a resync, or that lagged (a slow client) reads the gap from the
//! database instead of slowing anyone else down. Hints may come late, twice, or never:
//! nothing depends on them but latency.
//!
//! A chat's channel lives exactly as long as its subscribers: the last [`Subscription`]
//! dropped removes it, so chats opened once and left cost nothing afterwards.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::broadcast;

/// The SSE frame of a feed item; `id:` is `p<pos>`, its position in the chat's feed (the
/// `p` tells it from the side-wide inbox sequence that ids were before migration V7). Made
/// here, below the inbox consumer, the send handler (which announce) and the SSE handler
/// (which replays), so none imports another.
pub(crate) fn frame(item: &crate::model::HistoryItem) -> Bytes {
    let data = serde_json::to_string(item).expect("message serializes");
    Bytes::from(format!(
        "id: p{}\nevent: message\ndata: {data}\n\n",
        item.pos
    ))
}

/// Messages a chat's channel buffers for its slowest subscriber before it lags.
const CHAT_BUFFER: usize = 256;

/// What a received message's live push continues: when the inbox recorded it and the
/// trace of that write. Sent messages have none.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Delivery {
    /// When the inbox commit was done, Unix microseconds (the start of recorded → pushed).
    pub recorded_at_micros: u64,
    /// The inbox write's span (or the entry's trace context when spans are off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

#[derive(Debug, Clone)]
pub(crate) enum Live {
    /// A message committed at feed position `pos`, as a ready SSE frame.
    Message {
        pos: i64,
        frame: Bytes,
        delivery: Option<Arc<Delivery>>,
    },
    /// The chat's feed reaches position `pos`: a stream behind it reads what it missed.
    Tip(i64),
    /// Something may have been missed (a notification feed reconnected, the inbox changed
    /// writer): re-read the feed.
    Resync,
}

#[derive(Default)]
pub(crate) struct Hub {
    chats: Mutex<HashMap<i64, broadcast::Sender<Live>>>,
}

impl Hub {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub(crate) fn subscribe(self: &Arc<Self>, chat_id: i64) -> Subscription {
        let mut chats = self.chats.lock().unwrap();
        let receiver = chats
            .entry(chat_id)
            .or_insert_with(|| broadcast::channel(CHAT_BUFFER).0)
            .subscribe();
        Subscription {
            hub: self.clone(),
            chat_id,
            receiver: Some(receiver),
        }
    }

    /// Chats with at least one subscriber on this instance.
    pub(crate) fn chats(&self) -> usize {
        self.chats.lock().unwrap().len()
    }

    /// Hand a committed message to the chat's subscribers, if any (never blocks).
    pub(crate) fn publish(
        &self,
        chat_id: i64,
        pos: i64,
        frame: Bytes,
        delivery: Option<Arc<Delivery>>,
    ) {
        self.send(
            chat_id,
            Live::Message {
                pos,
                frame,
                delivery,
            },
        );
    }

    /// Tell the chat's subscribers how far its feed reaches.
    pub(crate) fn tip(&self, chat_id: i64, pos: i64) {
        self.send(chat_id, Live::Tip(pos));
    }

    fn send(&self, chat_id: i64, live: Live) {
        let mut chats = self.chats.lock().unwrap();
        if let Some(sender) = chats.get(&chat_id) {
            if sender.send(live).is_err() {
                // Nobody listens any more.
                chats.remove(&chat_id);
            }
        }
    }

    /// The chats with subscribers on this instance.
    pub(crate) fn chat_ids(&self) -> Vec<i64> {
        self.chats.lock().unwrap().keys().copied().collect()
    }

    /// Tell the chat's subscribers to re-read its feed.
    pub(crate) fn resync_chat(&self, chat_id: i64) {
        self.send(chat_id, Live::Resync);
    }

    /// Tell every subscriber to re-read the inbox.
    pub(crate) fn resync_all(&self) {
        let mut chats = self.chats.lock().unwrap();
        chats.retain(|_, sender| sender.send(Live::Resync).is_ok());
    }
}

/// One subscriber's live feed of a chat.
pub(crate) struct Subscription {
    hub: Arc<Hub>,
    chat_id: i64,
    /// `Some` until dropped.
    receiver: Option<broadcast::Receiver<Live>>,
}

impl Subscription {
    pub(crate) async fn recv(&mut self) -> Result<Live, broadcast::error::RecvError> {
        match self.receiver.as_mut() {
            Some(receiver) => receiver.recv().await,
            None => Err(broadcast::error::RecvError::Closed),
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // Under the lock, so a concurrent subscribe either sees the channel alive or makes
        // a new one.
        let mut chats = self.hub.chats.lock().unwrap();
        drop(self.receiver.take());
        if chats
            .get(&self.chat_id)
            .is_some_and(|sender| sender.receiver_count() == 0)
        {
            chats.remove(&self.chat_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_subscriber_gone_frees_the_chat() {
        let hub = Hub::new();
        let a = hub.subscribe(1);
        let b = hub.subscribe(1);
        let c = hub.subscribe(2);
        assert_eq!(hub.chats(), 2);
        drop(a);
        assert_eq!(hub.chats(), 2);
        drop(b);
        assert_eq!(hub.chats(), 1);
        drop(c);
        assert_eq!(hub.chats(), 0);
    }
}
