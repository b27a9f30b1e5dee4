//! Making the slot anew, when it cannot continue the stream: it was invalidated
//! (`max_slot_wal_keep_size`, an idle timeout), it is missing on a promoted standby, or the
//! server's history forked below what the stream holds (a failover to a standby that lagged,
//! a point-in-time restore), so new commits' LSNs may lie below the stream's top.
//!
//! Nothing is republished here: the new slot streams what commits from its consistent point
//! on, and every shard starts behind, caught up from the outbox table by the session's
//! catch-up (`catch_up`) while live traffic flows. So a rebuild blocks nothing for longer
//! than it takes Postgres to make a slot, and holds no snapshot open.
//!
//! Steps, under the rebuild lock (the caller took it and decided with it):
//! 1. [`mark`]: every shard's record gets its catch-up marker before the slot goes, so a
//!    crash in between resumes (no slot and a marker: make it again): `since` where the
//!    shard's watermark stays meaningful (a lost slot: same history), `everything` after a
//!    failover or a fork (another history's transactions);
//! 2. [`reslot`]: drop the slot and create it again on the replication session (no snapshot
//!    exported: the catch-up takes its own);
//! 3. the id offset: new ids above every shard's top, written into every record.

use pgwire_replication::ReplicationClient;
use tracing::info;

use crate::context::Context;
use crate::error::{sqlstate, sqlstates, RelayError};
use crate::sink::{
    offset_above, Publisher, RebuildLock, Records, StreamRecord, CATCH_UP_EVERYTHING,
    CATCH_UP_SINCE,
};
use crate::source::{create_slot_on_session, drop_slot, replication_error, slot_info};
use crate::source::{Origin, ReplicationPhase};

/// How long the slot may take to be made again: it waits for the transactions open at that
/// moment to end.
const SLOT_CREATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Why a shard starts behind, or the slot is made anew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The slot moved past what the shard recorded (it fell behind in an earlier session).
    FellBehind,
    /// The slot was invalidated (`wal_status = lost`).
    LostSlot,
    /// Redis lacks entries the relay wrote.
    LostRedisData,
    /// Redis has no record of the shard (it lost everything, or it was deleted on purpose).
    NoRecord,
    /// The server's history forked before what the stream acknowledged.
    Timeline,
    /// The server is a promoted standby (its history holds all the stream has) without the
    /// slot, or with one `setup` made after the failover.
    Failover,
    /// A catch-up or a rebuild was interrupted.
    Resumed,
    /// The slot is gone on the stream's own timeline: somebody dropped it.
    SlotDropped,
}

impl Reason {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Reason::FellBehind => "fell_behind",
            Reason::LostSlot => "lost_slot",
            Reason::LostRedisData => "lost_redis_data",
            Reason::NoRecord => "no_record",
            Reason::Timeline => "timeline",
            Reason::Failover => "failover",
            Reason::Resumed => "resumed",
            Reason::SlotDropped => "slot_dropped",
        }
    }

    /// One sentence for the log line that announces it.
    pub(super) fn explain(self) -> &'static str {
        match self {
            Reason::FellBehind => "the slot moved past what the shard recorded: it fell behind, and the outbox table owes it the rest",
            Reason::LostSlot => "the slot was invalidated (max_slot_wal_keep_size) and cannot stream what it had not confirmed",
            Reason::LostRedisData => "Redis lost entries the relay wrote (restarted without its AOF, a stale replica, or a deleted stream)",
            Reason::NoRecord => "the shard has no record: Redis lost everything, or the record was deleted to force a rebuild",
            Reason::Timeline => "Postgres is on a history that forked before what the stream acknowledged (failover to a lagging standby, or a point-in-time restore): the stream holds entries Postgres no longer has",
            Reason::Failover => "Postgres failed over to a server without the slot (no failover slots before Postgres 17, or the slot was not synced to the standby), or `setup` made the slot there",
            Reason::Resumed => "a catch-up or a rebuild was interrupted",
            Reason::SlotDropped => "the slot is gone though the stream was streaming from it on this timeline: it was dropped (by an operator, or by any role with REPLICATION: Postgres lets such a role drop every slot of the cluster, the other databases' included)",
        }
    }

    /// Whether the shards' watermarks stay meaningful (same history, same transactions).
    fn keeps_watermarks(self) -> bool {
        matches!(
            self,
            Reason::LostSlot | Reason::Resumed | Reason::FellBehind | Reason::SlotDropped
        )
    }
}

