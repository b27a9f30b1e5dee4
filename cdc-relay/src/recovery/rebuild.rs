//! Rebuilding the stream from the outbox table, when the slot or Redis lost data.
//!
//! Why it is needed: a slot invalidated by `max_slot_wal_keep_size` ("lost") can no longer
//! stream what it had not confirmed, and a Redis restarted without its AOF (or failed over to
//! a stale replica) lost entries the slot had confirmed. Both leave committed outbox rows
//! that will never reach the stream from the slot. The outbox table keeps rows for a
//! retention period for exactly this case.
//!
//! A new timeline (failover to a standby that lagged, point-in-time restore) is the third
//! case: the stream holds entries Postgres no longer has, and the new history's LSNs lie
//! below the stream's top, so new commits would be taken for replays.
//!
//! How, without losing a message or reordering the stream (each step a function below):
//! 1. [`mark`]: the caller holds the rebuild lock (extended in the background; checked before every
//!    destructive step) and decided the rebuild with it; mark the rebuild started in the
//!    stream's record, so a crash midway resumes it;
//! 2. [`reslot`]: drop the slot and create it again on the replication session, exporting its snapshot:
//!    every transaction after the new slot's consistent point will be streamed, and the
//!    snapshot shows exactly the rows committed before it;
//! 3. [`compare`], then [`republish`]: what may not have been consumed goes out again, nothing else. Trimming follows the
//!    consumer groups, so outbox rows created before the stream's oldest entry (less an
//!    overlap for commit order ≠ creation order) were consumed by every group; when the
//!    stream is empty or its record is missing, every retained row is compared. The
//!    stream's (outbox id, created_at) pairs are copied page by page into a temporary table
//!    and the missing rows read through a portal, so memory stays bounded however many rows
//!    are retained. They are published
//!    in outbox id order with ids right after the stream's top;
//! 4. [`replace`]: choose the id offset that puts the new slot's ids above the top, replace the record
//!    (acknowledged through the consistent point, the server's timeline history), and
//!    start streaming on the same session (the lock is released once streaming started).
//!
//! A stream of shards is rebuilt as one (there is one slot): every shard is marked and
//! compared, each missing row goes to its own shard above that shard's top, and every
//! shard's record is replaced with the same id offset.
//!
//! Rows published again are acceptable duplicates: the receivers' inboxes absorb them.

use std::time::Duration;

use outbox_core::stream::{shard_of, EntryId};
use pgwire_replication::{Lsn, ReplicationClient};
use tokio_postgres::Transaction;
use tracing::{info, warn};

use crate::context::Context;
use crate::decode::{rfc3339_utc, OutboxEvent};
use crate::error::{sqlstate, sqlstates, RelayError};
use crate::sink::{
    offset_above, Batch, NewRecord, Publisher, RebuildLock, Records, StreamEntry, StreamRecord,
};
use crate::source::{create_exporting_snapshot, drop_slot, replication_error, slot_info};
use crate::source::{NewSlot, Origin, ReplicationPhase};

/// Rows read and published per step.
const CHUNK: usize = 1000;
/// How often a rebuild waiting for the consumer groups looks again.
const ROOM_POLL: Duration = Duration::from_millis(200);
/// How long the slot may take to be made again: it waits for the transactions open at that
/// moment to end.
const SLOT_CREATE_TIMEOUT: Duration = Duration::from_secs(120);
/// Outbox rows created this long before the stream's oldest entry are still compared with
/// the stream (commit order and creation order differ by at most a transaction's duration).
const OVERLAP: &str = "10 minutes";

/// Why the stream is rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reason {
    /// The slot was invalidated (`wal_status = lost`).
    LostSlot,
    /// Redis acknowledges less than the slot confirmed, or lacks entries the relay wrote.
    LostRedisData,
    /// Redis has no record of the stream (it lost everything, or it was deleted on purpose).
    NoRecord,
    /// The server's history forked before what the stream acknowledged.
    Timeline,
    /// The server is a promoted standby (its history holds all the stream has) without the
    /// slot, or with one `setup` made after the failover.
    Failover,
    /// A rebuild was interrupted.
    Resumed,
}

