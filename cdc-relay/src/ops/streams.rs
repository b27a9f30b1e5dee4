//! `cdc-relay streams`: what Redis holds of a side's stream, shard by shard, so an operator
//! need not run `XINFO` by hand: its length, first and last entry id, and for each consumer
//! group the entries not yet delivered to it (`lag`), the entries delivered and not yet
//! acknowledged (`pending`), how long the oldest of those has waited since it was last
//! delivered (`XPENDING` idle: entry ids are commit positions, not times), its consumers and
//! the group's dead letters. A table, or `--json`. The relay holding the slot reads the same
//! into its metrics ([`watch`]), for the lag alerts.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::connect::RedisConn;
use outbox_core::stream::keys::dead_letter_base;
use outbox_core::stream::shard_key;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::cli::StreamsArgs;
use crate::context::Context;
use crate::error::RelayError;
use crate::sink::layout;
use crate::status::Role;

const TIMEOUT: Duration = Duration::from_secs(10);

/// One shard of the stream.
#[derive(Debug, Serialize)]
pub(crate) struct ShardReport {
    key: String,
    exists: bool,
    length: u64,
    first_id: Option<String>,
    last_id: Option<String>,
    groups: Vec<GroupReport>,
}

/// One consumer group of a shard.
#[derive(Debug, Serialize)]
pub(crate) struct GroupReport {
    name: String,
    consumers: u64,
    /// Entries not yet delivered to the group (`XINFO GROUPS` lag; `None` when Redis cannot
    /// tell, e.g. after entries were deleted from the middle of the stream).
    lag: Option<u64>,
    /// Delivered to a consumer, not yet acknowledged.
    pending: u64,
    /// How long ago the oldest pending entry was last delivered (`XPENDING` idle).
    oldest_pending_idle_seconds: Option<f64>,
    last_delivered_id: String,
    /// Entries in the group's dead-letter stream for this shard (`None` where this role may
    /// not read it: a relay's ACL user covers its own stream only).
    dead_letters: Option<u64>,
}

/// Reads every shard of `--stream` (`--stream-shards` of them); of a routed stream, every
/// shard of each registered route's.
async fn read(args: &StreamsArgs) -> Result<Vec<ShardReport>, RelayError> {
    let redis = args.connection.redis(TIMEOUT)?;
    let stream = args.connection.stream()?;
    let mut conn = redis.connect(TIMEOUT).await?;
    let shards = args.connection.stream_shards;
    let routes: Vec<String> = if layout::is_routed(stream) {
        redis::cmd("HKEYS")
            .arg(layout::registry_key(stream, shards))
            .query_async(&mut conn)
            .await?
    } else {
        Vec::new()
    };
    let layout = layout::Layout::new(stream, shards, routes);
    let mut reports = Vec::new();
    for (lane, key) in layout.keys().into_iter().enumerate() {
        let shard = layout.shard_of_lane(lane as u32);
        reports.push(read_shard(&mut conn, key, shard, shards, Detail::Full).await?);
    }
    Ok(reports)
}

/// What to read of a shard: everything (the command), or what the gauges need (the watch:
/// no entries' payloads, no dead letters, which the relay's ACL user may not read).
#[derive(Clone, Copy, PartialEq)]
enum Detail {
    Full,
    Gauges,
}

async fn read_shard(
    conn: &mut RedisConn,
    key: String,
    shard: u32,
    shards: u32,
    detail: Detail,
) -> Result<ShardReport, RelayError> {
    let exists: bool = redis::cmd("EXISTS").arg(&key).query_async(conn).await?;
    if !exists {
        return Ok(ShardReport {
            key,
            exists,
            length: 0,
            first_id: None,
            last_id: None,
            groups: Vec::new(),
        });
    }
    let (length, first_id, last_id) = match detail {
        Detail::Full => {
            let info: redis::streams::StreamInfoStreamReply = redis::cmd("XINFO")
                .arg("STREAM")
                .arg(&key)
                .query_async(conn)
                .await?;
            if info.length == 0 {
                (0, None, None)
            } else {
                (
                    info.length as u64,
                    Some(info.first_entry.id),
                    Some(info.last_entry.id),
                )
            }
        }
        Detail::Gauges => {
            let length: u64 = redis::cmd("XLEN").arg(&key).query_async(conn).await?;
            (length, None, None)
        }
    };
    let groups: redis::streams::StreamInfoGroupsReply = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&key)
        .query_async(conn)
        .await?;
    let mut reports = Vec::new();
    for g in groups.groups {
        // The oldest pending entry, with its idle time (the extended form). A group
        // destroyed since XINFO answers NOGROUP: it is gone, not a failed round.
        let oldest: redis::streams::StreamPendingCountReply = match redis::cmd("XPENDING")
            .arg(&key)
            .arg(&g.name)
            .arg("-")
            .arg("+")
            .arg(1)
            .query_async(conn)
            .await
        {
            Ok(reply) => reply,
            Err(e) if e.code() == Some("NOGROUP") => continue,
            Err(e) => return Err(e.into()),
        };
        let oldest_pending_idle_seconds = oldest
            .ids
            .first()
            .map(|p| p.last_delivered_ms as f64 / 1000.0);
        let dead_letters = match detail {
            Detail::Full => redis::cmd("XLEN")
                .arg(shard_key(&dead_letter_base(&g.name), shard, shards))
                .query_async::<u64>(conn)
                .await
                .ok(),
            Detail::Gauges => None,
        };
        reports.push(GroupReport {
            name: g.name,
            consumers: g.consumers as u64,
            lag: g.lag.map(|l| l as u64),
            pending: g.pending as u64,
            oldest_pending_idle_seconds,
            last_delivered_id: g.last_delivered_id,
            dead_letters,
        });
    }
    Ok(ShardReport {
        key,
        exists,
        length,
        first_id,
        last_id,
        groups: reports,
    })
}

