//! The stream's record (`<stream>:origin`): which Postgres system and timeline history
//! write the stream, how far the relay acknowledged its slot, the last id it wrote, the
//! offset that keeps ids above the stream's top after a rebuild, and a rebuild in progress.
//! Also the rebuild lock, held while one relay rebuilds so the others stand by.
//!
//! The record is the stream's identity, so only two code paths create or replace it:
//! `setup`, when it created the slot in the same call and the stream is empty or absent,
//! and a rebuild. The publish script refuses a stream without a record (`NORECORD`), so a
//! Redis that lost everything is noticed at the next call, even an acknowledgement-only one,
//! and leads to a rebuild instead of a silent fresh start.
//!
//! Invariant relied on everywhere: `acked_through` (Redis) ≥ the slot's
//! `confirmed_flush_lsn`, because every acknowledgement is recorded in Redis before it is
//! sent to Postgres. Read the slot first, then Redis: a relay acknowledging in between can
//! only raise Redis's side, so "Redis knows less than the slot" is never a false alarm.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::redis_client::RedisConn;
use pgwire_replication::Lsn;
use tokio::task::JoinHandle;
use tracing::warn;

use crate::batch::EntryId;
use crate::error::RelayError;
use crate::lease::Lease;

/// Key of the hash that is the stream's record.
pub fn origin_key(stream: &str) -> String {
    format!("{stream}:origin")
}

/// Key of the record that only the other key layout of `base` has (with one shard: shard
/// 0's of a sharded stream; with more: the plain stream's): if it exists, the stream was set
/// up with another count.
pub fn other_layout_origin_key(base: &str, shards: u32) -> String {
    if shards == 1 {
        origin_key(&crate::shard::shard_key(base, 0, 2))
    } else {
        origin_key(base)
    }
}

/// The shard count the record at `key` states (`None`: no record there; 0: a count that
/// cannot be read, which matches no configuration).
pub async fn recorded_shards<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
) -> redis::RedisResult<Option<u32>> {
    let (system_id, shards): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(key)
        .arg("system_id")
        .arg("shards")
        .query_async(conn)
        .await?;
    Ok(system_id.map(|_| crate::shard::recorded_count(shards.as_deref()).unwrap_or(0)))
}

/// Key of the lock a relay holds while it rebuilds the stream (other relays stand by).
pub fn rebuild_lock_key(stream: &str) -> String {
    format!("{stream}:rebuilding")
}

/// The Postgres cluster and history the relay reads from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub system_id: String,
    pub timeline: u32,
    /// The server's timeline history (empty on timeline 1).
    pub history: TimelineHistory,
}

impl Origin {
    /// IDENTIFY_SYSTEM and TIMELINE_HISTORY on a gated replication session: the server's
    /// origin, and its current WAL flush position.
    pub async fn identify(
        session: &mut pgwire_replication::ReplicationClient,
        timeout: Duration,
    ) -> Result<(Origin, u64), RelayError> {
        let within = |_| RelayError::ConnectTimeout(timeout);
        let identity = tokio::time::timeout(timeout, session.identify_system())
            .await
            .map_err(within)??;
        let history = if identity.timeline > 1 {
            let file = tokio::time::timeout(timeout, session.timeline_history(identity.timeline))
                .await
                .map_err(within)??;
            TimelineHistory::parse(&String::from_utf8_lossy(&file.content))
                .map_err(|e| RelayError::Protocol(format!("TIMELINE_HISTORY: {e}")))?
        } else {
            TimelineHistory::default()
        };
        let origin = Origin {
            system_id: identity.system_id,
            timeline: identity.timeline,
            history,
        };
        Ok((origin, identity.xlogpos.as_u64()))
    }
}

/// A timeline history file: for each ancestor timeline, the LSN where it ended.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TimelineHistory {
    pub switches: Vec<(u32, u64)>,
}

