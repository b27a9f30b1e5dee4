//! Rebuilding the stream from the outbox table, when the slot or Redis lost data.
//!
//! Why it is needed: a slot invalidated by `max_slot_wal_keep_size` ("lost") can no longer
//! stream what it had not confirmed, and a Redis restarted without its AOF (or failed over to
//! a stale replica) lost entries the slot had confirmed. Both leave committed outbox rows
//! that will never reach the stream from the slot. The outbox table keeps rows for a
//! retention period for exactly this case.
//!
//! How, without losing a message or reordering the stream:
//! 1. take the rebuild lock in Redis (other relays stand by) and mark the rebuild started
//!    in the stream's record, so a crash midway resumes it;
//! 2. drop the slot and create it again on the replication session, exporting its snapshot:
//!    every transaction after the new slot's consistent point will be streamed, and the
//!    snapshot shows exactly the rows committed before it;
//! 3. in that snapshot, read the outbox rows; publish those whose outbox id is not already
//!    in the stream, in outbox id order, with ids right after the stream's top (all below
//!    the new slot's LSN-based ids);
//! 4. record the new consistent point as acknowledged, clear the mark, and start streaming
//!    on the same session (the lock is released once streaming started).
//!
//! Rows published again are acceptable duplicates: the receivers' inboxes absorb them.

use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationClient};
use tracing::{info, warn};

use crate::batch::{Batch, EntryId, StreamEntry};
use crate::error::RelayError;
use crate::outbox::{rfc3339_utc, OutboxEvent};
use crate::publisher::{Origin, Publisher};
use crate::relay::Context;

/// How long the rebuild lock lives without being extended.
pub(crate) const LOCK_TTL: Duration = Duration::from_secs(30);
/// Rows read and published per step.
const CHUNK: usize = 1000;
/// Stream entries are compared with outbox rows created since the oldest row minus this
/// (commit order and creation order differ by at most a transaction's duration).
const OVERLAP: &str = "10 minutes";

/// Why the stream is rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The slot was invalidated (`wal_status = lost`).
    LostSlot,
    /// Redis acknowledges less than the slot confirmed: it lost data.
    LostRedisData,
    /// Redis has no record of the stream at all (first start, or all data lost).
    NoRecord,
    /// A rebuild was interrupted.
    Resumed,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::LostSlot => "lost_slot",
            Reason::LostRedisData => "lost_redis_data",
            Reason::NoRecord => "no_record",
            Reason::Resumed => "resumed",
        }
    }
}

/// Rebuild on the gated replication session `client` (IDENTIFY_SYSTEM done, replication
/// not started). The caller holds the rebuild lock.
pub(crate) async fn rebuild(
    ctx: &Context,
    client: &mut ReplicationClient,
    publisher: &mut Publisher,
    origin: &Origin,
    holder: &str,
    reason: Reason,
) -> Result<(), RelayError> {
    let cfg = &ctx.config;
    let pg = &cfg.postgres;
    publisher
        .mark_rebuilding(origin, Some(reason.as_str()))
        .await?;
    let sql = pg.endpoint.connect(cfg.connect_timeout).await?;
    let dropped = sql
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
            &[&pg.slot],
        )
        .await;
    if let Err(e) = dropped {
        if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE) {
            return Err(RelayError::SlotBusy {
                slot: pg.slot.clone(),
                holder: None,
            });
        }
        return Err(e.into());
    }
    let rows = client
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT \"{}\" LOGICAL pgoutput (SNAPSHOT 'export')",
            pg.slot
        ))
        .await?;
    let row = rows
        .first()
        .ok_or_else(|| RelayError::Protocol("CREATE_REPLICATION_SLOT returned no row".into()))?;
    let text = |i: usize| {
        row.get(i)
            .and_then(|v| v.as_ref())
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .ok_or_else(|| {
                RelayError::Protocol(format!("CREATE_REPLICATION_SLOT column {i} missing"))
            })
    };
    let consistent_point = Lsn::parse(&text(1)?)
        .map_err(|e| RelayError::Protocol(format!("consistent point: {}", e.0)))?;
    let snapshot = text(2)?;
    info!(slot = %pg.slot, reason = reason.as_str(), consistent_point = %consistent_point, "slot created again; publishing missing outbox rows");

    // The snapshot lives while the replication session stays idle: read it now.
    let mut snap = pg.endpoint.connect(cfg.connect_timeout).await?;
    let tx = snap
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    tx.batch_execute(&format!(
        "SET TRANSACTION SNAPSHOT '{}'",
        snapshot.replace('\'', "''")
    ))
    .await?;
    tx.batch_execute("SET LOCAL DateStyle = ISO; SET LOCAL TimeZone = 'UTC'")
        .await?;
    let table = format!(
        "\"{}\".\"{}\"",
        pg.outbox_table.schema, pg.outbox_table.table
    );
    let ids: Vec<(i64, String)> = tx
        .query(
            &format!("SELECT o.id, o.id::text FROM {table} o ORDER BY o.id"),
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let since: Option<String> = tx
        .query_one(
            &format!(
                "SELECT to_char((min(created_at) - interval '{OVERLAP}') AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') FROM {table}"
            ),
            &[],
        )
        .await?
        .get(0);
    let present = match &since {
        Some(since) => publisher.outbox_ids_since(since).await?,
        None => Default::default(),
    };
    let missing: Vec<i64> = ids
        .iter()
        .filter(|(_, text)| !present.contains(text))
        .map(|(id, _)| *id)
        .collect();

    let top = publisher.top().await?;
    let mut next = EntryId {
        commit_lsn: top.commit_lsn,
        seq: top.seq + 1,
    };
    let mut fence = None;
    let mut published = 0u64;
    for chunk in missing.chunks(CHUNK) {
        let rows = tx
            .query(
                &format!(
                    "SELECT o.id::text, o.event, o.payload::text, o.created_at::text FROM {table} o
                      WHERE o.id = ANY($1) ORDER BY o.id"
                ),
                &[&chunk],
            )
            .await?;
        let mut batch = Batch::default();
        for row in rows {
            let text = |i: usize| bytes::Bytes::from(row.get::<_, String>(i));
            batch.push(
                StreamEntry {
                    id: next,
                    event: OutboxEvent {
                        outbox_id: text(0),
                        event: text(1),
                        payload: text(2),
                        created_at: rfc3339_utc(text(3)),
                    },
                },
                0,
            );
            next.seq += 1;
        }
        let outcome = publisher.publish(&batch, origin, fence).await?;
        published += outcome.published;
        fence = batch.last_id();
        if !publisher.lock_rebuild(holder, LOCK_TTL).await? {
            warn!("lost the rebuild lock while publishing; another relay took over");
            return Err(RelayError::SlotBusy {
                slot: pg.slot.clone(),
                holder: None,
            });
        }
    }
    tx.commit().await?;

    // Everything before the consistent point is now in the stream.
    let mut ack = Batch::default();
    ack.complete_transaction(consistent_point);
    publisher.publish(&ack, origin, None).await?;
    publisher.mark_rebuilding(origin, None).await?;
    ctx.metrics
        .rebuilds_total
        .with_label_values(&[reason.as_str()])
        .inc();
    ctx.metrics.republished_events_total.inc_by(published);
    info!(
        reason = reason.as_str(),
        rows = ids.len(),
        already_in_stream = ids.len() - missing.len(),
        republished = published,
        "stream rebuilt from the outbox table"
    );
    Ok(())
}
