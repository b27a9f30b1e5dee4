//! The stream's record (`<stream>:origin`): which Postgres system and timeline history
//! write the stream, how far the relay acknowledged its slot, the last id it wrote, the
//! offset that keeps ids above the stream's top after a rebuild, and a rebuild in progress.
//! Its fields are the contract's (`outbox_core::stream::record`); reading and writing them
//! is the relay's alone.
//!
//! The record is the stream's identity, so only these create or replace it: `setup`, when it
//! created the slot in the same call and the stream is empty or absent; a catch-up of a
//! shard that lost its record; and a rebuild that made the slot anew. The publish script
//! refuses a stream without a record (`NORECORD`), so a Redis that lost everything is noticed
//! at the next call, even an acknowledgement-only one, and leads to a catch-up of every
//! retained row instead of a silent fresh start.
//!
//! Invariant relied on everywhere: for a shard that is live (not behind), `acked_through`
//! ≥ the slot's `confirmed_flush_lsn`, because every acknowledgement is recorded in every
//! live shard before the slot hears it. A shard below the slot fell behind (or Redis lost
//! data): its `watermark` says from where the outbox table owes it rows. Read the slot
//! first, then Redis: a relay acknowledging in between can only raise Redis's side.

use outbox_core::connect::RedisConn;
use outbox_core::stream::entry;
use outbox_core::stream::keys::{origin_key, rebuild_lock_key};
use outbox_core::stream::record::fields;
use outbox_core::stream::{recorded_count, EntryId};

use super::functions::{ADOPT_TIMELINE, CLAIM, RECORD_CREATE, RECORD_REPLACE};
use crate::error::RelayError;
use crate::source::{Origin, Snapshot, TimelineHistory, Watermark};

/// What Redis knows about the stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct StreamRecord {
    pub system_id: Option<String>,
    pub timeline: Option<u32>,
    pub history: Option<TimelineHistory>,
    /// The highest LSN the relay acknowledged to its slot (recorded before acknowledging).
    pub acked_through: Option<u64>,
    /// A catch-up (or an older relay's rebuild) started and did not finish.
    pub rebuilding: Option<String>,
    /// The last id the relay wrote.
    pub last_id: Option<EntryId>,
    /// Added to commit LSNs to make stream ids (non-zero after a rebuild onto a history
    /// whose LSNs lie below the stream's top).
    pub id_offset: u64,
    /// The stream's own last-generated id (`0-0` when the stream does not exist).
    pub top: EntryId,
    /// Entries in the stream now.
    pub len: u64,
    /// The shard count the stream was set up with (`None`: unreadable; records written
    /// before shards existed say 1).
    pub shards: Option<u32>,
    /// The snapshot `acked_through` covers (`None`: none recorded, or unreadable).
    pub watermark: Option<Watermark>,
    /// The first entry id that may hold a row the watermark does not show.
    pub watermark_from: Option<EntryId>,
    /// A catch-up's progress: every row the snapshot shows up to the outbox id is in the
    /// shard.
    pub catch_up_cursor: Option<(Snapshot, i64)>,
    /// A snapshot every row of which a catch-up put in the shard.
    pub catch_up_done: Option<Snapshot>,
    /// The slot the stream was last read from (`None` in records no session wrote since).
    pub slot: Option<String>,
}

impl StreamRecord {
    pub(crate) fn exists(&self) -> bool {
        self.system_id.is_some()
    }

    /// Entries the relay wrote are gone (the stream was deleted, or restored from older
    /// data than its record).
    pub(crate) fn lost_entries(&self) -> bool {
        self.last_id.is_some_and(|last| self.top < last)
    }

    /// A catch-up that compares every retained row was started (and not finished): the
    /// marker of this relay's, or any rebuild reason of an older relay's.
    pub(crate) fn catching_up_everything(&self) -> bool {
        self.rebuilding
            .as_deref()
            .is_some_and(|r| r != CATCH_UP_SINCE)
    }
}

/// The marker of a catch-up from the shard's watermark.
pub(crate) const CATCH_UP_SINCE: &str = "since";
/// The marker of a catch-up that compares every retained row.
pub(crate) const CATCH_UP_EVERYTHING: &str = "everything";

