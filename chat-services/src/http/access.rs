//! Open event streams of identified users, held to the chat's membership: every second
//! this instance asks, in one query whatever the number of streams, which of its streams'
//! users are still members, and ends the streams of those who are not. A member removed on
//! any instance stops receiving within about a second; removed here, at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::metrics::Metrics;
use crate::store::Store;

/// How often open streams are checked against the members.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The streams being watched, by a number of their own.
#[derive(Default)]
pub(crate) struct Streams {
    open: Mutex<HashMap<u64, Watched>>,
    next: AtomicU64,
}

struct Watched {
    chat_id: i64,
    user: String,
    revoked: CancellationToken,
}

/// One stream's place in [`Streams`]; leaves it when dropped.
pub(crate) struct Watch {
    streams: Arc<Streams>,
    id: u64,
    /// Cancelled when the user is no member of the chat any more.
    pub revoked: CancellationToken,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.streams
            .open
            .lock()
            .expect("not poisoned")
            .remove(&self.id);
    }
}

impl Streams {
    /// Watch `user`'s stream of chat `chat_id`.
    pub(crate) fn watch(self: &Arc<Self>, chat_id: i64, user: &str) -> Watch {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let revoked = CancellationToken::new();
        self.open.lock().expect("not poisoned").insert(
            id,
            Watched {
                chat_id,
                user: user.to_string(),
                revoked: revoked.clone(),
            },
        );
        Watch {
            streams: self.clone(),
            id,
            revoked,
        }
    }

    /// End `user`'s streams of chat `chat_id` on this instance; how many.
    pub(crate) fn revoke(&self, chat_id: i64, user: &str) -> usize {
        let open = self.open.lock().expect("not poisoned");
        let mut n = 0;
        for w in open.values() {
            if w.chat_id == chat_id && w.user == user && !w.revoked.is_cancelled() {
                w.revoked.cancel();
                n += 1;
            }
        }
        n
    }

    /// The `(chat, user)` pairs of the open streams, each once.
    fn pairs(&self) -> Vec<(i64, String)> {
        let open = self.open.lock().expect("not poisoned");
        let mut pairs: Vec<(i64, String)> =
            open.values().map(|w| (w.chat_id, w.user.clone())).collect();
        pairs.sort();
        pairs.dedup();
        pairs
    }

    /// Check the open streams against the members every second until `shutdown`. When the
    /// database does not answer, streams stay open (they get nothing from it either) and are
    /// checked again a second later.
    pub(crate) async fn run(
        self: Arc<Self>,
        store: Store,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) {
        let mut every = tokio::time::interval(CHECK_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every.tick() => {}
            }
            let pairs = self.pairs();
            if pairs.is_empty() {
                continue;
            }
            let members = match store.memberships(&pairs).await {
                Ok(members) => members,
                Err(e) => {
                    debug!(error = %e, "membership of open streams not checked");
                    continue;
                }
            };
            for (chat_id, user) in pairs.iter().filter(|p| !members.contains(p)) {
                let n = self.revoke(*chat_id, user);
                if n > 0 {
                    metrics.event_streams_revoked_total.inc_by(n as u64);
                    info!(chat_id, user = %user, streams = n, "event streams ended: no longer a member");
                }
            }
        }
    }
}
