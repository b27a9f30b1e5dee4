//! Looking ahead over a backlog: while the consumer works through a shard's entries in
//! stream order, it also scans ahead of its read position and records at once the entries
//! of order keys (`Inbox::order_key`: a chat, an aggregate) that have nothing older left
//! unprocessed, up to [`AHEAD_PER_KEY`] per key. A key with few entries in a backlog (quiet while the receiving side was down for hours,
//! beside another key's burst) is shown within a few rounds instead of after the whole
//! backlog; a key with many is left to the ordered path, which gives them in order, and
//! the scan goes on past them without writing.
//!
//! Invariants:
//! - An entry is recorded ahead only if every older entry of its key is processed: at or
//!   below `done_to` (the ordered path has finished everything up to there: it claims what
//!   a previous holder left before it goes past it) or recorded ahead itself. The scan runs
//!   in stream order, so every older entry of a key above `done_to` was seen, and one not
//!   recorded ahead holds the key back (`waiting`) until the ordered path passes it.
//! - Recorded ahead means committed and shown, never acknowledged: the entry stays in the
//!   stream, and when the ordered path reaches it, it is acknowledged without being
//!   recorded again (after a restart, the application's inbox absorbs it).
//! - What the look-ahead cannot decide it leaves to the ordered path, which holds its key
//!   back: an entry that does not parse (dead-lettered there), a batch the database refuses, an
//!   entry another run was recording ahead when it ended (processed alone there, so a
//!   entry that crashes its consumer is dead-lettered after one conclusive crash).
//! - Bounded: at most [`MAX_TRACKED`] keys held back and as many entries recorded ahead;
//!   past that the scan pauses until the ordered path catches up.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::Ordering;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::group::parse_range_reply;
use super::{Active, After, ConsumeError, Flow, Recorded, READ_COUNT};
use crate::inbox::{Entry, Inbox};

/// Entries one scan reads.
const SCAN_COUNT: usize = 1_000;
/// Longest look-ahead between two reads of the ordered path (which renews the claims and
/// makes the backlog's own progress meanwhile).
const SLICE: std::time::Duration = std::time::Duration::from_secs(1);
/// Chats held back, and entries recorded ahead, tracked at most.
pub(super) const MAX_TRACKED: usize = 100_000;
/// Entries of one key recorded ahead at most, from when the look-ahead begins or the
/// ordered path has passed the key: past that, the key has a backlog of its own, which
/// the ordered path works through while the scan goes on to the keys behind it.
const AHEAD_PER_KEY: u32 = 100;

/// A stream entry id, ordered as Redis orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub(super) struct StreamId(u64, u64);

impl FromStr for StreamId {
    type Err = ConsumeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ConsumeError::Reply(format!("not a stream entry id: {s:?}"));
        let (ms, seq) = s.split_once('-').ok_or_else(bad)?;
        Ok(Self(
            ms.parse().map_err(|_| bad())?,
            seq.parse().map_err(|_| bad())?,
        ))
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// The look-ahead's state for one session of one shard (a new session starts afresh).
#[derive(Debug, Default)]
pub(super) struct Ahead {
    /// Whether a backlog is being worked through (the last read was a full one).
    active: bool,
    /// The ordered path has processed every entry up to here.
    done_to: StreamId,
    /// The scan has seen every entry up to here.
    scanned_to: StreamId,
    /// Per key, its newest scanned entry that was not recorded ahead: the key is held
    /// back while that entry is above `done_to`.
    waiting: HashMap<i64, StreamId>,
    /// Per key, entries taken to be recorded ahead (see [`AHEAD_PER_KEY`]).
    taken: HashMap<i64, u32>,
    /// Entries recorded ahead that the ordered path has not reached yet.
    recorded: HashSet<StreamId>,
}

impl Ahead {
    /// The ordered path has processed everything up to `id`, and its read was `full` (more
    /// is waiting behind it: a backlog) or not (it reached the stream's end, so everything
    /// recorded ahead is behind it now).
    pub(super) fn processed_to(&mut self, id: StreamId, full: bool) {
        if !full {
            *self = Self::default();
            return;
        }
        self.done_to = self.done_to.max(id);
        if !self.active {
            self.active = true;
            self.scanned_to = id;
        }
    }