/// A new record, as `setup`, a rebuild or a catch-up writes it.
pub(crate) struct NewRecord<'a> {
    pub origin: &'a Origin,
    pub shards: u32,
    pub acked_through: u64,
    pub id_offset: u64,
    pub last_id: Option<EntryId>,
    /// A snapshot `acked_through` covers.
    pub watermark: Option<&'a Watermark>,
    /// A catch-up under way (its marker).
    pub rebuilding: Option<&'static str>,
}

impl NewRecord<'_> {
    fn fields(&self) -> Vec<(&'static str, String)> {
        let mut record = vec![
            (fields::SYSTEM_ID, self.origin.system_id.clone()),
            (fields::TIMELINE, self.origin.timeline.to_string()),
            (fields::HISTORY, self.origin.history.encode()),
            (fields::ACKED_THROUGH, self.acked_through.to_string()),
            (fields::ID_OFFSET, self.id_offset.to_string()),
            (fields::SHARDS, self.shards.to_string()),
        ];
        if let Some(id) = self.last_id {
            record.push((fields::LAST_ID, id.to_string()));
        }
        if let Some(w) = self.watermark {
            record.push((fields::WATERMARK, w.encode()));
            // Nothing before the record's creation is in the stream to compare with.
            record.push((fields::WATERMARK_FROM, "0-1".to_string()));
        }
        if let Some(marker) = self.rebuilding {
            record.push((fields::REBUILDING, marker.to_string()));
        }
        record
    }
}

/// The offset that puts ids of commits at or after `start_lsn` above `top`.
pub(crate) fn offset_above(top: EntryId, start_lsn: u64, current: u64) -> u64 {
    if start_lsn.saturating_add(current) > top.commit_lsn {
        current
    } else {
        top.commit_lsn + 1 - start_lsn
    }
}

/// Replace the record. (The caller confirmed the rebuild lock just before, which extends
/// it by a whole TTL: the ACL keeps the lock and the record in separate selectors, so one
/// script cannot touch both.)
pub(super) const REPLACE: &str = r#"
redis.call('HDEL', KEYS[1], 'rebuilding', 'last_id', 'watermark', 'watermark_from', 'catch_up_cursor', 'catch_up_done')
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"#;

/// Create the record, only if there is none.
pub(super) const CREATE: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
-- Fenced from the moment it exists: an epoch of Redis's clock is above every session's
-- claimed before (a paused relay's late batch would otherwise pass, and take the stream
-- back, between this and the creator's own claim).
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'writer_epoch', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
return 1
"#;

/// Claim a new writer epoch in the record: above the one it holds, and at least Redis's
/// clock in milliseconds, so a record Redis lost and a rebuild made again still starts
/// above every epoch claimed before. The new epoch (`false`: no record; only `setup` and a
/// rebuild make one). ARGV[1]: the slot the session holds, recorded with the claim.
pub(super) const CLAIM_EPOCH: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local current = tonumber(redis.call('HGET', KEYS[1], 'writer_epoch') or '0')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local claimed = math.max(current + 1, now)
redis.call('HSET', KEYS[1], 'writer_epoch', claimed, 'slot', ARGV[1])
return tostring(claimed)
"#;

/// Move an existing record onto the server's timeline. Snapshots the record holds from past
/// where its history and the server's agree (ARGV[4]: an LSN; 0 when they forked or when no
/// watermark stays meaningful) or past its acknowledgement (a catch-up's hand-over
/// watermark; a catch-up's progress snapshots, which carry no position) can show
/// transactions of the old primary whose ids the new one gives out again: they are
/// forgotten, so a later catch-up compares everything instead of skipping new rows by a
/// stale snapshot. (Acknowledgements record new watermarks, taken on the new primary.)
pub(super) const ADOPT: &str = r#"
if redis.call('HGET', KEYS[1], 'system_id') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'timeline', ARGV[2], 'history', ARGV[3])
local acked = tonumber(redis.call('HGET', KEYS[1], 'acked_through') or '0') or 0
local bound = math.min(acked, tonumber(ARGV[4]) or 0)
local w = redis.call('HGET', KEYS[1], 'watermark')
local hi = w and tonumber(string.match(w, '^%d+/(%d+)/'))
local stale = (w and (hi == nil or hi > bound))
  or redis.call('HEXISTS', KEYS[1], 'catch_up_done') == 1
  or redis.call('HEXISTS', KEYS[1], 'catch_up_cursor') == 1
