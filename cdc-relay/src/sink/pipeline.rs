//! The ordered publish pipeline: one lane per shard. A sealed batch splits into one part per
//! shard it writes (and an acknowledgement-only part for every other shard when it carries
//! the acknowledgement to all); each lane sends its parts strictly in order, up to two in
//! flight, and confirms them in that order. Lanes are independent: a shard that cannot
//! confirm (a WAIT that falls short, a node down, a refusal) holds back its own chats only,
//! while the others keep flowing, and the slot stays at the least that every shard's record
//! acknowledged.
//!
//! Order within a lane holds because its parts travel on one connection and each carries
//! the lane's fence (the last id sealed before it in that shard): the script refuses a part
//! whose predecessor did not land. A lane whose oldest part failed transiently abandons what
//! it has in flight (whatever of it ran is idempotent) and sends its parts again, one at a
//! time, after a backoff. A fence refusal of a lane's oldest part, whose predecessors all
//! confirmed, means the shard lost entries: it ends the session, and the next one rebuilds.
//!
//! Memory stays bounded: while a lane is failing, it queues at most [`LANE_MAX_BATCHES`]
//! batches' worth of entries. Past that it drops what it queued and every later part (they are still in the
//! slot, which is acknowledged only behind this lane), and once it confirms again the
//! session ends so that the next one reads them again (the other lanes' entries come again
//! too, and Redis rejects them by id). While every lane fails, nothing more is sealed: the
//! session stops reading the slot instead.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::backoff::Backoff;
use outbox_core::stream::EntryId;
use pgwire_replication::Lsn;
use tokio::task::JoinHandle;
use tracing::warn;

use super::batch::{Batch, StreamEntry};
use super::publisher::{PublishOutcome, Publisher};
use crate::config::BatchLimits;
use crate::context::SharedContext;
use crate::error::RelayError;
use crate::source::Origin;

/// Calls one lane may have in flight at once.
const MAX_IN_FLIGHT: usize = 2;
/// Entries a failing lane keeps queued at most, in batches of the limit (`--batch-max-
/// entries`), before it drops them (to be read again).
const LANE_MAX_BATCHES: usize = 10;
/// How long a lane sends again in place before it ends the session: the next one connects
/// afresh (a cluster's moved or new nodes, a connection gone bad) and reads the slot again.
const LANE_GIVE_UP: Duration = Duration::from_secs(30);

/// One shard's share of one or more sealed batches, sent as one call.
struct Part {
    entries: Vec<StreamEntry>,
    /// Recorded in the shard's record once the part is confirmed.
    ack_lsn: Option<Lsn>,
    /// The last id sealed into the shard before this part.
    fence: Option<EntryId>,
    /// Refused by a fence once already (see [`Pipeline::confirmed`]).
    gap_retried: bool,
}

impl Part {
    /// `next` appended (both of one lane, `next` sealed right after `self`).
    fn absorb(&mut self, next: Part) {
        self.entries.extend(next.entries);
        if next.ack_lsn.is_some() {
            self.ack_lsn = next.ack_lsn;
        }
    }
}

/// What Redis confirmed: one part of one shard.
pub(crate) struct Confirmed {
    pub(crate) shard: u32,
    /// The shard's record holds this acknowledgement now.
    pub(crate) ack_lsn: Option<Lsn>,
    pub(crate) outcome: PublishOutcome,
    pub(crate) entries: usize,
    /// Commit times of the transactions with entries in the part.
    pub(crate) commit_times_micros: Vec<i64>,
}

struct InFlight {
    part: Arc<Part>,
    task: JoinHandle<Result<PublishOutcome, RelayError>>,
}

