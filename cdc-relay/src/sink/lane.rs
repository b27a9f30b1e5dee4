//! One shard's lane of the pipeline: what it has sealed and not yet confirmed, in order, and
//! whether it is live or behind.
//!
//! A live lane receives its share of every sealed batch and sends it strictly in order, up to
//! two calls in flight, one at a time while it fails. A lane that cannot confirm for longer
//! than `--shard-detach-after`, whose stream is full (`--stream-max-len` unread entries), that
//! lost entries or its record, or whose queue passes its byte bound, falls *behind*: it drops
//! what it queued and everything sealed for it later, and the slot no longer waits for it.
//! Its record still says how far it got (`acked_through`, `watermark`): the outbox table owes
//! it the rest, which a catch-up publishes (`recovery::catch_up`) before the lane turns live
//! again. While a catch-up hands over, the lane keeps (captures) what is sealed for it, up to
//! its byte bound, to release the part the catch-up's last snapshot did not show.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::backoff::Backoff;
use outbox_core::stream::EntryId;
use pgwire_replication::Lsn;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::batch::StreamEntry;
use super::publisher::{PartMeta, PublishOutcome};
use crate::error::RelayError;
use crate::source::Watermark;

/// Calls one lane may have in flight at once.
pub(super) const MAX_IN_FLIGHT: usize = 2;

/// One shard's share of one or more sealed batches, sent as one call.
pub(super) struct Part {
    pub(super) entries: Vec<StreamEntry>,
    pub(super) bytes: usize,
    pub(super) meta: PartMeta,
    /// Refused by a fence once already (see `Pipeline::on_done`).
    pub(super) gap_retried: bool,
    /// When it was first sent (kept when it is sent again): how long the lane has been
    /// unable to confirm.
    pub(super) first_sent: Option<Instant>,
}

impl Part {
    pub(super) fn new(entries: Vec<StreamEntry>, meta: PartMeta) -> Self {
        let bytes = entries.iter().map(StreamEntry::bytes).sum();
        Self {
            entries,
            bytes,
            meta,
            gap_retried: false,
            first_sent: None,
        }
    }

    /// `next` appended (both of one lane, `next` sealed right after `self`): the newer
    /// acknowledgement and watermark win, the older fence stays.
    fn absorb(&mut self, next: Part) {
        self.entries.extend(next.entries);
        self.bytes += next.bytes;
        if next.meta.ack_lsn.is_some() {
            self.meta.ack_lsn = next.meta.ack_lsn;
        }
        if next.meta.watermark.is_some() {
            self.meta.watermark = next.meta.watermark;
        }
        self.meta.rejoin |= next.meta.rejoin;
    }

    /// A copy to send again (the task that held the other reference is done or aborted).
    fn reclaim(part: Arc<Part>) -> Part {
        Arc::try_unwrap(part).unwrap_or_else(|shared| Part {
            entries: shared.entries.clone(),
            bytes: shared.bytes,
            meta: shared.meta.clone(),
            gap_retried: shared.gap_retried,
            first_sent: shared.first_sent,
        })
    }
}

pub(super) struct InFlight {
    pub(super) part: Arc<Part>,
    pub(super) task: JoinHandle<Result<PublishOutcome, RelayError>>,
}

/// Why a lane fell behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BehindReason {
    /// It could not confirm for longer than `--shard-detach-after` (the last error).
    Failing(String),
    /// Its stream holds `--stream-max-len` entries some group has not read.
    Full(String),
    /// Its queue passed the byte bound while it could not confirm.
    Memory(usize),
    /// It lost entries this session wrote, or its record.
    Lost(String),
}

impl BehindReason {
    pub(crate) fn label(&self) -> &'static str {
        match self {
            BehindReason::Failing(_) => "failing",
            BehindReason::Full(_) => "full",
            BehindReason::Memory(_) => "memory",
            BehindReason::Lost(_) => "lost",
        }
    }
}

impl std::fmt::Display for BehindReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BehindReason::Failing(e) => write!(f, "could not confirm: {e}"),
            BehindReason::Full(e) => write!(f, "full: {e}"),
            BehindReason::Memory(bytes) => {
                write!(f, "could not confirm, and queued {bytes} bytes")
            }
            BehindReason::Lost(e) => write!(f, "lost data: {e}"),
        }
    }
}

