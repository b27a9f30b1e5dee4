//! Publishing batches into the Redis stream: one script call per batch, idempotent by id.
//!
//! The script (`publish.lua`) writes a whole batch atomically, skips entries Redis already
//! has (replays after a reconnect carry the same ids), refuses another cluster's stream
//! (origin guard) and refuses to continue after the stream lost entries this session wrote
//! (fence). A failed or timed-out call is simply sent again: it cannot write anything twice.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, ServerErrorKind, Value};

use crate::batch::{Batch, EntryId};
use crate::error::{script_codes, RelayError};

const SCRIPT: &str = include_str!("publish.lua");

/// What one batch did to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PublishOutcome {
    pub published: u64,
    /// Entries Redis already had (replays), counted, not written.
    pub duplicates: u64,
}

/// The Postgres cluster the relay reads from, recorded beside the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub system_id: String,
    pub timeline: u32,
}

/// Key of the hash that records which Postgres system writes `stream`, the LSN its relay
/// acknowledged through, and a rebuild in progress.
pub fn origin_key(stream: &str) -> String {
    format!("{stream}:origin")
}

/// Key of the lock a relay holds while it rebuilds the stream (other relays stand by).
pub fn rebuild_lock_key(stream: &str) -> String {
    format!("{stream}:rebuilding")
}

/// What Redis knows about the stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamRecord {
    pub system_id: Option<String>,
    /// The highest LSN the relay acknowledged to its slot (recorded before acknowledging).
    pub acked_through: Option<u64>,
    /// A rebuild started and did not finish (its reason).
    pub rebuilding: Option<String>,
    /// The last id the relay wrote.
    pub last_id: Option<EntryId>,
    /// The stream's own last-generated id (`0-0` when the stream does not exist).
    pub top: EntryId,
}

const LOCK: &str = r#"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"#;

const UNLOCK: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

#[derive(Clone)]
pub struct Publisher {
    conn: ConnectionManager,
    stream: String,
    origin_key: String,
    max_len: u64,
    script_sha: String,
}

impl Publisher {
    /// Connect (one attempt; the caller retries) and load the script.
    pub async fn connect(
        client: redis::Client,
        stream: &str,
        max_len: u64,
        response_timeout: Duration,
    ) -> Result<Self, RelayError> {
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(response_timeout))
            .set_connection_timeout(Some(response_timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(2));
        let mut conn = ConnectionManager::new_with_config(client, config).await?;
        let script_sha = load_script(&mut conn).await?;
        Ok(Self {
            conn,
            stream: stream.to_string(),
            origin_key: origin_key(stream),
            max_len,
            script_sha,
        })
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    pub async fn ping(&mut self) -> Result<(), RelayError> {
        let _: String = redis::cmd("PING").query_async(&mut self.conn).await?;
        Ok(())
    }

    /// The system recorded for the stream, if any (checked at session start so a mismatch
    /// is reported before anything is read from the slot; the script checks it again).
    pub async fn recorded_origin(&mut self) -> Result<Option<String>, RelayError> {
        let system: Option<String> = redis::cmd("HGET")
            .arg(&self.origin_key)
            .arg("system_id")
            .query_async(&mut self.conn)
            .await?;
        Ok(system)
    }

    /// The stream's record: origin, acknowledged position, rebuild marker.
    pub async fn record(&mut self) -> Result<StreamRecord, RelayError> {
        let (system_id, acked, rebuilding, last_id): (
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
        ) = redis::cmd("HMGET")
            .arg(&self.origin_key)
            .arg("system_id")
            .arg("acked_through")
            .arg("rebuilding")
            .arg("last_id")
            .query_async(&mut self.conn)
            .await?;
        Ok(StreamRecord {
            system_id,
            acked_through: acked.and_then(|a| a.parse().ok()),
            rebuilding,
            last_id: last_id.and_then(|id| id.parse().ok()),
            top: self.top().await?,
        })
    }

    /// Mark a rebuild as started (so a crash midway resumes it) or finished.
    pub async fn mark_rebuilding(
        &mut self,
        origin: &Origin,
        reason: Option<&str>,
    ) -> Result<(), RelayError> {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(&self.origin_key)
            .arg("system_id")
            .arg(&origin.system_id)
            .arg("timeline")
            .arg(origin.timeline);
        match reason {
            Some(reason) => {
                cmd.arg("rebuilding").arg(reason);
                let _: i64 = cmd.query_async(&mut self.conn).await?;
            }
            None => {
                let mut pipe = redis::pipe();
                pipe.atomic()
                    .add_command(cmd)
                    .ignore()
                    .cmd("HDEL")
                    .arg(&self.origin_key)
                    .arg("rebuilding")
                    .ignore();
                let () = pipe.query_async(&mut self.conn).await?;
            }
        }
        Ok(())
    }

    /// Take (or extend) the rebuild lock for `holder`; `false` while another relay holds it.
    pub async fn lock_rebuild(&mut self, holder: &str, ttl: Duration) -> Result<bool, RelayError> {
        let got: i64 = redis::Script::new(LOCK)
            .key(rebuild_lock_key(&self.stream))
            .arg(holder)
            .arg(ttl.as_millis() as u64)
            .invoke_async(&mut self.conn)
            .await?;
        Ok(got == 1)
    }

    pub async fn unlock_rebuild(&mut self, holder: &str) -> Result<(), RelayError> {
        let _: i64 = redis::Script::new(UNLOCK)
            .key(rebuild_lock_key(&self.stream))
            .arg(holder)
            .invoke_async(&mut self.conn)
            .await?;
        Ok(())
    }

    /// Whether some relay other than `holder` is rebuilding the stream.
    pub async fn rebuilding_elsewhere(&mut self, holder: &str) -> Result<bool, RelayError> {
        let current: Option<String> = redis::cmd("GET")
            .arg(rebuild_lock_key(&self.stream))
            .query_async(&mut self.conn)
            .await?;
        Ok(current.is_some_and(|c| c != holder))
    }

    /// The stream's last-generated id (`0-0` when the stream does not exist).
    pub async fn top(&mut self) -> Result<EntryId, RelayError> {
        let exists: bool = redis::cmd("EXISTS")
            .arg(&self.stream)
            .query_async(&mut self.conn)
            .await?;
        if !exists {
            return Ok(EntryId {
                commit_lsn: 0,
                seq: 0,
            });
        }
        let info: redis::streams::StreamInfoStreamReply = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(&self.stream)
            .query_async(&mut self.conn)
            .await?;
        info.last_generated_id
            .parse()
            .map_err(|e: String| RelayError::Protocol(format!("XINFO last-generated-id: {e}")))
    }

    /// The outbox ids of the stream's entries whose `created_at` is at or after `since`
    /// (RFC 3339), newest first until older ones (the stream is in commit order).
    pub async fn outbox_ids_since(
        &mut self,
        since: &str,
    ) -> Result<std::collections::HashSet<String>, RelayError> {
        let mut ids = std::collections::HashSet::new();
        let mut end = "+".to_string();
        loop {
            let page: redis::streams::StreamRangeReply = redis::cmd("XREVRANGE")
                .arg(&self.stream)
                .arg(&end)
                .arg("-")
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut self.conn)
                .await?;
            let n = page.ids.len();
            for entry in page.ids {
                let field = |name: &str| {
                    entry
                        .map
                        .get(name)
                        .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
                };
                if let Some(created_at) = field("created_at") {
                    // RFC 3339 in UTC with a fixed layout compares as text.
                    if created_at.as_str() < since {
                        return Ok(ids);
                    }
                }
                if let Some(id) = field("outbox_id") {
                    ids.insert(id);
                }
                end = format!("({}", entry.id);
            }
            if n < 1000 {
                return Ok(ids);
            }
        }
    }

