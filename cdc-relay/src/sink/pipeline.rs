//! The ordered publish pipeline: one lane per shard ([`lane`](super::lane)). A sealed batch
//! splits into one part per shard it writes (and an acknowledgement-only part for every other
//! live shard when it carries the acknowledgement to all); each live lane sends its parts
//! strictly in order, up to two in flight, and confirms them in that order.
//!
//! Lanes are independent: a shard that cannot confirm (a WAIT that falls short, a node down,
//! a refusal) holds back its own chats only, while the others keep flowing. Once it has been
//! unable to confirm for `--shard-detach-after`, or its stream is full, or its queue passes
//! `--lane-max-bytes`, it falls behind ([`Event::Behind`]): the slot stops waiting for it and
//! the outbox table owes it the rest (see `recovery::catch_up`). So the slot is acknowledged
//! at the least of what every *live* lane's record holds ([`Pipeline::slot_ack`]), and with no
//! live lane at all, as far as anything was sealed: WAL retained by the slot is bounded by
//! configuration, never by the length of an outage.
//!
//! Order within a lane holds because its parts travel on one connection and each carries
//! the lane's fence (the last id sealed before it in that shard): the script refuses a part
//! whose predecessor did not land. A lane whose oldest part failed transiently abandons what
//! it has in flight (whatever of it ran is idempotent) and sends its parts again, one at a
//! time, after a backoff. A fence refusal of a lane's oldest part, whose predecessors all
//! confirmed, means the shard lost entries: the lane falls behind, and its catch-up finds out
//! what is missing.
//!
//! A transaction is in the WAL, and so sent by the slot, a moment before snapshots show it
//! (Postgres writes the commit record, waits for a synchronous standby, and only then marks
//! it visible; with a standby down, for as long as that lasts). A catch-up judges what a shard
//! lacks by snapshots, so a transaction a lane dropped must be visible before its shard's
//! catch-up hands over, and must come again if the session ends first. The pipeline keeps
//! the transactions its behind lanes dropped or captured that no watermark has shown yet
//! ([`Pipeline::unseen`]), by shard: the slot is acknowledged below the oldest of them (a new
//! session receives it again), and a hand-over waits until its last snapshot shows those of
//! its shards. (A commit held for long by a synchronous standby holds the slot as long.)

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use outbox_core::stream::EntryId;
use pgwire_replication::Lsn;
use tokio::time::Instant;
use tracing::{info, warn};

use super::batch::{Batch, StreamEntry, PG_EPOCH_OFFSET_MICROS};
use super::lane::{BehindReason, Capture, InFlight, Lane, Part, State, MAX_IN_FLIGHT};
use super::publisher::{PartMeta, PublishOutcome, Publisher};
use crate::config::LaneLimits;
use crate::context::SharedContext;
use crate::error::RelayError;
use crate::source::{Origin, Watermark, Watermarks};

/// What Redis confirmed: one part of one shard.
pub(crate) struct Confirmed {
    pub(crate) shard: u32,
    pub(crate) outcome: PublishOutcome,
    pub(crate) entries: usize,
    /// Commit times of the transactions with entries in the part.
    pub(crate) commit_times_micros: Vec<i64>,
}

/// What the pipeline has to say.
pub(crate) enum Event {
    Confirmed(Confirmed),
    /// A lane fell behind: the slot no longer waits for it. `consumed`: a watermark every
    /// row of which its groups had acknowledged.
    Behind {
        shard: u32,
        reason: BehindReason,
        consumed: Option<Arc<Watermark>>,
    },
}

/// What sealing a batch did besides queueing it.
#[derive(Default)]
pub(crate) struct Sealed {
    /// Lanes that fell behind (their queue passed the byte bound), with what their groups
    /// had consumed.
    pub(crate) behind: Vec<(u32, Option<Arc<Watermark>>)>,
    /// Lanes whose capture passed the byte bound and was dropped: their hand-over fails.
    pub(crate) capture_lost: Vec<u32>,
}

/// What one lane's turn of [`Pipeline::next_event`] came to.
enum Turn {
    Retry(usize),
    Overdue(usize),
    Done(usize, Result<PublishOutcome, RelayError>),
}