/// A lane whose oldest call has waited longer than this is slow: sealing no longer waits for
/// it (far above a healthy call's milliseconds, far below the 2 s a message may take).
pub(crate) const SLOW_LANE: Duration = Duration::from_millis(250);

/// What a behind lane keeps of what is sealed for it while a catch-up hands over.
pub(super) struct Capture {
    pub(super) entries: Vec<StreamEntry>,
    pub(super) bytes: usize,
}

pub(super) enum State {
    Live,
    Behind { capture: Option<Capture> },
}

pub(super) struct Lane {
    pub(super) shard: u32,
    pub(super) state: State,
    /// Sealed and not sent yet (parts to send again come back to its front).
    pub(super) queued: VecDeque<Part>,
    pub(super) queued_bytes: usize,
    pub(super) in_flight: VecDeque<InFlight>,
    /// While set, this lane sends nothing before it (a backoff after a failure).
    pub(super) retry_at: Option<Instant>,
    pub(super) backoff: Backoff,
    /// The last id sealed into this lane so far (the next part's fence).
    pub(super) last_sealed: Option<EntryId>,
    /// The oldest part failed and is being sent again: one call at a time until one is
    /// confirmed, and this lane does not hold back sealing.
    pub(super) failing: bool,
    /// The last error while failing.
    pub(super) last_error: Option<String>,
    /// The highest acknowledgement its record holds from this session.
    pub(super) acked: Lsn,
    /// Watermarks it may record: those taken wholly after this position (after a catch-up's
    /// last snapshot; 0 otherwise).
    pub(super) watermark_floor: Lsn,
    /// The watermark its record holds, or the one sealed to it last.
    pub(super) watermark_sealed: Option<Arc<Watermark>>,
    /// The first id of its current live stretch (its top when the session started or when it
    /// turned live again): every row committed before it is at an id below it.
    pub(super) first_live_id: Option<EntryId>,
    /// A watermark every row of which its consumer groups acknowledged (learnt from the
    /// publish script): should the shard lose its data, only what it does not show is owed.
    pub(super) consumed: Option<Arc<Watermark>>,
    /// A watermark whose every row is in the stream already, maybe under a catch-up's id
    /// (below the live ids that followed), until the slot passes it: the one its record held
    /// when the session began, or the last snapshot of the catch-up that made it live again.
    /// A transaction it shows that the slot delivers (a replay after a restart, or one the
    /// relay had not received yet when the catch-up's snapshot already showed it) is not
    /// sent again (see `holds`).
    pub(super) held: Option<Watermark>,
    /// With a hand-over's snapshot in `held`: only transactions committed at or after this
    /// (Postgres epoch microseconds) are dropped. The catch-up published what the snapshot
    /// shows *from the outbox table*, and the services delete old rows from it: an older
    /// transaction's row may have been gone before the catch-up read it, so it is sent (at
    /// worst a second time, which consumers skip by id) rather than lost. `None`: the
    /// record's watermark, whose rows were published by a previous session.
    pub(super) held_from_micros: Option<i64>,
    /// Tableless entries sealed for it while behind (and those it had unconfirmed when it
    /// fell behind), in the order they came: no catch-up can bring them, so they wait here
    /// (the slot below the oldest) and go out when it turns live again.
    pub(super) messages: Vec<StreamEntry>,
    pub(super) messages_bytes: usize,
}

impl Lane {
    pub(super) fn new(shard: u32, fence: Option<EntryId>, max_backoff: Duration) -> Self {
        Self {
            shard,
            state: State::Live,
            queued: VecDeque::new(),
            queued_bytes: 0,
            in_flight: VecDeque::new(),
            retry_at: None,
            backoff: Backoff::new(Duration::from_millis(50), max_backoff),
            last_sealed: fence,
            failing: false,
            last_error: None,
            acked: Lsn(0),
            watermark_floor: Lsn(0),
            watermark_sealed: None,
            first_live_id: fence,
            consumed: None,
            held: None,
            held_from_micros: None,
            messages: Vec::new(),
            messages_bytes: 0,
        }
    }

