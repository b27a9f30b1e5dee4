//! Looking ahead over a backlog: while the consumer works through a shard's entries in
//! stream order, it also scans ahead of its read position and records at once the messages
//! of chats that have nothing older left unprocessed, up to [`AHEAD_PER_CHAT`] per chat. A
//! chat with few entries in a backlog (quiet while the receiving side was down for hours,
//! beside another chat's burst) is shown within a few rounds instead of after the whole
//! backlog; a chat with many is left to the ordered path, which gives them in order, and
//! the scan goes on past them without writing.
//!
//! Invariants:
//! - An entry is recorded ahead only if every older entry of its chat is processed: at or
//!   below `done_to` (the ordered path has finished everything up to there: it claims what
//!   a previous holder left before it goes past it) or recorded ahead itself. The scan runs
//!   in stream order, so every older entry of a chat above `done_to` was seen, and one not
//!   recorded ahead holds the chat back (`waiting`) until the ordered path passes it.
//! - Recorded ahead means committed and shown, never acknowledged: the entry stays in the
//!   stream, and when the ordered path reaches it, it is acknowledged without being
//!   recorded again (after a restart, the inbox's unique message id absorbs it).
//! - What the look-ahead cannot decide it leaves to the ordered path, which holds its chat
//!   back: an entry that does not parse (dead-lettered there), a batch Postgres refuses, an
//!   entry another run was recording ahead when it ended (processed alone there, so a
//!   message that crashes its consumer is dead-lettered after one conclusive crash).
//! - Bounded: at most [`MAX_TRACKED`] chats held back and as many entries recorded ahead;
//!   past that the scan pauses until the ordered path catches up.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::Ordering;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::group::{parse_range_reply, Entry};
use super::{Active, ConsumeError, Flow, Recorded, READ_COUNT};
use crate::model;
use crate::store::Received;

