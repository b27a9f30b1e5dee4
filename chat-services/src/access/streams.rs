//! Open event streams of identified users, held to the chat's membership: every second
//! this instance asks, in one query whatever the number of streams, which of its streams'
//! users are still members, and ends the streams of those who are not. A member removed on
//! any instance stops receiving within about a second; removed here, at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::store::Store;

/// How often open streams are checked against the members.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long membership may go unchecked before every watched stream is ended: they come
/// back through the membership check of a new request, which fails closed.
const UNCHECKED_AT_MOST: Duration = Duration::from_secs(30);

/// The streams being watched: by chat and user, then by a number of their own.
#[derive(Default)]
pub(crate) struct Streams {
    open: Mutex<HashMap<(i64, String), HashMap<u64, CancellationToken>>>,
    next: AtomicU64,
}

/// One stream's place in [`Streams`]; leaves it when dropped.
pub(crate) struct Watch {
    streams: Arc<Streams>,
    key: (i64, String),
    id: u64,
    /// Cancelled when the user is no member of the chat any more.
    pub revoked: CancellationToken,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut open = self.streams.open.lock().expect("not poisoned");
        if let Some(streams) = open.get_mut(&self.key) {
            streams.remove(&self.id);
            if streams.is_empty() {
                open.remove(&self.key);
            }
        }
    }
}

impl Streams {
    /// Watch `user`'s stream of chat `chat_id`.
    pub(crate) fn watch(self: &Arc<Self>, chat_id: i64, user: &str) -> Watch {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let revoked = CancellationToken::new();
        let key = (chat_id, user.to_string());
        self.open
            .lock()
            .expect("not poisoned")
            .entry(key.clone())
            .or_default()
            .insert(id, revoked.clone());
        Watch {
            streams: self.clone(),
            key,
            id,
            revoked,
        }
    }

    /// End `user`'s streams of chat `chat_id` on this instance; how many.
    pub(crate) fn revoke(&self, chat_id: i64, user: &str) -> usize {
        let open = self.open.lock().expect("not poisoned");
        let Some(streams) = open.get(&(chat_id, user.to_string())) else {
            return 0;
        };
        streams
            .values()
            .filter(|t| !t.is_cancelled())
            .map(|t| t.cancel())
            .count()
    }

    /// End every watched stream; how many.
    fn revoke_all(&self) -> usize {
        let open = self.open.lock().expect("not poisoned");
        open.values()
            .flat_map(|streams| streams.values())
            .filter(|t| !t.is_cancelled())
            .map(|t| t.cancel())
            .count()
    }

    /// The `(chat, user)` pairs of the open streams.
    fn pairs(&self) -> Vec<(i64, String)> {
        self.open
            .lock()
            .expect("not poisoned")
            .keys()
            .cloned()
            .collect()
    }

    /// Check the open streams against the members every second until `shutdown`. When the
    /// database does not answer, streams stay open (they get nothing from it either) and are
    /// checked again a second later; unchecked for [`UNCHECKED_AT_MOST`], they are ended.
    /// What each check finds also updates `members`: a membership it confirms is
    /// remembered, one it finds gone is forgotten (so a removal made on another instance
    /// ends, within a second, both the user's streams here and what this instance
    /// remembers of them).
    pub(crate) async fn run(
        self: Arc<Self>,
        store: Store,
        members: Arc<crate::access::members::Members>,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) {
        let mut every = tokio::time::interval(CHECK_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut checked = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every.tick() => {}
            }
            let pairs = self.pairs();
            if pairs.is_empty() {
                checked = tokio::time::Instant::now();
                continue;
            }
            let asked = members.asking();
            let found = match store.memberships(&pairs).await {
                Ok(found) => {
                    checked = tokio::time::Instant::now();
                    found
                }
                Err(e) => {
                    metrics.membership_checks_failed_total.inc();
                    if checked.elapsed() >= UNCHECKED_AT_MOST {
                        let n = self.revoke_all();
                        metrics.event_streams_revoked_total.inc_by(n as u64);
                        warn!(error = %e, streams = n, "membership of open streams unchecked for 30 s; ended them (they come back through the membership check)");
                        checked = tokio::time::Instant::now();
                    } else {
                        warn!(error = %e, "membership of open streams not checked; trying again in a second");
                    }
                    continue;
                }
            };
            for (chat_id, user) in &found {
                members.saw(asked, *chat_id, user);
            }
            for (chat_id, user) in pairs.iter().filter(|p| !found.contains(p)) {
                members.forget(*chat_id, user);
                let n = self.revoke(*chat_id, user);
                if n > 0 {
                    metrics.event_streams_revoked_total.inc_by(n as u64);
                    info!(chat_id, user = %user, streams = n, "event streams ended: no longer a member");
                }
            }
        }
    }
}