if stale then
  redis.call('HDEL', KEYS[1], 'watermark', 'watermark_from', 'catch_up_done', 'catch_up_cursor')
end
-- Histories that part before the acknowledgement (a fork): what the shard holds past that
-- point is not this server's. Marked in the same step, so a crash before the catch-up that
-- follows cannot leave a record that looks like the same history, streamed as is.
if bound < acked then
  redis.call('HSET', KEYS[1], 'rebuilding', 'everything')
end
return 1
"#;

/// Every shard's record, in shard order.
pub(crate) async fn read_all(records: &mut [Records]) -> Result<Vec<StreamRecord>, RelayError> {
    let mut all = Vec::with_capacity(records.len());
    for r in records.iter_mut() {
        all.push(r.read().await?);
    }
    Ok(all)
}

/// Reads and writes the record of one stream.
#[derive(Clone)]
pub(crate) struct Records {
    conn: RedisConn,
    stream: String,
    origin_key: String,
    lock_key: String,
}

impl Records {
    pub(crate) fn new(conn: RedisConn, stream: &str) -> Self {
        Self {
            conn,
            stream: stream.to_string(),
            origin_key: origin_key(stream),
            lock_key: rebuild_lock_key(stream),
        }
    }

    /// The stream (shard) key.
    pub(crate) fn stream(&self) -> &str {
        &self.stream
    }