/// One shard's parts, in sealing order.
struct Lane {
    shard: u32,
    /// Sealed and not sent yet (parts to send again come back to its front).
    queued: VecDeque<Part>,
    queued_entries: usize,
    in_flight: VecDeque<InFlight>,
    /// While set, this lane sends nothing before it (a backoff after a failure).
    retry_at: Option<tokio::time::Instant>,
    backoff: Backoff,
    /// The last id sealed into this lane so far.
    last_sealed: Option<EntryId>,
    /// The oldest part failed and is being sent again: one call at a time until one is
    /// confirmed, and this lane does not hold back sealing.
    failing: bool,
    /// When the current run of failures began.
    failing_since: Option<Instant>,
    /// Parts were dropped (see the module doc): the session must read them again.
    dropped: bool,
}

impl Lane {
    fn is_idle(&self) -> bool {
        self.in_flight.is_empty()
            && self.queued.is_empty()
            && self.retry_at.is_none()
            && !self.dropped
    }

    fn healthy(&self) -> bool {
        !self.failing && !self.dropped
    }

    fn push(&mut self, part: Part, limits: &BatchLimits) {
        if self.dropped {
            return;
        }
        if let Some(last) = part.entries.last() {
            self.last_sealed = Some(last.id);
        }
        self.queued_entries += part.entries.len();
        self.queued.push_back(part);
        if self.failing && self.queued_entries > LANE_MAX_BATCHES * limits.max_entries {
            warn!(
                shard = self.shard,
                queued = self.queued_entries,
                "a shard that cannot confirm holds too much: dropping what it queued (still in the slot, read again once the shard confirms)"
            );
            // The oldest part stays: it is what the lane sends again (when nothing is in
            // flight), and its confirmation is what tells the session to read the rest again.
            self.queued.truncate(1);
            self.queued_entries = self.queued.front().map_or(0, |p| p.entries.len());
            self.dropped = true;
        }
    }

    /// The next part to send: what is queued, merged into one call up to the batch limit
    /// (a lane that caught up after a failure sends its backlog in few calls).
    fn take_next(&mut self, limits: &BatchLimits) -> Option<Part> {
        let mut part = self.queued.pop_front()?;
        while let Some(next) = self.queued.front() {
            if part.entries.len() + next.entries.len() > limits.max_entries {
                break;
            }
            let next = self.queued.pop_front().expect("front exists");
            part.absorb(next);
        }
        self.queued_entries -= part.entries.len();
        Some(part)
    }

    /// Queue the oldest part in flight and every later one to be sent again, in order: later
    /// ones may have run or been refused by their fence, so their tasks are abandoned.
    fn send_again_from(&mut self, head: Arc<Part>) {
        let mut again = vec![head];
        for later in self.in_flight.drain(..) {
            later.task.abort();
            again.push(later.part);
        }
        for part in again.into_iter().rev() {
            // The task that held the other reference is done or aborted.
            let part = Arc::try_unwrap(part).unwrap_or_else(|shared| Part {
                entries: shared.entries.clone(),
                ack_lsn: shared.ack_lsn,
                fence: shared.fence,
                gap_retried: shared.gap_retried,
            });
            self.queued_entries += part.entries.len();
            self.queued.push_front(part);
        }
    }
}

/// What one lane's turn of [`Pipeline::confirmed`] came to.
enum Event {
    Retry(usize),
    Done(usize, Result<PublishOutcome, RelayError>),
}

pub(crate) struct Pipeline {
    publisher: Publisher,
    origin: Origin,
    ctx: SharedContext,
    lanes: Vec<Lane>,
    limits: BatchLimits,
}

