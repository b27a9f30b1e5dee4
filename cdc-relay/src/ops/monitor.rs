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
use crate::source::{confirmed_flush, read_slots, read_standby_copy, SlotHealth};
use crate::status::Role;

/// Keep the slot gauges current until `shutdown`.
pub(crate) async fn run(ctx: Arc<Context>, shutdown: CancellationToken) {
    if !ctx.config.standbys.is_empty() {
        // Apart: a standby that does not answer must not freeze the slot's own gauges, and
        // the standbys' must stay true while the primary is down (when they matter most).
        tokio::spawn(watch_standbys(ctx.clone(), shutdown.clone()));
    }
    let cfg = &ctx.config;
    let mut client: Option<tokio_postgres::Client> = None;
    let mut spilled = (0i64, 0i64, 0i64);
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

/// Run `read` on `endpoint`'s connection (made when missing), all within `limit`; on any
/// failure the connection is dropped and `None` returned.
async fn read_within<T, F, Fut>(
    endpoint: &outbox_core::connect::PgEndpoint,
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
    // The skip reason each standby's gauge was last set with (to clear it when it changes).
    let mut reasons: Vec<Option<String>> = cfg.standbys.iter().map(|_| None).collect();
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
        for ((endpoint, copy), shown) in cfg.standbys.iter().zip(copies).zip(reasons.iter_mut()) {
            let label = endpoint.address();
            let reason = copy.as_ref().and_then(|c| c.skip_reason.clone());
            if *shown != reason {
                if let Some(old) = shown.take() {
                    let _ = m
                        .standby_slot_sync_skipped
                        .remove_label_values(&[&label, &old]);
                }
                if let Some(new) = &reason {
                    m.standby_slot_sync_skipped
                        .with_label_values(&[&label, new])
                        .set(1);
                }
                *shown = reason;
            }
            // Unreachable counts as not ready: nobody can say a promotion keeps the slot.
            m.standby_up
                .with_label_values(&[&label])
                .set(i64::from(copy.is_some()));
            m.standby_slot_ready
                .with_label_values(&[&label])
                .set(i64::from(copy.as_ref().is_some_and(|c| c.ready)));
            let behind = match (confirmed, copy.as_ref().and_then(|c| c.confirmed_flush)) {
                (Some(p), Some(s)) => (p - s) as f64,
                _ => f64::NAN,
            };
            m.standby_slot_behind_bytes
                .with_label_values(&[&label])
                .set(behind);
        }
    }
}

fn update(ctx: &Context, slot: Option<&SlotHealth>, spilled: &mut (i64, i64, i64)) {
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
    let exceeded = slot.mem_exceeded.unwrap_or(0);
    if exceeded >= spilled.2 {
        m.slot_memory_exceeded_total
            .inc_by((exceeded - spilled.2) as u64);
    }
    *spilled = (bytes, txns, exceeded);
}
