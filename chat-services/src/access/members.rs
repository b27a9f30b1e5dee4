//! Who is a member of which chat, remembered briefly: every request of a member asks it,
//! and each would otherwise cost a query before anything else. A membership seen is kept
//! for [`KEPT`]; one removed on this instance is forgotten at once, and other instances
//! stop trusting theirs within [`KEPT`]. Nothing outlives a removal by more: a send
//! re-checks membership inside its own insert, and open streams are checked against the
//! database every second (`streams`).
//!
//! Invariant: only memberships are kept, never their absence (a stranger's guesses are
//! metered by the budgets, not remembered), and one read before a removal is never kept
//! after it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a membership seen is trusted without asking the database again.
pub(crate) const KEPT: Duration = Duration::from_secs(2);
/// Memberships kept at most; past it the expired ones are dropped, and if that is not
/// enough, all (they are only a shortcut).
const MOST: usize = 100_000;

#[derive(Default)]
pub(crate) struct Members {
    seen: Mutex<HashMap<(i64, String), Instant>>,
    /// Bumped by every removal: a membership read before one is not kept.
    removals: AtomicU64,
}

/// When a membership was read: taken before the query, given to [`Members::saw`]. Its
/// time is what is kept, not the answer's: a slow answer is trusted [`KEPT`] from when the
/// database was asked, no longer.
#[derive(Clone, Copy)]
pub(crate) struct Asked {
    removals: u64,
    at: Instant,
}

impl Members {
    /// Whether `user` was seen a member of `chat_id` within [`KEPT`].
    pub(crate) fn knows(&self, chat_id: i64, user: &str) -> bool {
        self.knows_at(Instant::now(), chat_id, user)
    }

    fn knows_at(&self, now: Instant, chat_id: i64, user: &str) -> bool {
        let seen = self.seen.lock().expect("not poisoned");
        seen.get(&(chat_id, user.to_string()))
            .is_some_and(|at| now.duration_since(*at) < KEPT)
    }

    /// Call before asking the database.
    pub(crate) fn asking(&self) -> Asked {
        Asked {
            removals: self.removals.load(Ordering::SeqCst),
            at: Instant::now(),
        }
    }

    /// The database said `user` is a member of `chat_id`, when `asked`: kept from then,
    /// unless a removal here came since (the answer may predate it).
    pub(crate) fn saw(&self, asked: Asked, chat_id: i64, user: &str) {
        let now = Instant::now();
        let mut seen = self.seen.lock().expect("not poisoned");
        if self.removals.load(Ordering::SeqCst) != asked.removals {
            return;
        }
        if seen.len() >= MOST {
            seen.retain(|_, at| now.duration_since(*at) < KEPT);
            if seen.len() >= MOST {
                seen.clear();
            }
        }
        seen.insert((chat_id, user.to_string()), asked.at);
    }

    /// `user` left `chat_id` (removed here): forget it, and any membership being read now.
    pub(crate) fn forget(&self, chat_id: i64, user: &str) {
        let mut seen = self.seen.lock().expect("not poisoned");
        self.removals.fetch_add(1, Ordering::SeqCst);
        seen.remove(&(chat_id, user.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_briefly_and_forgotten_on_removal() {
        let members = Members::default();
        assert!(!members.knows(1, "a"));
        let asked = members.asking();
        members.saw(asked, 1, "a");
        assert!(members.knows(1, "a"));
        assert!(!members.knows(2, "a"), "per chat");
        assert!(
            !members.knows_at(Instant::now() + KEPT, 1, "a"),
            "only for KEPT"
        );
        members.forget(1, "a");
        assert!(!members.knows(1, "a"));
    }

    #[test]
    fn a_slow_answer_is_kept_from_when_it_was_asked() {
        let members = Members::default();
        let Some(long_ago) = Instant::now().checked_sub(KEPT) else {
            return; // a machine up for less than KEPT: nothing to date back to
        };
        let asked = Asked {
            removals: 0,
            at: long_ago,
        };
        members.saw(asked, 1, "a");
        assert!(!members.knows(1, "a"));
    }

    #[test]
    fn a_membership_read_before_a_removal_is_not_kept() {
        let members = Members::default();
        let asked = members.asking();
        // Removed while the query was out: its answer ("a member") is stale.
        members.forget(1, "a");
        members.saw(asked, 1, "a");
        assert!(!members.knows(1, "a"));
    }
}