    pub(super) fn is_active(&self) -> bool {
        self.active
    }

    /// Where the next scan starts (exclusive).
    fn scan_from(&self) -> StreamId {
        self.scanned_to.max(self.done_to)
    }

    /// Whether `key` has an entry above `done_to` that was not recorded ahead.
    fn holds_back(&self, key: i64) -> bool {
        self.waiting.get(&key).is_some_and(|id| *id > self.done_to)
    }

    /// `id` of `key` is left to the ordered path: the key's later entries wait for it.
    fn wait(&mut self, key: i64, id: StreamId) {
        self.waiting.insert(key, id);
    }

    /// Whether the scanned entry `id` of `key` may be recorded ahead (then it counts
    /// towards the key's share), or must wait for the ordered path (then so must the
    /// key's later ones).
    fn take(&mut self, key: i64, id: StreamId) -> bool {
        match self.waiting.get(&key) {
            Some(last) if *last > self.done_to => {
                self.waiting.insert(key, id);
                return false;
            }
            // The ordered path passed the key's backlog: it starts afresh.
            Some(_) => {
                self.waiting.remove(&key);
                self.taken.remove(&key);
            }
            None => {}
        }
        let taken = self.taken.entry(key).or_default();
        if *taken >= AHEAD_PER_KEY {
            self.waiting.insert(key, id);
            return false;
        }
        *taken += 1;
        true
    }

    /// Whether the scan must pause: too much tracked even after forgetting the keys the
    /// ordered path has passed.
    fn full(&mut self) -> bool {
        if self.waiting.len() >= MAX_TRACKED || self.taken.len() >= MAX_TRACKED {
            let done_to = self.done_to;
            let passed: Vec<i64> = self
                .waiting
                .iter()
                .filter(|(_, id)| **id <= done_to)
                .map(|(key, _)| *key)
                .collect();
            for key in passed {
                self.waiting.remove(&key);
                self.taken.remove(&key);
            }
        }
        self.waiting.len() >= MAX_TRACKED
            || self.taken.len() >= MAX_TRACKED
            || self.recorded.len() >= MAX_TRACKED
    }

    /// The entry `id` was recorded ahead (committed, not acknowledged).
    pub(super) fn recorded_ahead(&mut self, id: StreamId) {
        self.recorded.insert(id);
    }

    /// Whether the ordered path's entry `id` was recorded ahead (then it only acknowledges
    /// it). Forgets it: the ordered path reaches each entry once.
    pub(super) fn take_recorded(&mut self, id: &str) -> bool {
        match id.parse::<StreamId>() {
            Ok(id) => self.recorded.remove(&id),
            Err(_) => false,
        }
    }
}

impl<I: Inbox> Active<'_, I> {
    /// Scan ahead and record what may go first, until the scan reaches the stream's end
    /// or for [`SLICE`]. The scan reads some twenty times faster than the ordered path
    /// records, so it goes first: the time it takes from the backlog's catch-up is a few
    /// percent of it, and halves how long a live key waits for the scan to reach it.
    pub(super) async fn look_ahead(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        let until = Instant::now() + SLICE;
        loop {
            if shutdown.is_cancelled() {
                return Ok(Flow::Shutdown);
            }
            if self.ahead.full() {
                debug!(
                    shard = self.keys().shard,
                    "look-ahead paused: it tracks as much as it may"
                );
                return Ok(Flow::Continue);
            }
            self.renew_if_due().await?;
            match self.look_ahead_once(shutdown).await? {
                Scan::AtEnd => return Ok(Flow::Continue),
                Scan::Shutdown => return Ok(Flow::Shutdown),
                Scan::More if Instant::now() >= until => return Ok(Flow::Continue),
                Scan::More => {}
            }
        }
    }