    /// The record and the stream's top and length.
    pub(crate) async fn read(&mut self) -> Result<StreamRecord, RelayError> {
        let values: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&self.origin_key)
            .arg(&[
                fields::SYSTEM_ID,
                fields::TIMELINE,
                fields::HISTORY,
                fields::ACKED_THROUGH,
                fields::REBUILDING,
                fields::LAST_ID,
                fields::ID_OFFSET,
                fields::SHARDS,
                fields::WATERMARK,
                fields::WATERMARK_FROM,
                fields::CATCH_UP_CURSOR,
                fields::CATCH_UP_DONE,
                fields::SLOT,
            ])
            .query_async(&mut self.conn)
            .await?;
        let field = |i: usize| values.get(i).cloned().flatten();
        let (top, len) = self.top_and_len().await?;
        Ok(StreamRecord {
            system_id: field(0),
            timeline: field(1).and_then(|t| t.parse().ok()),
            history: field(2).and_then(|h| TimelineHistory::decode(&h)),
            acked_through: field(3).and_then(|a| a.parse().ok()),
            rebuilding: field(4),
            last_id: field(5).and_then(|id| id.parse().ok()),
            id_offset: field(6).and_then(|o| o.parse().ok()).unwrap_or(0),
            top,
            len,
            shards: recorded_count(field(7).as_deref()),
            watermark: field(8).and_then(|w| Watermark::decode(&w)),
            watermark_from: field(9).and_then(|id| id.parse().ok()),
            catch_up_cursor: field(10).and_then(|c| {
                let (snapshot, id) = c.rsplit_once('/')?;
                Some((Snapshot::parse(snapshot)?, id.parse().ok()?))
            }),
            catch_up_done: field(11).and_then(|s| Snapshot::parse(&s)),
            slot: field(12),
        })
    }

    /// The stream's last-generated id (`0-0` when it does not exist) and its length.
    pub(crate) async fn top_and_len(&mut self) -> Result<(EntryId, u64), RelayError> {
        let exists: bool = redis::cmd("EXISTS")
            .arg(&self.stream)
            .query_async(&mut self.conn)
            .await?;
        if !exists {
            return Ok((EntryId::default(), 0));
        }
        let info: redis::streams::StreamInfoStreamReply = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(&self.stream)
            .query_async(&mut self.conn)
            .await?;
        let top = info
            .last_generated_id
            .parse()
            .map_err(|e| RelayError::Protocol(format!("XINFO last-generated-id: {e}")))?;
        Ok((top, info.length as u64))
    }

    /// Write a first record unless one exists (`setup`); whether it was written.
    pub(crate) async fn create(&mut self, record: &NewRecord<'_>) -> Result<bool, RelayError> {
        let mut invocation = RECORD_CREATE.key(&self.origin_key);
        for (name, value) in record.fields() {
            invocation.arg(name).arg(value);
        }
        let created: i64 = invocation.invoke_async(&mut self.conn).await?;
        Ok(created == 1)
    }

    /// Replace the record (`reshard`; the caller holds the rebuild lock).
    pub(crate) async fn replace(
        &mut self,
        lock: &mut super::RebuildLock,
        record: &NewRecord<'_>,
    ) -> Result<(), RelayError> {
        lock.confirm().await?;
        let mut invocation = RECORD_REPLACE.key(&self.origin_key);
        for (name, value) in record.fields() {
            invocation.arg(name).arg(value);
        }
        let _: i64 = invocation.invoke_async(&mut self.conn).await?;
        Ok(())
    }

    /// Claim the stream (this shard) for a new writer session: the publish script then
    /// refuses every session that claimed before (a paused or partitioned relay that lost
    /// the slot, retrying an old batch). The session's epoch (`0`: no record to claim in).
    pub(crate) async fn claim_epoch(&mut self, slot: &str) -> Result<u64, RelayError> {
        let claimed: Option<String> = CLAIM
            .key(&self.origin_key)
            .arg(slot)
            .invoke_async(&mut self.conn)
            .await?;
        Ok(claimed.and_then(|e| e.parse().ok()).unwrap_or(0))
    }

    /// Record that the stream continues on `origin`'s (later) timeline.
    pub(crate) async fn adopt_timeline(
        &mut self,
        origin: &Origin,
        agrees_through: u64,
    ) -> Result<bool, RelayError> {
        let adopted: i64 = ADOPT_TIMELINE
            .key(&self.origin_key)
            .arg(&origin.system_id)
            .arg(origin.timeline)
            .arg(origin.history.encode())
            .arg(agrees_through.to_string())
            .invoke_async(&mut self.conn)
            .await?;
        Ok(adopted == 1)
    }

    /// Whether some relay other than `holder` holds the rebuild lock (the lock's value is
    /// `<holder>/<nonce>`: a leftover of this process's own is not another relay's).
    pub(crate) async fn rebuilding_elsewhere(&mut self, holder: &str) -> Result<bool, RelayError> {
        let current: Option<String> = redis::cmd("GET")
            .arg(&self.lock_key)
            .query_async(&mut self.conn)
            .await?;
        Ok(current.is_some_and(|c| !c.starts_with(&format!("{holder}/"))))
    }

    /// Mark a catch-up under way (`CATCH_UP_SINCE` or `CATCH_UP_EVERYTHING`), so one cut
    /// short resumes the same way.
    pub(crate) async fn set_marker(&mut self, marker: &str) -> Result<(), RelayError> {
        let _: i64 = redis::cmd("HSET")
            .arg(&self.origin_key)
            .arg(fields::REBUILDING)
            .arg(marker)
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// Record `watermark`, with entries from `from` on to compare with the outbox.
    pub(crate) async fn set_watermark(
        &mut self,
        watermark: &Watermark,
        from: EntryId,
    ) -> Result<(), RelayError> {
        let _: i64 = redis::cmd("HSET")
            .arg(&self.origin_key)
            .arg(fields::WATERMARK)
            .arg(watermark.encode())
            .arg(fields::WATERMARK_FROM)
            .arg(from.to_string())
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// Forget an earlier catch-up's progress (the shard lost what it held, or the history
    /// forked: its snapshots no longer say what the shard holds).
    pub(crate) async fn clear_progress(&mut self) -> Result<(), RelayError> {
        let _: i64 = redis::cmd("HDEL")
            .arg(&self.origin_key)
            .arg(fields::CATCH_UP_CURSOR)
            .arg(fields::CATCH_UP_DONE)
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// Set the id offset (a slot made anew on a history whose LSNs lie below the top).
    pub(crate) async fn set_id_offset(&mut self, id_offset: u64) -> Result<(), RelayError> {
        let _: i64 = redis::cmd("HSET")
            .arg(&self.origin_key)
            .arg(fields::ID_OFFSET)
            .arg(id_offset)
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// Take a rebuild marker back that this relay set and did nothing after (the slot turned
    /// out to be held by another walsender).
    pub(crate) async fn clear_marker(&mut self) -> Result<(), RelayError> {
        let _: i64 = redis::cmd("HDEL")
            .arg(&self.origin_key)
            .arg(fields::REBUILDING)
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// One page of the stream's (outbox id, created_at) pairs, oldest first, from `start`
    /// (an `XRANGE` bound: `-`, an id, or `(id` for after it), and the last entry id read
    /// (`None`: no more).
    #[allow(clippy::type_complexity)]
    pub(crate) async fn outbox_ids_page(
        &mut self,
        start: &str,
        count: usize,
    ) -> Result<((Vec<String>, Vec<Option<String>>), Option<String>), RelayError> {
        let page: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&self.stream)
            .arg(start)
            .arg("+")
            .arg("COUNT")
            .arg(count)
            .query_async(&mut self.conn)
            .await?;
        let last = page.ids.last().map(|e| e.id.clone());
        let field = |e: &redis::streams::StreamId, name: &str| {
            e.map
                .get(name)
                .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
        };
        // Entries without an id match no row, and without a timestamp none of a mapping
        // that has one: those rows go out again.
        let pairs = page
            .ids
            .iter()
            .filter_map(|e| Some((field(e, entry::OUTBOX_ID)?, field(e, entry::CREATED_AT))))
            .unzip();
        Ok((pairs, last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_lifts_new_ids_above_the_top_and_never_shrinks() {
        let top = EntryId {
            commit_lsn: 1000,
            seq: 7,
        };
        assert_eq!(offset_above(top, 2000, 0), 0);
        assert_eq!(offset_above(top, 400, 0), 601);
        assert!(400 + offset_above(top, 400, 0) > top.commit_lsn);
        assert_eq!(offset_above(top, 400, 700), 700);
    }

    #[tokio::test]
    async fn adopting_a_timeline_forgets_snapshots_from_past_the_acknowledgement() {
        let redis = testkit::RedisServer::start().unwrap();
        let mut conn = redis.connect().await.unwrap();
        let shared = conn.clone();
        let adopt = |key: &'static str, agrees: &'static str| {
            let mut conn = shared.clone();
            async move {
                let adopted: i64 = ADOPT_TIMELINE
                    .key(key)
                    .arg("7")
                    .arg(2)
                    .arg("1/1000")
                    .arg(agrees)
                    .invoke_async(&mut conn)
                    .await
                    .unwrap();
                assert_eq!(adopted, 1);
            }
        };
        let fields = |key: &'static str| {
            let mut conn = shared.clone();
            async move {
                let f: Vec<String> = redis::cmd("HKEYS")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                f
            }
        };
        // A record on timeline 1 acknowledged through `acked`, with a watermark up to 1000.
        let seed =
            |key: &'static str, acked: &'static str, field: &'static str, value: &'static str| {
                let mut conn = shared.clone();
                async move {
                    let () = redis::cmd("HSET")
                        .arg(key)
                        .arg(&["system_id", "7", "timeline", "1", "acked_through", acked])
                        .arg(&["watermark", "900/1000/5/100:110:", field, value])
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                }
            };
        // Acknowledged through 1000: a watermark up to there stays, on timeline 2.
        seed("covered", "1000", "watermark_from", "900-0").await;
        adopt("covered", "1000").await;
        let kept = fields("covered").await;
        assert!(kept.contains(&"watermark".to_string()), "{kept:?}");
        let timeline: String = redis::cmd("HGET")
            .arg("covered")
            .arg("timeline")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(timeline, "2");
        // A hand-over's watermark above the acknowledgement, and a catch-up's progress: gone.
        seed("past", "800", "watermark_from", "900-0").await;
        seed("progress", "1000", "catch_up_done", "120:130:").await;
        // ... and so is one the acknowledgement covers from past where the histories agree
        // (a fork, or a rebuild whose watermarks mean nothing any more), which is marked
        // to be caught up comparing everything.
        seed("forked", "1000", "watermark_from", "900-0").await;
        for (key, agrees) in [("past", "1000"), ("progress", "1000"), ("forked", "0")] {
            adopt(key, agrees).await;
            let left = fields(key).await;
            for gone in [
                "watermark",
                "watermark_from",
                "catch_up_done",
                "catch_up_cursor",
            ] {
                assert!(!left.contains(&gone.to_string()), "{key}: {left:?}");
            }
            let marker: Option<String> = redis::cmd("HGET")
                .arg(key)
                .arg("rebuilding")
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(
                marker.as_deref(),
                (key == "forked").then_some("everything"),
                "{key}"
            );
        }
    }
}
