//! This side's tables in Postgres: sending (message + outbox event in one transaction),
//! history, and the inbox (recording received messages once, replaying them by position).
//!
//! Every statement names this side's schema; the service's role can touch nothing else.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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
    /// Postgres answers, but too slowly for this operation: a statement or lock wait ran
    /// out on the server, or every pooled connection is busy. Try again later (HTTP 503);
    /// never taken for a database that is gone (the breaker stays as it is), and an inbox
    /// batch that meets it is written in smaller parts.
    #[error("postgres busy: {0}")]
    Busy(String),
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

/// [`StoreError::Busy`]'s detail when no pooled connection came free in time.
const POOL_BUSY: &str = "every pooled connection is in use";

impl StoreError {
    /// Whether retrying later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Busy(_))
    }

    /// Whether the database certainly did not run the statement: unreachable, or no pooled
    /// connection free (a statement or lock wait that ran out on the server did run).
    pub fn ran_nothing(&self) -> bool {
        match self {
            StoreError::Unavailable(_) => true,
            StoreError::Busy(detail) => detail == POOL_BUSY,
            _ => false,
        }
    }

    /// Whether the failure is the written row's own fault (see [`StoreError::RowRefused`]).
    pub fn is_row_refused(&self) -> bool {
        matches!(self, StoreError::RowRefused(_))
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.code() {
            // statement_timeout and lock_timeout: the server answered, slowly.
            Some(code) if code.code() == "57014" || code.code() == "55P03" => {
                StoreError::Busy(describe(&e))
            }
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
            // Every connection in use: busy, not gone (a frozen server makes its statements
            // run out, which is what trips the breaker).
            deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Wait) => {
                StoreError::Busy(POOL_BUSY.into())
            }
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

/// How long a send whose outcome is unknown is retried before answering 503; also the most
/// a send waits for a database that stopped answering.
const RESOLVE_WITHIN: Duration = Duration::from_secs(5);
/// The most any other operation waits for the database (connection, statements, commit):
/// a server that stops answering without closing its connections (frozen, partitioned)
/// costs this, not forever.
const STATEMENT_DEADLINE: Duration = Duration::from_secs(5);
/// The most a request waits for a pooled connection.
const POOL_WAIT: Duration = Duration::from_secs(2);
/// An idle pooled connection is checked (one round trip) before reuse after this long.
const IDLE_CHECK_AFTER: Duration = Duration::from_secs(10);
/// Server-side bounds of every statement of the services' sessions, inside
/// [`STATEMENT_DEADLINE`]: a slow statement or a lock wait ends with the server's own error
/// on a connection that stays good, so the client's deadline fires only when the server
/// does not answer at all (and then no pooled connection is trusted, see [`Store::bounded`]).
const SESSION_LIMITS: &str =
    "-c statement_timeout=4s -c lock_timeout=3s -c idle_in_transaction_session_timeout=60s";

/// An Idempotency-Key as stored: each sender's keys are their own (two users choosing the
/// same key never meet, nor learn of each other's messages). A user id holds no control
/// character and a key only visible ASCII, so the separator is unambiguous. Keys of
/// anonymous sends, and of every send before identities, are stored as they are.
fn stored_key(sender: Option<&str>, key: &str) -> String {
    match sender {
        Some(sender) => format!("{sender}\u{1f}{key}"),
        None => key.to_string(),
    }
}

/// The least UUIDv7 of `at`'s millisecond: every id below it was made earlier.
fn least_uuid_v7_of(at: std::time::SystemTime) -> Uuid {
    let ms = at
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64;
    let mut bytes = [0u8; 16];
    bytes[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    bytes[6] = 0x70; // version 7
    bytes[8] = 0x80; // RFC 4122 variant
    Uuid::from_bytes(bytes)
}

/// One send's statement, runnable again with the same message id and key.
struct Send<'a> {
    message: &'a Message,
    /// The key as stored: scoped to the sender (see [`stored_key`]).
    key: &'a str,
    /// The key as the client knows it (answered with an unknown outcome).
    client_key: &'a str,
    payload: &'a serde_json::Value,
    /// The sending request's trace context, for the outbox row.
    traceparent: Option<&'a str>,
}

impl Send<'_> {
    /// [`Send::execute`], given up at `deadline`: an attempt that had no answer by then
    /// may have committed (its outcome is unknown), and the connections it used are not
    /// trusted again.
    async fn execute_by(&self, store: &Store, deadline: tokio::time::Instant) -> Attempt {
        let _probe = match store.breaker.admit() {
            Admit::Refuse => return Attempt::Refused(refused_by_breaker()),
            admitted => admitted,
        };
        match tokio::time::timeout_at(deadline, self.execute(store)).await {
            Ok(attempt) => {
                if matches!(
                    attempt,
                    Attempt::Done(_)
                        | Attempt::Refused(StoreError::Other(_) | StoreError::RowRefused(_))
                ) {
                    store.breaker.answered();
                }
                attempt
            }
            Err(_) => {
                store.breaker.trip();
                store.pool.retain(|_, _| false);
                Attempt::Unknown("no answer from the database in time".into())
            }
        }
    }

    /// One statement, so one round trip and atomic without an explicit transaction: the
    /// outbox row exists exactly when the message row does. `ON CONFLICT DO NOTHING` covers
    /// both the message id and the key, so running it again never writes twice. The outbox
    /// row's partition key is the chat (its stream shard, see `outbox_core::stream`). The chat
    /// feed position comes back when the message was written now (the trigger of migration
    /// V7 assigns it).
    async fn execute(&self, store: &Store) -> Attempt {
        let s = store.side.schema();
        let client = match store.pool.get().await {
            Ok(client) => client,
            Err(e) => return Attempt::Refused(e.into()),
        };
        let statement = match client
            .prepare_cached(&format!(
                "WITH m AS (
                   INSERT INTO {s}.messages (id, chat_id, body, created_at, idempotency_key, sender)
                   VALUES ($1, $2, $3, $4, $5, $8)
                   ON CONFLICT DO NOTHING
                   RETURNING pos, chat_id
                 ),
                 o AS (INSERT INTO {s}.outbox (event, payload, partition_key, traceparent)
                       SELECT $6, $7, chat_id::text, $9 FROM m)
                 SELECT pos FROM m"
            ))
            .await
        {
            Ok(statement) => statement,
            Err(e) => return Attempt::Refused(e.into()),
        };
        let m = self.message;
        let executed = client
            .query_opt(
                &statement,
                &[
                    &m.id,
                    &m.chat_id,
                    &m.body,
                    &m.created_at,
                    &self.key,
                    &MESSAGE_CREATED,
                    self.payload,
                    &m.sender,
                    &self.traceparent,
                ],
            )
            .await;
        match executed {
            Ok(row) => Attempt::Done(row.map(|r| r.get(0))),
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
    /// Ran to completion: the message's feed position if written now, `None` if it was
    /// already there.
    Done(Option<i64>),
    /// Certainly not written (it never reached the server, or the server refused it).
    Refused(StoreError),
    /// Sent, and no answer: written or not.
    Unknown(String),
}

/// A sent message with its place in the chat's feed.
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    pub item: HistoryItem,
    /// The Idempotency-Key was used before: this is the original, nothing was written.
    pub replayed: bool,
}

