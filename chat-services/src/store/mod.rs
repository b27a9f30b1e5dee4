//! This side's tables in Postgres, one file per concern: `send` (a message and its outbox
//! event in one transaction), `feed` (history, replays after a position, tips), `inbox`
//! (received messages recorded once under the writer fence), `members`, `retention`. This
//! file holds what they share: the pool, the breaker, the deadlines and the errors.
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

/// `on_connection!(self, |client, s| { ... })`: run the block on a pooled connection
/// (`client`) with this side's schema name (`s`), as one operation: admitted by the
/// [`Breaker`], the connection taken within [`POOL_WAIT`] (see [`Store::connection`]), then
/// the block bounded by [`STATEMENT_DEADLINE`] (see [`Store::within`]). The prelude of every
/// statement but a send's, written once. (A macro: an async closure borrowing the
/// connection cannot yet promise the `Send` future hyper's tasks need.)
macro_rules! on_connection {
    ($store:expr, |$client:ident, $schema:ident| $body:block) => {
        async {
            let _probe = $store.admit()?;
            let $client = $store.connection().await?;
            let $schema = $store.side.schema();
            $store
                .within($crate::store::STATEMENT_DEADLINE, async { $body })
                .await
        }
        .await
    };
}

mod feed;
mod inbox;
mod members;
mod retention;
mod send;

// Public for the integration tests' `test_support` (Received) and what `record_inbox`
// returns them (Position).
#[allow(unreachable_pub)]
pub use inbox::{Position, Received};

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
    /// The sender is no member of the chat (any more): nothing was written (HTTP 404, as
    /// for a chat that does not exist).
    #[error("not a member of chat {chat_id}")]
    NotMember { chat_id: i64 },
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
/// does not answer at all (and then no pooled connection is trusted, see [`Store::within`]).
const SESSION_LIMITS: &str =
    "-c statement_timeout=4s -c lock_timeout=3s -c idle_in_transaction_session_timeout=60s";

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
    /// Counts the trips (`chat_database_breaker_trips_total`), once set.
    trips: std::sync::OnceLock<prometheus::IntCounter>,
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
        if !self.tripped.swap(true, Ordering::AcqRel) {
            if let Some(trips) = self.trips.get() {
                trips.inc();
            }
        }
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
        // No connect timeout of its own: the pool's create timeout is the statement
        // deadline, and trips the breaker. A shorter one would fail a connection to a
        // frozen server sooner, so each request would open another.
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
            // Opening a connection the server does not answer is a frozen server, the one
            // thing that trips the breaker (see `Store::connection`).
            .create_timeout(Some(STATEMENT_DEADLINE))
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

    /// Count the breaker's trips on `trips` from now on.
    pub(crate) fn count_breaker_trips(&self, trips: prometheus::IntCounter) {
        let _ = self.breaker.trips.set(trips);
    }

    /// Whether an operation may go to the database now: while the [`Breaker`] is tripped,
    /// only one at a time does (the guard returned); the others fail at once.
    fn admit(&self) -> Result<Admit<'_>, StoreError> {
        match self.breaker.admit() {
            Admit::Refuse => Err(refused_by_breaker()),
            admitted => Ok(admitted),
        }
    }

    /// A pooled connection. Waiting for one to come free is bounded by [`POOL_WAIT`] and
    /// answered as busy: a pool all in use is a busy database, never a frozen one, and the
    /// wait is not counted against the operation's deadline (which starts once the
    /// connection is in hand). Opening one that the server does not answer within
    /// [`STATEMENT_DEADLINE`] is a frozen server: the breaker trips.
    ///
    /// The whole of it is bounded too ([`POOL_WAIT`] and [`STATEMENT_DEADLINE`]): idle
    /// connections that fail their check before reuse are each tried in turn (a partition
    /// leaves them all silent), and past that bound the server is taken for unreachable.
    async fn connection(&self) -> Result<deadpool_postgres::Object, StoreError> {
        let bound = POOL_WAIT + STATEMENT_DEADLINE;
        let Ok(got) = tokio::time::timeout(bound, self.pool.get()).await else {
            self.breaker.trip();
            self.pool.retain(|_, _| false);
            return Err(StoreError::Unavailable(format!(
                "no connection answered within {bound:?}"
            )));
        };
        match got {
            Ok(client) => Ok(client),
            Err(deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Create)) => {
                self.breaker.trip();
                self.pool.retain(|_, _| false);
                Err(StoreError::Unavailable(format!(
                    "no answer opening a connection within {STATEMENT_DEADLINE:?}"
                )))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// `op` within `deadline`, whatever the breaker says; its outcome sets the breaker.
    /// Past the deadline the database is taken for unavailable, and the idle pooled
    /// connections are dropped: anything merely slow was ended by the server first
    /// ([`SESSION_LIMITS`]), so a server that left a statement unanswered this long is
    /// frozen or cut off, and not trusted with the next on the same connections.
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
}