/// Entries one scan reads.
const SCAN_COUNT: usize = 1_000;
/// Longest look-ahead between two reads of the ordered path (which renews the claims and
/// makes the backlog's own progress meanwhile).
const SLICE: std::time::Duration = std::time::Duration::from_secs(1);
/// Chats held back, and entries recorded ahead, tracked at most.
pub(super) const MAX_TRACKED: usize = 100_000;
/// Entries of one chat recorded ahead at most, from when the look-ahead begins or the
/// ordered path has passed the chat: past that, the chat has a backlog of its own, which
/// the ordered path works through while the scan goes on to the chats behind it.
const AHEAD_PER_CHAT: u32 = 100;

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
    /// Per chat, its newest scanned entry that was not recorded ahead: the chat is held
    /// back while that entry is above `done_to`.
    waiting: HashMap<i64, StreamId>,
    /// Per chat, entries taken to be recorded ahead (see [`AHEAD_PER_CHAT`]).
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

    /// Whether `chat` has an entry above `done_to` that was not recorded ahead.
    fn holds_back(&self, chat: i64) -> bool {
        self.waiting.get(&chat).is_some_and(|id| *id > self.done_to)
    }

    /// `id` of `chat` is left to the ordered path: the chat's later entries wait for it.
    fn wait(&mut self, chat: i64, id: StreamId) {
        self.waiting.insert(chat, id);
    }

    /// Whether the scanned entry `id` of `chat` may be recorded ahead (then it counts
    /// towards the chat's share), or must wait for the ordered path (then so must the
    /// chat's later ones).
    fn take(&mut self, chat: i64, id: StreamId) -> bool {
        match self.waiting.get(&chat) {
            Some(last) if *last > self.done_to => {
                self.waiting.insert(chat, id);
                return false;
            }
            // The ordered path passed the chat's backlog: it starts afresh.
            Some(_) => {
                self.waiting.remove(&chat);
                self.taken.remove(&chat);
            }
            None => {}
        }
        let taken = self.taken.entry(chat).or_default();
        if *taken >= AHEAD_PER_CHAT {
            self.waiting.insert(chat, id);
            return false;
        }
        *taken += 1;
        true
    }

    /// Whether the scan must pause: too much tracked even after forgetting the chats the
    /// ordered path has passed.
    fn full(&mut self) -> bool {
        if self.waiting.len() >= MAX_TRACKED || self.taken.len() >= MAX_TRACKED {
            let done_to = self.done_to;
            let passed: Vec<i64> = self
                .waiting
                .iter()
                .filter(|(_, id)| **id <= done_to)
                .map(|(chat, _)| *chat)
                .collect();
            for chat in passed {
                self.waiting.remove(&chat);
                self.taken.remove(&chat);
            }
        }
        self.waiting.len() >= MAX_TRACKED
            || self.taken.len() >= MAX_TRACKED
            || self.recorded.len() >= MAX_TRACKED
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

impl Active<'_> {
    /// Scan ahead and record what may go first, until the scan reaches the stream's end
    /// or for [`SLICE`]. The scan reads some twenty times faster than the ordered path
    /// records, so it goes first: the time it takes from the backlog's catch-up is a few
    /// percent of it, and halves how long a live chat waits for the scan to reach it.
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
                    shard = self.cfg().shard,
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

    /// Read the next entries past the scan, and record those whose chats are not held
    /// back.
    async fn look_ahead_once(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<Scan, ConsumeError> {
        let from = self.ahead.scan_from();
        let reply: redis::Value = match redis::cmd("XRANGE")
            .arg(&self.cfg().stream)
            .arg(format!("({from}"))
            .arg("+")
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query_async(&mut self.conn)
            .await
        {
            Ok(reply) => reply,
            Err(e) if e.code() == Some("NOPERM") => {
                if !self.inbox.ahead_refused.swap(true, Ordering::Relaxed) {
                    warn!(error = %e, "the Redis user may not scan the stream (XRANGE), so a backlog holds back every chat of its shard; load the current deploy/redis/users.acl");
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
        let mut first: Vec<(Entry, model::Message)> = Vec::new();
        let mut first_chats: HashSet<i64> = HashSet::new();
        for entry in entries {
            let id: StreamId = entry.id.parse()?;
            let Some(fields) = &entry.fields else {
                continue;
            };
            let field = |name: &str| fields.get(name).map(String::as_str);
            // Most of a backlog is held back: its chat is all the scan needs of it. One
            // that names no chat holds none back (the ordered path dead-letters it).
            let Some(chat) = chat_of(field) else {
                continue;
            };
            if self.foreign.contains(&entry.id) {
                self.ahead.wait(chat, id);
            } else if self.ahead.take(chat, id) {
                // One that does not parse whole is dead-lettered by the ordered path, and
                // never recorded: the chat's later ones may still go first.
                if let Ok(message) = model::parse_entry(field, self.cfg().side.other()) {
                    first.push((entry, message));
                    first_chats.insert(chat);
                }
                continue;
            }
            // Held back from here: what this scan took of the chat is left to the
            // ordered path too.
            if first_chats.remove(&chat) {
                first.retain(|(_, m)| m.chat_id != chat);
            }
        }
        self.ahead.scanned_to = last;
        let mut rest = first.into_iter().peekable();
        while rest.peek().is_some() {
            // A part Postgres refused holds its chats back: their entries in later parts
            // wait too.
            let mut part = Vec::with_capacity(READ_COUNT);
            while part.len() < READ_COUNT {
                let Some((entry, message)) = rest.next() else {
                    break;
                };
                if self.ahead.holds_back(message.chat_id) {
                    self.ahead.wait(message.chat_id, entry.id.parse()?);
                } else {
                    part.push((entry, message));
                }
            }
            if !part.is_empty() {
                if let Flow::Shutdown = self.record_ahead(&part, shutdown).await? {
                    return Ok(Scan::Shutdown);
                }
            }
        }
        Ok(Scan::More)
    }

    /// Record `part` (entries whose chats have nothing older unprocessed) and show it,
    /// under attempt records of this run while it is at it (see the module's invariants).
    async fn record_ahead(
        &mut self,
        part: &[(Entry, model::Message)],
        shutdown: &CancellationToken,
    ) -> Result<Flow, ConsumeError> {
        let ids: Vec<String> = part.iter().map(|(e, _)| e.id.clone()).collect();
        let attempts = ids.iter().map(|id| (id.clone(), 1)).collect();
        {
            // Released as this run's if its session ends before the records are removed.
            let mut delivered = self.inbox.delivered.lock().unwrap();
            for id in &ids {
                delivered.insert(id.clone(), 1);
            }
        }
        self.begin_attempts_of(&ids, &attempts, false).await?;
        #[cfg(feature = "failpoints")]
        if let Some(body) = &self.cfg().crash_on_body {
            if part.iter().any(|(_, m)| &m.body == body) {
                tracing::error!("failpoint: crashing on a message recorded ahead");
                // SAFETY: signalling our own process.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
        }
        let read_at = std::time::SystemTime::now();
        let batch: Vec<Received> = part
            .iter()
            .map(|(e, m)| Received {
                stream_id: e.id.clone(),
                message: m.clone(),
            })
            .collect();
        match self.record_in_parts(&batch, shutdown).await? {
            Recorded::Done(positions) => {
                self.show(part, &positions, read_at)?;
                self.inbox
                    .metrics
                    .recorded_ahead_total
                    .inc_by(part.len() as u64);
                for (entry, _) in part {
                    self.ahead.recorded.insert(entry.id.parse()?);
                }
            }
            // Postgres refused one of them for its own data: the ordered path finds which
            // and dead-letters it; their chats wait for it.
            Recorded::Rejected(e) => {
                debug!(error = %e, "inbox refused a batch recorded ahead; left to the ordered path");
                for (entry, message) in part {
                    self.ahead.wait(message.chat_id, entry.id.parse()?);
                }
            }
            Recorded::Shutdown => return Ok(Flow::Shutdown),
            Recorded::TooLarge => unreachable!("parts of one entry are written whole"),
        }
        self.end_attempts(&ids).await?;
        Ok(Flow::Continue)
    }
}

/// The chat an entry's message is in, read without the rest of it (held-back entries
/// need no more).
fn chat_of<'a>(field: impl Fn(&str) -> Option<&'a str>) -> Option<i64> {
    #[derive(serde::Deserialize)]
    struct ChatOf {
        chat_id: i64,
    }
    let fields = outbox_core::stream::entry::EntryFields::decode(field).ok()?;
    if fields.event != model::MESSAGE_CREATED {
        return None;
    }
    serde_json::from_str::<ChatOf>(fields.payload)
        .ok()
        .map(|c| c.chat_id)
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
    fn a_chat_waits_until_the_ordered_path_passes_its_entry() {
        let mut ahead = Ahead::default();
        ahead.processed_to(id(100), true);
        assert!(ahead.is_active());
        assert!(!ahead.holds_back(1), "nothing of chat 1 seen past 100");
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
    fn a_chat_with_a_backlog_of_its_own_is_left_to_the_ordered_path() {
        let mut ahead = Ahead::default();
        ahead.processed_to(id(100), true);
        for n in 0..AHEAD_PER_CHAT as u64 {
            assert!(ahead.take(1, id(101 + n)));
        }
        let past = id(101 + AHEAD_PER_CHAT as u64);
        assert!(!ahead.take(1, past), "its share is taken");
        assert!(ahead.take(2, id(1000)), "another chat is not held back");
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
        for chat in 0..MAX_TRACKED as i64 {
            ahead.wait(chat, id(10));
        }
        assert!(ahead.full(), "every chat still held back");
        ahead.processed_to(id(10), true);
        assert!(!ahead.full(), "the ordered path passed them all");
        assert!(ahead.waiting.is_empty());
    }
}