/// Where [`Store::record_inbox`] put a message in its chat's feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub struct Position {
    pub pos: i64,
    /// Recorded by this call (`false`: it was in the inbox already).
    pub new: bool,
}

/// A message to record into the inbox by [`Store::record_inbox`].
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub struct Received {
    pub stream_id: String,
    pub message: Message,
}

#[derive(Clone)]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub struct Store {
    pool: Pool,
    side: Side,
    breaker: Arc<Breaker>,
    /// A connection of its own for [`Store::ping`], outside the pool: a pool that is all in
    /// use means a busy database, not a dead one, and the health checks must tell them apart.
    health: Arc<tokio::sync::Mutex<Health>>,
    endpoint: outbox_core::connect::PgEndpoint,
}

/// The health check's own connection, and since when it has left a check unanswered.
#[derive(Default)]
struct Health {
    client: Option<tokio_postgres::Client>,
    unanswered_since: Option<std::time::Instant>,
}

/// How long the health check's connection may leave checks unanswered before it is given up
/// for a new one. A frozen server answers on it the moment it wakes; a new connection would
/// queue behind every one abandoned during the freeze, and the instance would learn that
/// Postgres is back only after the server forked a backend for each. A server that went
/// away without closing it (a vanished host) is noticed this much later.
const HEALTH_GIVE_UP: Duration = Duration::from_secs(10);

/// Trips when an operation gets no answer by its deadline: from then on one operation at a
/// time goes to the database (waiting, if need be, on a connection to a frozen server) and
/// the others are answered at once (503, nothing written), until one gets an answer.
/// Without it every request during a freeze opens a connection and abandons it at its
/// deadline; the server accepts them all when it wakes (688 after 20 s frozen, in the soak)
/// and its first seconds go to forking backends for clients long gone.
#[derive(Default)]
struct Breaker {
    tripped: AtomicBool,
    probing: AtomicBool,
    /// Woken when a tripped breaker sees an answer: whatever waits out a backoff because
    /// the database did not answer tries again at once.
    answering: tokio::sync::Notify,
}

