//! The Redis side of the inbox consumer: the consumer-group protocol (create the group,
//! read new entries and this consumer's pending ones, claim what others left, acknowledge),
//! the dead-letter stream, and the attempt records that tell a crash on an entry from a
//! session restart. The loop that uses them is in the parent module.

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::stream::entry::dead_letter;
use redis::Value;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::{Active, ConsumeError, READ_BLOCK, READ_COUNT};
use crate::inbox::{Entry, Inbox};

/// Marks an attempt record of an entry processed alone: if that run ended during it, the
/// entry is what ended it.
const ALONE: &str = "alone";
/// Attempt records read whole at most when looking for other runs' (see
/// `Active::foreign_records`).
const FOREIGN_RECORDS_READ: usize = 10_000;

impl<I: Inbox> Active<'_, I> {
    /// Export the shard's dead-letter stream's length (alerts fire while it is not empty),
    /// with the pre-shard stream's for shard 0.
    pub(super) async fn count_dead_letters(&mut self) -> Result<(), ConsumeError> {
        let mut total = 0;
        let keys = self.keys().clone();
        let streams =
            std::iter::once(&keys.dead_letters).chain(keys.unsharded_dead_letters.as_ref());
        for stream in streams {
            let counted: redis::RedisResult<i64> = redis::cmd("XLEN")
                .arg(stream)
                .query_async(&mut self.conn)
                .await;
            match counted {
                Ok(n) => total += n,
                // An ACL from before per-shard dead letters: consuming goes on (dead-lettering
                // would fail with the same error, and say so).
                Err(e) if e.code() == Some("NOPERM") => {
                    warn!(dead_letter_stream = %stream, "the Redis user may not read this dead-letter stream; load the current deploy/redis/users.acl")
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.consumer.roles.set_dead_letters(keys.shard, total);
        Ok(())
    }

    pub(super) async fn ensure_group(&mut self) -> Result<(), ConsumeError> {
        // From id 0: a group created after the relay already published misses nothing.
        let created: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.keys().stream)
            .arg(&self.config().group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut self.conn)
            .await;
        match created {
            Ok(()) => {
                info!(stream = %self.keys().stream, group = %self.config().group, "created consumer group");
                Ok(())
            }
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether entries other than `batch` were pending in the group (now claimed by this
    /// consumer): a paused previous holder's outstanding read can be served after this
    /// holder took over, and those entries precede the batch in the stream.
    pub(super) async fn took_older_entries(
        &mut self,
        batch: &[Entry],
    ) -> Result<bool, ConsumeError> {
        let claimed = self.claim_ids(Duration::ZERO).await?;
        let ours: std::collections::HashSet<&str> = batch.iter().map(|e| e.id.as_str()).collect();
        let others = claimed
            .iter()
            .filter(|id| !ours.contains(id.as_str()))
            .count();
        if others > 0 {
            info!(
                claimed = others,
                "entries delivered to a previous holder claimed; recording them first"
            );
        }
        Ok(others > 0)
    }

    /// XAUTOCLAIM every pending entry idle at least `min_idle` for this consumer (ids only:
    /// the delivery count grows when they are read). Returns how many were claimed.
    pub(super) async fn claim(&mut self, min_idle: Duration) -> Result<usize, ConsumeError> {
        let claimed = self.claim_ids(min_idle).await?.len();
        if claimed > 0 {
            info!(claimed, min_idle = ?min_idle, "claimed pending entries");
        }
        Ok(claimed)
    }

    /// XAUTOCLAIM (JUSTID) every pending entry idle at least `min_idle`; the claimed ids.
    pub(super) async fn claim_ids(
        &mut self,
        min_idle: Duration,
    ) -> Result<Vec<String>, ConsumeError> {
        let mut cursor = "0-0".to_string();
        let mut claimed = Vec::new();
        loop {
            let reply: Value = redis::cmd("XAUTOCLAIM")
                .arg(&self.keys().stream)
                .arg(&self.config().group)
                .arg(&self.config().consumer)
                .arg(min_idle.as_millis() as u64)
                .arg(&cursor)
                .arg("COUNT")
                .arg(READ_COUNT)
                .arg("JUSTID")
                .query_async(&mut self.conn)
                .await?;
            let Value::Array(parts) = reply else {
                return Err(ConsumeError::Reply(format!("XAUTOCLAIM: {reply:?}")));
            };
            // Redis 7: [next cursor, claimed ids, deleted ids].
            let next: String = parts
                .first()
                .map(redis::from_redis_value_ref)
                .transpose()
                .map_err(|e| ConsumeError::Reply(e.to_string()))?
                .unwrap_or_else(|| "0-0".into());
            if let Some(Value::Array(ids)) = parts.get(1) {
                for id in ids {
                    claimed.push(
                        redis::from_redis_value_ref::<String>(id)
                            .map_err(|e| ConsumeError::Reply(e.to_string()))?,
                    );
                }
            }
            if let Some(Value::Array(deleted)) = parts.get(2) {
                if !deleted.is_empty() {
                    let ids: Vec<String> = deleted
                        .iter()
                        .filter_map(|id| redis::from_redis_value_ref::<String>(id).ok())
                        .collect();
                    let _: redis::RedisResult<i64> = redis::cmd("HDEL")
                        .arg(&self.keys().attempts)
                        .arg(&ids)
                        .query_async(&mut self.conn)
                        .await;
                    error!(count = deleted.len(), "pending entries were trimmed from the stream before being recorded; stream MAXLEN is too small for the consumer lag");
                    self.metrics()
                        .entries_lost_total
                        .inc_by(deleted.len() as u64);
                }
            }
            if next == "0-0" {
                break;
            }
            cursor = next;
        }
        Ok(claimed)
    }

    /// XREADGROUP from `id` (`>`: new entries, blocking briefly; otherwise own pending
    /// entries after `id`, with their delivery counts).
    pub(super) async fn read(&mut self, id: &str) -> Result<Vec<Entry>, ConsumeError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.config().group)
            .arg(&self.config().consumer)
            .arg("COUNT")
            .arg(READ_COUNT);
        if id == ">" {
            cmd.arg("BLOCK").arg(READ_BLOCK.as_millis() as u64);
        }
        cmd.arg("STREAMS").arg(&self.keys().stream).arg(id);
        let reply: Value = cmd.query_async(&mut self.blocking).await?;
        let mut entries = parse_read_reply(reply)?;
        if id == ">" {
            // First deliveries, to this run: if it reads them again (a session restart, a
            // claim of its own late read), they are its own, not a crashed run's.
            let mut delivered = self.consumer.delivered.lock().unwrap();
            for e in &entries {
                delivered.entry(e.id.clone()).or_insert(1);
            }
        }
        if id != ">" && !entries.is_empty() {
            let counts = self.delivery_counts(&entries).await?;
            for e in &mut entries {
                e.deliveries = counts.get(&e.id).copied().unwrap_or(1);
            }
        }
        Ok(entries)
    }

    pub(super) async fn delivery_counts(
        &mut self,
        entries: &[Entry],
    ) -> Result<HashMap<String, u64>, ConsumeError> {
        let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&self.keys().stream)
            .arg(&self.config().group)
            .arg(&entries[0].id)
            .arg(&entries[entries.len() - 1].id)
            .arg(entries.len())
            .arg(&self.config().consumer)
            .query_async(&mut self.conn)
            .await?;
        Ok(reply
            .ids
            .into_iter()
            .map(|p| (p.id, p.times_delivered as u64))
            .collect())
    }

    /// Each redelivered entry's attempt number: how many times processing it started and
    /// ended with the process that ran it (a crash), plus one. Redis's delivery count is not
    /// it: every session restart, handover and claim raises that, through no fault of the
    /// entry. A record `<run> <n>` per redelivered entry (in `inbox-attempts:<group>`) names
    /// the run processing it, `<run> <n> alone` when it processed it on its own; a run whose
    /// session ends marks what it was handed released (`- <n>`). What this run was handed
    /// itself is its own (see `Inbox::delivered`).
    ///
    /// A record of another run that was not released, or none (first deliveries cost no
    /// record), means that run was processing the entry when it lost the shard: it crashed,
    /// or it was killed, frozen or cut off through no fault of the entry, or it is alive and
    /// about to notice. Such an entry is a *suspect*: processed alone ([`Active::suspects`]),
    /// at once, without counting (no waiting on a previous holder: it is fenced in Postgres
    /// whatever it does). A suspect's run that ended while processing it *alone* is
    /// conclusive: the entry itself ended it, so it is dead-lettered (its attempt number is
    /// past the limit) instead of crashing more instances. That one verdict waits for the
    /// other run to release (a lease TTL at most: a live holder notices a lost lease and
    /// releases well within that), and is reached at once for entries this consumer name's
    /// previous process left (it is gone). Decides only; [`Active::begin_attempts`] records,
    /// entry by entry as each starts, so a crash on one entry does not move the count of
    /// those queued behind it. `None`: shutdown came during the wait.
    pub(super) async fn attempts(
        &mut self,
        entries: &[Entry],
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<Option<HashMap<String, u64>>, ConsumeError> {
        // First deliveries cost no record lookup, except those another run was recording
        // ahead of its reads when it ended.
        let redelivered: Vec<&str> = entries
            .iter()
            .filter(|e| e.deliveries > 1 || self.foreign.contains(&e.id))
            .map(|e| e.id.as_str())
            .collect();
        let mut attempts = HashMap::new();
        if redelivered.is_empty() {
            return Ok(Some(attempts));
        }
        let key = self.keys().attempts.clone();
        let ours = self.consumer.delivered.lock().unwrap().clone();
        let deadline = Instant::now() + self.lease.ttl();
        let records = loop {
            let records: Vec<Option<(String, u64, bool)>> = redis::cmd("HMGET")
                .arg(&key)
                .arg(&redelivered)
                .query_async::<Vec<Option<String>>>(&mut self.conn)
                .await?
                .into_iter()
                .map(|r| {
                    let r = r?;
                    let mut words = r.split(' ');
                    let run = words.next()?.to_string();
                    let n = words.next()?.parse::<u64>().ok()?;
                    Some((run, n, words.next() == Some(ALONE)))
                })
                .collect();
            // Only an unreleased record of a run that processed the entry alone waits (its
            // verdict is a dead letter); inherited ones are decided at once.
            let verdict_pending = redelivered.iter().zip(&records).any(|(id, record)| {
                !self.inherited.contains(*id)
                    && matches!(record, Some((run, _, true)) if run != "-" && *run != self.consumer.run_id)
            });
            if !verdict_pending || Instant::now() >= deadline {
                break records;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
            self.renew_if_due().await?;
        };
        for (id, record) in redelivered.iter().zip(records) {
            let n = match record {
                None => match ours.get(*id) {
                    Some(n) => *n,
                    // Another run's first processing left no record and never finished.
                    None => {
                        self.suspects.insert(id.to_string());
                        1
                    }
                },
                Some((run, n, _)) if run == "-" || run == self.consumer.run_id => n,
                // Processed alone, and the run ended: the entry did it.
                Some((_, n, true)) => (n + 1).max(self.config().max_deliveries + 1),
                // Its processing ended with that run, maybe through no fault of its own.
                Some((_, n, false)) => {
                    self.suspects.insert(id.to_string());
                    n
                }
            };
            attempts.insert(id.to_string(), n);
        }
        Ok(Some(attempts))
    }

    /// Record that this run starts processing these entries (those with an attempt
    /// number: redelivered ones), just before it does.
    pub(super) async fn begin_attempts(
        &mut self,
        entries: &[Entry],
        attempts: &HashMap<String, u64>,
    ) -> Result<(), ConsumeError> {
        let ids: Vec<String> = entries.iter().map(|e| e.id.clone()).collect();
        self.begin_attempts_of(&ids, attempts, entries.len() == 1)
            .await
    }

    /// [`Active::begin_attempts`] by entry ids; `alone` marks the records as of an entry
    /// processed on its own.
    pub(super) async fn begin_attempts_of(
        &mut self,
        ids: &[String],
        attempts: &HashMap<String, u64>,
        alone: bool,
    ) -> Result<(), ConsumeError> {
        let mut hset = redis::cmd("HSET");
        hset.arg(&self.keys().attempts);
        let mut any = false;
        // In this run's hands from now on, under the number its record says: a session that
        // ends without a crash releases it (`release_delivered`), or its next holder would
        // read the record as this run having died on it (and one processed alone as the entry
        // having killed it).
        let mut handed = Vec::new();
        for id in ids {
            if let Some(n) = attempts.get(id) {
                handed.push((id.clone(), *n));
                let record = if alone {
                    format!("{} {n} {ALONE}", self.consumer.run_id)
                } else {
                    format!("{} {n}", self.consumer.run_id)
                };
                hset.arg(id).arg(record);
                any = true;
            }
        }
        self.consumer.delivered.lock().unwrap().extend(handed);
        if any {
            let _: i64 = hset.query_async(&mut self.conn).await?;
        }
        Ok(())
    }

    /// Remove this run's attempt records of entries it finished without acknowledging
    /// them (recorded ahead, see `ahead`): they are no longer in its hands.
    pub(super) async fn end_attempts(&mut self, ids: &[String]) -> Result<(), ConsumeError> {
        if ids.is_empty() {
            return Ok(());
        }
        let _: i64 = redis::cmd("HDEL")
            .arg(&self.keys().attempts)
            .arg(ids)
            .query_async(&mut self.conn)
            .await?;
        self.forget_delivered(ids);
        Ok(())
    }

    /// These entries are no longer in this run's hands.
    fn forget_delivered(&self, ids: &[String]) {
        let mut delivered = self.consumer.delivered.lock().unwrap();
        for id in ids {
            delivered.remove(id);
        }
    }

    /// Attempt records of runs other than this one that were not released: entries
    /// another run was recording ahead of its reads when it ended (see `ahead`), which
    /// its group deliveries alone would not show. Empty if there are implausibly many (the
    /// records are of entries in flight; they would only cost memory here).
    pub(super) async fn foreign_records(
        &mut self,
    ) -> Result<std::collections::HashSet<String>, ConsumeError> {
        let key = self.keys().attempts.clone();
        let len: usize = match redis::cmd("HLEN")
            .arg(&key)
            .query_async(&mut self.conn)
            .await
        {
            Ok(len) => len,
            // An ACL from before the look-ahead: this user cannot scan either (see `ahead`),
            // so no run of it recorded ahead.
            Err(e) if e.code() == Some("NOPERM") => {
                warn!(error = %e, %key, "the Redis user may not read the attempt records whole (HLEN, HGETALL); load the current deploy/redis/users.acl");
                return Ok(Default::default());
            }
            Err(e) => return Err(e.into()),
        };
        if len == 0 || len > FOREIGN_RECORDS_READ {
            return Ok(Default::default());
        }
        let records: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&key)
            .query_async(&mut self.conn)
            .await?;
        Ok(records
            .into_iter()
            .filter(|(_, record)| {
                let run = record.split(' ').next().unwrap_or("-");
                run != "-" && run != self.consumer.run_id
            })
            .map(|(id, _)| id)
            .collect())
    }

    /// Entries pending under this consumer's name that this run was not handed (see
    /// `Active::inherited`).
    pub(super) async fn inherited_entries(
        &mut self,
    ) -> Result<std::collections::HashSet<String>, ConsumeError> {
        let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&self.keys().stream)
            .arg(&self.config().group)
            .arg("-")
            .arg("+")
            .arg(10_000)
            .arg(&self.config().consumer)
            .query_async(&mut self.conn)
            .await?;
        let ours = self.consumer.delivered.lock().unwrap();
        Ok(reply
            .ids
            .into_iter()
            .map(|p| p.id)
            .filter(|id| !ours.contains_key(id))
            .collect())
    }

    /// Mark everything this run was handed and has not finished as released: its next
    /// processing is not a new attempt. Only where the record is still this run's (or
    /// absent): a newer holder's record stays. Best effort: if Redis cannot take it, the
    /// next holder counts one attempt too many.
    pub(super) async fn release_delivered(&mut self) {
        let delivered = std::mem::take(&mut *self.consumer.delivered.lock().unwrap());
        if delivered.is_empty() {
            return;
        }
        let mut invocation = RELEASE.key(&self.keys().attempts);
        invocation.arg(&self.consumer.run_id);
        for (id, n) in &delivered {
            invocation.arg(id).arg(n);
        }
        let released: redis::RedisResult<i64> = invocation.invoke_async(&mut self.conn).await;
        if let Err(e) = released {
            debug!(error = %e, "could not mark entries in flight as released; the next session tries again");
            // Kept, so the next session of this run releases them (or reads its own records
            // as its own): an unreleased record reads as this run having died on them.
            let mut kept = self.consumer.delivered.lock().unwrap();
            for (id, n) in delivered {
                kept.entry(id).or_insert(n);
            }
        }
    }

    pub(super) async fn ack(&mut self, ids: &[String]) -> Result<(), ConsumeError> {
        // (A batch whose every entry was refused leaves nothing to acknowledge here; XACK
        // without ids is an error that would restart the session and count a delivery.)
        if ids.is_empty() {
            return Ok(());
        }
        let () = redis::pipe()
            .cmd("XACK")
            .arg(&self.keys().stream)
            .arg(&self.config().group)
            .arg(ids)
            .ignore()
            .cmd("HDEL")
            .arg(&self.keys().attempts)
            .arg(ids)
            .ignore()
            .query_async(&mut self.conn)
            .await?;
        self.forget_delivered(ids);
        Ok(())
    }

    /// Move an entry to the dead-letter stream with its reason, atomically with its XACK.
    /// The stream is capped: what the cap trims is counted and logged.
    pub(super) async fn dead_letter(
        &mut self,
        entry: &Entry,
        reason: &str,
    ) -> Result<(), ConsumeError> {
        let max_len = self.config().dead_letter_max_len;
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&self.keys().dead_letters)
            .arg("MAXLEN")
            .arg("=")
            .arg(max_len)
            .arg("*")
            .arg(dead_letter::STREAM)
            .arg(&self.keys().stream)
            .arg(dead_letter::ID)
            .arg(&entry.id)
            .arg(dead_letter::REASON)
            .arg(reason)
            .arg(dead_letter::DELIVERIES)
            .arg(entry.deliveries);
        if let Some(fields) = &entry.fields {
            for (k, v) in fields {
                xadd.arg(dead_letter::entry_field(k)).arg(v);
            }
        }
        for (k, v) in &entry.binary {
            xadd.arg(dead_letter::entry_field(k)).arg(v);
        }
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("XLEN")
            .arg(&self.keys().dead_letters)
            .add_command(xadd)
            .ignore()
            .cmd("XACK")
            .arg(&self.keys().stream)
            .arg(&self.config().group)
            .arg(&entry.id)
            .ignore()
            .cmd("HDEL")
            .arg(&self.keys().attempts)
            .arg(&entry.id)
            .ignore();
        let (before,): (u64,) = pipe.query_async(&mut self.conn).await?;
        self.consumer.delivered.lock().unwrap().remove(&entry.id);
        self.metrics().dead_lettered_total.inc();
        let trimmed = (before + 1).saturating_sub(max_len);
        if trimmed > 0 {
            self.metrics().dead_letters_trimmed_total.inc_by(trimmed);
            error!(trimmed, max_len, dead_letter_stream = %self.keys().dead_letters, "dead-letter stream full: its oldest entries were trimmed and can no longer be replayed; act on the dead letters (replay or drop them) or raise the cap (--dead-letter-max-len)");
        }
        self.count_dead_letters().await?;
        warn!(stream_id = %entry.id, trace_id = %entry.trace_id(), %reason, dead_letter_stream = %self.keys().dead_letters, "entry dead-lettered");
        Ok(())
    }
}

