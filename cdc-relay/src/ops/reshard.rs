//! `cdc-relay reshard`: move a drained stream to another shard count.
//!
//! A chat's messages must reach its receivers in commit order, and a new count sends most
//! chats to another shard. So the count changes only at a point where nothing is in flight
//! in the old layout: every relay of the side stopped (the slot inactive: commits wait in
//! the slot), and every consumer group read and acknowledged every entry of every old
//! shard. Then the new layout's records are written at the old layout's position (same
//! origin, acknowledged through the slot's position, ids placed above whatever the new
//! shard keys already hold), and the old records that are not also new ones are marked with
//! the new count, so a binary still configured with the old count refuses to run. The
//! relay started with the new count streams on from the slot; nothing is republished.
//! See docs/deployment.md, "Resizing a stream".
//!
//! The steps: [`inactive_slot`] → [`current_layout`] → [`old_layout`] (drained and whole)
//! → under the rebuild lock, [`write_new_layout`].

use outbox_core::connect::RedisConn;
use outbox_core::stream::keys::origin_key;
use outbox_core::stream::record::{other_layout_origin_key, recorded_shards};
use outbox_core::stream::{shard_keys, EntryId};
use tracing::info;

use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::sink::{offset_above, read_all, NewRecord, Publisher, RebuildLock, Records};
use crate::source::{slot_info, Origin};

/// The layout in use: its shard count, and whether the plain stream has a record.
struct Layout {
    current: u32,
    plain: Option<u32>,
}

/// What the old layout says, checked.
struct OldLayout {
    keys: Vec<String>,
    origin: Origin,
    /// The largest id offset of its records.
    id_offset: u64,
}

/// Resize `cfg.stream` to `cfg.stream_shards` shards; what was done, for the operator.
pub async fn reshard(cfg: &RelayConfig) -> Result<String, RelayError> {
    let base = &cfg.stream;
    let target = cfg.stream_shards;
    if crate::sink::layout::is_routed(base) {
        return Err(RelayError::Config(format!(
            "reshard resizes one stream; --stream '{base}' is a template of routes, whose resizing is not supported yet: every route keeps --stream-shards"
        )));
    }
    let sql = cfg.postgres.endpoint.connect(cfg.connect_timeout).await?;
    let start_lsn = inactive_slot(cfg, &sql).await?;
    let mut publisher = Publisher::connect(
        &cfg.redis,
        base,
        target,
        cfg.stream_max_len,
        cfg.redis_timeout,
    )
    .await?;
    let mut conn = publisher.connection();
    let layout = current_layout(&mut conn, base).await?;
    let current = layout.current;
    if current == target {
        return Ok(format!(
            "stream {base} already has {target} shard(s); nothing to do"
        ));
    }
    let old = old_layout(&mut conn, base, current, start_lsn).await?;
    // The new layout's keys may hold entries already (shared keys, an earlier layout):
    // new ids go above every one of them.
    let Some(mut lock) = RebuildLock::acquire(
        conn.clone(),
        publisher.shard_stream(0),
        &format!("reshard-{}", std::process::id()),
        cfg.rebuild_lock_ttl,
    )
    .await?
    else {
        return Err(RelayError::Config(format!(
            "a relay holds the rebuild lock of {}: stop every relay of this side first",
            publisher.shard_stream(0)
        )));
    };
    let written = write_new_layout(
        cfg,
        &sql,
        &mut publisher,
        &mut conn,
        &mut lock,
        &layout,
        &old,
        start_lsn,
    )
    .await;
    lock.release().await;
    let id_offset = written?;
    info!(stream = %base, from = current, to = target, acked_through = start_lsn, id_offset, "stream resized");
    Ok(format!(
        "stream {base} resized from {current} to {target} shard(s) at the slot's position; start the receivers with --stream-shards {target}, then the relay"
    ))
}

/// Step 1: the slot exists and no relay holds it; its confirmed position.
async fn inactive_slot(cfg: &RelayConfig, sql: &tokio_postgres::Client) -> Result<u64, RelayError> {
    let slot =
        slot_info(sql, &cfg.postgres.slot)
            .await?
            .ok_or_else(|| RelayError::SlotMissing {
                slot: cfg.postgres.slot.clone(),
            })?;
    if let Some(pid) = slot.active_pid {
        return Err(RelayError::Config(format!(
            "slot {} is in use (walsender pid {pid}): stop every relay of this side, then run reshard again",
            cfg.postgres.slot
        )));
    }
    Ok(slot
        .confirmed_flush_lsn
        .map(|l| l.as_u64())
        .unwrap_or_default())
}

/// Step 2: the layout in use: the plain stream unless its record was retired, else the
/// count shard 0 of a sharded stream states.
async fn current_layout(conn: &mut RedisConn, base: &str) -> Result<Layout, RelayError> {
    let plain = recorded_shards(conn, &origin_key(base)).await?;
    let tagged = recorded_shards(conn, &other_layout_origin_key(base, 1)).await?;
    let current = match (plain, tagged) {
        (Some(1), _) => 1,
        (_, Some(n)) if n > 1 => n,
        _ => {
            return Err(RelayError::Config(format!(
                "stream {base} has no record to resize from: run the relay once (or `setup`) with its current --stream-shards first"
            )))
        }
    };
    Ok(Layout { current, plain })
}