/// Whether an operation may go to the database now.
enum Admit<'a> {
    Go,
    /// The one operation trying the database while the breaker is tripped.
    Probe(#[allow(dead_code)] ProbeGuard<'a>),
    Refuse,
}

/// Held by the probing operation; lets the next one probe when it ends.
struct ProbeGuard<'a>(&'a Breaker);

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        self.0.probing.store(false, Ordering::Release);
    }
}

impl Breaker {
    fn admit(&self) -> Admit<'_> {
        if !self.tripped.load(Ordering::Acquire) {
            return Admit::Go;
        }
        if self.probing.swap(true, Ordering::AcqRel) {
            return Admit::Refuse;
        }
        Admit::Probe(ProbeGuard(self))
    }

    /// An operation got an answer from the server within its deadline: it is not frozen.
    fn answered(&self) {
        if self.tripped.swap(false, Ordering::AcqRel) {
            self.answering.notify_waiters();
        }
    }

    fn trip(&self) {
        self.tripped.store(true, Ordering::Release);
    }
}

/// What an operation refused by the tripped breaker answers.
fn refused_by_breaker() -> StoreError {
    StoreError::Unavailable(
        "the database did not answer in time a moment ago; one request at a time tries it until it answers"
            .into(),
    )
}

impl Store {
    /// A pool of connections to `endpoint` (with its TLS settings) as this side's role.
    #[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
    pub fn new(
        endpoint: &outbox_core::connect::PgEndpoint,
        side: Side,
        max_connections: usize,
    ) -> Result<Self, outbox_core::ConfigError> {
        // No connect timeout of its own, and none for the pool's creation: every use is
        // under a deadline (`bounded`, `within`), which is what trips the breaker. A
        // shorter one would fail a connection to a frozen server before it, so each
        // request would open another.
        let (mut config, tls) = endpoint.pool_parts(&format!("chat-{side}"))?;
        // Every statement here goes by an index, and a prepared statement keeps the plan it
        // settled on for the connection's life: one made while a table was nearly empty and
        // analyzed scans the whole table on every run as it grows, until autovacuum analyzes
        // again (seen: the inbox write's lookup of recorded messages, at 2,800 messages/s).
        // Statements with no index to use still scan (this only prices scans out).
        let options = match config.get_options() {
            Some(given) if !given.trim().is_empty() => {
                format!("{given} -c enable_seqscan=off {SESSION_LIMITS}")
            }
            _ => format!("-c enable_seqscan=off {SESSION_LIMITS}"),
        };
        config.options(&options);
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
            // Shorter than every operation's deadline: a request that cannot get a
            // connection is told the database is busy, and never takes it for a dead one.
            .wait_timeout(Some(POOL_WAIT))
            .recycle_timeout(Some(Duration::from_secs(2)))
            // A connection idle for a while is checked before reuse: one whose server went
            // away without closing it (a failover, a partition) is replaced, not handed to
            // a request that would wait for it.
            .pre_recycle(deadpool_postgres::Hook::async_fn(|client, metrics| {
                Box::pin(async move {
                    if metrics.last_used() < IDLE_CHECK_AFTER {
                        return Ok(());
                    }
                    match tokio::time::timeout(Duration::from_secs(1), client.simple_query(""))
                        .await
                    {
                        Ok(Ok(_)) => Ok(()),
                        _ => Err(deadpool_postgres::HookError::Message(
                            "an idle connection did not answer its check".into(),
                        )),
                    }
                })
            }))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .expect("pool configuration is valid");
        Ok(Self {
            pool,
            side,
            breaker: Arc::default(),
            health: Arc::default(),
            endpoint: endpoint.clone(),
        })
    }

    /// `op` within `deadline`. Past it the database is taken for unavailable, and the idle
    /// pooled connections are dropped: anything merely slow was ended by the server first
    /// ([`SESSION_LIMITS`]), so a server that left a statement unanswered this long is
    /// frozen or cut off, and not trusted with the next on the same connections.
    ///
    /// While the [`Breaker`] is tripped, only one operation at a time goes to the database;
    /// the others fail at once.
    async fn bounded<T>(
        &self,
        deadline: Duration,
        op: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let _probe = match self.breaker.admit() {
            Admit::Refuse => return Err(refused_by_breaker()),
            admitted => admitted,
        };
        self.within(deadline, op).await
    }