impl Reason {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Reason::LostSlot => "lost_slot",
            Reason::LostRedisData => "lost_redis_data",
            Reason::NoRecord => "no_record",
            Reason::Timeline => "timeline",
            Reason::Failover => "failover",
            Reason::Resumed => "resumed",
        }
    }

    /// One sentence for the log line that announces the rebuild.
    pub(super) fn explain(self) -> &'static str {
        match self {
            Reason::LostSlot => "the slot was invalidated (max_slot_wal_keep_size) and cannot stream what it had not confirmed",
            Reason::LostRedisData => "Redis acknowledges less than the slot confirmed, or lost entries the relay wrote (restarted without its AOF, a stale replica, or a slot made anew)",
            Reason::NoRecord => "the stream has no record: Redis lost everything, or the record was deleted to force a rebuild",
            Reason::Timeline => "Postgres is on a history that forked before what the stream acknowledged (failover to a lagging standby, or a point-in-time restore): the stream holds entries Postgres no longer has",
            Reason::Failover => "Postgres failed over to a server without the slot (no failover slots before Postgres 17, or the slot was not synced to the standby): the slot is made here and the outbox rows the stream lacks (committed before the failover but not yet published) are republished",
            Reason::Resumed => "a rebuild was interrupted",
        }
    }
}

/// Rebuild on the gated replication session `client` (IDENTIFY_SYSTEM done, replication
/// not started). `shard_records` (every shard's, in shard order) were read under `lock`.
/// Returns the id offset to stream with and each shard's top after the rebuild.
pub(crate) async fn rebuild(
    ctx: &Context,
    client: &mut ReplicationClient,
    publisher: &mut Publisher,
    origin: &Origin,
    shard_records: &[StreamRecord],
    lock: &mut RebuildLock,
    reason: Reason,
) -> Result<(u64, Vec<EntryId>), RelayError> {
    let cfg = &ctx.config;
    let mut records = publisher.records();
    mark(
        &mut records,
        lock,
        origin,
        publisher.shard_count(),
        shard_records,
        reason,
    )
    .await?;
    let slot = reslot(ctx, client, lock, &mut records, shard_records, reason).await?;
    // The record exists now in every shard, and the slot is ours (made anew; a streamer that
    // still held the old one refused the drop above and was not fenced for nothing): claim
    // the stream, so a relay that wrote before (paused, retrying an old batch) cannot land
    // behind what this rebuild compares and republishes.
    publisher.claim_writer_epochs().await?;
    info!(slot = %cfg.postgres.slot, reason = reason.as_str(), consistent_point = %slot.consistent_point, "slot created again; publishing the outbox rows the stream may be missing");

    // The snapshot lives while the replication session stays idle: read it now. Not
    // read-only: the comparison needs a temporary table.
    let mut snap = cfg.postgres.endpoint.connect(cfg.connect_timeout).await?;
    let tx = snap
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await?;
    tx.batch_execute(&format!(
        "SET TRANSACTION SNAPSHOT '{}'",
        slot.snapshot.replace('\'', "''")
    ))
    .await?;
    let compared = compare(ctx, &tx, &mut records, shard_records, reason, lock).await?;
    let (tops, published) = republish(ctx, &tx, publisher, origin, &compared, lock).await?;
    tx.commit().await?;
    let id_offset = replace(
        &mut records,
        lock,
        origin,
        publisher.shard_count(),
        shard_records,
        slot.consistent_point,
        &tops,
    )
    .await?;
    ctx.metrics.rebuild_remaining_rows.set(0);
    ctx.metrics
        .rebuilds_total
        .with_label_values(&[reason.as_str()])
        .inc();
    info!(
        reason = reason.as_str(),
        bound = compared
            .bound
            .as_deref()
            .unwrap_or("none: every retained row"),
        republished = published,
        id_offset,
        "stream rebuilt from the outbox table"
    );
    Ok((id_offset, tops))
}

/// Step 1: mark the rebuild started in every shard's record (creating it if Redis lost
/// it), so a crash midway resumes it. A resumed rebuild keeps the reason it started with
/// (it decides what is compared).
async fn mark(
    records: &mut [Records],
    lock: &mut RebuildLock,
    origin: &Origin,
    shards: u32,
    shard_records: &[StreamRecord],
    reason: Reason,
) -> Result<(), RelayError> {
    let started = shard_records.iter().find_map(|r| r.rebuilding.as_deref());
    let marker = match (started, reason) {
        (Some(started), Reason::Resumed) => started,
        _ => reason.as_str(),
    };
    for r in records.iter_mut() {
        r.mark_rebuilding(lock, origin, shards, marker).await?;
    }
    Ok(())
}