    /// Read the next entries past the scan, and record those whose keys are not held
    /// back.
    async fn look_ahead_once(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<Scan, ConsumeError> {
        let from = self.ahead.scan_from();
        let reply: redis::Value = match redis::cmd("XRANGE")
            .arg(&self.keys().stream)
            .arg(format!("({from}"))
            .arg("+")
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query_async(&mut self.conn)
            .await
        {
            Ok(reply) => reply,
            Err(e) if e.code() == Some("NOPERM") => {
                if !self.consumer.ahead_refused.swap(true, Ordering::Relaxed) {
                    warn!(error = %e, "the Redis user may not scan the stream (XRANGE), so a backlog holds back every key of its shard; load the current deploy/redis/users.acl");
                }
                return Ok(Scan::AtEnd);
            }
            Err(e) => return Err(e.into()),
        };
        let entries = parse_range_reply(reply)?;
        let Some(last) = entries.last() else {
            return Ok(Scan::AtEnd);
        };
        let last: StreamId = last.id.parse()?;
        let mut first: Vec<(Entry, I::Item, i64)> = Vec::new();
        let mut first_keys: HashSet<i64> = HashSet::new();
        for entry in entries {
            let id: StreamId = entry.id.parse()?;
            if entry.fields.is_none() {
                continue;
            }
            // Most of a backlog is held back: its key is all the scan needs of it. One
            // without a key holds none back (the ordered path records or dead-letters it).
            let Some(key) = self.inbox().order_key(&entry) else {
                continue;
            };
            if self.foreign.contains(&entry.id) {
                self.ahead.wait(key, id);
            } else if self.ahead.take(key, id) {
                // One that does not decode is dead-lettered by the ordered path, and never
                // recorded: the key's later ones may still go first.
                if let Ok(item) = self.inbox().decode(&entry) {
                    first.push((entry, item, key));
                    first_keys.insert(key);
                }
                continue;
            }
            // Held back from here: what this scan took of the key is left to the ordered
            // path too.
            if first_keys.remove(&key) {
                first.retain(|(_, _, k)| *k != key);
            }
        }
        self.ahead.scanned_to = last;
        let mut rest = first.into_iter().peekable();
        while rest.peek().is_some() {
            // A part the database refused holds its keys back: their entries in later
            // parts wait too.
            let mut part = Vec::with_capacity(READ_COUNT);
            while part.len() < READ_COUNT {
                let Some((entry, item, key)) = rest.next() else {
                    break;
                };
                if self.ahead.holds_back(key) {
                    self.ahead.wait(key, entry.id.parse()?);
                } else {
                    part.push((entry, item, key));
                }
            }
            if !part.is_empty() {
                if let Flow::Shutdown = self.record_ahead(part, shutdown).await? {
                    return Ok(Scan::Shutdown);
                }
            }
        }
        Ok(Scan::More)
    }

    /// Record `part` (entries whose keys have nothing older unprocessed) and show it,
    /// under attempt records of this run while it is at it (see the module's invariants).
    async fn record_ahead(
        &mut self,
        part: Vec<(Entry, I::Item, i64)>,
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        let ids: Vec<String> = part.iter().map(|(e, _, _)| e.id.clone()).collect();
        let attempts = ids.iter().map(|id| (id.clone(), 1)).collect();
        {
            // Released as this run's if its session ends before the records are removed.
            let mut delivered = self.consumer.delivered.lock().unwrap();
            for id in &ids {
                delivered.insert(id.clone(), 1);
            }
        }
        self.begin_attempts_of(&ids, &attempts, false).await?;
        let read_at = std::time::SystemTime::now();
        let (batch, keys): (Vec<(Entry, I::Item)>, Vec<i64>) = part
            .into_iter()
            .map(|(entry, item, key)| ((entry, item), key))
            .unzip();
        match self
            .record_in_parts(&batch, read_at, After::KeepPending, shutdown)
            .await?
        {
            Recorded::Done => {}
            // The database refused one of them for its own data: the ordered path finds
            // which and dead-letters it; the keys of what did not commit wait for it.
            Recorded::Rejected(e, committed) => {
                debug!(error = %e, "inbox refused a batch recorded ahead; left to the ordered path");
                for ((entry, _), key) in batch.iter().zip(&keys).skip(committed) {
                    self.ahead.wait(*key, entry.id.parse()?);
                }
            }
            Recorded::Shutdown => return Ok(Flow::Shutdown),
        }
        self.end_attempts(&ids).await?;
        Ok(Flow::Continue)
    }
}

/// How one scan went.
enum Scan {
    /// Nothing past the scan: it reached the stream's end.
    AtEnd,
    /// Scanned (and recorded what could go first); more may follow.
    More,
    Shutdown,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u64) -> StreamId {
        StreamId(n, 0)
    }

