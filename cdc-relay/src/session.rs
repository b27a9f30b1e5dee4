//! The relay loop: replication events in, Redis stream entries out, slot acknowledgements back.
//!
//! Invariant: the slot is never acknowledged past a transaction whose entries Redis has not
//! confirmed. Everything held in memory here may vanish at any moment; Postgres re-sends it
//! because we did not acknowledge it, and Redis rejects the part it already has (stream ids
//! are derived from commit LSNs).
//!
//! One batch is in flight at a time while the next one fills (double buffering), so Redis
//! applies batches in order and a failed batch is simply retried before anything after it.
//! Acknowledgements are the `end_lsn` of the last transaction whose Commit was in a
//! confirmed batch (never `Commit.lsn`, which makes Postgres re-send that transaction), or
//! a keepalive's `wal_end` when nothing is open or unconfirmed (so an idle outbox does not
//! pin WAL while other tables are busy).

use std::time::Duration;

use futures::FutureExt;
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::batch::{Batch, BatchLimits, EntryId, StreamEntry};
use crate::config::OnLostSlot;
use crate::error::{sqlstate, sqlstates, RelayError};
use crate::outbox::{RelationCache, Row};
use crate::pgoutput::{self, PgOutput};
use crate::pipeline::Pipeline;
use crate::publisher::StreamRecord;
use crate::publisher::{Origin, PublishOutcome, Publisher};
use crate::rebuild::{self, Reason};
use crate::relay::Context;
use crate::setup::{check_prerequisites, check_slot, slot_info, SlotInfo};
use crate::status::Role;

/// Microseconds between the Unix epoch and the Postgres epoch (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// Connect, take the slot (rebuilding the stream first when the slot or Redis lost data)
/// and stream until shutdown (`Ok`) or an error.
pub(crate) async fn run(
    ctx: &Context,
    mut publisher: Publisher,
    shutdown: &CancellationToken,
) -> Result<(), RelayError> {
    let cfg = &ctx.config;
    let pg = &cfg.postgres;
    let sql = pg.endpoint.connect(cfg.connect_timeout).await?;
    ctx.set_postgres_reachable(true);
    check_prerequisites(&sql, pg).await?;
    let slot = slot_info(&sql, &pg.slot).await?;
    let lost = slot
        .as_ref()
        .is_some_and(|s| s.wal_status.as_deref() == Some("lost"));
    ctx.set_slot_lost(lost);
    if lost && cfg.on_lost_slot == OnLostSlot::Fail {
        return Err(RelayError::SlotLost {
            slot: pg.slot.clone(),
            recover: false,
        });
    }
    let record = publisher.record().await?;
    // A slot dropped by an interrupted rebuild is expected to be missing.
    let slot = match (slot, &record.rebuilding) {
        (None, Some(_)) => None,
        _ => Some(check_slot(&sql, pg).await?),
    };
    let holder = ctx.instance_id();
    if publisher.rebuilding_elsewhere(holder).await? {
        return Err(RelayError::SlotBusy {
            slot: pg.slot.clone(),
            holder: None,
        });
    }

    let replication =
        pg.endpoint
            .replication_config(&pg.slot, &pg.publication, cfg.status_interval)?;
    let mut client = ReplicationClient::connect_gated(replication).await?;
    let identity = within(cfg.connect_timeout, client.identify_system()).await??;
    let origin = Origin {
        system_id: identity.system_id,
        timeline: identity.timeline,
    };
    publisher.check_origin(&origin).await?;

    let reason = rebuild_reason(&slot, &record);
    ctx.set_slot_lost(reason == Some(Reason::LostSlot));
    let rebuilt = match reason {
        Some(Reason::LostSlot) if cfg.on_lost_slot == OnLostSlot::Fail => {
            return Err(RelayError::SlotLost {
                slot: pg.slot.clone(),
                recover: false,
            });
        }
        Some(reason) => {
            if !publisher.lock_rebuild(holder, rebuild::LOCK_TTL).await? {
                return Err(RelayError::SlotBusy {
                    slot: pg.slot.clone(),
                    holder: None,
                });
            }
            warn!(slot = %pg.slot, stream = %publisher.stream(), reason = reason.as_str(), "rebuilding the stream from the outbox table");
            let result =
                rebuild::rebuild(ctx, &mut client, &mut publisher, &origin, holder, reason).await;
            if let Err(e) = result {
                let _ = publisher.unlock_rebuild(holder).await;
                return Err(e);
            }
            ctx.set_slot_lost(false);
            true
        }
        None => false,
    };
    client.start().await?;
    let started = within(cfg.connect_timeout, client.wait_started()).await;
    if rebuilt {
        let _ = publisher.unlock_rebuild(holder).await;
    }
    if let Err(e) = started? {
        let recover = cfg.on_lost_slot == OnLostSlot::Recover;
        return Err(start_error(e, &sql, &pg.slot, recover).await);
    }
    drop(sql);
    info!(
        slot = %pg.slot,
        stream = %publisher.stream(),
        system_id = %origin.system_id,
        timeline = origin.timeline,
        "acquired slot; streaming"
    );
    ctx.set_role(Role::Streaming);
    ctx.set_last_error(None);

    let session = Session {
        ctx,
        relations: RelationCache::new(pg.outbox_table.clone()),
        state: State {
            limits: cfg.batch,
            open: None,
            filling: Batch::default(),
            acknowledged_lsn: Lsn(0),
            ack_only_not_before: tokio::time::Instant::now(),
        },
        pipeline: Pipeline::new(publisher, origin, ctx.shared()),
        client,
    };
    session.stream(shutdown).await
}

