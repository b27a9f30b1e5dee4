//! Publishing batches into the Redis stream: one script call per batch, idempotent by id.
//!
//! The script (`publish.lua`) writes a whole batch atomically, skips entries Redis already
//! has (replays after a reconnect carry the same ids), refuses a stream without its record
//! (Redis lost it), another cluster's stream (origin guard) or another timeline, refuses to
//! continue after the stream lost entries this session wrote (fence), and trims only what
//! every consumer group acknowledged. A failed or timed-out call is simply sent again: it
//! cannot write anything twice.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, ServerErrorKind, Value};

use crate::batch::{Batch, EntryId};
use crate::error::{script_codes, RelayError};
use crate::record::{origin_key, Origin, Records};

const SCRIPT: &str = include_str!("publish.lua");

/// What one batch did to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PublishOutcome {
    pub published: u64,
    /// Entries Redis already had (replays), counted, not written.
    pub duplicates: u64,
    /// Entries no consumer group had acknowledged, trimmed because the stream reached
    /// `--stream-max-len` (the last-resort cap).
    pub unread_trimmed: u64,
}

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

    /// The stream's record, with this publisher's connection.
    pub fn records(&self) -> Records {
        Records::new(self.conn.clone(), &self.stream)
    }

    /// The connection (for the rebuild lock).
    pub(crate) fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// Publish `batch`'s entries (ids already offset). `fence`: the last id this session
    /// published before.
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
            Some(script_codes::NORECORD) => RelayError::RecordMissing {
                stream: self.stream.clone(),
            },
            Some(script_codes::TIMELINE) => RelayError::TimelineMismatch {
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