    #[test]
    fn ids_order_as_redis_orders_them() {
        let a: StreamId = "9-5".parse().unwrap();
        let b: StreamId = "10-0".parse().unwrap();
        assert!(a < b, "numeric, not textual");
        assert_eq!(b.to_string(), "10-0");
        assert!("10".parse::<StreamId>().is_err());
        assert!("x-1".parse::<StreamId>().is_err());
    }

    #[test]
    fn a_key_waits_until_the_ordered_path_passes_its_entry() {
        let mut ahead = Ahead::default();
        ahead.processed_to(id(100), true);
        assert!(ahead.is_active());
        assert!(!ahead.holds_back(1), "nothing of key 1 seen past 100");
        ahead.wait(1, id(150));
        assert!(ahead.holds_back(1));
        assert!(!ahead.holds_back(2));
        ahead.processed_to(id(149), true);
        assert!(ahead.holds_back(1), "entry 150 not processed yet");
        ahead.processed_to(id(150), true);
        assert!(!ahead.holds_back(1));
    }

    #[test]
    fn the_scan_starts_past_what_was_processed_or_scanned() {
        let mut ahead = Ahead::default();
        ahead.processed_to(id(100), true);
        assert_eq!(ahead.scan_from(), id(100));
        ahead.scanned_to = id(300);
        ahead.processed_to(id(200), true);
        assert_eq!(ahead.scan_from(), id(300));
        ahead.processed_to(id(400), true);
        assert_eq!(ahead.scan_from(), id(400));
    }

    #[test]
    fn a_read_that_reaches_the_end_forgets_everything() {
        let mut ahead = Ahead::default();
        ahead.processed_to(id(100), true);
        ahead.wait(1, id(150));
        ahead.recorded.insert(id(160));
        ahead.processed_to(id(170), false);
        assert!(!ahead.is_active());
        assert!(ahead.waiting.is_empty() && ahead.recorded.is_empty());
    }

    #[test]
    fn entries_recorded_ahead_are_taken_once() {
        let mut ahead = Ahead::default();
        ahead.recorded.insert(id(160));
        assert!(ahead.take_recorded("160-0"));
        assert!(!ahead.take_recorded("160-0"));
        assert!(!ahead.take_recorded("garbage"));
    }

    #[test]
    fn a_key_with_a_backlog_of_its_own_is_left_to_the_ordered_path() {
        let mut ahead = Ahead::default();
        ahead.processed_to(id(100), true);
        for n in 0..AHEAD_PER_KEY as u64 {
            assert!(ahead.take(1, id(101 + n)));
        }
        let past = id(101 + AHEAD_PER_KEY as u64);
        assert!(!ahead.take(1, past), "its share is taken");
        assert!(ahead.take(2, id(1000)), "another key is not held back");
        assert!(
            !ahead.take(1, id(1001)),
            "held back until the ordered path passes it"
        );
        assert_eq!(ahead.waiting[&1], id(1001));
        ahead.processed_to(id(1001), true);
        assert!(ahead.take(1, id(1002)), "passed: it starts afresh");
    }

    #[test]
    fn the_scan_pauses_only_while_what_it_tracks_is_still_needed() {
        let mut ahead = Ahead::default();
        ahead.processed_to(id(1), true);
        for key in 0..MAX_TRACKED as i64 {
            ahead.wait(key, id(10));
        }
        assert!(ahead.full(), "every key still held back");
        ahead.processed_to(id(10), true);
        assert!(!ahead.full(), "the ordered path passed them all");
        assert!(ahead.waiting.is_empty());
    }
}
