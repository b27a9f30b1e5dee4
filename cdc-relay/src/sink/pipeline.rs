//! The ordered publish pipeline: sealed batches go to Redis with up to two in flight, and
//! come back confirmed strictly in the order they were sealed.
//!
//! Two full batches in flight keep Redis busy while the relay hands over the next one. Order holds
//! because both travel on one connection and each batch carries a fence per shard (the
//! last id sealed before it in that shard): the script refuses a part whose predecessor did
//! not land.
//! On a transient failure of the oldest batch, every later batch is abandoned (whatever
//! of it ran is idempotent) and all of them are sent again, one at a time, after a backoff.
//! A fence refusal of the oldest batch, whose predecessors are all confirmed, means the
//! stream lost entries: it ends the session, and the next one rebuilds the stream.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tracing::warn;

use outbox_core::backoff::Backoff;
use outbox_core::stream::EntryId;

use super::batch::Batch;
use super::publisher::{PublishOutcome, Publisher};
use crate::context::SharedContext;
use crate::error::RelayError;
use crate::source::Origin;

/// Batches Redis may be working on at once.
const MAX_IN_FLIGHT: usize = 2;

/// A batch with its place in the sequence.
pub(crate) struct SealedBatch {
    pub batch: Batch,
    /// Per shard, the last entry id of the batches sealed before this one in this session.
    pub fences: Vec<Option<EntryId>>,
    /// Every shard records the acknowledgement (see `publisher`).
    pub ack_all: bool,
    /// Refused by a fence once already (see [`Pipeline::confirmed`]).
    gap_retried: std::sync::atomic::AtomicBool,
}

/// What Redis confirmed for a batch: the outcome, and per shard whether its record holds
/// the batch's acknowledgement.
pub(crate) type Confirmed = (PublishOutcome, Vec<bool>);

struct InFlight {
    sealed: Arc<SealedBatch>,
    task: JoinHandle<Result<Confirmed, RelayError>>,
}