    /// `op` within `deadline`, whatever the breaker says; its outcome sets the breaker.
    async fn within<T>(
        &self,
        deadline: Duration,
        op: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(deadline, op).await {
            Ok(result) => {
                // A refusal proves nothing about a frozen server (a connection can be
                // dropped by anything), nor a full pool; an answer or the server's own
                // error does.
                if !matches!(
                    result,
                    Err(StoreError::Unavailable(_) | StoreError::Busy(_))
                ) {
                    self.breaker.answered();
                }
                result
            }
            Err(_) => {
                self.breaker.trip();
                self.pool.retain(|_, _| false);
                Err(StoreError::Unavailable(format!(
                    "no answer within {deadline:?}"
                )))
            }
        }
    }

    /// Postgres answers, on a connection of its own (never one of the pool, which may be all
    /// in use by a busy database: that is not a dead one), within `deadline` (the caller's).
    /// A check left unanswered keeps its connection (see [`HEALTH_GIVE_UP`]): the next check
    /// goes behind it on the same one. Never refused by the breaker, so the health checks
    /// (readiness, the inbox membership) learn the truth; its answer clears the breaker, its
    /// silence trips it.
    pub(crate) async fn ping(&self, deadline: Duration) -> Result<(), StoreError> {
        let started = std::time::Instant::now();
        let Ok(mut health) = tokio::time::timeout(deadline, self.health.lock()).await else {
            return Err(StoreError::Busy(
                "another health check has not finished".into(),
            ));
        };
        let health = &mut *health;
        let left = deadline.saturating_sub(started.elapsed());
        let outcome = tokio::time::timeout(left, async {
            let given_up = health
                .unanswered_since
                .is_some_and(|t| t.elapsed() >= HEALTH_GIVE_UP);
            if given_up || health.client.as_ref().is_none_or(|c| c.is_closed()) {
                health.client = None;
                health.unanswered_since = None;
                let client = self
                    .endpoint
                    .connect_as(left, &format!("chat-{}-health", self.side))
                    .await
                    .map_err(|e| StoreError::Unavailable(e.to_string()))?;
                client.batch_execute("SET statement_timeout = '4s'").await?;
                health.client = Some(client);
            }
            health
                .client
                .as_ref()
                .expect("connected above")
                .simple_query("SELECT 1")
                .await?;
            Ok::<(), StoreError>(())
        })
        .await;
        match outcome {
            Ok(Ok(())) => {
                health.unanswered_since = None;
                self.breaker.answered();
                Ok(())
            }
            Ok(Err(e)) => {
                health.client = None;
                health.unanswered_since = None;
                Err(e)
            }
            Err(_) => {
                if health.client.is_some() {
                    health
                        .unanswered_since
                        .get_or_insert_with(std::time::Instant::now);
                }
                self.breaker.trip();
                self.pool.retain(|_, _| false);
                Err(StoreError::Unavailable(format!(
                    "no answer within {deadline:?}"
                )))
            }
        }
    }