impl TimelineHistory {
    /// Parse a history file (`<tli>\t<X/Y>\t<reason>` lines; comments and blanks skipped).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut switches = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let tli = fields.next().and_then(|t| t.parse().ok());
            let lsn = fields.next().and_then(|l| Lsn::parse(l).ok());
            match (tli, lsn) {
                (Some(tli), Some(lsn)) => switches.push((tli, lsn.as_u64())),
                _ => return Err(format!("timeline history line {line:?}")),
            }
        }
        Ok(Self { switches })
    }

    /// As stored in the record: `tli:lsn` pairs separated by commas.
    pub fn encode(&self) -> String {
        self.switches
            .iter()
            .map(|(tli, lsn)| format!("{tli}:{lsn}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn decode(text: &str) -> Option<Self> {
        let mut switches = Vec::new();
        for pair in text.split(',').filter(|p| !p.is_empty()) {
            let (tli, lsn) = pair.split_once(':')?;
            switches.push((tli.parse().ok()?, lsn.parse().ok()?));
        }
        Some(Self { switches })
    }

    /// Where `timeline` ended on the way to the current one (`None`: not an ancestor).
    pub fn switch_point(&self, timeline: u32) -> Option<u64> {
        self.switches
            .iter()
            .find(|(tli, _)| *tli == timeline)
            .map(|(_, lsn)| *lsn)
    }
}

/// What Redis knows about the stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamRecord {
    pub system_id: Option<String>,
    pub timeline: Option<u32>,
    pub history: Option<TimelineHistory>,
    /// The highest LSN the relay acknowledged to its slot (recorded before acknowledging).
    pub acked_through: Option<u64>,
    /// A rebuild started and did not finish (its reason).
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
}

impl StreamRecord {
    pub fn exists(&self) -> bool {
        self.system_id.is_some()
    }
}

/// A new record, as `setup` or a finished rebuild writes it.
pub(crate) struct NewRecord<'a> {
    pub origin: &'a Origin,
    pub shards: u32,
    pub acked_through: u64,
    pub id_offset: u64,
    pub last_id: Option<EntryId>,
}

impl NewRecord<'_> {
    fn fields(&self) -> Vec<(&'static str, String)> {
        let mut fields = vec![
            ("system_id", self.origin.system_id.clone()),
            ("timeline", self.origin.timeline.to_string()),
            ("history", self.origin.history.encode()),
            ("acked_through", self.acked_through.to_string()),
            ("id_offset", self.id_offset.to_string()),
            ("shards", self.shards.to_string()),
        ];
        if let Some(id) = self.last_id {
            fields.push(("last_id", id.to_string()));
        }
        fields
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
const REPLACE: &str = r#"
redis.call('HDEL', KEYS[1], 'rebuilding', 'last_id')
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"#;

/// Create the record, only if there is none.
const CREATE: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"#;

/// Move an existing record onto a later timeline of the same history.
const ADOPT: &str = r#"
if redis.call('HGET', KEYS[1], 'system_id') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'timeline', ARGV[2], 'history', ARGV[3])
return 1
"#;

/// Every shard's record, in shard order.
pub async fn read_all(records: &mut [Records]) -> Result<Vec<StreamRecord>, RelayError> {
    let mut all = Vec::with_capacity(records.len());
    for r in records.iter_mut() {
        all.push(r.read().await?);
    }
    Ok(all)
}

/// Reads and writes the record of one stream.
#[derive(Clone)]
pub struct Records {
    conn: RedisConn,
    stream: String,
    origin_key: String,
    lock_key: String,
}

impl Records {
    pub fn new(conn: RedisConn, stream: &str) -> Self {
        Self {
            conn,
            stream: stream.to_string(),
            origin_key: origin_key(stream),
            lock_key: rebuild_lock_key(stream),
        }
    }