/// Release attempt records still naming the run `ARGV[1]` (or absent), whether that run
/// processed the entry in a batch or alone: pairs of entry id and attempt number follow.
pub(crate) const RELEASE_BODY: &str = r#"
local run = ARGV[1]
for i = 2, #ARGV, 2 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  local mine = run .. ' ' .. ARGV[i + 1]
  if (not v) or v == mine or v == mine .. ' alone' then
    redis.call('HSET', KEYS[1], ARGV[i], '- ' .. ARGV[i + 1])
  end
end
return 1
"#;
static RELEASE: std::sync::LazyLock<outbox_core::functions::Function> =
    std::sync::LazyLock::new(|| crate::functions::LIBRARY.function("release_attempts"));

/// Entries of an XREADGROUP reply (RESP2 arrays or RESP3 maps; `Nil` when the block timed out).
fn parse_read_reply(reply: Value) -> Result<Vec<Entry>, ConsumeError> {
    let streams = match reply {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .into_iter()
            .filter_map(|s| match s {
                Value::Array(mut kv) if kv.len() == 2 => kv.pop(),
                _ => None,
            })
            .collect::<Vec<_>>(),
        Value::Map(streams) => streams.into_iter().map(|(_, v)| v).collect(),
        other => return Err(ConsumeError::Reply(format!("XREADGROUP: {other:?}"))),
    };
    let mut entries = Vec::new();
    for stream in streams {
        let Value::Array(items) = stream else {
            continue;
        };
        entries.extend(parse_items(items)?);
    }
    Ok(entries)
}

