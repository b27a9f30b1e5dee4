//! Live fan-out of received messages to the SSE clients of each chat on this instance.
//!
//! The inbox is the source of truth; the hub only carries what was just committed, so an
//! SSE stream that falls behind (a slow client) is told it lagged and catches up from the
//! inbox instead of slowing anyone else down. Messages are published in inbox order.
//!
//! A chat's channel lives exactly as long as its subscribers: the last [`Subscription`]
//! dropped removes it, so chats opened once and left cost nothing afterwards.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::broadcast;

/// The SSE frame of a received message; `id:` is its inbox position. Made here, below
/// both the inbox consumer (which announces) and the SSE handler (which replays), so neither
/// imports the other.
pub fn frame(item: &crate::model::HistoryItem) -> Bytes {
    let seq = item.seq.expect("received messages have a position");
    let data = serde_json::to_string(item).expect("message serializes");
    Bytes::from(format!("id: {seq}\nevent: message\ndata: {data}\n\n"))
}

/// Messages a chat's channel buffers for its slowest subscriber before it lags.
const CHAT_BUFFER: usize = 256;

#[derive(Debug, Clone)]
pub enum Live {
    /// A message recorded at inbox position `seq`, as a ready SSE frame.
    Message { seq: i64, frame: Bytes },
    /// Something may have been missed (a notification feed reconnected): re-read the inbox.
    Resync,
}

#[derive(Default)]
pub struct Hub {
    chats: Mutex<HashMap<i64, broadcast::Sender<Live>>>,
}

impl Hub {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn subscribe(self: &Arc<Self>, chat_id: i64) -> Subscription {
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
    pub fn chats(&self) -> usize {
        self.chats.lock().unwrap().len()
    }

    /// Hand a recorded message to the chat's subscribers, if any (never blocks).
    pub fn publish(&self, chat_id: i64, seq: i64, frame: Bytes) {
        let mut chats = self.chats.lock().unwrap();
        if let Some(sender) = chats.get(&chat_id) {
            if sender.send(Live::Message { seq, frame }).is_err() {
                // Nobody listens any more.
                chats.remove(&chat_id);
            }
        }
    }

    /// Tell every subscriber to re-read the inbox.
    pub fn resync_all(&self) {
        let mut chats = self.chats.lock().unwrap();
        chats.retain(|_, sender| sender.send(Live::Resync).is_ok());
    }

    /// Clients connected to this instance.
    pub fn subscribers(&self) -> usize {
        let chats = self.chats.lock().unwrap();
        chats.values().map(|s| s.receiver_count()).sum()
    }
}

/// One subscriber's live feed of a chat.
pub struct Subscription {
    hub: Arc<Hub>,
    chat_id: i64,
    /// `Some` until dropped.
    receiver: Option<broadcast::Receiver<Live>>,
}

impl Subscription {
    pub async fn recv(&mut self) -> Result<Live, broadcast::error::RecvError> {
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