/// Whether (and why) the stream must be rebuilt before streaming: the slot is lost, Redis
/// knows less than the slot confirmed or lacks entries the relay wrote (it lost data),
/// Redis has no record of the stream, or a rebuild was interrupted.
fn rebuild_reason(slot: &Option<SlotInfo>, record: &StreamRecord) -> Option<Reason> {
    let Some(slot) = slot else {
        return Some(Reason::Resumed);
    };
    if slot.wal_status.as_deref() == Some("lost") {
        return Some(Reason::LostSlot);
    }
    if record.rebuilding.is_some() {
        return Some(Reason::Resumed);
    }
    if record.system_id.is_none() {
        return Some(Reason::NoRecord);
    }
    // Entries the relay wrote are gone (the stream was deleted or restored from older data).
    if record.last_id.is_some_and(|last| record.top < last) {
        return Some(Reason::LostRedisData);
    }
    match (record.acked_through, slot.confirmed_flush_lsn) {
        (acked, Some(confirmed)) if acked.unwrap_or(0) < confirmed.as_u64() => {
            Some(Reason::LostRedisData)
        }
        _ => None,
    }
}

async fn within<T>(
    limit: Duration,
    fut: impl std::future::Future<Output = T>,
) -> Result<T, RelayError> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| RelayError::ConnectTimeout(limit))
}

/// Turn a START_REPLICATION failure into what it means for the relay.
async fn start_error(
    e: PgWireError,
    sql: &tokio_postgres::Client,
    slot: &str,
    ctx_recover: bool,
) -> RelayError {
    let recover = ctx_recover;
    match sqlstate(&e) {
        Some(sqlstates::OBJECT_IN_USE) => {
            let holder = slot_info(sql, slot)
                .await
                .ok()
                .flatten()
                .and_then(|s| s.active_pid)
                .map(|pid| pid as u32);
            RelayError::SlotBusy {
                slot: slot.to_string(),
                holder,
            }
        }
        Some(sqlstates::UNDEFINED_OBJECT) => RelayError::SlotMissing {
            slot: slot.to_string(),
        },
        // "cannot read from logical replication slot": invalidated.
        Some(sqlstates::OBJECT_NOT_IN_PREREQUISITE_STATE) => RelayError::SlotLost {
            slot: slot.to_string(),
            recover,
        },
        _ => RelayError::Replication(e),
    }
}

/// A transaction between its Begin and its Commit.
struct OpenTransaction {
    commit_lsn: Lsn,
    commit_time_micros: i64,
    next_seq: u64,
}

/// What the loop's branches share, with the predicates that gate them.
struct State {
    limits: BatchLimits,
    open: Option<OpenTransaction>,
    filling: Batch,
    /// Last LSN acknowledged to the slot in this session.
    acknowledged_lsn: Lsn,
    /// A batch carrying only an acknowledgement (a keepalive's position, a commit without
    /// entries) waits until then, so a busy database with an idle outbox costs Redis a few
    /// small calls per second, not one per keepalive.
    ack_only_not_before: tokio::time::Instant,
}

impl State {
    /// The filling batch can take another event (otherwise: backpressure on the slot).
    fn has_room(&self) -> bool {
        self.filling.has_room(&self.limits)
    }
}

struct Session<'a> {
    ctx: &'a Context,
    client: ReplicationClient,
    relations: RelationCache,
    state: State,
    pipeline: Pipeline,
}

