//! Slot health for /metrics: lag, retained WAL, wal_status, whether the slot is active and
//! held by this relay, spill statistics, and where the server has them (17+: `conflicting`,
//! `inactive_since`, `invalidation_reason`, `failover`, `synced`) those too. Read every `--slot-metrics-interval` by every relay,
//! standbys included, so a dead active relay does not hide the slot it left behind. With
//! `--standby-url`, also whether each standby holds a usable copy of the failover slot.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::context::Context;
use crate::status::Role;

/// One reading of a slot.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotHealth {
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
}

/// Every logical slot of the connected database (or only `slot`).
pub async fn read_slots(
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
                    (to_jsonb(s) ->> 'synced')::boolean
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
        })
        .collect())
}

/// Keep the slot gauges current until `shutdown`.
pub(crate) async fn run(ctx: Arc<Context>, shutdown: CancellationToken) {
    if !ctx.config.standbys.is_empty() {
        // Apart: a standby that does not answer must not freeze the slot's own gauges, and
        // the standbys' must stay true while the primary is down (when they matter most).
        tokio::spawn(watch_standbys(ctx.clone(), shutdown.clone()));
    }
    let cfg = &ctx.config;
    let mut client: Option<tokio_postgres::Client> = None;
    let mut spilled = (0i64, 0i64);
    let mut interval = tokio::time::interval(cfg.slot_metrics_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = interval.tick() => {}
        }
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = cfg
                .postgres
                .endpoint
                .connect(cfg.connect_timeout.min(Duration::from_secs(5)))
                .await
                .ok();
        }
        let Some(c) = &client else {
            ctx.metrics.postgres_up.set(0);
            continue;
        };
        match read_slots(c, Some(&cfg.postgres.slot)).await {
            Ok(slots) => {
                ctx.metrics.postgres_up.set(1);
                update(&ctx, slots.first(), &mut spilled);
            }
            Err(e) => {
                debug!(error = %e, "slot health query failed");
                ctx.metrics.postgres_up.set(0);
                client = None;
            }
        }
    }
}

