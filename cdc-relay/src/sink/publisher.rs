//! Publishing batches into the Redis stream: one script call per batch and shard, idempotent
//! by id.
//!
//! A stream of N shards (see `shard`) is N streams: a batch splits into one part per shard
//! with entries, the parts are sent concurrently on one connection, and the batch is
//! confirmed when every part is. Per shard, parts reach Redis in sealing order (one
//! connection, tasks started in order) and each carries the shard's own fence. A part
//! records the batch's acknowledgement in its shard's record; a batch marked `ack_all` also
//! sends an acknowledgement-only part to every other shard (the session does that at most
//! once per status interval and acknowledges the slot only as far as every shard recorded).
//!
//! The script (`publish.lua`) writes a whole batch atomically, skips entries Redis already
//! has (replays after a reconnect carry the same ids), refuses a stream without its record
//! (Redis lost it), another cluster's stream (origin guard) or another timeline, refuses to
//! continue after the stream lost entries this session wrote (fence), and trims only what
//! every consumer group acknowledged. A failed or timed-out call is simply sent again: it
//! cannot write anything twice.

use std::time::Duration;

use pgwire_replication::Lsn;
use redis::{ErrorKind, ServerErrorKind, Value};

use outbox_core::connect::{RedisConn, RedisTarget};
use outbox_core::stream::keys::origin_key;
use outbox_core::stream::record::check_layout;
use outbox_core::stream::{shard_keys, EntryId};

use super::batch::{Batch, StreamEntry};
use super::record::{Records, StreamRecord};
use crate::error::{script_codes, RelayError};
use crate::source::Origin;

/// The publish script, after the helpers it shares with [`ROOM`].
const SCRIPT: &str = concat!(include_str!("trim.lua"), include_str!("publish.lua"));
/// Making room for a rebuild's entries (see `room.lua`).
const ROOM: &str = concat!(include_str!("trim.lua"), include_str!("room.lua"));

/// What one batch did to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct PublishOutcome {
    pub published: u64,
    /// Entries Redis already had (replays), counted, not written.
    pub duplicates: u64,
    /// Entries no consumer group had acknowledged, trimmed because the stream reached
    /// `--stream-max-len` (the last-resort cap).
    pub unread_trimmed: u64,
}

impl std::ops::AddAssign for PublishOutcome {
    fn add_assign(&mut self, other: Self) {
        self.published += other.published;
        self.duplicates += other.duplicates;
        self.unread_trimmed += other.unread_trimmed;
    }
}

/// The keys of one shard.
#[derive(Debug, Clone)]
struct ShardKeys {
    stream: String,
    origin_key: String,
}

#[derive(Clone)]
pub(crate) struct Publisher {
    conn: RedisConn,
    /// The stream's configured name (shard keys derive from it).
    base: String,
    shards: std::sync::Arc<[ShardKeys]>,
    max_len: u64,
    script_sha: String,
    /// Replicas that must acknowledge each call before it counts (`WAIT`), and how long
    /// to wait for them.
    wait_replicas: u32,
    timeout: Duration,
    /// This session's writer epoch per shard (see the record): the script refuses it once
    /// a newer session claimed the shard.
    writer_epochs: std::sync::Arc<[u64]>,
}

impl Publisher {
    /// Connect (one attempt; the caller retries) and load the script.
    pub(crate) async fn connect(
        target: &RedisTarget,
        stream: &str,
        shards: u32,
        max_len: u64,
        response_timeout: Duration,
    ) -> Result<Self, RelayError> {
        let mut conn = target.connect(response_timeout).await?;
        let script_sha = load_script(&mut conn, SCRIPT).await?;
        let shards: std::sync::Arc<[ShardKeys]> = shard_keys(stream, shards)
            .into_iter()
            .map(|stream| ShardKeys {
                origin_key: origin_key(&stream),
                stream,
            })
            .collect();
        let writer_epochs = vec![0; shards.len()].into();
        Ok(Self {
            conn,
            base: stream.to_string(),
            shards,
            max_len,
            script_sha,
            wait_replicas: 0,
            timeout: response_timeout,
            writer_epochs,
        })
    }

    /// Count a call as confirmed only once `replicas` replicas of its node acknowledged it
    /// (`WAIT`): a failover then cannot lose what the slot was told was delivered.
    pub(crate) fn with_wait_replicas(mut self, replicas: u32) -> Self {
        self.wait_replicas = replicas;
        self
    }

    /// Claim every shard for this session (see [`Records::claim_epoch`]) and write with
    /// those epochs from now on.
    pub(crate) async fn claim_writer_epochs(&mut self) -> Result<(), RelayError> {
        let mut epochs = Vec::with_capacity(self.shards.len());
        for mut records in self.records() {
            epochs.push(records.claim_epoch().await?);
        }
        self.writer_epochs = epochs.into();
        Ok(())
    }