/// Keep the stream gauges current until `shutdown`. Only the relay holding the slot reads
/// (one reader per side, whatever the replicas); the others export no group gauges, so a
/// value read before a takeover cannot outlive it under the alerts' `max by`.
pub(crate) async fn watch(ctx: Arc<Context>, shutdown: CancellationToken) {
    let cfg = &ctx.config;
    let m = &ctx.metrics;
    let mut conn: Option<RedisConn> = None;
    let mut interval = tokio::time::interval(cfg.slot_metrics_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let clear = || {
        m.stream_length_entries.reset();
        m.stream_group_lag_entries.reset();
        m.stream_group_pending_entries.reset();
        m.stream_group_oldest_pending_idle_seconds.reset();
        m.stream_group_consumers.reset();
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = interval.tick() => {}
        }
        // The role, not the monitor's slot_held: that one trails by an interval and stays as
        // it was while Postgres does not answer.
        if ctx.role() != Role::Streaming {
            clear();
            m.stream_up.set(0);
            continue;
        }
        if conn.is_none() {
            conn = cfg.redis.connect(cfg.redis_timeout).await.ok();
        }
        let Some(c) = conn.as_mut() else {
            clear();
            m.stream_up.set(0);
            continue;
        };
        // The current session's streams (every route's, when routed).
        let layout = ctx.layout();
        let read = async {
            let mut reports = Vec::new();
            for (lane, key) in layout.keys().into_iter().enumerate() {
                let shard = layout.shard_of_lane(lane as u32);
                reports.push(read_shard(c, key, shard, layout.shards(), Detail::Gauges).await?);
            }
            Ok::<_, RelayError>(reports)
        };
        match read.await {
            Ok(reports) => {
                m.stream_up.set(1);
                // Groups come and go: only what this round saw is exported.
                clear();
                for (lane, report) in reports.iter().enumerate() {
                    let shard = layout.label(lane as u32);
                    m.stream_length_entries
                        .with_label_values(&[&shard])
                        .set(report.length as i64);
                    for g in &report.groups {
                        let labels = [shard.as_str(), g.name.as_str()];
                        m.stream_group_lag_entries
                            .with_label_values(&labels)
                            .set(g.lag.map_or(f64::NAN, |l| l as f64));
                        m.stream_group_pending_entries
                            .with_label_values(&labels)
                            .set(g.pending as i64);
                        m.stream_group_oldest_pending_idle_seconds
                            .with_label_values(&labels)
                            .set(g.oldest_pending_idle_seconds.unwrap_or(0.0));
                        m.stream_group_consumers
                            .with_label_values(&labels)
                            .set(g.consumers as i64);
                    }
                }
            }
            Err(e) => {
                // Stale values would keep (or hide) an alert: export none instead.
                debug!(error = %e, "stream health query failed");
                clear();
                m.stream_up.set(0);
                conn = None;
            }
        }
    }
}

/// `cdc-relay streams`: a table, or JSON.
pub async fn streams(args: &StreamsArgs) -> Result<String, RelayError> {
    let reports = read(args).await?;
    if args.json {
        return Ok(serde_json::to_string_pretty(&reports).expect("serializes") + "\n");
    }
    let dash = || "-".to_string();
    let mut out = format!(
        "{:<28} {:>9} {:<22} {:<22} {:<16} {:>9} {:>7} {:>9} {:>12} {:>6}\n",
        "stream",
        "length",
        "first id",
        "last id",
        "group",
        "consumers",
        "lag",
        "pending",
        "idle (s)",
        "dead"
    );
    for shard in &reports {
        let head = format!(
            "{:<28} {:>9} {:<22} {:<22}",
            shard.key,
            if shard.exists {
                shard.length.to_string()
            } else {
                "(none)".into()
            },
            shard.first_id.clone().unwrap_or_else(dash),
            shard.last_id.clone().unwrap_or_else(dash),
        );
        if shard.groups.is_empty() {
            out.push_str(&format!("{head} {:<16}\n", "(no groups)"));
        }
        for g in &shard.groups {
            out.push_str(&format!(
                "{head} {:<16} {:>9} {:>7} {:>9} {:>12} {:>6}\n",
                g.name,
                g.consumers,
                g.lag.map_or_else(dash, |l| l.to_string()),
                g.pending,
                g.oldest_pending_idle_seconds
                    .map_or_else(dash, |a| format!("{a:.1}")),
                g.dead_letters.map_or_else(dash, |d| d.to_string()),
            ));
        }
    }
    Ok(out)
}
