//! Every way the relay can fail, and the one place that decides whether a failure is worth
//! retrying ([`RelayError::is_transient`]).
//!
//! Classification uses SQLSTATE codes and Redis error kinds/codes, never message text where
//! a code exists. A permanent error stops the relay with a message that says what to change.

use outbox_core::error::{
    describe_postgres, describe_redis, postgres_is_transient, redis_is_transient,
    sqlstate_is_transient,
};
use outbox_core::ConfigError;
use pgwire_replication::PgWireError;
use redis::RedisError;

use crate::decode::{DecodeError, OutboxError};

/// Error codes the publish script returns (see `publish.lua`).
pub(crate) mod script_codes {
    pub(crate) const ORIGIN: &str = "ORIGIN";
    pub(crate) const DIVERGED: &str = "DIVERGED";
    pub(crate) const GAP: &str = "GAP";
    pub(crate) const NORECORD: &str = "NORECORD";
    pub(crate) const TIMELINE: &str = "TIMELINE";
    pub(crate) const SHARDS: &str = "SHARDS";
    pub(crate) const FENCED: &str = "FENCED";
    pub(crate) const FULL: &str = "FULL";
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("invalid configuration: {0}")]
    Config(String),

    #[error("wal_level is '{actual}' but logical decoding needs 'logical' (on Postgres 19+, 'replica' is enough: creating the slot turns logical decoding on): set wal_level = logical in postgresql.conf and restart Postgres")]
    WalLevelNotLogical { actual: String },

    #[error("publication {publication} does not exist: run the migrations (`migrate`), then `cdc-relay setup`")]
    PublicationMissing { publication: String },

    #[error("publication {publication} does not publish inserts into {table}: add it with `ALTER PUBLICATION {publication} ADD TABLE {table}` and `publish = 'insert'` (see migrations/), or fix --outbox-table")]
    PublicationIncomplete { publication: String, table: String },

    #[error("replication slot {slot} does not exist: create it with `cdc-relay setup` (same flags as `run`)")]
    SlotMissing { slot: String },

    #[error("replication slot {slot} is gone though the stream was streaming from it (dropped by an operator, or by another role with REPLICATION): restart the relay with --on-lost-slot recover to make it anew and republish what it missed from the outbox table (rows older than the services' outbox retention cannot be), or run `cdc-relay setup` and restart")]
    SlotDropped { slot: String },

    #[error("replication slot {slot} is not usable by the relay: {problem}; drop it (`SELECT pg_drop_replication_slot('{slot}')`) or choose another --slot")]
    SlotMismatch { slot: String, problem: String },

    #[error("replication slot {slot} is lost: Postgres removed WAL it still needed (max_slot_wal_keep_size); {}", if *.recover { "recreating it and republishing from the outbox table" } else { "restart the relay with --on-lost-slot recover to recreate it and republish the outbox rows it may have missed from the outbox table (rows older than the services' outbox retention cannot be recovered)" })]
    SlotLost { slot: String, recover: bool },

    #[error("replication slot {slot} is held by another relay{}", holder.map(|p| format!(" (walsender pid {p})")).unwrap_or_default())]
    SlotBusy { slot: String, holder: Option<u32> },

    #[error("postgres: {}", describe_postgres(.0))]
    Postgres(#[from] tokio_postgres::Error),

    #[error("replication stream: {0}")]
    Replication(#[from] PgWireError),

    #[error("the server ended the replication stream")]
    StreamEnded,

    #[error("could not connect within {0:?}")]
    ConnectTimeout(std::time::Duration),

    #[error("redis: {}", describe_redis(.0))]
    Redis(#[from] RedisError),

    #[error("stream {stream} was written from Postgres system {stream_system}, but this server is system {server_system}: refusing to publish another cluster's changes into it; point --stream at a new key")]
    OriginMismatch {
        stream: String,
        stream_system: String,
        server_system: String,
    },

    #[error("stream {stream} diverged from the replication slot: {detail}; find what else writes the stream, or whether Postgres was restored from a backup, then point --stream at a new key")]
    StreamDiverged { stream: String, detail: String },

    #[error("stream {stream} is behind what this relay published moments ago: {detail}; Redis lost data (restarted without its AOF, or failed over to a stale replica); reconnecting to republish")]
    StreamBehind { stream: String, detail: String },

    #[error("stream {stream} has no record (Redis lost it, or it was deleted to force a rebuild); reconnecting to rebuild the stream from the outbox table")]
    RecordMissing { stream: String },

    #[error("stream {stream} is recorded on another Postgres timeline: {detail}; reconnecting to check the timeline history")]
    TimelineMismatch { stream: String, detail: String },

    #[error("stream {stream} is on Postgres timeline {recorded}, but this server is on its ancestor timeline {server}: it is not the current primary (after a failover); retrying; point --database-url at the current primary")]
    OlderTimeline {
        stream: String,
        recorded: u32,
        server: u32,
    },

    #[error("{}", if *.synced_copy { format!("replication slot {slot} on this server is a synced copy of the primary's and the server is a standby: waiting for its promotion (a failover under way?), or point --database-url at the primary") } else { format!("the server is a standby without replication slot {slot}: waiting for its promotion (a failover under way?); to decode on this standby instead, run `cdc-relay setup` against it") })]
    AwaitingPromotion { slot: String, synced_copy: bool },

    #[error("creating replication slot {slot} again did not finish within {waited:?}: it waits for the transactions open when it started (see pg_stat_activity, xact_start); retrying, and the rebuild resumes")]
    SlotCreateTimeout {
        slot: String,
        waited: std::time::Duration,
    },

    #[error("stream {stream}: {detail}: another relay took the stream over (or rebuilt it) since this session began; standing by")]
    Superseded { stream: String, detail: String },

    #[error("stream {stream} is full: {detail} (--stream-max-len); it falls behind and is caught up from the outbox table once its consumer groups have read")]
    StreamFull { stream: String, detail: String },

    #[error("the replication connection was silent for {0:?} (the server pings at least every half of wal_sender_timeout): the server or the network between is gone; reconnecting")]
    ReplicationSilent(std::time::Duration),

    #[error("the server asked for a confirmation of everything it sent (up to {asked}; it is stopping, or heard no status for half of wal_sender_timeout) and only {acknowledged} is confirmed in Redis after {waited:?} (--shutdown-grace): ending the session so a stopping server is not held; the next session is sent the rest again")]
    ConfirmationOverdue {
        asked: String,
        acknowledged: String,
        waited: std::time::Duration,
    },

    #[error("shard {stream} does not answer: making the slot anew marks every shard, so it waits for it")]
    ShardUnreachable { stream: String },

    #[error("{0}; starting the session again")]
    Restart(String),

    #[error("a row names route '{route}', which this session has no stream for; the next session loads it")]
    NewRoute {
        route: String,
        /// The commit LSN of the row's transaction: where the route is first seen.
        at: u64,
    },

    #[error("{count} transaction(s) the slot sent are still invisible to snapshots after {waited:?} (commits waiting for a synchronous standby?); the hand-over waits for them")]
    CommitsInvisible {
        count: usize,
        waited: std::time::Duration,
    },

    #[error("stopped by a signal before streaming")]
    ShuttingDown,

    #[error("lost the rebuild lock of stream {stream} (Redis unreachable for longer than its TTL, or another relay took it); standing by")]
    RebuildLockLost { stream: String },

    #[error("pgoutput: {0}")]
    Decode(#[from] DecodeError),

    #[error("{0}")]
    Outbox(#[from] OutboxError),

    #[error("protocol: {0}")]
    Protocol(String),
}

impl RelayError {
    /// Whether retrying the same operation later can succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            // Another relay holds the lease; it may go away.
            RelayError::SlotBusy { .. } => true,
            // Recovered by the next session when recovery is enabled.
            RelayError::SlotLost { recover, .. } => *recover,
            // Redis lost entries: the next session finds out what and republishes it.
            RelayError::StreamBehind { .. }
            | RelayError::RecordMissing { .. }
            | RelayError::TimelineMismatch { .. }
            | RelayError::RebuildLockLost { .. } => true,
            // The URL may point at the old primary for a moment (DNS or VIP lag): retry.
            RelayError::OlderTimeline { .. } => true,
            // A failover under way: the standby the name points at is promoted in a moment.
            RelayError::AwaitingPromotion { .. } => true,
            // The rebuild's marker stays: the next session resumes it.
            RelayError::SlotCreateTimeout { .. } => true,
            // The newer session holds the slot: this relay stands by behind it.
            RelayError::Superseded { .. } => true,
            // The shard falls behind; its rows wait in the outbox table.
            RelayError::StreamFull { .. } => true,
            RelayError::ReplicationSilent(_) => true,
            // The server is stopping; the next session (on it or its successor) resumes.
            RelayError::ConfirmationOverdue { .. } => true,
            RelayError::ShardUnreachable { .. }
            | RelayError::Restart(_)
            | RelayError::NewRoute { .. } => true,
            // The commits become visible once their wait ends.
            RelayError::CommitsInvisible { .. } => true,
            // Not an error to retry: the supervisor stops.
            RelayError::ShuttingDown => false,
            RelayError::StreamEnded | RelayError::ConnectTimeout(_) => true,
            // A transient SQLSTATE, or the connection broke; never a refused certificate.
            RelayError::Postgres(e) => postgres_is_transient(e),
            RelayError::Replication(e) => match e {
                PgWireError::Io(_) | PgWireError::Task(_) | PgWireError::Internal(_) => true,
                PgWireError::Server(_) => sqlstate(e).is_some_and(sqlstate_is_transient),
                _ => false,
            },
            RelayError::Redis(e) => redis_call_may_repeat(e),
            RelayError::Config(_)
            | RelayError::WalLevelNotLogical { .. }
            | RelayError::PublicationMissing { .. }
            | RelayError::PublicationIncomplete { .. }
            | RelayError::SlotMissing { .. }
            | RelayError::SlotDropped { .. }
            | RelayError::SlotMismatch { .. }
            | RelayError::OriginMismatch { .. }
            | RelayError::StreamDiverged { .. }
            | RelayError::Decode(_)
            | RelayError::Outbox(_)
            | RelayError::Protocol(_) => false,
        }
    }

    /// Whether the same Redis call may simply be sent again (connection trouble, a timeout,
    /// a busy or loading server). Other transient errors need a new session: a stream that
    /// lost entries is rebuilt before anything more is published.
    pub fn retry_in_place(&self) -> bool {
        matches!(self, RelayError::Redis(e) if redis_call_may_repeat(e))
    }

    /// Whether this is a Redis failure (for metrics and readiness).
    pub fn is_redis(&self) -> bool {
        matches!(self, RelayError::Redis(_))
    }
}

/// Whether a Redis call that failed with `e` may be sent again: a transient error, and not
/// one of the publish script's verdicts (those are mapped to their own variants before they
/// get here; one that was not is never retried blindly).
fn redis_call_may_repeat(e: &RedisError) -> bool {
    let verdict = [
        script_codes::ORIGIN,
        script_codes::DIVERGED,
        script_codes::GAP,
        script_codes::NORECORD,
        script_codes::TIMELINE,
        script_codes::SHARDS,
        script_codes::FENCED,
        script_codes::FULL,
    ];
    redis_is_transient(e) && !e.code().is_some_and(|code| verdict.contains(&code))
}

/// The SQLSTATE of a server error reported by `pgwire-replication`, which formats it as a
/// structured `(SQLSTATE xxxxx)` suffix of its message.
pub(crate) fn sqlstate(e: &PgWireError) -> Option<&str> {
    let PgWireError::Server(message) = e else {
        return None;
    };
    let start = message.rfind("(SQLSTATE ")? + "(SQLSTATE ".len();
    let code = message.get(start..start + 5)?;
    code.chars()
        .all(|c| c.is_ascii_alphanumeric())
        .then_some(code)
}

/// SQLSTATE codes the relay acts on.
pub(crate) mod sqlstates {
    /// `object_in_use`: the replication slot is active for another walsender.
    pub(crate) const OBJECT_IN_USE: &str = "55006";
    /// `object_not_in_prerequisite_state`: among others, an invalidated (lost) slot.
    pub(crate) const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
    /// `undefined_object`: missing slot (at start) or publication (at first change).
    pub(crate) const UNDEFINED_OBJECT: &str = "42704";
    /// `duplicate_object`: a slot created concurrently.
    pub(crate) const DUPLICATE_OBJECT: &str = "42710";
}

impl From<ConfigError> for RelayError {
    fn from(e: ConfigError) -> Self {
        RelayError::Config(e.0)
    }
}

impl From<outbox_core::Error> for RelayError {
    fn from(e: outbox_core::Error) -> Self {
        match e {
            outbox_core::Error::Config(e) => e.into(),
            outbox_core::Error::Postgres(e) => RelayError::Postgres(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(msg: &str) -> PgWireError {
        PgWireError::Server(msg.into())
    }

    #[test]
    fn sqlstate_is_read_from_the_structured_suffix() {
        let e = server("replication slot \"s\" is active for PID 42 (SQLSTATE 55006)");
        assert_eq!(sqlstate(&e), Some("55006"));
        assert_eq!(sqlstate(&server("no code here")), None);
        assert_eq!(sqlstate(&PgWireError::Protocol("x".into())), None);
    }

    #[test]
    fn replication_errors_are_classified_by_code() {
        let t = |msg: &str| RelayError::Replication(server(msg)).is_transient();
        assert!(t(
            "terminating connection due to administrator command (SQLSTATE 57P01)"
        ));
        assert!(t("the database system is starting up (SQLSTATE 57P03)"));
        assert!(t("sorry, too many clients already (SQLSTATE 53300)"));
        assert!(!t("password authentication failed (SQLSTATE 28P01)"));
        assert!(!t("replication slot \"s\" does not exist (SQLSTATE 42704)"));
        assert!(RelayError::Replication(PgWireError::Io(std::sync::Arc::new(
            std::io::Error::from(std::io::ErrorKind::ConnectionReset)
        )))
        .is_transient());
        assert!(!RelayError::Replication(PgWireError::Auth("bad".into())).is_transient());
    }

    #[test]
    fn redis_errors_are_classified_by_kind_and_code() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(RelayError::Redis(io).is_transient());
        let oom = redis::make_extension_error("OOM".into(), Some("command not allowed".into()));
        assert!(RelayError::Redis(oom).is_transient());
        let origin = redis::make_extension_error(script_codes::ORIGIN.into(), None);
        assert!(!RelayError::Redis(origin).is_transient());
        let no_node = RedisError::from((
            redis::ErrorKind::ClusterConnectionNotFound,
            "No connections found",
        ));
        assert!(RelayError::Redis(no_node).is_transient());
    }

    #[test]
    fn configuration_problems_are_permanent_and_say_what_to_do() {
        let e = RelayError::SlotMissing {
            slot: "consumers_relay".into(),
        };
        assert!(!e.is_transient());
        assert!(e.to_string().contains("cdc-relay setup"));
        let e = RelayError::PublicationMissing {
            publication: "consumers_outbox".into(),
        };
        assert!(e.to_string().contains("run the migrations"));
        assert!(RelayError::SlotBusy {
            slot: "s".into(),
            holder: Some(7)
        }
        .is_transient());
    }
}