    /// The record and the stream's top and length.
    pub async fn read(&mut self) -> Result<StreamRecord, RelayError> {
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&self.origin_key)
            .arg(&[
                "system_id",
                "timeline",
                "history",
                "acked_through",
                "rebuilding",
                "last_id",
                "id_offset",
                "shards",
            ])
            .query_async(&mut self.conn)
            .await?;
        let field = |i: usize| fields.get(i).cloned().flatten();
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
            shards: crate::shard::recorded_count(field(7).as_deref()),
        })
    }

    /// The stream's last-generated id (`0-0` when it does not exist) and its length.
    pub async fn top_and_len(&mut self) -> Result<(EntryId, u64), RelayError> {
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
            .map_err(|e: String| RelayError::Protocol(format!("XINFO last-generated-id: {e}")))?;
        Ok((top, info.length as u64))
    }

    /// Write a first record unless one exists (`setup`); whether it was written.
    pub(crate) async fn create(&mut self, record: &NewRecord<'_>) -> Result<bool, RelayError> {
        let script = redis::Script::new(CREATE);
        let mut invocation = script.key(&self.origin_key);
        for (name, value) in record.fields() {
            invocation.arg(name).arg(value);
        }
        let created: i64 = invocation.invoke_async(&mut self.conn).await?;
        Ok(created == 1)
    }

    /// Replace the record at the end of a rebuild (the caller confirmed the lock just before).
    pub(crate) async fn replace(
        &mut self,
        lock: &mut RebuildLock,
        record: &NewRecord<'_>,
    ) -> Result<(), RelayError> {
        lock.confirm().await?;
        let script = redis::Script::new(REPLACE);
        let mut invocation = script.key(&self.origin_key);
        for (name, value) in record.fields() {
            invocation.arg(name).arg(value);
        }
        let _: i64 = invocation.invoke_async(&mut self.conn).await?;
        Ok(())
    }

    /// Mark a rebuild started (creating the record if Redis lost it), so a crash midway
    /// resumes it; only while holding the lock.
    pub(crate) async fn mark_rebuilding(
        &mut self,
        lock: &mut RebuildLock,
        origin: &Origin,
        shards: u32,
        reason: &str,
    ) -> Result<(), RelayError> {
        lock.confirm().await?;
        let () = redis::cmd("HSET")
            .arg(&self.origin_key)
            .arg("shards")
            .arg(shards)
            .arg("system_id")
            .arg(&origin.system_id)
            .arg("timeline")
            .arg(origin.timeline)
            .arg("history")
            .arg(origin.history.encode())
            .arg("rebuilding")
            .arg(reason)
            .query_async::<i64>(&mut self.conn)
            .await
            .map(|_| ())?;
        Ok(())
    }

    /// Record that the stream continues on `origin`'s (later) timeline.
    pub(crate) async fn adopt_timeline(&mut self, origin: &Origin) -> Result<bool, RelayError> {
        let adopted: i64 = redis::Script::new(ADOPT)
            .key(&self.origin_key)
            .arg(&origin.system_id)
            .arg(origin.timeline)
            .arg(origin.history.encode())
            .invoke_async(&mut self.conn)
            .await?;
        Ok(adopted == 1)
    }

    /// Whether some relay other than `holder` holds the rebuild lock (the lock's value is
    /// `<holder>/<nonce>`: a leftover of this process's own is not another relay's).
    pub async fn rebuilding_elsewhere(&mut self, holder: &str) -> Result<bool, RelayError> {
        let current: Option<String> = redis::cmd("GET")
            .arg(&self.lock_key)
            .query_async(&mut self.conn)
            .await?;
        Ok(current.is_some_and(|c| !c.starts_with(&format!("{holder}/"))))
    }

    /// Take a rebuild marker back that this relay set and did nothing after (the slot turned
    /// out to be held by another walsender).
    pub(crate) async fn clear_marker(&mut self) -> Result<(), RelayError> {
        let _: i64 = redis::cmd("HDEL")
            .arg(&self.origin_key)
            .arg("rebuilding")
            .query_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// The oldest entry's `created_at` (`None`: the stream is empty).
    pub async fn oldest_created_at(&mut self) -> Result<Option<String>, RelayError> {
        let page: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&self.stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut self.conn)
            .await?;
        Ok(page
            .ids
            .first()
            .and_then(|e| e.map.get("created_at"))
            .and_then(|v| redis::from_redis_value_ref::<String>(v).ok()))
    }

    /// One page of the stream's (outbox id, created_at) pairs, oldest first, after `after`
    /// (exclusive; `None`: from the start), and the last entry id read (`None`: no more).
    #[allow(clippy::type_complexity)]
    pub async fn outbox_ids_page(
        &mut self,
        after: Option<&str>,
        count: usize,
    ) -> Result<((Vec<i64>, Vec<String>), Option<String>), RelayError> {
        let start = after.map_or_else(|| "-".to_string(), |id| format!("({id}"));
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
        // Entries without a numeric id or a timestamp match no row: those rows go out again.
        let pairs = page
            .ids
            .iter()
            .filter_map(|e| {
                let id = field(e, "outbox_id")?.parse::<i64>().ok()?;
                Some((id, field(e, "created_at")?))
            })
            .unzip();
        Ok((pairs, last))
    }
}