    /// Keep the tableless ones of `entries` (which this lane drops) until it is live again.
    pub(super) fn keep_messages<'e>(&mut self, entries: impl IntoIterator<Item = &'e StreamEntry>) {
        for e in entries.into_iter().filter(|e| e.tableless) {
            self.messages_bytes += e.bytes();
            self.messages.push(e.clone());
        }
    }

    /// The oldest commit (by its id, without the session's offset) of a kept message.
    pub(super) fn oldest_message(&self, id_offset: u64) -> Option<Lsn> {
        self.messages
            .iter()
            .map(|e| Lsn(e.id.commit_lsn.saturating_sub(id_offset)))
            .min()
    }

    /// Take out of `entries` (sealed for this lane with the slot acknowledgement `ack`) those
    /// the stream holds already (see `holds`); answers how many. Once the slot passes the
    /// watermark, nothing it shows comes again and the check ends.
    pub(super) fn drop_held(
        &mut self,
        entries: &mut Vec<StreamEntry>,
        ack: Option<Lsn>,
        id_offset: u64,
    ) -> usize {
        let Some(hi) = self.held.as_ref().map(|w| w.hi) else {
            return 0;
        };
        let before = entries.len();
        entries.retain(|e| !self.holds(e, id_offset));
        if ack.is_some_and(|ack| ack >= hi) {
            self.held = None;
            self.held_from_micros = None;
        }
        before - entries.len()
    }

    /// Whether the stream holds `entry` already, as `held` shows: a replay whose row a
    /// catch-up published under another id (the slot was not yet acknowledged past it when
    /// the last session ended), or a transaction a hand-over's last snapshot showed before
    /// the relay received it (see `held_from_micros`). Sent again, the first would sit below
    /// the stream's top at an id never written there, which the script must refuse as
    /// another writer's; the second would be a duplicate.
    pub(super) fn holds(&self, entry: &StreamEntry, id_offset: u64) -> bool {
        let Some(held) = &self.held else {
            return false;
        };
        let commit = entry.id.commit_lsn.saturating_sub(id_offset);
        // Nothing committed above `hi` is visible in it; below, its snapshot decides. A
        // tableless entry is never taken for published by a snapshot (a catch-up did not
        // write it): sent again, Redis skips it if it has it.
        entry.xid != 0
            && !entry.tableless
            && commit <= held.hi.as_u64()
            && self
                .held_from_micros
                .is_none_or(|from| entry.commit_time_micros >= from)
            && held.snapshot.visible(held.snapshot.widen(entry.xid))
    }

    pub(super) fn is_live(&self) -> bool {
        matches!(self.state, State::Live)
    }

    /// Live and confirming.
    pub(super) fn healthy(&self) -> bool {
        self.is_live() && !self.failing
    }

    /// Nothing sealed is unconfirmed (a behind lane holds nothing).
    pub(super) fn is_idle(&self) -> bool {
        self.in_flight.is_empty() && self.queued.is_empty() && self.retry_at.is_none()
    }

    /// Its oldest unconfirmed part has waited longer than [`SLOW_LANE`] (it confirms, but
    /// slowly: the others are not held to its pace).
    pub(super) fn slow(&self, now: Instant) -> bool {
        self.unconfirmed_since()
            .is_some_and(|since| now.saturating_duration_since(since) > SLOW_LANE)
    }

    /// Since when its oldest unconfirmed part has waited for Redis.
    pub(super) fn unconfirmed_since(&self) -> Option<Instant> {
        self.in_flight
            .front()
            .and_then(|f| f.part.first_sent)
            .or_else(|| self.queued.front().and_then(|p| p.first_sent))
    }

    pub(super) fn push(&mut self, part: Part) {
        if let Some(last) = part.entries.last() {
            self.last_sealed = Some(last.id);
        }
        self.queued_bytes += part.bytes;
        self.queued.push_back(part);
    }

    /// The next part to send: what is queued, merged into one call up to the batch limits
    /// (a lane that caught up after a failure sends its backlog in few calls).
    pub(super) fn take_next(&mut self, max_entries: usize, max_bytes: usize) -> Option<Part> {
        let mut part = self.queued.pop_front()?;
        while let Some(next) = self.queued.front() {
            if part.entries.len() + next.entries.len() > max_entries
                || part.bytes + next.bytes > max_bytes
            {
                break;
            }
            let next = self.queued.pop_front().expect("front exists");
            part.absorb(next);
        }
        self.queued_bytes -= part.bytes;
        Some(part)
    }

    /// Queue the oldest part in flight and every later one to be sent again, in order: later
    /// ones may have run or been refused by their fence, so their tasks are abandoned.
    pub(super) fn send_again_from(&mut self, head: Arc<Part>) {
        let mut again = vec![head];
        for later in self.in_flight.drain(..) {
            later.task.abort();
            again.push(later.part);
        }
        for part in again.into_iter().rev() {
            let part = Part::reclaim(part);
            self.queued_bytes += part.bytes;
            self.queued.push_front(part);
        }
    }

    /// Send the oldest part again after it was refused once by its fence.
    pub(super) fn send_again_after_gap(&mut self, head: Arc<Part>) {
        let mut part = Part::reclaim(head);
        part.gap_retried = true;
        self.send_again_from(Arc::new(part));
        self.retry_at = Some(Instant::now());
    }

    /// Fall behind: drop everything sealed and not confirmed (it is still in the outbox
    /// table, and the slot no longer waits for this lane). What its groups had consumed.
    pub(super) fn fall_behind(&mut self) -> Option<Arc<Watermark>> {
        // Tableless entries are kept, oldest first (in flight before queued).
        let in_flight: Vec<Arc<Part>> = self.in_flight.iter().map(|f| f.part.clone()).collect();
        let queued: Vec<Part> = self.queued.drain(..).collect();
        self.keep_messages(
            in_flight
                .iter()
                .flat_map(|p| p.entries.iter())
                .chain(queued.iter().flat_map(|p| p.entries.iter())),
        );
        self.drop_unconfirmed();
        self.state = State::Behind { capture: None };
        self.failing = false;
        self.backoff.reset();
        self.watermark_sealed = None;
        self.consumed.take()
    }

    /// Abandon what is in flight and queued.
    pub(super) fn drop_unconfirmed(&mut self) {
        for f in self.in_flight.drain(..) {
            f.task.abort();
        }
        self.queued.clear();
        self.queued_bytes = 0;
        self.retry_at = None;
    }

    /// Bytes it holds (queued, in flight, captured).
    pub(super) fn held_bytes(&self) -> usize {
        let captured = match &self.state {
            State::Behind {
                capture: Some(capture),
            } => capture.bytes,
            _ => 0,
        };
        self.queued_bytes
            + self.in_flight.iter().map(|f| f.part.bytes).sum::<usize>()
            + captured
            + self.messages_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Snapshot;

    #[test]
    fn a_replay_is_held_when_the_recorded_watermark_shows_its_transaction() {
        let mut lane = Lane::new(0, None, Duration::from_secs(1));
        let at = |lsn: u64, xid: u32| StreamEntry {
            xid,
            ..crate::sink::batch::tests::entry(lsn + 7, 0)
        };
        assert!(!lane.holds(&at(900, 99), 7), "no watermark: nothing held");
        lane.held = Some(Watermark {
            lo: Lsn(800),
            hi: Lsn(1000),
            taken_at_micros: 0,
            snapshot: Snapshot {
                xmin: 100,
                xmax: 105,
                xip: vec![103],
            },
        });
        assert!(lane.holds(&at(900, 99), 7), "finished before the snapshot");
        assert!(lane.holds(&at(1000, 104), 7), "committed before it, at hi");
        assert!(!lane.holds(&at(900, 103), 7), "running when it was taken");
        assert!(
            !lane.holds(&at(900, 105), 7),
            "not started when it was taken"
        );
        assert!(!lane.holds(&at(1001, 99), 7), "committed above hi");
        assert!(
            !lane.holds(&at(900, 0), 7),
            "read from the table, not the slot"
        );
        // A hand-over's snapshot: only what committed since the floor is taken for published
        // (an older row may have been deleted from the table before the catch-up read it).
        lane.held_from_micros = Some(5_000);
        let committed_at = |micros: i64| StreamEntry {
            commit_time_micros: micros,
            ..at(900, 99)
        };
        assert!(lane.holds(&committed_at(5_000), 7));
        assert!(
            !lane.holds(&committed_at(4_999), 7),
            "older than the floor: sent"
        );
    }
}