/// Step 3: every old shard fully read and acknowledged by every group, and whole: what
/// takeover would rebuild for must not be papered over by new records.
async fn old_layout(
    conn: &mut RedisConn,
    base: &str,
    current: u32,
    start_lsn: u64,
) -> Result<OldLayout, RelayError> {
    let keys = shard_keys(base, current);
    for key in &keys {
        drained(conn, key).await?;
    }
    let first = Records::new(conn.clone(), &keys[0]).read().await?;
    let (Some(system_id), Some(timeline)) = (first.system_id.clone(), first.timeline) else {
        return Err(RelayError::Config(format!(
            "stream {} has no complete record: let the relay finish its rebuild with the current count first",
            keys[0]
        )));
    };
    let origin = Origin {
        system_id,
        timeline,
        history: first.history.clone().unwrap_or_default(),
    };
    let mut old = Vec::new();
    for key in &keys {
        old.push(Records::new(conn.clone(), key).read().await?);
    }
    // Every old shard has its record, holds what it wrote, and knows what the slot
    // confirmed.
    for (key, r) in keys.iter().zip(&old) {
        let lost = !r.exists()
            || r.last_id.is_some_and(|last| r.top < last)
            || r.acked_through.unwrap_or(0) < start_lsn;
        if lost {
            return Err(RelayError::Config(format!(
                "{key} lost data (its record is missing, or behind the slot, or entries it wrote are gone): start the relay with the current --stream-shards so it rebuilds, let the receivers drain, then run reshard again"
            )));
        }
    }
    if old.iter().any(|r| r.rebuilding.is_some()) {
        return Err(RelayError::Config(format!(
            "stream {base} is being rebuilt: let the relay finish, stop it, then run reshard again"
        )));
    }
    Ok(OldLayout {
        keys,
        origin,
        id_offset: old.iter().map(|r| r.id_offset).max().unwrap_or(0),
    })
}

/// Step 4, under the lock: the new layout's records at the slot's position (acknowledged
/// through it: the relays are stopped, so it no longer moves), the old ones retired, and
/// the result checked. The id offset the new layout streams with.
#[allow(clippy::too_many_arguments)]
async fn write_new_layout(
    cfg: &RelayConfig,
    sql: &tokio_postgres::Client,
    publisher: &mut Publisher,
    conn: &mut RedisConn,
    lock: &mut RebuildLock,
    layout: &Layout,
    old: &OldLayout,
    start_lsn: u64,
) -> Result<u64, RelayError> {
    let base = &cfg.stream;
    let target = cfg.stream_shards;
    // A relay that started since the checks would have moved the slot: then nothing is
    // written and the operator runs reshard again with the relays stopped.
    let now = slot_info(sql, &cfg.postgres.slot).await?;
    if now
        .as_ref()
        .map(|s| (s.active_pid, s.confirmed_flush_lsn.map(|l| l.as_u64())))
        != Some((None, Some(start_lsn)))
    {
        return Err(RelayError::Config(format!(
            "slot {} was taken or moved while resharding: stop every relay of this side, then run reshard again",
            cfg.postgres.slot
        )));
    }
    let mut records = publisher.records();
    let new = read_all(&mut records).await?;
    let id_offset = new
        .iter()
        .map(|r| offset_above(r.top, start_lsn, old.id_offset))
        .max()
        .unwrap_or(old.id_offset);
    for (r, now) in records.iter_mut().zip(&new) {
        r.replace(
            lock,
            &NewRecord {
                origin: &old.origin,
                shards: target,
                acked_through: start_lsn,
                id_offset,
                last_id: (now.top != EntryId::default()).then_some(now.top),
                watermark: None,
                rebuilding: None,
            },
        )
        .await?;
    }
    // Retire the old records that are not new ones: they now state the new count (and so
    // does the plain stream's record of an earlier layout, which every binary reads to tell
    // the layouts apart).
    let new_keys = shard_keys(base, target);
    let mut retire: Vec<&String> = old.keys.iter().filter(|k| !new_keys.contains(k)).collect();
    if target > 1 && layout.plain.is_some() && !retire.contains(&base) {
        retire.push(base);
    }
    for key in retire {
        let () = redis::cmd("HSET")
            .arg(origin_key(key))
            .arg(outbox_core::stream::record::fields::SHARDS)
            .arg(target)
            .query_async::<i64>(&mut *conn)
            .await
            .map(|_| ())?;
    }
    publisher
        .check_layout(
            &read_all(&mut records)
                .await?
                .into_iter()
                .map(Some)
                .collect::<Vec<_>>(),
        )
        .await?;
    Ok(id_offset)
}

/// Every consumer group of `stream` read up to its top and acknowledged everything.
async fn drained(conn: &mut RedisConn, stream: &str) -> Result<(), RelayError> {
    let exists: bool = redis::cmd("EXISTS").arg(stream).query_async(conn).await?;
    if !exists {
        return Ok(());
    }
    let info: redis::streams::StreamInfoStreamReply = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query_async(conn)
        .await?;
    let groups: redis::streams::StreamInfoGroupsReply = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await?;
    if groups.groups.is_empty() && info.length > 0 {
        return Err(RelayError::Config(format!(
            "{stream} holds {} entries and no consumer group read them: start the receivers and let them drain it, then run reshard again",
            info.length
        )));
    }
    for g in &groups.groups {
        if g.pending > 0 || g.last_delivered_id != info.last_generated_id {
            return Err(RelayError::Config(format!(
                "{stream}: group {} has not finished (read up to {} of {}, {} pending): with the relay stopped, wait until the receivers drained every shard, then run reshard again",
                g.name, g.last_delivered_id, info.last_generated_id, g.pending
            )));
        }
    }
    Ok(())
}
