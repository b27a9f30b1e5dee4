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

use crate::redis_client::RedisConn;
use tracing::info;

use crate::batch::EntryId;
use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::publisher::Publisher;
use crate::record::{
    offset_above, origin_key, other_layout_origin_key, read_all, recorded_shards, NewRecord,
    Origin, RebuildLock,
};
use crate::setup::slot_info;
use crate::shard::shard_keys;

/// Resize `cfg.stream` to `cfg.stream_shards` shards; what was done, for the operator.
pub async fn reshard(cfg: &RelayConfig) -> Result<String, RelayError> {
    let base = &cfg.stream;
    let target = cfg.stream_shards;
    let sql = cfg.postgres.endpoint.connect(cfg.connect_timeout).await?;
    let slot =
        slot_info(&sql, &cfg.postgres.slot)
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
    let start_lsn = slot
        .confirmed_flush_lsn
        .map(|l| l.as_u64())
        .unwrap_or_default();
    let mut publisher = Publisher::connect(
        &cfg.redis,
        base,
        target,
        cfg.stream_max_len,
        cfg.redis_timeout,
    )
    .await?;
    let mut conn = publisher.connection();

    // The layout in use: the plain stream unless its record was retired, else the count
    // shard 0 of a sharded stream states.
    let plain = recorded_shards(&mut conn, &origin_key(base)).await?;
    let tagged = recorded_shards(&mut conn, &other_layout_origin_key(base, 1)).await?;
    let current = match (plain, tagged) {
        (Some(1), _) => 1,
        (_, Some(n)) if n > 1 => n,
        _ => {
            return Err(RelayError::Config(format!(
                "stream {base} has no record to resize from: run the relay once (or `setup`) with its current --stream-shards first"
            )))
        }
    };
    if current == target {
        return Ok(format!(
            "stream {base} already has {target} shard(s); nothing to do"
        ));
    }

    // Every old shard fully read and acknowledged by every group.
    let old_keys = shard_keys(base, current);
    for key in &old_keys {
        drained(&mut conn, key).await?;
    }
    let mut old_records = crate::record::Records::new(conn.clone(), &old_keys[0]);
    let first = old_records.read().await?;
    let (Some(system_id), Some(timeline)) = (first.system_id.clone(), first.timeline) else {
        return Err(RelayError::Config(format!(
            "stream {} has no complete record: let the relay finish its rebuild with the current count first",
            old_keys[0]
        )));
    };
    let origin = Origin {
        system_id,
        timeline,
        history: first.history.clone().unwrap_or_default(),
    };
    let mut old = Vec::new();
    for key in &old_keys {
        old.push(
            crate::record::Records::new(conn.clone(), key)
                .read()
                .await?,
        );
    }
    // What takeover would rebuild for must not be papered over by new records: every old
    // shard has its record, holds what it wrote, and knows what the slot confirmed.
    for (key, r) in old_keys.iter().zip(&old) {
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
    // Acknowledged through the slot's position: every shard then knows what the slot says
    // was delivered (the relays are stopped, so it no longer moves).
    let acked_through = start_lsn;
    let old_offset = old.iter().map(|r| r.id_offset).max().unwrap_or(0);

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
    let result = async {
        // A relay that started since the checks would have moved the slot: then nothing
        // is written and the operator runs reshard again with the relays stopped.
        let now = slot_info(&sql, &cfg.postgres.slot).await?;
        if now.as_ref().map(|s| (s.active_pid, s.confirmed_flush_lsn.map(|l| l.as_u64())))
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
            .map(|r| offset_above(r.top, start_lsn, old_offset))
            .max()
            .unwrap_or(old_offset);
        for (r, now) in records.iter_mut().zip(&new) {
            r.replace(
                &mut lock,
                &NewRecord {
                    origin: &origin,
                    shards: target,
                    acked_through,
                    id_offset,
                    last_id: (now.top != EntryId::default()).then_some(now.top),
                },
            )
            .await?;
        }
        // Retire the old records that are not new ones: they now state the new count (and
        // so does the plain stream's record of an earlier layout, which every binary reads
        // to tell the layouts apart).
        let new_keys = shard_keys(base, target);
        let mut retire: Vec<&String> = old_keys.iter().filter(|k| !new_keys.contains(k)).collect();
        if target > 1 && plain.is_some() && !retire.contains(&base) {
            retire.push(base);
        }
        for key in retire {
            let () = redis::cmd("HSET")
                .arg(origin_key(key))
                .arg("shards")
                .arg(target)
                .query_async::<i64>(&mut conn)
                .await
                .map(|_| ())?;
        }
        publisher
            .check_layout(&read_all(&mut records).await?)
            .await?;
        Ok::<_, RelayError>(id_offset)
    }
    .await;
    lock.release().await;
    let id_offset = result?;
    info!(stream = %base, from = current, to = target, acked_through, id_offset, "stream resized");
    Ok(format!(
        "stream {base} resized from {current} to {target} shard(s) at the slot's position; start the receivers with --stream-shards {target}, then the relay"
    ))
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
