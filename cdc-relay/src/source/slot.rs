//! Replication slots, as SQL sees them: one place for every query and command about a
//! slot (its state for the relay, its health for metrics and operators, its copy on a
//! standby, creating, altering and dropping it), so the relay, the recovery and the
//! operator commands agree on what a slot is.

use pgwire_replication::{Lsn, ReplicationClient};
use tokio_postgres::Client;

use crate::config::PostgresConfig;
use crate::error::RelayError;

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotInfo {
    pub plugin: Option<String>,
    pub slot_type: String,
    pub database: Option<String>,
    pub active_pid: Option<i32>,
    pub wal_status: Option<String>,
    pub confirmed_flush_lsn: Option<pgwire_replication::Lsn>,
    /// Why the server invalidated the slot (Postgres 17+: `wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, 18's `idle_timeout`).
    pub invalidation_reason: Option<String>,
    /// A failover slot (Postgres 17+; `None` before).
    pub failover: Option<bool>,
    /// A standby's copy synced from the primary (17+; `None` before): unusable until the
    /// standby is promoted.
    pub synced: Option<bool>,
}

impl SlotInfo {
    /// The slot can no longer be streamed from: its WAL was removed, or the server
    /// invalidated it for another reason (17+: rows removed, wal_level lowered, idle).
    pub(crate) fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost") || self.invalidation_reason.is_some()
    }
}

pub(crate) async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, RelayError> {
    let row = client
        .query_opt(
            "SELECT plugin::text, slot_type, database::text, active_pid, wal_status,
                    confirmed_flush_lsn::text, to_jsonb(s) ->> 'invalidation_reason',
                    (to_jsonb(s) ->> 'failover')::boolean, (to_jsonb(s) ->> 'synced')::boolean
               FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotInfo {
        plugin: r.get(0),
        slot_type: r.get(1),
        database: r.get(2),
        active_pid: r.get(3),
        wal_status: r.get(4),
        confirmed_flush_lsn: r
            .get::<_, Option<String>>(5)
            .and_then(|l| pgwire_replication::Lsn::parse(&l).ok()),
        invalidation_reason: r.get(6),
        failover: r.get(7),
        synced: r.get(8),
    }))
}

/// The slot, if it exists, checked to be a pgoutput slot of this database (one query).
pub(crate) async fn check_slot(
    client: &Client,
    cfg: &PostgresConfig,
) -> Result<Option<SlotInfo>, RelayError> {
    let Some(info) = slot_info(client, &cfg.slot).await? else {
        return Ok(None);
    };
    let dbname = cfg.endpoint.dbname();
    let problem = if info.slot_type != "logical" {
        Some(format!("it is a {} slot", info.slot_type))
    } else if info.plugin.as_deref() != Some("pgoutput") {
        Some(format!(
            "it uses plugin {}, not pgoutput",
            info.plugin.as_deref().unwrap_or("?")
        ))
    } else if info.database.as_deref() != Some(dbname) {
        Some(format!(
            "it belongs to database {}, not {dbname}",
            info.database.as_deref().unwrap_or("?")
        ))
    } else {
        None
    };
    match problem {
        Some(problem) => Err(RelayError::SlotMismatch {
            slot: cfg.slot.clone(),
            problem,
        }),
        None => Ok(Some(info)),
    }
}

/// One reading of a slot.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SlotHealth {
    pub name: String,
    pub plugin: Option<String>,
    pub database: Option<String>,
    pub active: bool,
    pub active_pid: Option<i32>,
    pub lag_bytes: Option<i64>,
    pub retained_bytes: Option<i64>,
    pub wal_status: Option<String>,
    pub safe_wal_size: Option<i64>,
    pub spill_bytes: Option<i64>,
    pub spill_txns: Option<i64>,
    /// The slot conflicts with recovery (17+: the primary removed rows it needs, or lowered
    /// wal_level; a slot on a standby): it cannot be used.
    pub conflicting: Option<bool>,
    /// Why the slot was invalidated (17+): `wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, `idle_timeout` (18).
    pub invalidation_reason: Option<String>,
    /// Seconds since the slot became inactive, by the server's clock (17+; `None` while active
    /// or before 17).
    pub inactive_seconds: Option<f64>,
    /// Created to be synced to standbys (17+).
    pub failover: Option<bool>,
    /// Synced from the primary (17+, on a standby).
    pub synced: Option<bool>,
    /// Times decoding this slot used more than `logical_decoding_work_mem` (19+:
    /// `pg_stat_replication_slots.mem_exceeded_count`).
    pub mem_exceeded: Option<i64>,
}