/// The rebuild lock while held: extended in the background every third of its TTL, and
/// marked lost when an extension is refused or none succeeded for a whole TTL. Every
/// destructive step of a rebuild checks it first.
pub(crate) struct RebuildLock {
    conn: RedisConn,
    lease: Arc<Lease>,
    stream: String,
    lost: Arc<AtomicBool>,
    heartbeat: JoinHandle<()>,
}

impl RebuildLock {
    /// Take the lock for `holder` (`None` while another relay holds it).
    pub async fn acquire(
        conn: RedisConn,
        stream: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Self>, RelayError> {
        let lease = Arc::new(Lease::new(rebuild_lock_key(stream), holder, ttl));
        if !lease.acquire(&mut conn.clone()).await? {
            return Ok(None);
        }
        let lost = Arc::new(AtomicBool::new(false));
        let heartbeat = tokio::spawn({
            let (mut conn, lease, lost) = (conn.clone(), lease.clone(), lost.clone());
            async move {
                let mut last_ok = tokio::time::Instant::now();
                loop {
                    tokio::time::sleep(ttl / 3).await;
                    match lease.acquire(&mut conn).await {
                        Ok(true) => last_ok = tokio::time::Instant::now(),
                        Ok(false) => break,
                        Err(e) if last_ok.elapsed() < ttl => {
                            warn!(error = %e, "could not extend the rebuild lock; retrying")
                        }
                        Err(_) => break,
                    }
                }
                lost.store(true, Ordering::SeqCst);
            }
        });
        Ok(Some(Self {
            conn,
            lease,
            stream: stream.to_string(),
            lost,
            heartbeat,
        }))
    }

    /// Err when the lock was lost: stop before doing anything more.
    pub fn check(&self) -> Result<(), RelayError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(RelayError::RebuildLockLost {
                stream: self.stream.clone(),
            });
        }
        Ok(())
    }

    /// Extend now and confirm the lock is still ours (before an irreversible step): it then
    /// stays ours for at least a whole TTL.
    pub async fn confirm(&mut self) -> Result<(), RelayError> {
        self.check()?;
        if !self.lease.acquire(&mut self.conn).await? {
            self.lost.store(true, Ordering::SeqCst);
            return self.check();
        }
        Ok(())
    }

    /// Stop extending and delete the lock if still ours.
    pub async fn release(mut self) {
        self.heartbeat.abort();
        if let Err(e) = self.lease.release(&mut self.conn).await {
            warn!(error = %e, "could not release the rebuild lock; it expires by itself");
        }
    }
}

impl Drop for RebuildLock {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_files_parse_and_round_trip() {
        let text =
            "1\t0/3000158\tno recovery target specified\n\n2\t0/5000000\tat restore point \"x\"\n";
        let h = TimelineHistory::parse(text).unwrap();
        assert_eq!(h.switches, vec![(1, 0x3000158), (2, 0x5000000)]);
        assert_eq!(TimelineHistory::decode(&h.encode()), Some(h.clone()));
        assert_eq!(h.switch_point(2), Some(0x5000000));
        assert_eq!(h.switch_point(3), None);
        assert_eq!(
            TimelineHistory::decode(""),
            Some(TimelineHistory::default())
        );
        assert!(TimelineHistory::parse("1 nonsense").is_err());
    }

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
}