pub(crate) struct Pipeline {
    publisher: Publisher,
    origin: Origin,
    ctx: SharedContext,
    lanes: Vec<Lane>,
    limits: LaneLimits,
    watermarks: Watermarks,
    /// The highest acknowledgement sealed so far.
    sealed_ack: Option<Lsn>,
    /// Transactions whose entries a lane dropped or captured and no watermark has shown yet,
    /// by commit LSN and shard (their 32-bit xid; see the module doc).
    unseen: BTreeMap<(Lsn, u32), u32>,
    /// The watermark (its `hi`) `unseen` was last pruned with.
    pruned_with: Option<Lsn>,
}

/// Dropped transactions no watermark has shown yet, at most: more means the watermarks
/// stopped (their connection fails) while lanes drop; the session starts again.
pub(crate) const MAX_UNSEEN: usize = 250_000;

impl Pipeline {
    /// `fences`: each shard's top when the session decided to stream (a shard's first part
    /// is refused (GAP) if Redis no longer holds it). `behind`: the shards that start behind.
    /// `held`: each live shard's recorded watermark (replays of what it shows are not sent).
    pub(crate) fn new(
        publisher: Publisher,
        origin: Origin,
        ctx: SharedContext,
        fences: Vec<Option<EntryId>>,
        held: Vec<Option<Watermark>>,
        behind: &[u32],
        watermarks: Watermarks,
    ) -> Self {
        let max_backoff = ctx.config.reconnect_max_backoff;
        let limits = ctx.config.lanes;
        let mut held = held.into_iter();
        let lanes = fences
            .into_iter()
            .enumerate()
            .map(|(shard, fence)| {
                let mut lane = Lane::new(shard as u32, fence, max_backoff);
                lane.held = held.next().flatten();
                lane.held_from_micros = None;
                if behind.contains(&(shard as u32)) {
                    lane.fall_behind();
                }
                lane
            })
            .collect();
        Self {
            publisher,
            origin,
            ctx,
            lanes,
            limits,
            watermarks,
            sealed_ack: None,
            unseen: BTreeMap::new(),
            pruned_with: None,
        }
    }

    /// A new batch may be sealed now: every healthy lane is idle, or the batch is full and
    /// every healthy lane has room for one more call. A lone message goes out at once; a
    /// burst rides in full batches; in between, batches grow while calls are in flight
    /// (each costs an fsync, so fewer, larger calls go faster). Lanes that fail, or confirm
    /// slowly (a call waiting longer than [`SLOW_LANE`](super::lane::SLOW_LANE)), do not hold sealing back: they
    /// queue, bounded in bytes, and fall behind; nor do behind ones. One slow shard never
    /// sets the pace of the others.
    pub(crate) fn has_room_for(&self, batch_full: bool) -> bool {
        let now = Instant::now();
        // Lanes that may not fall behind (tableless events) set the pace, failing or not:
        // what they cannot confirm stays in the slot, and reading waits for them.
        let may_fall_behind = self.limits.may_fall_behind;
        let healthy: Vec<&Lane> = self
            .lanes
            .iter()
            .filter(|l| {
                if may_fall_behind {
                    l.healthy() && !l.slow(now)
                } else {
                    l.is_live()
                }
            })
            .collect();
        healthy.iter().all(|l| l.is_idle())
            || (batch_full
                && healthy
                    .iter()
                    .all(|l| l.in_flight.len() < MAX_IN_FLIGHT && l.queued.is_empty()))
    }

    /// Nothing sealed for a live lane is unconfirmed.
    pub(crate) fn is_idle(&self) -> bool {
        self.lanes.iter().all(Lane::is_idle)
    }

    /// Every live lane that confirms is idle (what a stop waits for).
    pub(crate) fn healthy_idle(&self) -> bool {
        self.lanes.iter().filter(|l| l.healthy()).all(Lane::is_idle)
    }