impl Pipeline {
    /// `fences`: each shard's top when the session decided to stream. A shard's first part
    /// is refused (GAP) if Redis no longer holds it, e.g. after failing over to a stale
    /// replica between the session's start and its first call.
    pub(crate) fn new(
        publisher: Publisher,
        origin: Origin,
        ctx: SharedContext,
        fences: Vec<Option<EntryId>>,
    ) -> Self {
        let max_backoff = ctx.config.reconnect_max_backoff;
        let limits = ctx.config.batch;
        let lanes = fences
            .into_iter()
            .enumerate()
            .map(|(shard, fence)| Lane {
                shard: shard as u32,
                queued: VecDeque::new(),
                queued_entries: 0,
                in_flight: VecDeque::new(),
                retry_at: None,
                backoff: Backoff::new(Duration::from_millis(50), max_backoff),
                last_sealed: fence,
                failing: false,
                failing_since: None,
                dropped: false,
            })
            .collect();
        Self {
            publisher,
            origin,
            ctx,
            lanes,
            limits,
        }
    }

    /// A new batch may be sealed now: every healthy lane is idle, or the batch is full and
    /// every healthy lane has room for one more call. A lone message goes out at once; a
    /// burst rides in full batches; in between, batches grow while calls are in flight
    /// (each costs an fsync, so fewer, larger calls go faster). Failing lanes do not hold
    /// sealing back (they queue, bounded), unless every lane fails: then the session stops
    /// reading the slot.
    pub(crate) fn has_room_for(&self, batch_full: bool) -> bool {
        let mut healthy = self.lanes.iter().filter(|l| l.healthy()).peekable();
        if healthy.peek().is_none() {
            return false;
        }
        let lanes: Vec<&Lane> = healthy.collect();
        lanes.iter().all(|l| l.is_idle())
            || (batch_full
                && lanes
                    .iter()
                    .all(|l| l.in_flight.len() < MAX_IN_FLIGHT && l.queued.is_empty()))
    }

    /// Nothing sealed is unconfirmed.
    pub(crate) fn is_idle(&self) -> bool {
        self.lanes.iter().all(Lane::is_idle)
    }

    /// Seal `batch` into its shards' lanes; `ack_all`: every shard records its
    /// acknowledgement, not only those it writes.
    pub(crate) fn send(&mut self, batch: Batch, ack_all: bool) {
        let ack_lsn = batch.ack_lsn;
        let mut parts: Vec<Vec<StreamEntry>> = (0..self.lanes.len()).map(|_| Vec::new()).collect();
        for entry in batch.entries {
            parts[entry.shard as usize].push(entry);
        }
        for (lane, entries) in self.lanes.iter_mut().zip(parts) {
            if entries.is_empty() && !(ack_all && ack_lsn.is_some()) {
                continue;
            }
            let fence = lane.last_sealed;
            lane.push(
                Part {
                    entries,
                    ack_lsn,
                    fence,
                    gap_retried: false,
                },
                &self.limits,
            );
        }
        self.pump();
    }