/// Step 2: drop the slot and create it again on the replication session, exporting its
/// snapshot. A slot another walsender holds is left alone (and the marker taken back
/// unless it is evidence of a new timeline).
async fn reslot(
    ctx: &Context,
    client: &mut ReplicationClient,
    lock: &mut RebuildLock,
    records: &mut [Records],
    shard_records: &[StreamRecord],
    reason: Reason,
) -> Result<NewSlot, RelayError> {
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
            // Nothing done yet: a marker of ours would make the holder rebuild for nothing
            // (but a new timeline written beside it is evidence to keep: a timeline or
            // failover rebuild resumes from it).
            if !matches!(reason, Reason::Timeline | Reason::Failover) {
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
        create_exporting_snapshot(client, &pg.slot, failover),
    )
    .await
    .map_err(|_| RelayError::SlotCreateTimeout {
        slot: pg.slot.clone(),
        waited: SLOT_CREATE_TIMEOUT,
    })?
    .map_err(|e| {
        // A `setup` (an init container) made the slot since it was dropped: the marker
        // stays, and the next attempt drops that one and rebuilds.
        if sqlstate(&e) == Some(sqlstates::DUPLICATE_OBJECT) {
            return RelayError::SlotBusy {
                slot: pg.slot.clone(),
                holder: None,
            };
        }
        replication_error(e, ReplicationPhase::Start, pg, true, None)
    })??;
    lock.check()?;
    Ok(created)
}

/// What the stream holds and what the outbox has that it may lack.
struct Comparison {
    /// Each shard's top before republishing.
    tops: Vec<EntryId>,
    /// Rows created before this (less an overlap) were consumed by every group; `None`:
    /// every retained row is compared.
    bound: Option<String>,
    /// Outbox rows missing from the stream.
    total: i64,
}

/// Step 3a: copy the stream's (outbox id, created_at) pairs page by page into a temporary
/// table of the snapshot's transaction, and count the outbox rows missing from them.
async fn compare(
    ctx: &Context,
    tx: &Transaction<'_>,
    records: &mut [Records],
    shard_records: &[StreamRecord],
    reason: Reason,
    lock: &RebuildLock,
) -> Result<Comparison, RelayError> {
    tx.batch_execute(
        "SET LOCAL DateStyle = ISO; SET LOCAL TimeZone = 'UTC';
         CREATE TEMPORARY TABLE cdc_relay_present (id bigint, created_at timestamptz) ON COMMIT DROP",
    )
    .await?;
    // What the stream holds now, and from when on outbox rows may be unconsumed: trimming
    // follows the groups and never empties a stream (it keeps the last-delivered entry), so
    // rows before the oldest entry were consumed. An empty stream lost its data, and a
    // missing record is Redis losing everything or an operator asking for everything:
    // then every retained row is compared.
    // A shard without a record may have lost everything, whatever the other shards say.
    let everything = reason == Reason::NoRecord
        || shard_records
            .iter()
            .any(|r| !r.exists() || r.rebuilding.as_deref() == Some(Reason::NoRecord.as_str()));
    let mut tops = Vec::with_capacity(records.len());
    let mut bound: Option<String> = None;
    let mut bounded = !everything;
    for (r, record) in records.iter_mut().zip(shard_records) {
        let (top, len) = r.top_and_len().await?;
        tops.push(top);
        if len > 0 {
            if let Some(oldest) = r.oldest_created_at().await? {
                // RFC 3339 UTC texts of one format compare as times.
                if bound.as_ref().is_none_or(|b| oldest < *b) {
                    bound = Some(oldest);
                }
            }
        } else if !record.exists() || record.last_id.is_some() {
            // Empty, and it held entries (or nobody knows): it lost them.
            bounded = false;
        }
        copy_present(tx, r, lock).await?;
    }
    // A shard that never held anything does not bound what the others may be missing.
    let bound = if bounded { bound } else { None };
    tx.batch_execute("CREATE INDEX ON cdc_relay_present (id); ANALYZE cdc_relay_present")
        .await?;
    let total: i64 = tx
        .query_one(&format!("SELECT count(*) {}", missing_rows(ctx)), &[&bound])
        .await?
        .get(0);
    ctx.metrics.rebuild_remaining_rows.set(total);
    Ok(Comparison { tops, bound, total })
}