/// An XRANGE reply's entries.
pub(super) fn parse_range_reply(reply: Value) -> Result<Vec<Entry>, ConsumeError> {
    match reply {
        Value::Nil => Ok(Vec::new()),
        Value::Array(items) => parse_items(items),
        other => Err(ConsumeError::Reply(format!("XRANGE: {other:?}"))),
    }
}

/// An XRANGE reply's entries, for the contract's vectors (`crate::contract`).
#[cfg(test)]
pub(crate) fn entries_of(reply: Value) -> Result<Vec<Entry>, String> {
    parse_range_reply(reply).map_err(|e| e.to_string())
}

/// Entries as `[id, fields]` pairs (fields nil: trimmed since delivered).
fn parse_items(items: Vec<Value>) -> Result<Vec<Entry>, ConsumeError> {
    let mut entries = Vec::with_capacity(items.len());
    for item in items {
        let Value::Array(mut parts) = item else {
            return Err(ConsumeError::Reply("entry is not an array".into()));
        };
        if parts.len() != 2 {
            return Err(ConsumeError::Reply("entry is not [id, fields]".into()));
        }
        let fields = parts.pop().expect("two parts");
        let id: String = redis::from_redis_value(parts.pop().expect("two parts"))
            .map_err(|e| ConsumeError::Reply(e.to_string()))?;
        // Values are bytes: a payload need not be text (the relay publishes bytea as is),
        // and one that is not must reach the application (or a dead letter), not stall
        // the shard on a reply that does not parse.
        let mut binary = HashMap::new();
        let fields = match fields {
            Value::Nil => None,
            other => {
                let raw = redis::from_redis_value::<HashMap<String, Vec<u8>>>(other)
                    .map_err(|e| ConsumeError::Reply(e.to_string()))?;
                let mut text = HashMap::with_capacity(raw.len());
                for (name, value) in raw {
                    match String::from_utf8(value) {
                        Ok(value) => {
                            text.insert(name, value);
                        }
                        Err(e) => {
                            binary.insert(name, e.into_bytes());
                        }
                    }
                }
                Some(text)
            }
        };
        entries.push(Entry {
            id,
            fields,
            binary,
            deliveries: 1,
        });
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(bytes: &[u8]) -> Value {
        Value::BulkString(bytes.to_vec())
    }

    #[test]
    fn an_entry_whose_payload_is_bytes_parses_and_keeps_them() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                bulk(b"10-0"),
                Value::Array(vec![
                    bulk(b"event"),
                    bulk(b"blob.stored"),
                    bulk(b"payload"),
                    bulk(&[0x00, 0xff, 0xfe]),
                    bulk(b"key"),
                    bulk(b"k-1"),
                ]),
            ]),
            Value::Array(vec![bulk(b"11-0"), Value::Nil]),
        ]);
        let entries = parse_range_reply(reply).unwrap();
        assert_eq!(entries.len(), 2);
        let blob = &entries[0];
        assert_eq!(blob.field("event"), Some("blob.stored"));
        assert_eq!(blob.key(), Some("k-1"));
        assert_eq!(blob.field("payload"), None, "not text");
        assert_eq!(blob.field_bytes("payload"), Some(&[0x00, 0xff, 0xfe][..]));
        assert_eq!(blob.field_bytes("event"), Some(&b"blob.stored"[..]));
        assert!(blob.decode().is_err(), "no text payload to decode");
        assert!(entries[1].fields.is_none(), "trimmed since delivered");
    }
}