    /// Refuse a stream written from another Postgres system.
    pub async fn check_origin(&mut self, origin: &Origin) -> Result<(), RelayError> {
        match self.recorded_origin().await? {
            Some(recorded) if recorded != origin.system_id => Err(RelayError::OriginMismatch {
                stream: self.stream.clone(),
                stream_system: recorded,
                server_system: origin.system_id.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Publish `batch`'s entries. `fence`: the last id this session published before.
    pub async fn publish(
        &mut self,
        batch: &Batch,
        origin: &Origin,
        fence: Option<EntryId>,
    ) -> Result<PublishOutcome, RelayError> {
        if batch.entries.is_empty() && batch.ack_lsn.is_none() {
            return Ok(PublishOutcome::default());
        }
        let reply = self.eval(batch, origin, fence).await;
        let reply = match reply {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                // Redis restarted (scripts are not persisted): load it again and resend.
                self.script_sha = load_script(&mut self.conn).await?;
                self.eval(batch, origin, fence).await
            }
            other => other,
        };
        let reply = reply.map_err(|e| self.script_error(e, origin))?;
        parse_outcome(reply)
    }

    async fn eval(
        &mut self,
        batch: &Batch,
        origin: &Origin,
        fence: Option<EntryId>,
    ) -> redis::RedisResult<Value> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.script_sha)
            .arg(2)
            .arg(&self.stream)
            .arg(&self.origin_key)
            .arg(&origin.system_id)
            .arg(origin.timeline)
            .arg(self.max_len)
            .arg(fence.map(|id| id.to_string()).unwrap_or_default())
            .arg(
                batch
                    .ack_lsn
                    .map(|lsn| lsn.as_u64().to_string())
                    .unwrap_or_default(),
            );
        let mut id_buf = String::with_capacity(40);
        for entry in &batch.entries {
            use std::fmt::Write;
            id_buf.clear();
            let _ = write!(id_buf, "{}", entry.id);
            cmd.arg(id_buf.as_bytes())
                .arg(&entry.event.event[..])
                .arg(&entry.event.payload[..])
                .arg(&entry.event.outbox_id[..])
                .arg(&entry.event.created_at[..]);
        }
        cmd.query_async(&mut self.conn).await
    }

    fn script_error(&self, e: redis::RedisError, origin: &Origin) -> RelayError {
        let detail = e.detail().unwrap_or_default().to_string();
        match e.code() {
            Some(script_codes::ORIGIN) => RelayError::OriginMismatch {
                stream: self.stream.clone(),
                stream_system: detail,
                server_system: origin.system_id.clone(),
            },
            Some(script_codes::GAP) => RelayError::StreamBehind {
                stream: self.stream.clone(),
                detail,
            },
            Some(script_codes::DIVERGED) => RelayError::StreamDiverged {
                stream: self.stream.clone(),
                detail,
            },
            _ => RelayError::Redis(e),
        }
    }
}

async fn load_script(conn: &mut ConnectionManager) -> Result<String, RelayError> {
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SCRIPT)
        .query_async(conn)
        .await?;
    Ok(sha)
}

fn parse_outcome(reply: Value) -> Result<PublishOutcome, RelayError> {
    match reply {
        Value::Array(items) if items.len() == 2 => {
            let int = |v: &Value| match v {
                Value::Int(n) if *n >= 0 => Ok(*n as u64),
                other => Err(RelayError::Protocol(format!(
                    "publish script returned {other:?} where a count was expected"
                ))),
            };
            Ok(PublishOutcome {
                published: int(&items[0])?,
                duplicates: int(&items[1])?,
            })
        }
        other => Err(RelayError::Protocol(format!(
            "publish script returned {other:?}"
        ))),
    }
}