/// The slot's `confirmed_flush_lsn` as a number (`None`: no slot, or none confirmed).
async fn confirmed_flush(
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
#[derive(Debug, Clone, Copy, PartialEq)]
struct StandbyCopy {
    /// A promotion of this server would keep the slot usable: it is a standby, and its copy
    /// is synced, no longer temporary (a temporary one is dropped at promotion), valid.
    ready: bool,
    confirmed_flush: Option<i64>,
}

async fn read_standby_copy(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<StandbyCopy, tokio_postgres::Error> {
    // Failover slots exist from 17 on, so the columns are read directly.
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery()
                    AND coalesce(s.synced AND NOT s.temporary AND NOT s.conflicting
                                 AND s.invalidation_reason IS NULL, false),
                    (s.confirmed_flush_lsn - '0/0')::bigint
               FROM (SELECT 1) one
               LEFT JOIN pg_replication_slots s ON s.slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(StandbyCopy {
        ready: row.get(0),
        confirmed_flush: row.get(1),
    })
}

/// Run `read` on `endpoint`'s connection (made when missing), all within `limit`; on any
/// failure the connection is dropped and `None` returned.
async fn read_within<T, F, Fut>(
    endpoint: &crate::pg::PgEndpoint,
    client: &mut Option<tokio_postgres::Client>,
    limit: Duration,
    read: F,
) -> Option<T>
where
    F: FnOnce(tokio_postgres::Client) -> Fut,
    Fut: std::future::Future<Output = (tokio_postgres::Client, Result<T, tokio_postgres::Error>)>,
{
    let attempt = async {
        let c = match client.take() {
            Some(c) if !c.is_closed() => c,
            _ => endpoint.connect(limit).await.ok()?,
        };
        let (c, result) = read(c).await;
        match result {
            Ok(value) => {
                *client = Some(c);
                Some(value)
            }
            Err(e) => {
                debug!(server = %endpoint.address(), error = %e, "query for slot metrics failed");
                None
            }
        }
    };
    tokio::time::timeout(limit, attempt).await.ok().flatten()
}

/// Keep the standby gauges current until `shutdown`.
async fn watch_standbys(ctx: Arc<Context>, shutdown: CancellationToken) {
    let cfg = &ctx.config;
    let m = &ctx.metrics;
    let slot = cfg.postgres.slot.clone();
    let limit = cfg.connect_timeout.min(Duration::from_secs(5));
    let mut primary: Option<tokio_postgres::Client> = None;
    let mut clients: Vec<Option<tokio_postgres::Client>> =
        cfg.standbys.iter().map(|_| None).collect();
    let mut interval = tokio::time::interval(cfg.slot_metrics_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = interval.tick() => {}
        }
        let mut copies = Vec::with_capacity(clients.len());
        for (endpoint, client) in cfg.standbys.iter().zip(clients.iter_mut()) {
            let slot = slot.clone();
            copies.push(
                read_within(endpoint, client, limit, |c| async move {
                    let r = read_standby_copy(&c, &slot).await;
                    (c, r)
                })
                .await,
            );
        }
        // Read after the copies: a copy is never ahead of the primary's slot then.
        let confirmed = {
            let slot = slot.clone();
            read_within(
                &cfg.postgres.endpoint,
                &mut primary,
                limit,
                |c| async move {
                    let r = confirmed_flush(&c, &slot).await;
                    (c, r)
                },
            )
            .await
            .flatten()
        };
        for (endpoint, copy) in cfg.standbys.iter().zip(copies) {
            let label = endpoint.address();
            // Unreachable counts as not ready: nobody can say a promotion keeps the slot.
            m.standby_up
                .with_label_values(&[&label])
                .set(i64::from(copy.is_some()));
            m.standby_slot_ready
                .with_label_values(&[&label])
                .set(i64::from(copy.is_some_and(|c| c.ready)));
            let behind = match (confirmed, copy.and_then(|c| c.confirmed_flush)) {
                (Some(p), Some(s)) => (p - s) as f64,
                _ => f64::NAN,
            };
            m.standby_slot_behind_bytes
                .with_label_values(&[&label])
                .set(behind);
        }
    }
}

fn update(ctx: &Context, slot: Option<&SlotHealth>, spilled: &mut (i64, i64)) {
    let m = &ctx.metrics;
    m.slot_exists.set(i64::from(slot.is_some()));
    let Some(slot) = slot else {
        m.set_wal_status(None);
        m.slot_active.set(0);
        m.slot_held.set(0);
        for unknown in [
            &m.slot_conflicting,
            &m.slot_failover,
            &m.slot_synced,
            &m.slot_inactive_seconds,
        ] {
            unknown.set(f64::NAN);
        }
        return;
    };
    m.slot_lag_bytes.set(slot.lag_bytes.unwrap_or(0));
    m.slot_retained_wal_bytes
        .set(slot.retained_bytes.unwrap_or(0));
    m.slot_safe_wal_size_bytes
        .set(slot.safe_wal_size.map_or(f64::NAN, |b| b as f64));
    m.set_wal_status(slot.wal_status.as_deref());
    if slot.wal_status.as_deref() == Some("lost") || slot.invalidation_reason.is_some() {
        ctx.set_slot_lost(true);
    }
    let flag = |b: Option<bool>| b.map_or(f64::NAN, |b| f64::from(u8::from(b)));
    m.slot_conflicting.set(flag(slot.conflicting));
    m.slot_failover.set(flag(slot.failover));
    m.slot_synced.set(flag(slot.synced));
    // 17+ (which has `failover` too) leaves `inactive_since` empty while active.
    m.slot_inactive_seconds
        .set(match (slot.failover, slot.active) {
            (None, _) => f64::NAN,
            (Some(_), true) => 0.0,
            (Some(_), false) => slot.inactive_seconds.unwrap_or(f64::NAN),
        });
    m.slot_active.set(i64::from(slot.active));
    let streaming = ctx.status_snapshot().role == Role::Streaming;
    m.slot_held.set(i64::from(slot.active && streaming));
    // Server-side counters: add what grew since the last reading (they reset with the slot).
    let (bytes, txns) = (slot.spill_bytes.unwrap_or(0), slot.spill_txns.unwrap_or(0));
    if bytes >= spilled.0 {
        m.slot_spilled_bytes_total
            .inc_by((bytes - spilled.0) as u64);
    }
    if txns >= spilled.1 {
        m.slot_spilled_transactions_total
            .inc_by((txns - spilled.1) as u64);
    }
    *spilled = (bytes, txns);
}