    /// Where the slot may be acknowledged: the least acknowledgement every live lane's
    /// record holds, or, with no live lane, whatever was sealed (nothing waits for Redis).
    /// Never past a dropped transaction no snapshot shows yet: the next session must receive
    /// it again.
    pub(crate) fn slot_ack(&mut self) -> Option<Lsn> {
        self.prune_unseen();
        let mut live = self.lanes.iter().filter(|l| l.is_live()).peekable();
        let ack = if live.peek().is_none() {
            self.sealed_ack
        } else {
            live.map(|l| l.acked).min()
        }?;
        let ack = match self.unseen.first_key_value() {
            Some(((oldest, _), _)) => ack.min(*oldest),
            None => ack,
        };
        // Never past a tableless entry a behind lane keeps: nothing else could send it again.
        let id_offset = self.publisher.id_offset();
        Some(
            self.lanes
                .iter()
                .filter_map(|l| l.oldest_message(id_offset))
                .fold(ack, Lsn::min),
        )
    }

    /// A behind lane that keeps more tableless entries than `--lane-max-bytes` allows
    /// (reading waits until it is live again).
    pub(crate) fn messages_overflow(&self) -> Option<u32> {
        self.lanes
            .iter()
            .find(|l| l.messages_bytes > self.limits.max_bytes)
            .map(|l| l.shard)
    }

    /// The xids of the transactions of `shards` dropped that no watermark has shown yet
    /// (what a hand-over's last snapshot must show).
    pub(crate) fn unseen(&mut self, shards: &[u32]) -> Vec<u32> {
        self.prune_unseen();
        self.unseen
            .iter()
            .filter(|((_, shard), _)| shards.contains(shard))
            .map(|(_, xid)| *xid)
            .collect()
    }

    /// How many dropped transactions no watermark has shown yet.
    pub(crate) fn unseen_count(&self) -> usize {
        self.unseen.len()
    }

