//! The stream's record (`<stream>:origin`, a hash beside each stream or shard): which
//! Postgres system and timeline history write the stream, how far the relay acknowledged
//! its slot, and the shard count the stream was set up with. Only the relay writes it
//! (`setup` and rebuilds); consumers read the shard count, so that every binary of a side
//! agrees on the layout before it touches a shard.

use redis::aio::ConnectionLike;

use super::keys::origin_key;
use super::shard::{check_recorded, recorded_count, shard_key};
use crate::error::ConfigError;

/// The record's fields.
pub mod fields {
    /// The Postgres system identifier (`IDENTIFY_SYSTEM`) whose changes the stream carries.
    pub const SYSTEM_ID: &str = "system_id";
    /// The server's timeline when the record was last written.
    pub const TIMELINE: &str = "timeline";
    /// Its timeline history: `<tli>:<lsn>` switch points, comma-separated.
    pub const HISTORY: &str = "history";
    /// The highest LSN the relay acknowledged to its slot (always recorded here first).
    pub const ACKED_THROUGH: &str = "acked_through";
    /// A catch-up from the outbox table started and did not finish: `everything` (the shard
    /// lost what it held: every retained row is compared with it) or `since` (from its
    /// watermark). Older relays wrote their rebuild's reason here: read as `everything`.
    pub const REBUILDING: &str = "rebuilding";
    /// The last id the relay wrote.
    pub const LAST_ID: &str = "last_id";
    /// Added to commit LSNs to make stream ids (non-zero after some rebuilds).
    pub const ID_OFFSET: &str = "id_offset";
    /// The shard count the stream was set up with (absent in records from before shards:
    /// one).
    pub const SHARDS: &str = "shards";
    /// The writer epoch of the relay session that writes the stream now (each takeover and
    /// rebuild claims a higher one; the publish script refuses older sessions).
    pub const WRITER_EPOCH: &str = "writer_epoch";
    /// A Postgres snapshot `acked_through` covers, between two WAL positions:
    /// `<lo>/<hi>/<taken at, Unix µs>/<xmin:xmax:xip,...>`. Rows whose transaction it does not
    /// show may be missing from the shard when the slot has moved past `acked_through`.
    pub const WATERMARK: &str = "watermark";
    /// The first entry id that may hold such a row (entries from here on are never trimmed,
    /// so that a comparison with the outbox sees them).
    pub const WATERMARK_FROM: &str = "watermark_from";
    /// A catch-up's progress, `<snapshot>/<outbox id>`: every row the snapshot shows, up to
    /// that id, is in the shard (or was consumed), so one cut short goes on from there.
    pub const CATCH_UP_CURSOR: &str = "catch_up_cursor";
    /// A snapshot every row of which a catch-up put in the shard (a round it finished).
    pub const CATCH_UP_DONE: &str = "catch_up_done";
    /// The replication slot the stream was last read from (written by every session that
    /// holds it): a relay finding no slot of this name knows it was dropped, while a relay
    /// configured with another name is misconfigured, not facing a dropped slot.
    pub const SLOT: &str = "slot";

    /// Every field of the record.
    pub const ALL: [&str; 14] = [
        SYSTEM_ID,
        TIMELINE,
        HISTORY,
        ACKED_THROUGH,
        REBUILDING,
        LAST_ID,
        ID_OFFSET,
        SHARDS,
        WRITER_EPOCH,
        WATERMARK,
        WATERMARK_FROM,
        CATCH_UP_CURSOR,
        CATCH_UP_DONE,
        SLOT,
    ];
}

/// Key of the record that only the other key layout of `base` has (with one shard: shard
/// 0's of a sharded stream; with more: the plain stream's): if it exists, the stream was set
/// up with another count.
pub fn other_layout_origin_key(base: &str, shards: u32) -> String {
    if shards == 1 {
        origin_key(&shard_key(base, 0, 2))
    } else {
        origin_key(base)
    }
}

/// The shard count the record at `key` states (`None`: no record there; 0: a count that
/// cannot be read, which matches no configuration).
pub async fn recorded_shards<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
) -> redis::RedisResult<Option<u32>> {
    let (system_id, shards): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(key)
        .arg(fields::SYSTEM_ID)
        .arg(fields::SHARDS)
        .query_async(conn)
        .await?;
    Ok(system_id.map(|_| recorded_count(shards.as_deref()).unwrap_or(0)))
}

/// How long the other layout's record may take to read before its check is skipped.
const OTHER_LAYOUT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether the stream `base` may be used with `shards` shards: every record given in
/// `recorded` (counts already read) and the other layout's record must state the same
/// count. The inner error says what to change; the outer one is Redis failing.
///
/// The other layout's record is one key, on one node of a cluster: a node that fails
/// transiently or does not answer within 2 s skips that record's check for this call (the
/// records in `recorded` were read, each on its shard's node), so one master's outage does
/// not stop the shards on the others. A Redis user whose ACL predates shards may not read it
/// either: then it is not checked (and a warning says to load the current ACL).
pub async fn check_layout<C: ConnectionLike + Send>(
    conn: &mut C,
    base: &str,
    shards: u32,
    mut recorded: Vec<u32>,
) -> redis::RedisResult<Result<(), ConfigError>> {
    let other = other_layout_origin_key(base, shards);
    match tokio::time::timeout(OTHER_LAYOUT_WAIT, recorded_shards(conn, &other)).await {
        Ok(Ok(count)) => recorded.extend(count),
        Ok(Err(e)) if e.code() == Some("NOPERM") => {
            tracing::warn!(key = %other, "the Redis user may not read the other shard layout's record; load the current deploy/redis/users.acl");
        }
        Ok(Err(e)) if crate::error::redis_is_transient(&e) => {
            tracing::warn!(key = %other, error = %e, "the other shard layout's record cannot be read now; checked next time");
        }
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            tracing::warn!(key = %other, "the other shard layout's record did not answer within 2 s; checked next time");
        }
    }
    Ok(check_recorded(base, shards, recorded))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_other_layout_is_the_plain_key_or_shard_zero() {
        assert_eq!(
            other_layout_origin_key("outbox:consumers", 1),
            "outbox:consumers:{0}:origin"
        );
        assert_eq!(
            other_layout_origin_key("outbox:consumers", 8),
            "outbox:consumers:origin"
        );
    }
}