/// Make the slot anew on the gated replication session `client` (IDENTIFY_SYSTEM done,
/// replication not started). `shard_records` (every shard's, in shard order) were read under
/// `lock`. Returns the id offset to stream with.
pub(crate) async fn rebuild(
    ctx: &Context,
    client: &mut ReplicationClient,
    publisher: &Publisher,
    origin: &Origin,
    shard_records: &[StreamRecord],
    lock: &mut RebuildLock,
    reason: Reason,
) -> Result<u64, RelayError> {
    let mut records = publisher.records();
    mark(&mut records, lock, shard_records, reason).await?;
    let consistent_point = reslot(ctx, client, lock, &mut records, shard_records, reason).await?;
    let id_offset = shard_records
        .iter()
        .map(|r| offset_above(r.top, consistent_point, r.id_offset))
        .max()
        .unwrap_or(0);
    lock.confirm().await?;
    for (r, record) in records.iter_mut().zip(shard_records) {
        if record.exists() {
            r.set_id_offset(id_offset).await?;
            if !reason.keeps_watermarks() {
                r.adopt_timeline(origin, 0).await?;
            }
        }
    }
    ctx.metrics
        .rebuilds_total
        .with_label_values(&[reason.as_str()])
        .inc();
    info!(slot = %ctx.config.postgres.slot, reason = reason.as_str(), consistent_point, id_offset, "slot made anew; every shard is caught up from the outbox table while the slot streams");
    Ok(id_offset)
}

/// Step 1: every existing record gets its catch-up marker (a shard without a record gets
/// one made by its catch-up).
async fn mark(
    records: &mut [Records],
    lock: &mut RebuildLock,
    shard_records: &[StreamRecord],
    reason: Reason,
) -> Result<(), RelayError> {
    lock.confirm().await?;
    for (r, record) in records.iter_mut().zip(shard_records) {
        if !record.exists() {
            continue;
        }
        if !reason.keeps_watermarks() {
            // Another history's snapshots say nothing of what the shard holds.
            r.clear_progress().await?;
        }
        if record.catching_up_everything() {
            continue;
        }
        let marker = if reason.keeps_watermarks() && record.watermark.is_some() {
            CATCH_UP_SINCE
        } else {
            CATCH_UP_EVERYTHING
        };
        r.set_marker(marker).await?;
    }
    Ok(())
}

/// Step 2: drop the slot and create it again on the replication session; its consistent
/// point. A slot another walsender holds is left alone.
async fn reslot(
    ctx: &Context,
    client: &mut ReplicationClient,
    lock: &mut RebuildLock,
    records: &mut [Records],
    shard_records: &[StreamRecord],
    reason: Reason,
) -> Result<u64, RelayError> {
    let pg = &ctx.config.postgres;
    let sql = pg.endpoint.connect(ctx.config.connect_timeout).await?;
    lock.confirm().await?;
    // A failover slot stays one, whether or not this relay was told --failover.
    let failover = pg.failover
        || slot_info(&sql, &pg.slot)
            .await?
            .is_some_and(|s| s.failover == Some(true));
    if let Err(e) = drop_slot(&sql, &pg.slot).await {
        if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE) {
            // Nothing done yet: markers of ours would make the holder's shards catch up for
            // nothing (but a new history written beside it is evidence to keep).
            if reason.keeps_watermarks() {
                for (r, record) in records.iter_mut().zip(shard_records) {
                    if record.exists() && record.rebuilding.is_none() {
                        r.clear_marker().await?;
                    }
                }
            }
            return Err(RelayError::SlotBusy {
                slot: pg.slot.clone(),
                holder: None,
            });
        }
        return Err(e.into());
    }
    // Waits for transactions open at this moment (bounded); the lock is extended meanwhile.
    let created = tokio::time::timeout(
        SLOT_CREATE_TIMEOUT,
        create_slot_on_session(client, &pg.slot, failover),
    )
    .await
    .map_err(|_| RelayError::SlotCreateTimeout {
        slot: pg.slot.clone(),
        waited: SLOT_CREATE_TIMEOUT,
    })?
    .map_err(|e| {
        // A `setup` (an init container) made the slot since it was dropped: the markers
        // stay, and the next attempt drops that one and makes it again.
        if sqlstate(&e) == Some(sqlstates::DUPLICATE_OBJECT) {
            return RelayError::SlotBusy {
                slot: pg.slot.clone(),
                holder: None,
            };
        }
        replication_error(e, ReplicationPhase::Start, pg, true, None)
    })??;
    lock.check()?;
    Ok(created.as_u64())
}