    /// The stream's configured name (with one shard, its key).
    pub(crate) fn stream(&self) -> &str {
        &self.base
    }

    pub(crate) fn shard_count(&self) -> u32 {
        self.shards.len() as u32
    }

    /// The stream key of `shard`.
    pub(crate) fn shard_stream(&self, shard: u32) -> &str {
        &self.shards[shard as usize].stream
    }

    /// Trim from `shard` what every consumer group acknowledged; the entries left (unread
    /// by some group) and how many groups read the shard.
    pub(crate) async fn room(&mut self, shard: u32) -> Result<(u64, u64), RelayError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(ROOM));
        let (entries, groups): (u64, u64) = SCRIPT
            .key(&self.shards[shard as usize].stream)
            .invoke_async(&mut self.conn)
            .await?;
        Ok((entries, groups))
    }

    /// Refuse to write when the records say the stream has another shard count than this
    /// relay's (`records`: every shard's, as read), or the other key layout has a record.
    pub(crate) async fn check_layout(
        &mut self,
        records: &[StreamRecord],
    ) -> Result<(), RelayError> {
        let recorded: Vec<u32> = records
            .iter()
            .filter(|r| r.exists())
            .map(|r| r.shards.unwrap_or(0))
            .collect();
        let shards = self.shard_count();
        Ok(check_layout(&mut self.conn, &self.base, shards, recorded).await??)
    }

    /// The record of every shard, in shard order, with this publisher's connection.
    pub(crate) fn records(&self) -> Vec<Records> {
        self.shards
            .iter()
            .map(|s| Records::new(self.conn.clone(), &s.stream))
            .collect()
    }

    /// The connection (for the rebuild lock).
    pub(crate) fn connection(&self) -> RedisConn {
        self.conn.clone()
    }

    /// Publish `batch`'s entries (ids already offset), each into its shard. `fences`: per
    /// shard, the last id this session published there before. `ack_all`: every shard
    /// records the batch's acknowledgement, not only those with entries. Also returns, per
    /// shard, whether its record now holds the acknowledgement.
    pub(crate) async fn publish(
        &mut self,
        batch: &Batch,
        origin: &Origin,
        fences: &[Option<EntryId>],
        ack_all: bool,
    ) -> Result<(PublishOutcome, Vec<bool>), RelayError> {
        if batch.entries.is_empty() && batch.ack_lsn.is_none() {
            return Ok((PublishOutcome::default(), vec![false; self.shards.len()]));
        }
        if self.shards.len() == 1 {
            let entries: Vec<&StreamEntry> = batch.entries.iter().collect();
            let outcome = self
                .publish_part(0, &entries, batch.ack_lsn, origin, fences[0])
                .await?;
            return Ok((outcome, vec![true]));
        }
        let mut parts: Vec<Vec<&StreamEntry>> = vec![Vec::new(); self.shards.len()];
        for entry in &batch.entries {
            parts[entry.shard as usize].push(entry);
        }
        let sent: Vec<bool> = parts
            .iter()
            .map(|entries| !entries.is_empty() || (ack_all && batch.ack_lsn.is_some()))
            .collect();
        let calls = parts
            .iter()
            .enumerate()
            .filter(|(k, _)| sent[*k])
            .map(|(k, entries)| {
                let mut this = self.clone();
                async move {
                    this.publish_part(k, entries, batch.ack_lsn, origin, fences[k])
                        .await
                }
            });
        let results = futures::future::join_all(calls).await;
        let mut outcome = PublishOutcome::default();
        let mut failure: Option<RelayError> = None;
        for result in results {
            match result {
                Ok(part) => outcome += part,
                // A part that cannot simply be sent again decides what happens next.
                Err(e) => match &failure {
                    Some(f) if !f.retry_in_place() => {}
                    _ => failure = Some(e),
                },
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok((outcome, sent)),
        }
    }

    /// Publish `entries` (all of shard `shard`, ids increasing) as one call, recording
    /// `ack_lsn` in the shard's record; `fence`: the last id sealed into the shard before
    /// them.
    pub(crate) async fn publish_part(
        &mut self,
        shard: usize,
        entries: &[&StreamEntry],
        ack_lsn: Option<Lsn>,
        origin: &Origin,
        fence: Option<EntryId>,
    ) -> Result<PublishOutcome, RelayError> {
        let reply = self.eval(shard, entries, ack_lsn, origin, fence).await;
        let reply = match reply {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                // Redis restarted or failed over (scripts are not persisted): load it again
                // (on every node of a cluster) and resend.
                self.script_sha = load_script(&mut self.conn, SCRIPT).await?;
                self.eval(shard, entries, ack_lsn, origin, fence).await
            }
            other => other,
        };
        let (reply, replicas) = reply.map_err(|e| self.script_error(shard, e, origin))?;
        let outcome = parse_outcome(reply)?;
        if let Some(acked) = replicas.filter(|n| *n < self.wait_replicas) {
            // Not confirmed: sent again (idempotent) until enough replicas have it.
            return Err(RelayError::Redis(redis::RedisError::from(
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "WAIT: {acked} of {} replicas acknowledged {} in time",
                        self.wait_replicas, self.shards[shard].stream
                    ),
                ),
            )));
        }
        Ok(outcome)
    }

    /// The script call, followed on the same connection by `WAIT` when replicas must
    /// confirm (their count comes back too).
    async fn eval(
        &mut self,
        shard: usize,
        entries: &[&StreamEntry],
        ack_lsn: Option<Lsn>,
        origin: &Origin,
        fence: Option<EntryId>,
    ) -> redis::RedisResult<(Value, Option<u32>)> {
        let keys = &self.shards[shard];
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.script_sha)
            .arg(2)
            .arg(&keys.stream)
            .arg(&keys.origin_key)
            .arg(&origin.system_id)
            .arg(origin.timeline)
            .arg(self.max_len)
            .arg(fence.map(|id| id.to_string()).unwrap_or_default())
            .arg(
                ack_lsn
                    .map(|lsn| lsn.as_u64().to_string())
                    .unwrap_or_default(),
            )
            .arg(self.shards.len())
            .arg(self.writer_epochs[shard]);
        let mut id_buf = String::with_capacity(40);
        for entry in entries {
            use std::fmt::Write;
            id_buf.clear();
            let _ = write!(id_buf, "{}", entry.id);
            cmd.arg(id_buf.as_bytes());
            for value in entry.event.field_values() {
                cmd.arg(value);
            }
        }
        if self.wait_replicas == 0 {
            return Ok((cmd.query_async(&mut self.conn).await?, None));
        }
        // WAIT counts the writes of the connection it arrives on: it must follow the
        // script on the same one, so both go as one pipeline. Its own timeout stays well
        // inside the response timeout.
        let (reply, replicas) = self
            .conn
            .then_wait(cmd, &keys.stream, self.wait_replicas, self.timeout / 2)
            .await?;
        Ok((reply, Some(replicas)))
    }

    fn script_error(&self, shard: usize, e: redis::RedisError, origin: &Origin) -> RelayError {
        let detail = e.detail().unwrap_or_default().to_string();
        let stream = &self.shards[shard].stream;
        match e.code() {
            Some(script_codes::ORIGIN) => RelayError::OriginMismatch {
                stream: stream.clone(),
                stream_system: detail,
                server_system: origin.system_id.clone(),
            },
            Some(script_codes::GAP) => RelayError::StreamBehind {
                stream: stream.clone(),
                detail,
            },
            Some(script_codes::DIVERGED) => RelayError::StreamDiverged {
                stream: stream.clone(),
                detail,
            },
            Some(script_codes::NORECORD) => RelayError::RecordMissing {
                stream: stream.clone(),
            },
            Some(script_codes::SHARDS) => RelayError::Config(format!(
                "stream {} now states {detail} shard(s) (it was resized while this relay ran): restart the relay with --stream-shards {detail}",
                self.base
            )),
            Some(script_codes::FENCED) => RelayError::Superseded {
                stream: stream.clone(),
                detail,
            },
            Some(script_codes::TIMELINE) => RelayError::TimelineMismatch {
                stream: stream.clone(),
                detail,
            },
            _ => RelayError::Redis(e),
        }
    }
}