    /// Remember the transactions of `entries`, which a lane drops.
    fn note_dropped<'e>(
        unseen: &mut BTreeMap<(Lsn, u32), u32>,
        id_offset: u64,
        entries: impl IntoIterator<Item = &'e StreamEntry>,
    ) {
        for e in entries {
            // Entries a catch-up read from the table carry no xid, and never pass here.
            if e.xid != 0 {
                let commit = Lsn(e.id.commit_lsn.saturating_sub(id_offset));
                unseen.insert((commit, e.shard), e.xid);
            }
        }
    }

    /// Forget the dropped transactions the newest watermark shows: every later snapshot shows
    /// them too.
    fn prune_unseen(&mut self) {
        if self.unseen.is_empty() {
            return;
        }
        let Some(newest) = self.watermarks.newest() else {
            return;
        };
        if self.pruned_with == Some(newest.hi) {
            return;
        }
        self.pruned_with = Some(newest.hi);
        let snapshot = &newest.snapshot;
        self.unseen
            .retain(|_, xid| !snapshot.visible(snapshot.widen(*xid)));
    }

    /// The highest acknowledgement any live lane's record holds (what a stop tells the
    /// others).
    pub(crate) fn newest_ack(&self) -> Option<Lsn> {
        self.lanes
            .iter()
            .filter(|l| l.is_live())
            .map(|l| l.acked)
            .max()
    }

    /// Bytes held by every lane.
    pub(crate) fn held_bytes(&self) -> usize {
        self.lanes.iter().map(Lane::held_bytes).sum()
    }

    /// Seal `batch` into its shards' lanes; `ack_all`: every live shard records its
    /// acknowledgement, not only those it writes.
    pub(crate) fn send(&mut self, batch: Batch, ack_all: bool) -> Sealed {
        let ack_lsn = batch.ack_lsn;
        if let Some(ack) = ack_lsn {
            self.sealed_ack = Some(self.sealed_ack.map_or(ack, |a| a.max(ack)));
        }
        let mut parts: Vec<Vec<StreamEntry>> = (0..self.lanes.len()).map(|_| Vec::new()).collect();
        for entry in batch.entries {
            parts[entry.shard as usize].push(entry);
        }
        let mut sealed = Sealed::default();
        let mut memory = Vec::new();
        let id_offset = self.publisher.id_offset();
        for (k, mut entries) in parts.into_iter().enumerate() {
            let lane = &mut self.lanes[k];
            if lane.is_live() {
                let held = lane.drop_held(&mut entries, ack_lsn, id_offset);
                self.ctx
                    .metrics
                    .duplicates_rejected_total
                    .inc_by(held as u64);
                if entries.is_empty() && !(ack_all && ack_lsn.is_some()) {
                    continue;
                }
                let watermark =
                    ack_lsn.and_then(|ack| attach_watermark(&self.watermarks, lane, ack));
                let meta = PartMeta {
                    ack_lsn,
                    fence: lane.last_sealed,
                    watermark,
                    rejoin: false,
                    ..PartMeta::default()
                };
                lane.push(Part::new(entries, meta));
                let held = lane.held_bytes();
                if self.limits.may_fall_behind
                    && (lane.failing || lane.slow(Instant::now()))
                    && held > self.limits.max_bytes
                {
                    memory.push((k as u32, BehindReason::Memory(held)));
                }
                continue;
            }
            // Behind: tableless entries are kept until it is live again (no table holds
            // them); rows are kept while a catch-up hands over, otherwise still in the
            // outbox table, which its catch-up publishes.
            lane.keep_messages(entries.iter());
            entries.retain(|e| !e.tableless);
            // Noted whether dropped or captured: until a snapshot shows them, the slot must
            // not pass them (a session ending first would never see them again). So a
            // capture dropped later (lost, abandoned, left over) needs no note of its own.
            Self::note_dropped(&mut self.unseen, self.publisher.id_offset(), &entries);
            if let State::Behind {
                capture: Some(capture),
            } = &mut lane.state
            {
                capture.bytes += entries.iter().map(StreamEntry::bytes).sum::<usize>();
                capture.entries.extend(entries);
                if capture.bytes > self.limits.max_bytes {
                    lane.state = State::Behind { capture: None };
                    sealed.capture_lost.push(k as u32);
                }
            }
        }
        for (shard, reason) in memory {
            let consumed = self.fall_behind(shard, &reason);
            sealed.behind.push((shard, consumed));
        }
        self.pump();
        sealed
    }

    /// The lanes of `shards` keep what is sealed for them from now on (a catch-up is about
    /// to take its last snapshot).
    pub(crate) fn start_capture(&mut self, shards: &[u32]) {
        for &k in shards {
            let lane = &mut self.lanes[k as usize];
            if let State::Behind { capture } = &mut lane.state {
                // A capture left over is dropped (its transactions were noted when captured).
                *capture = Some(Capture {
                    entries: Vec::new(),
                    bytes: 0,
                });
            }
        }
    }

    /// Drop what the lanes of `shards` captured (their catch-up goes on, or gave up).
    pub(crate) fn abandon_capture(&mut self, shards: &[u32]) {
        for &k in shards {
            let lane = &mut self.lanes[k as usize];
            if let State::Behind { capture } = &mut lane.state {
                *capture = None;
            }
        }
    }

    /// `shard`'s catch-up is done: its stream holds every row `watermark` shows, its last id
    /// is `top`, and its record holds `watermark`. The lane turns live with what it captured
    /// that the watermark does not show (those transactions committed after its snapshot),
    /// and drops what the watermark shows when the slot delivers it later (see `Lane::held`),
    /// its record counted as holding `acked` (the slot's acknowledged position: everything
    /// below it is either shown by the watermark or captured). `false`: its capture was lost
    /// (it stays behind, and the catch-up goes on).
    pub(crate) fn rejoin(
        &mut self,
        shard: u32,
        top: Option<EntryId>,
        watermark: Arc<Watermark>,
        acked: Lsn,
    ) -> bool {
        let lane = &mut self.lanes[shard as usize];
        if matches!(lane.state, State::Live) {
            // Live already (a hand-over repeated after an error): nothing to change.
            return true;
        }
        let State::Behind {
            capture: Some(capture),
        } = std::mem::replace(&mut lane.state, State::Live)
        else {
            lane.state = State::Behind { capture: None };
            return false;
        };
        lane.last_sealed = top;
        lane.first_live_id = top;
        lane.acked = acked;
        lane.failing = false;
        lane.last_error = None;
        lane.watermark_floor = watermark.hi;
        let snapshot = &watermark.snapshot;
        lane.watermark_sealed = Some(watermark.clone());
        // The snapshot may show transactions the relay has not received yet (its stream of
        // the slot lags the server): the catch-up published them, so when they arrive they
        // are dropped, not written again under their live ids. It shows everything an older
        // held watermark did.
        lane.held = Some((*watermark).clone());
        // Rows the services may have deleted by then are not taken for published (see
        // `Lane::held_from_micros`): half the retention before the snapshot, by the
        // server's clock, in the Postgres epoch the commit times are in.
        let half_retention = (self.ctx.config.outbox_retention / 2).as_micros() as i64;
        lane.held_from_micros =
            Some(watermark.taken_at_micros - PG_EPOCH_OFFSET_MICROS - half_retention);
        let mut released: Vec<StreamEntry> = capture
            .entries
            .into_iter()
            .filter(|e| !snapshot.visible(snapshot.widen(e.xid)))
            .collect();
        // With the tableless entries kept while behind, in id (commit) order: all of them
        // above the catch-up's top, which continues the stream's top from before.
        released.append(&mut lane.messages);
        lane.messages_bytes = 0;
        released.sort_by_key(|e| e.id);
        released.dedup_by_key(|e| e.id);
        if !released.is_empty() {
            let meta = PartMeta {
                ack_lsn: self.sealed_ack,
                fence: lane.last_sealed,
                watermark: None,
                rejoin: false,
                ..PartMeta::default()
            };
            lane.push(Part::new(released, meta));
        }
        info!(shard, stream = %self.publisher.shard_stream(shard), "shard caught up from the outbox table; live again");
        self.pump();
        true
    }

    /// Start what each live lane may send now.
    fn pump(&mut self) {
        let now = Instant::now();
        let limits = self.limits.batch;
        for lane in &mut self.lanes {
            if !lane.is_live() {
                continue;
            }
            loop {
                if lane.retry_at.is_some_and(|at| at > now) {
                    break;
                }
                let room = if lane.failing {
                    lane.in_flight.is_empty()
                } else {
                    lane.in_flight.is_empty()
                        || (lane.in_flight.len() < MAX_IN_FLIGHT
                            && lane.queued.iter().map(|p| p.entries.len()).sum::<usize>()
                                >= limits.max_entries)
                };
                if !room {
                    break;
                }
                let Some(mut part) = lane.take_next(limits.max_entries, limits.max_bytes) else {
                    break;
                };
                part.first_sent.get_or_insert(now);
                let part = Arc::new(part);
                let task = tokio::spawn(publish_once(
                    self.publisher.clone(),
                    lane.shard,
                    part.clone(),
                    self.origin.clone(),
                    self.ctx.clone(),
                ));
                lane.in_flight.push_back(InFlight { part, task });
            }
        }
    }

    /// The next thing a lane has to say: a part Redis confirmed (in sealing order within its
    /// shard), or a lane that fell behind. Transient failures are handled here (per lane:
    /// backoff, then everything unconfirmed is sent again); only errors that end the session
    /// come out. Cancel-safe: state changes only between awaits.
    pub(crate) async fn next_event(&mut self) -> Result<Event, RelayError> {
        loop {
            self.pump();
            let detach_after = self.limits.detach_after;
            let may_fall_behind = self.limits.may_fall_behind;
            let turn = {
                let mut turns: Vec<Pin<Box<dyn Future<Output = Turn> + Send + '_>>> = Vec::new();
                for (k, lane) in self.lanes.iter_mut().enumerate() {
                    if !lane.is_live() {
                        continue;
                    }
                    if let Some(since) = lane.unconfirmed_since().filter(|_| may_fall_behind) {
                        turns.push(Box::pin(async move {
                            tokio::time::sleep_until(since + detach_after).await;
                            Turn::Overdue(k)
                        }));
                    }
                    if let Some(at) = lane.retry_at {
                        turns.push(Box::pin(async move {
                            tokio::time::sleep_until(at).await;
                            Turn::Retry(k)
                        }));
                    } else if let Some(head) = lane.in_flight.front_mut() {
                        turns.push(Box::pin(async move {
                            let joined = (&mut head.task).await;
                            Turn::Done(
                                k,
                                joined.unwrap_or_else(|e| {
                                    Err(RelayError::Protocol(format!("publish task failed: {e}")))
                                }),
                            )
                        }));
                    }
                }
                if turns.is_empty() {
                    return std::future::pending().await;
                }
                futures::future::select_all(turns).await.0
            };
            match turn {
                Turn::Retry(k) => self.lanes[k].retry_at = None,
                Turn::Overdue(k) => {
                    let lane = &self.lanes[k];
                    let waited = lane.unconfirmed_since().map(|s| s.elapsed());
                    if waited.is_some_and(|w| w >= detach_after) {
                        let why = lane.last_error.clone().unwrap_or_else(|| {
                            format!("no answer for {:?}", waited.unwrap_or_default())
                        });
                        let reason = BehindReason::Failing(why);
                        let consumed = self.fall_behind(k as u32, &reason);
                        return Ok(Event::Behind {
                            shard: k as u32,
                            reason,
                            consumed,
                        });
                    }
                }
                Turn::Done(k, result) => {
                    if let Some(event) = self.on_done(k, result)? {
                        return Ok(event);
                    }
                }
            }
        }
    }

    /// A lane's oldest call finished: its confirmation, the lane falling behind, or `None`
    /// when it is sent again.
    fn on_done(
        &mut self,
        k: usize,
        result: Result<PublishOutcome, RelayError>,
    ) -> Result<Option<Event>, RelayError> {
        let lane = &mut self.lanes[k];
        let head = lane.in_flight.pop_front().expect("a head finished");
        let behind = |reason: BehindReason, this: &mut Self| {
            // The refused head is no longer in flight: its transactions are dropped too.
            let id_offset = this.publisher.id_offset();
            Self::note_dropped(&mut this.unseen, id_offset, &head.part.entries);
            // Its tableless entries first: they are older than those in flight after it.
            this.lanes[k].keep_messages(head.part.entries.iter());
            let consumed = this.fall_behind(k as u32, &reason);
            Ok(Some(Event::Behind {
                shard: k as u32,
                reason,
                consumed,
            }))
        };
        match result {
            Ok(outcome) => {
                lane.backoff.reset();
                lane.failing = false;
                lane.last_error = None;
                if let Some(ack) = head.part.meta.ack_lsn {
                    lane.acked = lane.acked.max(ack);
                }
                if let Some(below) = outcome.acked_below {
                    // Every row committed before the returned id's LSN was consumed, once the
                    // id lies past everything older than this live stretch.
                    if Some(below) > lane.first_live_id {
                        let lsn = below.commit_lsn.saturating_sub(self.publisher.id_offset());
                        if let Some(w) = self.watermarks.covered_by(Lsn(lsn), Lsn(0)) {
                            lane.consumed = Some(w);
                        }
                    }
                }
                if self.lanes.iter().all(Lane::healthy) {
                    self.ctx.set_redis_reachable(true);
                }
                let mut commit_times_micros: Vec<i64> = Vec::new();
                let mut last_commit = None;
                for entry in &head.part.entries {
                    if let Some(span) = &entry.span {
                        span.end();
                    }
                    if last_commit != Some(entry.id.commit_lsn) && entry.commit_time_micros > 0 {
                        commit_times_micros.push(entry.commit_time_micros);
                    }
                    last_commit = Some(entry.id.commit_lsn);
                }
                Ok(Some(Event::Confirmed(Confirmed {
                    shard: k as u32,
                    outcome,
                    entries: head.part.entries.len(),
                    commit_times_micros,
                })))
            }
            // A fence refusal of a part whose predecessors all confirmed: either one of its
            // lane's calls overtook another on the way (sent again at once), or the shard
            // lost entries (refused again: it falls behind, and its catch-up finds out).
            Err(RelayError::StreamBehind { .. }) if !head.part.gap_retried => {
                warn!(
                    shard = lane.shard,
                    "a part reached its shard before its predecessor; sending both again in order"
                );
                lane.send_again_after_gap(head.part);
                Ok(None)
            }
            Err(e @ (RelayError::StreamBehind { .. } | RelayError::RecordMissing { .. })) => {
                behind(BehindReason::Lost(e.to_string()), self)
            }
            Err(RelayError::StreamFull { detail, .. }) if self.limits.may_fall_behind => {
                behind(BehindReason::Full(detail), self)
            }
            // Not allowed to fall behind: a full stream is waited out like a failure (its
            // groups read, the trim makes room), holding the slot meanwhile.
            Err(e) if e.retry_in_place() || matches!(e, RelayError::StreamFull { .. }) => {
                if !matches!(e, RelayError::StreamFull { .. }) {
                    self.ctx.metrics.redis_errors_total.inc();
                    self.ctx.set_redis_reachable(false);
                }
                self.ctx.set_last_error(Some(e.to_string()));
                lane.failing = true;
                lane.last_error = Some(e.to_string());
                lane.send_again_from(head.part);
                let delay = lane.backoff.next_delay();
                warn!(error = %e, shard = lane.shard, queued_bytes = lane.queued_bytes, retry_in = ?delay, "publish failed; this shard sends again, the others go on");
                lane.retry_at = Some(Instant::now() + delay);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn fall_behind(&mut self, shard: u32, reason: &BehindReason) -> Option<Arc<Watermark>> {
        let lane = &mut self.lanes[shard as usize];
        let queued = lane.queued.iter().flat_map(|p| p.entries.iter());
        let in_flight = lane.in_flight.iter().flat_map(|f| f.part.entries.iter());
        Self::note_dropped(
            &mut self.unseen,
            self.publisher.id_offset(),
            queued.chain(in_flight),
        );
        warn!(shard, stream = %self.publisher.shard_stream(shard), %reason, "shard falls behind: the slot no longer waits for it, and its rows are published from the outbox table once it accepts them");
        let consumed = lane.fall_behind();
        self.ctx
            .metrics
            .shards_fell_behind_total
            .with_label_values(&[reason.label()])
            .inc();
        consumed
    }

    /// Stop sending to lanes that cannot confirm (a stop does not wait for them: the slot
    /// stays at what they recorded, and the next session sends it again).
    pub(crate) fn drop_failing(&mut self) {
        for lane in self.lanes.iter_mut().filter(|l| l.is_live() && l.failing) {
            lane.drop_unconfirmed();
        }
    }

    /// An acknowledgement-only part to every live lane that confirms and whose record holds
    /// less than `ack` (a stop brings them level, so the slot can move to the newest).
    pub(crate) fn acknowledge_healthy(&mut self, ack: Lsn) {
        for lane in self
            .lanes
            .iter_mut()
            .filter(|l| l.healthy() && l.acked < ack)
        {
            let meta = PartMeta {
                ack_lsn: Some(ack),
                fence: lane.last_sealed,
                watermark: attach_watermark(&self.watermarks, lane, ack),
                rejoin: false,
                ..PartMeta::default()
            };
            lane.push(Part::new(Vec::new(), meta));
        }
        self.pump();
    }

    /// Abandon everything in flight (on a session error, or at the end of a stop).
    pub(crate) fn abort(&mut self) {
        for lane in &mut self.lanes {
            lane.drop_unconfirmed();
        }
    }
}

/// The watermark a part acknowledging `ack` records in `lane`'s shard: the newest one the
/// acknowledgement covers and the lane may record, when newer than what it holds.
fn attach_watermark(watermarks: &Watermarks, lane: &mut Lane, ack: Lsn) -> Option<Arc<Watermark>> {
    let candidate = watermarks.covered_by(ack, lane.watermark_floor)?;
    if lane
        .watermark_sealed
        .as_ref()
        .is_some_and(|w| w.hi >= candidate.hi)
    {
        return None;
    }
    lane.watermark_sealed = Some(candidate.clone());
    Some(candidate)
}

async fn publish_once(
    mut publisher: Publisher,
    shard: u32,
    part: Arc<Part>,
    origin: Origin,
    ctx: SharedContext,
) -> Result<PublishOutcome, RelayError> {
    let started = std::time::Instant::now();
    let entries: Vec<&StreamEntry> = part.entries.iter().collect();
    let outcome = publisher
        .publish_part(shard as usize, &entries, &part.meta, &origin)
        .await?;
    ctx.metrics
        .publish_batch_duration_seconds
        .observe(started.elapsed().as_secs_f64());
    Ok(outcome)
}
