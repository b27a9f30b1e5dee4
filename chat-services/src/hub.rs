//! Live fan-out of received messages to the SSE clients of each chat on this instance.
//!
//! The inbox is the source of truth; the hub only carries what was just committed, so an
//! SSE stream that falls behind (a slow client) is told it lagged and catches up from the
//! inbox instead of slowing anyone else down. Messages are published in inbox order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::broadcast;

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

    pub fn subscribe(&self, chat_id: i64) -> broadcast::Receiver<Live> {
        let mut chats = self.chats.lock().unwrap();
        chats
            .entry(chat_id)
            .or_insert_with(|| broadcast::channel(CHAT_BUFFER).0)
            .subscribe()
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