/// Every logical slot of the connected database (or only `slot`).
pub(crate) async fn read_slots(
    client: &tokio_postgres::Client,
    slot: Option<&str>,
) -> Result<Vec<SlotHealth>, tokio_postgres::Error> {
    let rows = client
        .query(
            "WITH here AS (
               -- A standby has no current WAL position; what it replayed stands for it.
               SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                           ELSE pg_current_wal_lsn() END AS lsn
             )
             SELECT s.slot_name::text, s.plugin::text, s.database::text, s.active, s.active_pid,
                    pg_wal_lsn_diff(here.lsn, s.confirmed_flush_lsn)::bigint,
                    pg_wal_lsn_diff(here.lsn, s.restart_lsn)::bigint,
                    s.wal_status, s.safe_wal_size, st.spill_bytes, st.spill_txns,
                    -- Columns of newer servers, read by name so one query fits 15 to 18.
                    -- On 16 `conflicting` is true for any invalidation; from 17 only for a
                    -- recovery conflict, which is what it reports here.
                    CASE WHEN to_jsonb(s) ? 'invalidation_reason'
                         THEN (to_jsonb(s) ->> 'conflicting')::boolean END,
                    to_jsonb(s) ->> 'invalidation_reason',
                    extract(epoch FROM clock_timestamp()
                        - (to_jsonb(s) ->> 'inactive_since')::timestamptz)::float8,
                    (to_jsonb(s) ->> 'failover')::boolean,
                    (to_jsonb(s) ->> 'synced')::boolean,
                    (to_jsonb(st) ->> 'mem_exceeded_count')::bigint
               FROM here, pg_replication_slots s
               LEFT JOIN pg_stat_replication_slots st ON st.slot_name = s.slot_name
              WHERE s.slot_type = 'logical' AND s.database = current_database()
                AND ($1::text IS NULL OR s.slot_name = $1)
              ORDER BY s.slot_name",
            &[&slot],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| SlotHealth {
            name: r.get(0),
            plugin: r.get(1),
            database: r.get(2),
            active: r.get(3),
            active_pid: r.get(4),
            lag_bytes: r.get(5),
            retained_bytes: r.get(6),
            wal_status: r.get(7),
            safe_wal_size: r.get(8),
            spill_bytes: r.get(9),
            spill_txns: r.get(10),
            conflicting: r.get(11),
            invalidation_reason: r.get(12),
            // (Clamped here: GREATEST in SQL would turn the NULL of older servers into 0.)
            inactive_seconds: r.get::<_, Option<f64>>(13).map(|s| s.max(0.0)),
            failover: r.get(14),
            synced: r.get(15),
            mem_exceeded: r.get(16),
        })
        .collect())
}

/// The slot's `confirmed_flush_lsn` as a number (`None`: no slot, or none confirmed).
pub(crate) async fn confirmed_flush(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<Option<i64>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .and_then(|r| r.get(0)))
}

/// One reading of the slot's copy on a standby.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StandbyCopy {
    /// A promotion of this server would keep the slot usable: it is a standby, and its copy
    /// is synced, no longer temporary (a temporary one is dropped at promotion), valid.
    pub(crate) ready: bool,
    pub(crate) confirmed_flush: Option<i64>,
    /// Why the standby's last attempt to sync the slot skipped it (19+:
    /// `slotsync_skip_reason`, e.g. `wal_not_flushed`); `None` when it did not, or before 19.
    pub(crate) skip_reason: Option<String>,
}

pub(crate) async fn read_standby_copy(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<StandbyCopy, tokio_postgres::Error> {
    // Failover slots exist from 17 on, so their columns are read directly; 19's by name.
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery()
                    AND coalesce(s.synced AND NOT s.temporary AND NOT s.conflicting
                                 AND s.invalidation_reason IS NULL, false),
                    (s.confirmed_flush_lsn - '0/0')::bigint,
                    to_jsonb(s) ->> 'slotsync_skip_reason'
               FROM (SELECT 1) one
               LEFT JOIN pg_replication_slots s ON s.slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(StandbyCopy {
        ready: row.get(0),
        confirmed_flush: row.get(1),
        skip_reason: row.get::<_, Option<String>>(2).filter(|r| r != "none"),
    })
}

/// Create the pgoutput slot `name` (a failover slot when `failover`, Postgres 17+) over SQL;
/// its consistent point, or `None` when another `setup` created it meanwhile.
pub(crate) async fn create_slot(
    client: &Client,
    name: &str,
    failover: bool,
) -> Result<Option<String>, tokio_postgres::Error> {
    let sql = if failover {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    match client.query_one(sql, &[&name]).await {
        Ok(row) => Ok(Some(row.get(0))),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Make the existing slot `name` a failover slot in place (same position). Only a
/// replication connection may alter a slot; it acquires the slot, so it waits while a relay
/// holds it: the caller bounds the wait.
pub(crate) async fn make_failover(
    session: &mut ReplicationClient,
    name: &str,
) -> Result<(), pgwire_replication::PgWireError> {
    session
        .simple_query(&format!(
            "ALTER_REPLICATION_SLOT \"{name}\" (FAILOVER true)"
        ))
        .await
        .map(|_| ())
}

/// Drop the slot `name` if it exists (refused with `object_in_use` while it is active).
pub(crate) async fn drop_slot(client: &Client, name: &str) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
            &[&name],
        )
        .await
        .map(|_| ())
}

/// `CREATE_REPLICATION_SLOT ... (SNAPSHOT 'nothing')` on the gated session `client`: its
/// consistent point (every transaction committed after it will be streamed). It waits for
/// the transactions open at this moment. No snapshot is exported: what committed before is
/// the outbox table's to give, by a catch-up that takes its own snapshots.
pub(crate) async fn create_slot_on_session(
    client: &mut ReplicationClient,
    name: &str,
    failover: bool,
) -> Result<Result<Lsn, RelayError>, pgwire_replication::PgWireError> {
    let rows = client
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT \"{name}\" LOGICAL pgoutput (SNAPSHOT 'nothing'{})",
            // Only a 17+ server has failover slots (and --failover is refused before).
            if failover { ", FAILOVER true" } else { "" }
        ))
        .await?;
    let point = rows
        .first()
        .and_then(|row| row.get(1))
        .and_then(|v| v.as_ref())
        .map(|b| String::from_utf8_lossy(b).into_owned());
    Ok(match point {
        None => Err(RelayError::Protocol(
            "CREATE_REPLICATION_SLOT returned no consistent point".into(),
        )),
        Some(text) => Lsn::parse(&text)
            .map_err(|e| RelayError::Protocol(format!("consistent point: {}", e.0))),
    })
}