pub(crate) struct Pipeline {
    publisher: Publisher,
    origin: Origin,
    ctx: SharedContext,
    in_flight: VecDeque<InFlight>,
    /// Batches to send again after a failure, oldest first, one at a time.
    resend: VecDeque<Arc<SealedBatch>>,
    /// While set, nothing is sent before this instant (backoff after a failure).
    retry_at: Option<tokio::time::Instant>,
    backoff: Backoff,
    /// Per shard, the last id sealed so far.
    last_sealed: Vec<Option<EntryId>>,
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
        let backoff = Backoff::new(Duration::from_millis(50), ctx.config.reconnect_max_backoff);
        Self {
            publisher,
            origin,
            ctx,
            in_flight: VecDeque::new(),
            resend: VecDeque::new(),
            retry_at: None,
            backoff,
            last_sealed: fences,
        }
    }

    /// A new batch may be sent now: nothing is in flight, or the batch is full and there is
    /// room for a second one. A lone message goes out at once; a burst rides in full
    /// batches with one queued behind the other; in between, batches grow while one is
    /// in flight (each Redis call costs an fsync, so fewer, larger calls go faster).
    pub(crate) fn has_room_for(&self, batch_full: bool) -> bool {
        self.resend.is_empty()
            && self.retry_at.is_none()
            && (self.in_flight.is_empty() || (batch_full && self.in_flight.len() < MAX_IN_FLIGHT))
    }

    /// Nothing sent is unconfirmed.
    pub(crate) fn is_idle(&self) -> bool {
        self.in_flight.is_empty() && self.resend.is_empty()
    }

    /// Seal `batch` behind everything sealed before and send it.
    pub(crate) fn send(&mut self, batch: Batch, ack_all: bool) {
        let fences = self.last_sealed.clone();
        batch.advance_fences(&mut self.last_sealed);
        self.spawn(Arc::new(SealedBatch {
            batch,
            fences,
            ack_all,
            gap_retried: Default::default(),
        }));
    }

    fn spawn(&mut self, sealed: Arc<SealedBatch>) {
        let task = tokio::spawn(publish_once(
            self.publisher.clone(),
            sealed.clone(),
            self.origin.clone(),
            self.ctx.clone(),
        ));
        self.in_flight.push_back(InFlight { sealed, task });
    }

    /// The next batch Redis confirmed, in sealing order. Transient failures are handled
    /// here (backoff, then everything unconfirmed is sent again); only permanent errors
    /// come out. Cancel-safe: state changes only between awaits.
    pub(crate) async fn confirmed(&mut self) -> Result<(Arc<SealedBatch>, Confirmed), RelayError> {
        loop {
            if let Some(at) = self.retry_at {
                tokio::time::sleep_until(at).await;
                self.retry_at = None;
                if let Some(next) = self.resend.pop_front() {
                    self.spawn(next);
                }
                continue;
            }
            let Some(head) = self.in_flight.front_mut() else {
                return std::future::pending().await;
            };
            let joined = (&mut head.task).await;
            let head = self.in_flight.pop_front().expect("head exists");
            let result = joined
                .unwrap_or_else(|e| Err(RelayError::Protocol(format!("publish task failed: {e}"))));
            match result {
                Ok(outcome) => {
                    self.backoff.reset();
                    self.ctx.set_redis_reachable(true);
                    // Resending one at a time until caught up.
                    if self.in_flight.is_empty() {
                        if let Some(next) = self.resend.pop_front() {
                            self.spawn(next);
                        }
                    }
                    return Ok((head.sealed, outcome));
                }
                // A fence refusal of a batch whose predecessors all confirmed: either one
                // of its parts overtook its predecessor's on the way (resent at once), or
                // the shard lost entries (refused again, and then it ends the session).
                Err(RelayError::StreamBehind { .. })
                    if !head
                        .sealed
                        .gap_retried
                        .swap(true, std::sync::atomic::Ordering::SeqCst) =>
                {
                    warn!("a batch's part reached a shard before its predecessor's; sending both again in order");
                    self.send_again_from(head.sealed);
                    self.retry_at = Some(tokio::time::Instant::now());
                }
                Err(e) if e.retry_in_place() => {
                    self.ctx.metrics.redis_errors_total.inc();
                    self.ctx.set_redis_reachable(false);
                    self.ctx.set_last_error(Some(e.to_string()));
                    self.send_again_from(head.sealed);
                    let delay = self.backoff.next_delay();
                    warn!(error = %e, unconfirmed_batches = self.resend.len(), retry_in = ?delay, "publish failed; sending again");
                    self.retry_at = Some(tokio::time::Instant::now() + delay);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Queue `head` and every later batch to be sent again, in order: later batches may
    /// have run or been refused by their fence, so their tasks are abandoned.
    fn send_again_from(&mut self, head: Arc<SealedBatch>) {
        let mut again: Vec<Arc<SealedBatch>> = vec![head];
        for later in self.in_flight.drain(..) {
            later.task.abort();
            again.push(later.sealed);
        }
        for sealed in again.into_iter().rev() {
            self.resend.push_front(sealed);
        }
    }

    /// Abandon everything in flight (on a session error).
    pub(crate) fn abort(&mut self) {
        for f in self.in_flight.drain(..) {
            f.task.abort();
        }
        self.resend.clear();
    }
}

async fn publish_once(
    mut publisher: Publisher,
    sealed: Arc<SealedBatch>,
    origin: Origin,
    ctx: SharedContext,
) -> Result<Confirmed, RelayError> {
    let started = Instant::now();
    let outcome = publisher
        .publish(&sealed.batch, &origin, &sealed.fences, sealed.ack_all)
        .await?;
    ctx.metrics
        .publish_batch_duration_seconds
        .observe(started.elapsed().as_secs_f64());
    Ok(outcome)
}