    /// Resolves when the database answers again after it did not (the breaker clears):
    /// a retry waiting out its backoff because of an outage starts at once instead. Create
    /// it before the wait; it sees only answers that come after.
    pub(crate) fn answering_again(&self) -> tokio::sync::futures::Notified<'_> {
        self.breaker.answering.notified()
    }

    /// Write the message and its outbox event in one transaction. With an idempotency key
    /// already used for the same chat and body, return the original (a replay) and write
    /// nothing.
    pub(crate) async fn send(
        &self,
        chat_id: i64,
        body: &str,
        idempotency_key: Option<&str>,
        sender: Option<&str>,
        traceparent: Option<&str>,
    ) -> Result<Sent, StoreError> {
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
            sender: sender.map(str::to_string),
        };
        let payload = serde_json::to_value(&message).expect("message serializes");
        // Every send has a key: the client's, or one of ours, so that an outcome we cannot
        // learn (Postgres unreachable for the whole resolution window) can still be retried
        // safely by the client with the key we answer.
        let key = idempotency_key
            .map(str::to_string)
            .unwrap_or_else(|| format!("auto:{}", message.id));
        let stored = stored_key(sender, &key);
        let send = Send {
            message: &message,
            key: &stored,
            client_key: &key,
            payload: &payload,
            traceparent,
        };
        let deadline = tokio::time::Instant::now() + RESOLVE_WITHIN;
        let written = match send.execute_by(self, deadline).await {
            Attempt::Done(written) => written,
            Attempt::Refused(e) => return Err(e),
            // The statement went out and no answer came back (the connection broke): it
            // may have committed. Send it again: the same message id and key make a second
            // run write nothing if the first committed, and wait for it if still running.
            Attempt::Unknown(e) => {
                warn!(error = %e, message_id = %message.id, "send's outcome unknown (connection lost); resolving");
                self.resolve(&send, deadline).await?
            }
        };
        if let Some(pos) = written {
            return Ok(Sent {
                item: HistoryItem { message, pos },
                replayed: false,
            });
        }
        // The key was there already: the client's key used before, or this very send
        // (our own key or the client's), committed before its connection broke. Answer
        // the original. Failing to read it now leaves the outcome unknown, not "nothing
        // written".
        let unknown = || StoreError::OutcomeUnknown {
            idempotency_key: key.clone(),
        };
        let row = self
            .bounded(STATEMENT_DEADLINE, async {
                let client = self.pool.get().await?;
                Ok(client
                    .query_one(
                        &format!("SELECT id, chat_id, body, created_at, pos, sender FROM {s}.messages WHERE idempotency_key = $1"),
                        &[&stored],
                    )
                    .await?)
            })
            .await
            .map_err(|_| unknown())?;
        let original = Message {
            id: row.get(0),
            chat_id: row.get(1),
            body: row.get(2),
            created_at: row.get(3),
            side: self.side,
            sender: row.get(5),
        };
        // Another user's key is a mismatch too: a replay answers only its own sender.
        if original.chat_id != chat_id
            || original.body != body
            || original.sender.as_deref() != sender
        {
            return Err(StoreError::IdempotencyMismatch {
                chat_id: original.chat_id,
            });
        }
        // The same message id: this very send, committed before its connection broke.
        let replayed = original.id != message.id;
        Ok(Sent {
            item: HistoryItem {
                message: original,
                pos: row.get(4),
            },
            replayed,
        })
    }

    /// Run `send` again on fresh connections until its outcome is known, or `deadline`
    /// (5 s after the send began).
    async fn resolve(
        &self,
        send: &Send<'_>,
        deadline: tokio::time::Instant,
    ) -> Result<Option<i64>, StoreError> {
        let mut pause = Duration::from_millis(50);
        loop {
            // Only a completed rerun settles it: a rerun refused (say by a read-only node
            // after a failover) says nothing about whether the first attempt committed.
            let e = match send.execute_by(self, deadline).await {
                Attempt::Done(written) => return Ok(written),
                Attempt::Refused(e) => e.to_string(),
                Attempt::Unknown(e) => e,
            };
            if tokio::time::Instant::now() + pause > deadline {
                warn!(error = %e, key = %send.client_key, "send's outcome still unknown");
                return Err(StoreError::OutcomeUnknown {
                    idempotency_key: send.client_key.to_string(),
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }

    /// The chat as this side shows it, oldest first: sent and received messages in feed
    /// order (their per-chat position); `before` pages back from a message id.
    pub(crate) async fn history(
        &self,
        chat_id: i64,
        limit: i64,
        before: Option<Uuid>,
    ) -> Result<Vec<HistoryItem>, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let before_pos: Option<i64> = match before {
                None => None,
                Some(id) => {
                    let row = client
                        .query_opt(
                            &format!(
                                "SELECT pos FROM {s}.messages WHERE id = $1 AND chat_id = $2
                             UNION ALL
                             SELECT pos FROM {s}.inbox WHERE message_id = $1 AND chat_id = $2"
                            ),
                            &[&id, &chat_id],
                        )
                        .await?
                        .ok_or(StoreError::UnknownCursor(id))?;
                    Some(row.get(0))
                }
            };
            let rows = client
                .query(
                    &format!(
                        "SELECT * FROM (
                        SELECT id, body, created_at, true, pos, sender FROM {s}.messages
                         WHERE chat_id = $1 AND pos < $2 ORDER BY pos DESC LIMIT $3) sent
                     UNION ALL
                     SELECT * FROM (
                        SELECT message_id, body, sent_at, false, pos, sender FROM {s}.inbox
                         WHERE chat_id = $1 AND pos < $2 ORDER BY pos DESC LIMIT $3) received
                     ORDER BY pos DESC
                     LIMIT $3"
                    ),
                    &[&chat_id, &before_pos.unwrap_or(i64::MAX), &limit],
                )
                .await?;
            let mut items: Vec<HistoryItem> = rows.iter().map(|r| self.item(chat_id, r)).collect();
            items.reverse();
            Ok(items)
        })
        .await
    }

    /// A feed row `(id, body, created_at, sent, pos, sender)` as a history item.
    fn item(&self, chat_id: i64, row: &tokio_postgres::Row) -> HistoryItem {
        let sent: bool = row.get(3);
        HistoryItem {
            message: Message {
                id: row.get(0),
                chat_id,
                body: row.get(1),
                created_at: row.get(2),
                side: if sent { self.side } else { self.side.other() },
                sender: row.get(5),
            },
            pos: row.get(4),
        }
    }

    /// The chat's feed after position `after`, in order (sent and received).
    pub(crate) async fn feed(
        &self,
        chat_id: i64,
        after: i64,
        limit: i64,
    ) -> Result<Vec<HistoryItem>, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let statement = client
                .prepare_cached(&format!(
                    "SELECT * FROM (
                    SELECT id, body, created_at, true, pos, sender FROM {s}.messages
                     WHERE chat_id = $1 AND pos > $2 ORDER BY pos LIMIT $3) sent
                 UNION ALL
                 SELECT * FROM (
                    SELECT message_id, body, sent_at, false, pos, sender FROM {s}.inbox
                     WHERE chat_id = $1 AND pos > $2 ORDER BY pos LIMIT $3) received
                 ORDER BY pos
                 LIMIT $3"
                ))
                .await?;
            let rows = client
                .query(&statement, &[&chat_id, &after, &limit])
                .await?;
            Ok(rows.iter().map(|r| self.item(chat_id, r)).collect())
        })
        .await
    }

    /// The newest position of each chat's feed (chats with no message are absent). Every
    /// position up to it is final: readers that reach it missed nothing.
    pub(crate) async fn tips(&self, chats: &[i64]) -> Result<Vec<(i64, i64)>, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let statement = client
                .prepare_cached(&format!(
                    "SELECT chat_id, last_pos FROM {s}.chats WHERE chat_id = ANY($1)"
                ))
                .await?;
            let rows = client.query(&statement, &[&chats]).await?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
        .await
    }

    /// The feed position a cursor of the previous event-id scheme (a side-wide inbox `seq`,
    /// before migration V7) stands for: the position of the last received message at or
    /// before it, or just before the first received after it if V7 (which numbered old rows
    /// by their sender's timestamp, not `seq` order) put that one lower; 0 if the client had
    /// seen nothing (`0` meant "from the beginning" then too). Messages sent after it are sent again; what a client already has, pages
    /// drop by message id.
    pub(crate) async fn position_of_inbox_seq(
        &self,
        chat_id: i64,
        seq: i64,
    ) -> Result<i64, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let row = client
                .query_one(
                    &format!(
                        "SELECT least(
                       coalesce((SELECT pos FROM {s}.inbox WHERE chat_id = $1 AND seq <= $2
                                  ORDER BY seq DESC LIMIT 1), 0),
                       coalesce((SELECT min(pos) - 1 FROM {s}.inbox
                                  WHERE chat_id = $1 AND seq > $2), 9223372036854775807))"
                    ),
                    &[&chat_id, &seq],
                )
                .await?;
            Ok(row.get(0))
        })
        .await
    }

    /// Become the inbox's writer for `shard` (after taking its consumer lease): bump the
    /// shard's fencing epoch. Waits for a previous holder's in-flight write (bounded by
    /// `lock_timeout`, past which the consumer tries again), whose epoch it then
    /// invalidates.
    #[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
    pub async fn claim_inbox_writer(&self, holder: &str, shard: u32) -> Result<i64, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let row = client
                .query_one(
                    &format!(
                    "INSERT INTO {s}.inbox_writer AS w (shard, holder, epoch) VALUES ($2, $1, 1)
                     ON CONFLICT (shard) DO UPDATE SET holder = $1, epoch = w.epoch + 1
                     RETURNING epoch"
                ),
                    &[&holder, &(shard as i32)],
                )
                .await?;
            Ok(row.get(0))
        })
        .await
    }

    /// The current epoch of `shard`'s inbox writer (for a write beside the writer: an
    /// operator's replay); 0 before any writer claimed the shard.
    pub(crate) async fn inbox_writer_epoch(&self, shard: u32) -> Result<i64, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
        let s = self.side.schema();
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                &format!(
                    "WITH new AS (INSERT INTO {s}.inbox_writer (shard, holder, epoch) VALUES ($1, '', 0)
                                  ON CONFLICT (shard) DO NOTHING RETURNING epoch)
                     SELECT epoch FROM new UNION ALL SELECT epoch FROM {s}.inbox_writer WHERE shard = $1"
                ),
                &[&(shard as i32)],
            )
            .await?;
        match row {
            Some(row) => Ok(row.get(0)),
            // A first claim committed between the insert's conflict and the select's
            // snapshot: the row is there now.
            None => Ok(client
                .query_one(
                    &format!("SELECT epoch FROM {s}.inbox_writer WHERE shard = $1"),
                    &[&(shard as i32)],
                )
                .await?
                .get(0)),
        }
        })
        .await
    }

    /// Record received messages in one transaction, each once (by message id), in the
    /// given order, only while `epoch` is `shard`'s inbox writer's epoch (see
    /// [`Store::claim_inbox_writer`]); `Fenced` otherwise, with nothing written. Returns
    /// every message's feed position, whether recorded now or found there (a redelivery,
    /// to be announced again: its first announcement may never have gone out).
    #[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
    pub async fn record_inbox(
        &self,
        received: &[Received],
        shard: u32,
        epoch: i64,
    ) -> Result<HashMap<Uuid, Position>, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
        let s = self.side.schema();
        let mut ids = Vec::with_capacity(received.len());
        let mut chats = Vec::with_capacity(received.len());
        let mut bodies = Vec::with_capacity(received.len());
        let mut sent = Vec::with_capacity(received.len());
        let mut streams = Vec::with_capacity(received.len());
        let mut senders = Vec::with_capacity(received.len());
        for r in received {
            ids.push(r.message.id);
            chats.push(r.message.chat_id);
            bodies.push(r.message.body.as_str());
            sent.push(r.message.created_at);
            streams.push(r.stream_id.as_str());
            senders.push(r.message.sender.as_deref());
        }
        let client = self.pool.get().await?;
        // One statement: the writer row locked FOR SHARE and its epoch checked, then the
        // rows inserted in the order of `ord` (stream order, so feed positions, taken by
        // the V7 trigger, follow the sender's commit order). The first output row (message
        // id NULL) carries the current epoch; then the rows written now; then those that
        // were there before (the statement's snapshot does not see its own inserts).
        let statement = client
            .prepare_cached(&format!(
                    "WITH w AS (SELECT epoch FROM {s}.inbox_writer WHERE shard = $7 FOR SHARE),
                          ins AS (
                            INSERT INTO {s}.inbox (message_id, chat_id, body, sent_at, stream_id, sender)
                            SELECT id, chat, body, sent, stream, sender
                              FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::timestamptz[], $5::text[], $8::text[])
                                   WITH ORDINALITY AS r(id, chat, body, sent, stream, sender, ord)
                             WHERE (SELECT epoch FROM w) = $6
                             ORDER BY ord
                            ON CONFLICT (message_id) DO NOTHING
                            RETURNING message_id, pos)
                     SELECT NULL::uuid, (SELECT epoch FROM w), true
                     UNION ALL
                     SELECT message_id, pos, true FROM ins
                     UNION ALL
                     SELECT message_id, pos, false FROM {s}.inbox
                      WHERE message_id = ANY($1) AND (SELECT epoch FROM w) = $6"
            ))
            .await?;
        let rows = client
            .query(
                &statement,
                &[
                    &ids,
                    &chats,
                    &bodies,
                    &sent,
                    &streams,
                    &epoch,
                    &(shard as i32),
                    &senders,
                ],
            )
            .await?;
        let mut recorded = HashMap::with_capacity(rows.len());
        for row in &rows {
            match row.get::<_, Option<Uuid>>(0) {
                Some(id) => {
                    recorded.insert(
                        id,
                        Position {
                            pos: row.get(1),
                            new: row.get(2),
                        },
                    );
                }
                None => {
                    // No row: nobody ever claimed the shard, so no epoch is current.
                    let current: i64 = row.get::<_, Option<i64>>(1).unwrap_or(0);
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
        })
        .await
    }

    /// Which of these message ids the inbox holds already.
    pub(crate) async fn inbox_holds(&self, ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let statement = client
                .prepare_cached(&format!(
                    "SELECT message_id FROM {s}.inbox WHERE message_id = ANY($1)"
                ))
                .await?;
            let rows = client.query(&statement, &[&ids]).await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
        .await
    }

    /// Whether `user` is a member of chat `chat_id` on this side.
    pub(crate) async fn is_member(&self, chat_id: i64, user: &str) -> Result<bool, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let statement = client
                .prepare_cached(&format!(
                    "SELECT EXISTS (SELECT 1 FROM {s}.chat_members WHERE chat_id = $1 AND user_id = $2)"
                ))
                .await?;
            Ok(client.query_one(&statement, &[&chat_id, &user]).await?.get(0))
        })
        .await
    }

    /// Make `user` a member of chat `chat_id`; `false` if they were one already.
    pub(crate) async fn add_member(
        &self,
        chat_id: i64,
        user: &str,
        by: &str,
    ) -> Result<bool, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let added = client
                .execute(
                    &format!(
                        "INSERT INTO {s}.chat_members (chat_id, user_id, added_by) VALUES ($1, $2, $3)
                         ON CONFLICT DO NOTHING"
                    ),
                    &[&chat_id, &user, &by],
                )
                .await?;
            Ok(added == 1)
        })
        .await
    }

    /// End `user`'s membership of chat `chat_id`; `false` if they were no member.
    pub(crate) async fn remove_member(&self, chat_id: i64, user: &str) -> Result<bool, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let removed = client
                .execute(
                    &format!("DELETE FROM {s}.chat_members WHERE chat_id = $1 AND user_id = $2"),
                    &[&chat_id, &user],
                )
                .await?;
            Ok(removed == 1)
        })
        .await
    }

    /// The members of chat `chat_id`, by user id.
    pub(crate) async fn members(&self, chat_id: i64) -> Result<Vec<String>, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let rows = client
                .query(
                    &format!(
                        "SELECT user_id FROM {s}.chat_members WHERE chat_id = $1 ORDER BY user_id"
                    ),
                    &[&chat_id],
                )
                .await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
        .await
    }

    /// Which of these `(chat, user)` pairs are memberships, in one query whatever their
    /// number (the open event streams of an instance are checked this way every second).
    pub(crate) async fn memberships(
        &self,
        pairs: &[(i64, String)],
    ) -> Result<std::collections::HashSet<(i64, String)>, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let chats: Vec<i64> = pairs.iter().map(|(c, _)| *c).collect();
            let users: Vec<&str> = pairs.iter().map(|(_, u)| u.as_str()).collect();
            let statement = client
                .prepare_cached(&format!(
                    "SELECT m.chat_id, m.user_id
                       FROM unnest($1::bigint[], $2::text[]) AS p(chat_id, user_id)
                       JOIN {s}.chat_members m USING (chat_id, user_id)"
                ))
                .await?;
            let rows = client.query(&statement, &[&chats, &users]).await?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
        .await
    }

    /// Delete up to `batch` of this side's sent messages written before `older_than`, or of
    /// its received messages recorded before it; returns how many. Sent messages are found
    /// by their UUIDv7 ids (time first), received ones by their inbox sequence (the order
    /// they were recorded in): a range of an index, oldest first, however large the table.
    /// A received message goes by when it was *recorded*, not sent: its row is what keeps a
    /// redelivery from being recorded twice, and a delivery can come long after the send.
    pub(crate) async fn delete_old_messages(
        &self,
        sent: bool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let cutoff = std::time::SystemTime::now()
            .checked_sub(older_than)
            .unwrap_or(std::time::UNIX_EPOCH);
        let bound = least_uuid_v7_of(cutoff);
        let cutoff = OffsetDateTime::from(cutoff);
        self.bounded(STATEMENT_DEADLINE, async {
            let s = self.side.schema();
            let client = self.pool.get().await?;
            let deleted = if sent {
                let statement = client
                    .prepare_cached(&format!(
                        "DELETE FROM {s}.messages WHERE id IN (
                           SELECT id FROM {s}.messages
                            WHERE id < $1 AND created_at < $2
                            ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED)"
                    ))
                    .await?;
                client
                    .execute(&statement, &[&bound, &cutoff, &batch])
                    .await?
            } else {
                // The oldest `batch` rows by sequence, of which those recorded before the
                // cutoff: the scan reads `batch` rows at most, whatever the table holds.
                let statement = client
                    .prepare_cached(&format!(
                        "DELETE FROM {s}.inbox WHERE seq IN (
                           SELECT seq FROM (SELECT seq, received_at FROM {s}.inbox
                                             ORDER BY seq LIMIT $2
                                             FOR UPDATE SKIP LOCKED) oldest
                            WHERE received_at < $1)"
                    ))
                    .await?;
                client.execute(&statement, &[&cutoff, &batch]).await?
            };
            Ok(deleted)
        })
        .await
    }

    /// Delete up to `batch` outbox rows older than `older_than`; returns how many. Deletes
    /// are not published (the publication sends inserts only); rows locked by someone else
    /// are skipped, so concurrent instances share the work instead of waiting.
    pub(crate) async fn delete_old_outbox(
        &self,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        self.bounded(STATEMENT_DEADLINE, async {
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
        })
        .await
    }
}