/// One shard's (outbox id, created_at) pairs into `cdc_relay_present`, a page at a time.
async fn copy_present(
    tx: &Transaction<'_>,
    records: &mut Records,
    lock: &RebuildLock,
) -> Result<(), RelayError> {
    let mut after: Option<String> = None;
    loop {
        lock.check()?;
        let (page, last) = records.outbox_ids_page(after.as_deref(), CHUNK).await?;
        if page.0.is_empty() && last.is_none() {
            return Ok(());
        }
        tx.execute(
            "INSERT INTO cdc_relay_present SELECT * FROM unnest($1::bigint[], $2::text[]::timestamptz[])",
            &[&page.0, &page.1],
        )
        .await?;
        after = last;
    }
}

/// The outbox rows the stream may lack (`$1`: the bound, or NULL for every retained row).
fn missing_rows(ctx: &Context) -> String {
    let table = &ctx.config.postgres.outbox_table;
    format!(
        "FROM \"{}\".\"{}\" o
          WHERE ($1::text IS NULL OR o.created_at >= $1::timestamptz - interval '{OVERLAP}')
            AND NOT EXISTS (SELECT 1 FROM cdc_relay_present p
                             WHERE p.id = o.id AND p.created_at = o.created_at)",
        table.schema, table.table
    )
}

/// Step 3b: publish the missing rows in outbox id order, each to its shard with ids right
/// after that shard's top, fenced there (the shard must still hold what it held when
/// compared: a failover to a stale replica mid-rebuild is refused, and the next session
/// starts over). Each shard's new top, and how many rows were published.
async fn republish(
    ctx: &Context,
    tx: &Transaction<'_>,
    publisher: &mut Publisher,
    origin: &Origin,
    compared: &Comparison,
    lock: &RebuildLock,
) -> Result<(Vec<EntryId>, u64), RelayError> {
    let shards = publisher.shard_count();
    let partition_key = if shards > 1 {
        "o.partition_key"
    } else {
        "NULL::text"
    };
    let select = tx
        .prepare(&format!(
            "SELECT o.id::text, o.event, o.payload::text, o.created_at::text, {partition_key} {} ORDER BY o.id",
            missing_rows(ctx)
        ))
        .await?;
    let portal = tx.bind(&select, &[&compared.bound]).await?;
    let tops = &compared.tops;
    let mut next: Vec<EntryId> = tops
        .iter()
        .map(|top| EntryId {
            commit_lsn: top.commit_lsn,
            seq: top.seq + 1,
        })
        .collect();
    let mut fences: Vec<Option<EntryId>> = tops
        .iter()
        .map(|top| (*top != EntryId::default()).then_some(*top))
        .collect();
    let mut published = 0u64;
    // Never more at once than a quarter of the cap, so each batch fits beside what the
    // groups have not read yet, under the three quarters a rebuild may fill.
    let cap = ctx.config.stream_max_len;
    let per_batch = if cap == 0 {
        CHUNK
    } else {
        (cap / 4).clamp(1, CHUNK as u64) as usize
    };
    loop {
        let rows = tx.query_portal(&portal, per_batch as i32).await?;
        if rows.is_empty() {
            break;
        }
        let mut batch = Batch::default();
        for row in rows {
            let text = |i: usize| bytes::Bytes::from(row.get::<_, String>(i));
            let partition_key = row.get::<_, Option<String>>(4).map(bytes::Bytes::from);
            let shard = shard_of(partition_key.as_deref(), shards);
            let id = &mut next[shard as usize];
            batch.push(
                StreamEntry {
                    id: *id,
                    shard,
                    commit_time_micros: 0,
                    event: OutboxEvent {
                        outbox_id: text(0),
                        event: text(1),
                        payload: text(2),
                        created_at: rfc3339_utc(text(3)),
                        partition_key,
                        // A rebuild republishes rows long after their request: their
                        // traces ended then.
                        traceparent: None,
                    },
                    span: None,
                },
                0,
            );
            id.seq += 1;
        }
        // Sorted by id within each shard, as the publish script expects: ids of a shard
        // only grow, and the split keeps the order.
        wait_for_room(ctx, publisher, &batch, lock).await?;
        lock.check()?;
        let (outcome, _) = publisher.publish(&batch, origin, &fences, false).await?;
        published += outcome.published;
        ctx.metrics
            .unread_entries_trimmed_total
            .inc_by(outcome.unread_trimmed);
        ctx.metrics
            .republished_events_total
            .inc_by(outcome.published);
        ctx.metrics
            .rebuild_remaining_rows
            .set(compared.total - published as i64);
        batch.advance_fences(&mut fences);
    }
    // Everything before the consistent point is in the stream now.
    let tops = fences
        .iter()
        .zip(tops)
        .map(|(fence, top)| fence.unwrap_or(*top))
        .collect();
    Ok((tops, published))
}