impl Session<'_> {
    /// Entries are waiting and the pipeline can take a batch.
    fn ready_to_publish(&self) -> bool {
        self.state.filling.has_entries() && self.pipeline.has_room_for(!self.state.has_room())
    }

    /// Only an acknowledgement is waiting (it goes out at `ack_only_not_before`).
    fn ack_only_waiting(&self) -> bool {
        !self.state.filling.has_entries()
            && self.state.filling.ack_lsn.is_some()
            && self.pipeline.has_room_for(false)
    }

    /// Nothing received is open or unconfirmed.
    fn is_idle(&self) -> bool {
        self.state.open.is_none() && !self.state.filling.has_entries() && self.pipeline.is_idle()
    }
}

impl Session<'_> {
    async fn stream(mut self, shutdown: &CancellationToken) -> Result<(), RelayError> {
        let result = self.stream_loop(shutdown).await;
        if result.is_err() {
            // Whatever it wrote is idempotent; the next session re-sends the rest.
            self.pipeline.abort();
        }
        result
    }

    async fn stream_loop(&mut self, shutdown: &CancellationToken) -> Result<(), RelayError> {
        // Registered once: polling a fresh `cancelled()` each turn would lock its mutex.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        loop {
            tokio::select! {
                biased;
                // 1. shutdown: stop reading, finish the in-flight batch, acknowledge, leave
                _ = &mut cancelled => return self.finish().await,
                // 2. a batch confirmed: acknowledge the end_lsn of the last confirmed transaction
                confirmed = self.pipeline.confirmed(), if !self.pipeline.is_idle() => {
                    let (sealed, outcome) = confirmed?;
                    self.on_published(&sealed.batch, outcome);
                }
                // 3. the next replication events, only while the batch has room (backpressure)
                received = self.client.recv(), if self.state.has_room() => {
                    self.on_received(received)?;
                    // Take what is already waiting without another turn of the select.
                    while self.state.has_room() {
                        match self.client.recv().now_or_never() {
                            Some(received) => self.on_received(received)?,
                            None => break,
                        }
                    }
                }
                // 4. nothing more is waiting: publish what we have now (no timer, no added latency)
                _ = std::future::ready(()), if self.ready_to_publish() => self.start_publish(),
                // 5. only an acknowledgement waits: record it in Redis, then acknowledge
                _ = tokio::time::sleep_until(self.state.ack_only_not_before), if self.ack_only_waiting() => {
                    self.state.ack_only_not_before = tokio::time::Instant::now() + self.ctx.config.status_interval;
                    self.start_publish();
                }
            }
        }
    }

    fn on_received(
        &mut self,
        received: Result<Option<ReplicationEvent>, PgWireError>,
    ) -> Result<(), RelayError> {
        match received {
            Ok(Some(event)) => self.on_event(event),
            Ok(None) => Err(RelayError::StreamEnded),
            Err(e) => Err(self.streaming_error(e)),
        }
    }

    fn streaming_error(&self, e: PgWireError) -> RelayError {
        match sqlstate(&e) {
            // At the first decoded change: the publication was dropped after the slot was made.
            Some(sqlstates::UNDEFINED_OBJECT) => RelayError::PublicationMissing {
                publication: self.ctx.config.postgres.publication.clone(),
            },
            Some(sqlstates::OBJECT_NOT_IN_PREREQUISITE_STATE) => RelayError::SlotLost {
                slot: self.ctx.config.postgres.slot.clone(),
                recover: self.ctx.config.on_lost_slot == OnLostSlot::Recover,
            },
            _ => RelayError::Replication(e),
        }
    }

    fn on_event(&mut self, event: ReplicationEvent) -> Result<(), RelayError> {
        match event {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                if self.state.open.is_some() {
                    return Err(RelayError::Protocol(format!(
                        "Begin {final_lsn} inside an open transaction"
                    )));
                }
                self.state.open = Some(OpenTransaction {
                    commit_lsn: final_lsn,
                    commit_time_micros,
                    next_seq: 0,
                });
            }
            ReplicationEvent::XLogData { data, .. } => match pgoutput::decode(&data)? {
                PgOutput::Relation(relation) => {
                    debug!(relation = %relation.name, id = relation.id, "relation");
                    self.relations.on_relation(&relation)?;
                }
                PgOutput::Insert(insert) => match self.relations.on_insert(insert)? {
                    Row::Outbox(event) => {
                        let txn = self.state.open.as_mut().ok_or_else(|| {
                            RelayError::Protocol("insert outside a transaction".into())
                        })?;
                        let id = EntryId {
                            commit_lsn: txn.commit_lsn.as_u64(),
                            seq: txn.next_seq,
                        };
                        txn.next_seq += 1;
                        self.state
                            .filling
                            .push(StreamEntry { id, event }, txn.commit_time_micros);
                    }
                    Row::Foreign(table) => {
                        self.ctx.metrics.foreign_inserts_skipped_total.inc();
                        debug!(%table, "insert into another table of the publication; not published");
                    }
                },
                PgOutput::Skipped(_) => {}
            },
            ReplicationEvent::Commit { lsn, end_lsn, .. } => {
                let txn =
                    self.state.open.take().ok_or_else(|| {
                        RelayError::Protocol(format!("Commit {lsn} without Begin"))
                    })?;
                if txn.commit_lsn != lsn {
                    return Err(RelayError::Protocol(format!(
                        "Commit {lsn} does not match Begin final_lsn {}",
                        txn.commit_lsn
                    )));
                }
                self.ctx.metrics.transactions_total.inc();
                self.state.filling.complete_transaction(end_lsn);
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                // Nothing open or unconfirmed: the slot may move to the server's position
                // (recorded in Redis first, like every acknowledgement).
                if self.is_idle() && wal_end > self.state.acknowledged_lsn {
                    let ack = self
                        .state
                        .filling
                        .ack_lsn
                        .map_or(wal_end, |lsn| lsn.max(wal_end));
                    self.state.filling.ack_lsn = Some(ack);
                }
            }
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    fn start_publish(&mut self) {
        let batch = std::mem::take(&mut self.state.filling);
        self.pipeline.send(batch);
    }

    fn on_published(&mut self, batch: &Batch, outcome: PublishOutcome) {
        let metrics = &self.ctx.metrics;
        metrics.events_published_total.inc_by(outcome.published);
        metrics.duplicates_rejected_total.inc_by(outcome.duplicates);
        metrics.publish_batches_total.inc();
        metrics
            .publish_batch_entries
            .observe(batch.entries.len() as f64);
        let now_pg_micros = unix_micros() - PG_EPOCH_OFFSET_MICROS;
        for commit_time in &batch.commit_times_micros {
            let latency = (now_pg_micros - commit_time).max(0) as f64 / 1e6;
            metrics.commit_to_published_seconds.observe(latency);
        }
        if outcome.duplicates > 0 {
            debug!(
                duplicates = outcome.duplicates,
                "stream already held re-sent entries"
            );
        }
        if let Some(lsn) = batch.ack_lsn {
            self.acknowledge(lsn);
        }
    }

    fn acknowledge(&mut self, lsn: Lsn) {
        if lsn > self.state.acknowledged_lsn {
            self.client.update_applied_lsn(lsn);
            self.state.acknowledged_lsn = lsn;
            self.ctx.metrics.acknowledged_lsn.set(lsn.as_u64() as i64);
        }
    }

    /// Graceful end: publish what was received (bounded by the shutdown grace), send the
    /// last acknowledgement, wait until it was written to the server, then stop.
    async fn finish(&mut self) -> Result<(), RelayError> {
        self.ctx.set_role(Role::Stopping);
        let cfg = &self.ctx.config;
        let deadline = tokio::time::Instant::now() + cfg.shutdown_grace;
        // The open transaction (if any) is dropped: Postgres re-sends it next time.
        loop {
            if self.ready_to_publish() || self.ack_only_waiting() {
                self.start_publish();
            }
            if self.pipeline.is_idle() {
                break;
            }
            match tokio::time::timeout_at(deadline, self.pipeline.confirmed()).await {
                Ok(Ok((sealed, outcome))) => self.on_published(&sealed.batch, outcome),
                Ok(Err(e)) => {
                    warn!(error = %e, "publishing failed during shutdown; the rest stays unacknowledged");
                    break;
                }
                Err(_) => {
                    warn!(grace = ?cfg.shutdown_grace, "unconfirmed batches left at the end of the shutdown grace; they stay unacknowledged");
                    break;
                }
            }
        }
        self.pipeline.abort();
        // pgwire-replication sends no final status on stop(): wait until the worker reports
        // that a status update carrying our last acknowledgement went out.
        let target = self.state.acknowledged_lsn;
        let metrics = self.client.metrics();
        let ack_deadline =
            tokio::time::Instant::now() + cfg.status_interval * 2 + Duration::from_secs(2);
        while metrics.last_applied_lsn() < target && tokio::time::Instant::now() < ack_deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sent = metrics.last_applied_lsn();
        if sent < target {
            warn!(acknowledged = %target, sent = %sent, "last acknowledgement not confirmed as sent before stopping");
        }
        match tokio::time::timeout(Duration::from_secs(5), self.client.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => debug!(error = %e, "replication stream closed with an error"),
            Err(_) => warn!("replication stream did not close within 5 s"),
        }
        info!(acknowledged_lsn = %sent, "stopped");
        Ok(())
    }
}

fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
}
