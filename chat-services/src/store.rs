//! This side's tables in Postgres: sending (message + outbox event in one transaction),
//! history, and the inbox (recording received messages once, replaying them by position).
//!
//! Every statement names this side's schema; the service's role can touch nothing else.

use std::collections::HashMap;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use time::OffsetDateTime;
use tracing::warn;
use uuid::Uuid;

use crate::model::{HistoryItem, Message, MESSAGE_CREATED};
use crate::side::Side;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Postgres cannot be reached or is shutting down: try again later (HTTP 503).
    #[error("postgres unavailable: {0}")]
    Unavailable(String),
    /// The Idempotency-Key was used before for a different request (HTTP 422).
    #[error("Idempotency-Key was already used for a different message (chat {chat_id})")]
    IdempotencyMismatch { chat_id: i64 },
    /// `before` names no message of this chat (HTTP 400).
    #[error("before={0} is not a message of this chat")]
    UnknownCursor(Uuid),
    /// Postgres refused the row itself: a data exception (SQLSTATE class 22) or an
    /// integrity constraint violation (23). The one kind of failure that is the data's
    /// fault, so the only one that may dead-letter an entry (HTTP 500 on a send: the
    /// handler validates first, so it is a bug there).
    #[error("postgres refused the row: {0}")]
    RowRefused(String),
    /// The inbox writer's epoch moved on: another instance holds the consumer lease now,
    /// and this write was refused (nothing written).
    #[error("another instance became the inbox writer (epoch {current}, ours {ours})")]
    Fenced { ours: i64, current: i64 },
    /// A send whose commit outcome could not be learned within the resolution window
    /// (HTTP 503 with the key: retrying with it returns the message if it was written).
    #[error("the database did not answer whether the message was written; retry with Idempotency-Key {idempotency_key}")]
    OutcomeUnknown { idempotency_key: String },
    /// Anything else: the database's state (read-only after a failover, a revoked
    /// permission, a missing table mid-migration, a lock timeout) or a bug (HTTP 500).
    #[error("postgres: {0}")]
    Other(String),
}

impl StoreError {
    /// Whether retrying later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }

    /// Whether the failure is the written row's own fault (see [`StoreError::RowRefused`]).
    pub fn is_row_refused(&self) -> bool {
        matches!(self, StoreError::RowRefused(_))
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.code() {
            // Connection exceptions, insufficient resources, operator intervention (shutdown,
            // restart), system errors, serialization failures and deadlocks.
            Some(code) if matches!(&code.code()[..2], "08" | "53" | "57" | "58" | "40") => {
                StoreError::Unavailable(describe(&e))
            }
            // (23505 excepted: every write that can meet a duplicate says ON CONFLICT, so a
            // unique violation means database state, such as an identity sequence behind
            // its table after a restore.)
            Some(code) if matches!(&code.code()[..2], "22" | "23") && code.code() != "23505" => {
                StoreError::RowRefused(describe(&e))
            }
            Some(_) => StoreError::Other(describe(&e)),
            None => StoreError::Unavailable(describe(&e)),
        }
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}

fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

/// How long a send whose outcome is unknown is retried before answering 503.
const RESOLVE_WITHIN: Duration = Duration::from_secs(5);

/// One send's statement, runnable again with the same message id and key.
struct Send<'a> {
    message: &'a Message,
    key: &'a str,
    payload: &'a serde_json::Value,
}

impl Send<'_> {
    /// One statement, so one round trip and atomic without an explicit transaction: the
    /// outbox row exists exactly when the message row does. `ON CONFLICT DO NOTHING` covers
    /// both the message id and the key, so running it again never writes twice.
    async fn execute(&self, store: &Store) -> Attempt {
        let s = store.side.schema();
        let client = match store.pool.get().await {
            Ok(client) => client,
            Err(e) => return Attempt::Refused(e.into()),
        };
        let statement = match client
            .prepare_cached(&format!(
                "WITH m AS (
                   INSERT INTO {s}.messages (id, chat_id, body, created_at, idempotency_key)
                   VALUES ($1, $2, $3, $4, $5)
                   ON CONFLICT DO NOTHING
                   RETURNING id
                 )
                 INSERT INTO {s}.outbox (event, payload) SELECT $6, $7 FROM m"
            ))
            .await
        {
            Ok(statement) => statement,
            Err(e) => return Attempt::Refused(e.into()),
        };
        let m = self.message;
        let executed = client
            .execute(
                &statement,
                &[
                    &m.id,
                    &m.chat_id,
                    &m.body,
                    &m.created_at,
                    &self.key,
                    &MESSAGE_CREATED,
                    self.payload,
                ],
            )
            .await;
        match executed {
            Ok(inserted) => Attempt::Done(inserted),
            // The server answered with an ERROR: the statement (and its commit) failed. A
            // FATAL (an immediate shutdown, a crash restart) may follow a commit: unknown.
            Err(e)
                if e.as_db_error().is_some_and(|db| {
                    db.parsed_severity() == Some(tokio_postgres::error::Severity::Error)
                }) =>
            {
                Attempt::Refused(e.into())
            }
            Err(e) => Attempt::Unknown(e.to_string()),
        }
    }
}