/// Before republishing `batch`: wait until every shard it writes has room for its part
/// under `--stream-max-len`, beside what some consumer group has not read (the groups'
/// reading and acknowledging makes the room; trimming follows them). However much is
/// retained, a rebuild never trims an unread entry and never refuses: it goes at the pace
/// of the slowest group, and says so. It fills at most three quarters of the cap: live
/// publishing, which follows the rebuild at once and cannot wait, trims at the cap, so a
/// rebuild that left the stream full would have its last entries trimmed unread by the
/// first new messages (seen: 8 of a rebuild's entries trimmed after Redis lost its data).
async fn wait_for_room(
    ctx: &Context,
    publisher: &mut Publisher,
    batch: &Batch,
    lock: &RebuildLock,
) -> Result<(), RelayError> {
    let cap = ctx.config.stream_max_len;
    if cap == 0 {
        return Ok(());
    }
    let fill_to = cap - cap / 4;
    let mut parts = vec![0u64; publisher.shard_count() as usize];
    for entry in &batch.entries {
        parts[entry.shard as usize] += 1;
    }
    for (shard, &part) in parts.iter().enumerate().filter(|(_, n)| **n > 0) {
        let shard = shard as u32;
        let mut said = None::<tokio::time::Instant>;
        loop {
            let (entries, groups) = publisher.room(shard).await?;
            if entries + part <= fill_to {
                break;
            }
            ctx.metrics.rebuild_waiting_for_consumers.set(1);
            if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
                let why = if groups == 0 {
                    "no consumer group reads it yet".to_string()
                } else {
                    format!("{groups} consumer group(s) have not read {entries} of its entries")
                };
                warn!(stream = %publisher.shard_stream(shard), entries, fill_to, max_len = cap, %why, "the rebuild waits for the consumers: it fills at most three quarters of the cap, so that the new messages after it do not trim entries nobody read");
                ctx.set_last_error(Some(format!(
                    "rebuilding {}: waiting for the consumer groups to read ({why}; {entries} entries, a rebuild fills {fill_to} of --stream-max-len {cap})",
                    publisher.shard_stream(shard)
                )));
                said = Some(tokio::time::Instant::now());
            }
            lock.check()?;
            tokio::time::sleep(ROOM_POLL).await;
        }
    }
    ctx.metrics.rebuild_waiting_for_consumers.set(0);
    Ok(())
}

/// Step 4: the id offset that puts the new slot's ids above every shard's top, and every
/// shard's record replaced (acknowledged through the consistent point, the server's
/// timeline history, no marker).
async fn replace(
    records: &mut [Records],
    lock: &mut RebuildLock,
    origin: &Origin,
    shards: u32,
    shard_records: &[StreamRecord],
    consistent_point: Lsn,
    tops: &[EntryId],
) -> Result<u64, RelayError> {
    let id_offset = tops
        .iter()
        .zip(shard_records)
        .map(|(top, record)| offset_above(*top, consistent_point.as_u64(), record.id_offset))
        .max()
        .unwrap_or(0);
    for (r, top) in records.iter_mut().zip(tops) {
        r.replace(
            lock,
            &NewRecord {
                origin,
                shards,
                acked_through: consistent_point.as_u64(),
                id_offset,
                last_id: (*top != EntryId::default()).then_some(*top),
            },
        )
        .await?;
    }
    Ok(id_offset)
}