    /// Start what each lane may send now.
    fn pump(&mut self) {
        let now = tokio::time::Instant::now();
        for k in 0..self.lanes.len() {
            loop {
                let lane = &mut self.lanes[k];
                if lane.retry_at.is_some_and(|at| at > now) {
                    break;
                }
                let room = if lane.failing {
                    lane.in_flight.is_empty()
                } else {
                    lane.in_flight.is_empty()
                        || (lane.in_flight.len() < MAX_IN_FLIGHT
                            && lane.queued_entries >= self.limits.max_entries)
                };
                if !room {
                    break;
                }
                let Some(part) = lane.take_next(&self.limits) else {
                    break;
                };
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

    /// The next part Redis confirmed, in sealing order within its shard. Transient failures
    /// are handled here (per lane: backoff, then everything unconfirmed is sent again); only
    /// permanent errors come out, and the news that a lane dropped parts once it confirms
    /// again. Cancel-safe: state changes only between awaits.
    pub(crate) async fn confirmed(&mut self) -> Result<Confirmed, RelayError> {
        loop {
            self.pump();
            let event = {
                let mut turns: Vec<Pin<Box<dyn Future<Output = Event> + Send + '_>>> = Vec::new();
                for (k, lane) in self.lanes.iter_mut().enumerate() {
                    if let Some(at) = lane.retry_at {
                        turns.push(Box::pin(async move {
                            tokio::time::sleep_until(at).await;
                            Event::Retry(k)
                        }));
                    } else if let Some(head) = lane.in_flight.front_mut() {
                        turns.push(Box::pin(async move {
                            let joined = (&mut head.task).await;
                            Event::Done(
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
            match event {
                Event::Retry(k) => self.lanes[k].retry_at = None,
                Event::Done(k, result) => {
                    if let Some(confirmed) = self.on_done(k, result)? {
                        return Ok(confirmed);
                    }
                }
            }
        }
    }

    /// A lane's oldest call finished: its confirmation, or `None` when it is sent again.
    fn on_done(
        &mut self,
        k: usize,
        result: Result<PublishOutcome, RelayError>,
    ) -> Result<Option<Confirmed>, RelayError> {
        let lane = &mut self.lanes[k];
        let head = lane.in_flight.pop_front().expect("a head finished");
        match result {
            Ok(outcome) => {
                lane.backoff.reset();
                lane.failing = false;
                lane.failing_since = None;
                if lane.dropped {
                    return Err(RelayError::ShardDropped {
                        stream: self.publisher.shard_stream(lane.shard).to_string(),
                    });
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
                Ok(Some(Confirmed {
                    shard: k as u32,
                    ack_lsn: head.part.ack_lsn,
                    outcome,
                    entries: head.part.entries.len(),
                    commit_times_micros,
                }))
            }
            // A fence refusal of a part whose predecessors all confirmed: either one of its
            // lane's calls overtook another on the way (sent again at once), or the shard
            // lost entries (refused again, and then it ends the session).
            Err(RelayError::StreamBehind { .. }) if !head.part.gap_retried => {
                warn!(
                    shard = lane.shard,
                    "a part reached its shard before its predecessor; sending both again in order"
                );
                let mut part = Arc::try_unwrap(head.part).unwrap_or_else(|shared| Part {
                    entries: shared.entries.clone(),
                    ack_lsn: shared.ack_lsn,
                    fence: shared.fence,
                    gap_retried: true,
                });
                part.gap_retried = true;
                lane.send_again_from(Arc::new(part));
                lane.retry_at = Some(tokio::time::Instant::now());
                Ok(None)
            }
            Err(e) if e.retry_in_place() => {
                self.ctx.metrics.redis_errors_total.inc();
                self.ctx.set_redis_reachable(false);
                self.ctx.set_last_error(Some(e.to_string()));
                let since = *lane.failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= LANE_GIVE_UP {
                    warn!(error = %e, shard = lane.shard, failing_for = ?since.elapsed(), "a shard kept failing; the session starts afresh");
                    return Err(e);
                }
                lane.failing = true;
                lane.send_again_from(head.part);
                let delay = lane.backoff.next_delay();
                warn!(error = %e, shard = lane.shard, queued_entries = lane.queued_entries, retry_in = ?delay, "publish failed; this shard sends again, the others go on");
                lane.retry_at = Some(tokio::time::Instant::now() + delay);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Abandon everything in flight (on a session error).
    pub(crate) fn abort(&mut self) {
        for lane in &mut self.lanes {
            for f in lane.in_flight.drain(..) {
                f.task.abort();
            }
            lane.queued.clear();
            lane.queued_entries = 0;
            lane.retry_at = None;
        }
    }
}

async fn publish_once(
    mut publisher: Publisher,
    shard: u32,
    part: Arc<Part>,
    origin: Origin,
    ctx: SharedContext,
) -> Result<PublishOutcome, RelayError> {
    let started = Instant::now();
    let entries: Vec<&StreamEntry> = part.entries.iter().collect();
    let outcome = publisher
        .publish_part(shard as usize, &entries, part.ack_lsn, &origin, part.fence)
        .await?;
    ctx.metrics
        .publish_batch_duration_seconds
        .observe(started.elapsed().as_secs_f64());
    Ok(outcome)
}