/// What one run of a send's statement did.
enum Attempt {
    Done(u64),
    /// Certainly not written (it never reached the server, or the server refused it).
    Refused(StoreError),
    /// Sent, and no answer: written or not.
    Unknown(String),
}

/// A message recorded into the inbox by [`Store::record_inbox`].
#[derive(Debug, Clone)]
pub struct Received {
    pub stream_id: String,
    pub message: Message,
}

#[derive(Clone)]
pub struct Store {
    pool: Pool,
    side: Side,
}

impl Store {
    /// A pool of connections to `endpoint` (with its TLS settings) as this side's role.
    pub fn new(
        endpoint: &cdc_relay::pg::PgEndpoint,
        side: Side,
        max_connections: usize,
    ) -> Result<Self, String> {
        let (mut config, tls) = endpoint
            .pool_parts(&format!("chat-{side}"))
            .map_err(|e| e.to_string())?;
        config.connect_timeout(Duration::from_secs(3));
        let recycling = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match tls {
            None => Manager::from_config(config, tokio_postgres::NoTls, recycling),
            Some(tls) => Manager::from_config(
                config,
                tokio_postgres_rustls::MakeRustlsConnect::new(tls),
                recycling,
            ),
        };
        let pool = Pool::builder(manager)
            .max_size(max_connections)
            .wait_timeout(Some(Duration::from_secs(5)))
            .create_timeout(Some(Duration::from_secs(5)))
            .recycle_timeout(Some(Duration::from_secs(2)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .expect("pool configuration is valid");
        Ok(Self { pool, side })
    }

    pub fn side(&self) -> Side {
        self.side
    }

    /// Postgres answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let client = self.pool.get().await?;
        client.simple_query("SELECT 1").await?;
        Ok(())
    }

    /// Write the message and its outbox event in one transaction. With an idempotency key
    /// already used for the same chat and body, return the original (`true`: a replay)
    /// and write nothing.
    pub async fn send(
        &self,
        chat_id: i64,
        body: &str,
        idempotency_key: Option<&str>,
    ) -> Result<(Message, bool), StoreError> {
        let s = self.side.schema();
        // The message's timestamp comes from here (like its UUIDv7), at the database's
        // microsecond precision, so the event carries exactly what is stored and answered.
        let now = OffsetDateTime::now_utc();
        let created_at = now
            .replace_nanosecond(now.nanosecond() / 1_000 * 1_000)
            .expect("valid nanosecond");
        let message = Message {
            id: Uuid::now_v7(),
            chat_id,
            body: body.to_string(),
            created_at,
            side: self.side,
        };
        let payload = serde_json::to_value(&message).expect("message serializes");
        // Every send has a key: the client's, or one of ours, so that an outcome we cannot
        // learn (Postgres unreachable for the whole resolution window) can still be retried
        // safely by the client with the key we answer.
        let key = idempotency_key
            .map(str::to_string)
            .unwrap_or_else(|| format!("auto:{}", message.id));
        let send = Send {
            message: &message,
            key: &key,
            payload: &payload,
        };
        let inserted = match send.execute(self).await {
            Attempt::Done(inserted) => inserted,
            Attempt::Refused(e) => return Err(e),
            // The statement went out and no answer came back (the connection broke): it
            // may have committed. Send it again: the same message id and key make a second
            // run write nothing if the first committed, and wait for it if still running.
            Attempt::Unknown(e) => {
                warn!(error = %e, message_id = %message.id, "send's outcome unknown (connection lost); resolving");
                self.resolve(&send).await?
            }
        };
        if inserted == 1 {
            return Ok((message, false));
        }
        // Our own key was already there: this very send, committed before its connection
        // broke (a rerun wrote nothing). No need to read it back.
        if idempotency_key.is_none() {
            return Ok((message, false));
        }
        // The client's key was used before: answer the original. Failing to read it now
        // leaves the outcome unknown, not "nothing written".
        let unknown = || StoreError::OutcomeUnknown {
            idempotency_key: key.clone(),
        };
        let client = self.pool.get().await.map_err(|_| unknown())?;
        let row = client
            .query_one(
                &format!("SELECT id, chat_id, body, created_at FROM {s}.messages WHERE idempotency_key = $1"),
                &[&key],
            )
            .await
            .map_err(|_| unknown())?;
        let original = Message {
            id: row.get(0),
            chat_id: row.get(1),
            body: row.get(2),
            created_at: row.get(3),
            side: self.side,
        };
        if original.chat_id != chat_id || original.body != body {
            return Err(StoreError::IdempotencyMismatch {
                chat_id: original.chat_id,
            });
        }
        // The same message id: this very send, committed before its connection broke.
        let replayed = original.id != message.id;
        Ok((original, replayed))
    }

    /// Run `send` again on fresh connections until its outcome is known (5 s at most).
    async fn resolve(&self, send: &Send<'_>) -> Result<u64, StoreError> {
        let deadline = tokio::time::Instant::now() + RESOLVE_WITHIN;
        let mut pause = Duration::from_millis(50);
        loop {
            // Only a completed rerun settles it: a rerun refused (say by a read-only node
            // after a failover) says nothing about whether the first attempt committed.
            let e = match send.execute(self).await {
                Attempt::Done(inserted) => return Ok(inserted),
                Attempt::Refused(e) => e.to_string(),
                Attempt::Unknown(e) => e,
            };
            if tokio::time::Instant::now() + pause > deadline {
                warn!(error = %e, key = %send.key, "send's outcome still unknown");
                return Err(StoreError::OutcomeUnknown {
                    idempotency_key: send.key.to_string(),
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }

    /// The chat as this side sees it, oldest first: sent and received messages ordered by
    /// their sender's timestamp; `before` pages back from a message id.
    pub async fn history(
        &self,
        chat_id: i64,
        limit: i64,
        before: Option<Uuid>,
    ) -> Result<Vec<HistoryItem>, StoreError> {
        let s = self.side.schema();
        let client = self.pool.get().await?;
        let cursor: Option<(OffsetDateTime, Uuid)> = match before {
            None => None,
            Some(id) => {
                let row = client
                    .query_opt(
                        &format!(
                            "SELECT created_at FROM {s}.messages WHERE id = $1 AND chat_id = $2
                             UNION ALL
                             SELECT sent_at FROM {s}.inbox WHERE message_id = $1 AND chat_id = $2"
                        ),
                        &[&id, &chat_id],
                    )
                    .await?
                    .ok_or(StoreError::UnknownCursor(id))?;
                Some((row.get(0), id))
            }
        };
        let (before_at, before_id) = cursor.unzip();
        let rows = client
            .query(
                &format!(
                    "SELECT id, body, at, sent, seq FROM (
                        SELECT id, body, created_at AS at, true AS sent, NULL::bigint AS seq
                          FROM {s}.messages WHERE chat_id = $1
                        UNION ALL
                        SELECT message_id, body, sent_at, false, seq
                          FROM {s}.inbox WHERE chat_id = $1
                     ) m
                     WHERE $2::timestamptz IS NULL OR (at, id) < ($2, $3)
                     ORDER BY at DESC, id DESC
                     LIMIT $4"
                ),
                &[&chat_id, &before_at, &before_id, &limit],
            )
            .await?;
        let mut items: Vec<HistoryItem> = rows
            .iter()
            .map(|r| {
                let sent: bool = r.get(3);
                HistoryItem {
                    message: Message {
                        id: r.get(0),
                        chat_id,
                        body: r.get(1),
                        created_at: r.get(2),
                        side: if sent { self.side } else { self.side.other() },
                    },
                    seq: r.get(4),
                }
            })
            .collect();
        items.reverse();
        Ok(items)
    }

    /// Record received messages in one transaction, each once (by message id), in the given
    /// order. Returns the inbox position of each message recorded now; messages already in
    /// the inbox (redeliveries) are absent from the map.
    /// Become the inbox's writer (after taking the consumer lease): bump the fencing epoch.
    /// Waits for a previous holder's in-flight write, whose epoch it then invalidates.
    pub async fn claim_inbox_writer(&self, holder: &str) -> Result<i64, StoreError> {
        let s = self.side.schema();
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                &format!(
                    "UPDATE {s}.inbox_writer SET holder = $1, epoch = epoch + 1 RETURNING epoch"
                ),
                &[&holder],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Record received messages, only while `epoch` is the inbox writer's epoch (see
    /// [`Store::claim_inbox_writer`]); `Fenced` otherwise, with nothing written.
    pub async fn record_inbox(
        &self,
        received: &[Received],
        epoch: i64,
    ) -> Result<HashMap<Uuid, i64>, StoreError> {
        let s = self.side.schema();
        let mut ids = Vec::with_capacity(received.len());
        let mut chats = Vec::with_capacity(received.len());
        let mut bodies = Vec::with_capacity(received.len());
        let mut sent = Vec::with_capacity(received.len());
        let mut streams = Vec::with_capacity(received.len());
        for r in received {
            ids.push(r.message.id);
            chats.push(r.message.chat_id);
            bodies.push(r.message.body.as_str());
            sent.push(r.message.created_at);
            streams.push(r.stream_id.as_str());
        }
        let client = self.pool.get().await?;
        // One statement: the writer row locked FOR SHARE and its epoch checked, then the
        // rows inserted, identities assigned in the order of `ord`, which is stream order,
        // so positions grow in the sender's commit order. The first output row (message id
        // NULL) carries the current epoch.
        let statement = client
            .prepare_cached(&format!(
                    "WITH w AS (SELECT epoch FROM {s}.inbox_writer FOR SHARE),
                          ins AS (
                            INSERT INTO {s}.inbox (message_id, chat_id, body, sent_at, stream_id)
                            SELECT id, chat, body, sent, stream
                              FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::timestamptz[], $5::text[])
                                   WITH ORDINALITY AS r(id, chat, body, sent, stream, ord)
                             WHERE (SELECT epoch FROM w) = $6
                             ORDER BY ord
                            ON CONFLICT (message_id) DO NOTHING
                            RETURNING message_id, seq)
                     SELECT NULL::uuid, (SELECT epoch FROM w)
                     UNION ALL
                     SELECT message_id, seq FROM ins"
            ))
            .await?;
        let rows = client
            .query(
                &statement,
                &[&ids, &chats, &bodies, &sent, &streams, &epoch],
            )
            .await?;
        let mut recorded = HashMap::with_capacity(rows.len());
        for row in &rows {
            match row.get::<_, Option<Uuid>>(0) {
                Some(id) => {
                    recorded.insert(id, row.get(1));
                }
                None => {
                    let current: i64 = row.get(1);
                    if current != epoch {
                        return Err(StoreError::Fenced {
                            ours: epoch,
                            current,
                        });
                    }
                }
            }
        }
        Ok(recorded)
    }

    /// Received messages of a chat after inbox position `after`, in order.
    pub async fn replay(
        &self,
        chat_id: i64,
        after: i64,
        limit: i64,
    ) -> Result<Vec<HistoryItem>, StoreError> {
        let s = self.side.schema();
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT seq, message_id, body, sent_at FROM {s}.inbox
                      WHERE chat_id = $1 AND seq > $2 ORDER BY seq LIMIT $3"
                ),
                &[&chat_id, &after, &limit],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| HistoryItem {
                seq: Some(r.get(0)),
                message: Message {
                    id: r.get(1),
                    chat_id,
                    body: r.get(2),
                    created_at: r.get(3),
                    side: self.side.other(),
                },
            })
            .collect())
    }

    /// Delete up to `batch` outbox rows older than `older_than`; returns how many. Deletes
    /// are not published (the publication sends inserts only); rows locked by someone else
    /// are skipped, so concurrent instances share the work instead of waiting.
    pub async fn delete_old_outbox(
        &self,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let s = self.side.schema();
        let client = self.pool.get().await?;
        let statement = client
            .prepare_cached(&format!(
                "DELETE FROM {s}.outbox WHERE id IN (
                   SELECT id FROM {s}.outbox
                    WHERE created_at < now() - make_interval(secs => $1)
                    ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)"
            ))
            .await?;
        Ok(client
            .execute(&statement, &[&older_than.as_secs_f64(), &batch])
            .await?)
    }

    /// The newest inbox position (0 when empty): where a client without `Last-Event-ID`
    /// starts.
    pub async fn last_seq(&self) -> Result<i64, StoreError> {
        let s = self.side.schema();
        let client = self.pool.get().await?;
        let row = client
            .query_one(&format!("SELECT coalesce(max(seq), 0) FROM {s}.inbox"), &[])
            .await?;
        Ok(row.get(0))
    }
}