async fn load_script(conn: &mut RedisConn, script: &str) -> Result<String, RelayError> {
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script)
        .query_async(conn)
        .await?;
    Ok(sha)
}

fn parse_outcome(reply: Value) -> Result<PublishOutcome, RelayError> {
    match reply {
        Value::Array(items) if items.len() == 3 => {
            let int = |v: &Value| match v {
                Value::Int(n) if *n >= 0 => Ok(*n as u64),
                other => Err(RelayError::Protocol(format!(
                    "publish script returned {other:?} where a count was expected"
                ))),
            };
            Ok(PublishOutcome {
                published: int(&items[0])?,
                duplicates: int(&items[1])?,
                unread_trimmed: int(&items[2])?,
            })
        }
        other => Err(RelayError::Protocol(format!(
            "publish script returned {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_writes_the_contracts_fields_in_their_order() {
        use outbox_core::stream::entry::{FIELDS, TRACEPARENT};
        let add = SCRIPT
            .split("local function add(i)")
            .nth(1)
            .and_then(|rest| rest.split("\nend\n").next())
            .expect("publish.lua defines add()");
        let calls: Vec<Vec<&str>> = add
            .split("redis.call('XADD'")
            .skip(1)
            .map(|call| {
                call.split('\'')
                    .filter(|w| FIELDS.contains(w) || *w == TRACEPARENT)
                    .collect()
            })
            .collect();
        let mut traced = FIELDS.to_vec();
        traced.push(TRACEPARENT);
        assert_eq!(calls, vec![FIELDS.to_vec(), traced], "{add}");
    }
}
