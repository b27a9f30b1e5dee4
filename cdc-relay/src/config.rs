//! The relay's configuration once validated: what `run` and the operator commands work
//! with. The command line ([`crate::cli`]) builds it and refuses what does not validate.

use std::net::SocketAddr;
use std::time::Duration;

use outbox_core::connect::{PgEndpoint, RedisTarget};

use std::sync::Arc;

use crate::decode::OutboxMapping;

/// What to do when the slot is lost (invalidated by `max_slot_wal_keep_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnLostSlot {
    Fail,
    Recover,
}

/// Bounds of one batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    pub max_entries: usize,
    pub max_bytes: usize,
}

/// When a shard's lane falls behind, and what it may hold meanwhile.
#[derive(Debug, Clone, Copy)]
pub struct LaneLimits {
    pub batch: BatchLimits,
    /// How long a lane may be unable to confirm before it falls behind.
    pub detach_after: Duration,
    /// Bytes a lane may hold (queued, in flight, captured) before it falls behind.
    pub max_bytes: usize,
    /// Whether a lane that cannot confirm (or whose stream is full) falls behind, to be
    /// caught up from the outbox table later. Not with tableless events, which the table
    /// does not hold: such a lane keeps its entries and holds the slot (and, once its
    /// bytes are spent, the session's reading) until it confirms.
    pub may_fall_behind: bool,
}

/// Validated Postgres side of the configuration.
#[derive(Debug, Clone)]
pub struct PostgresConfig {
    pub endpoint: PgEndpoint,
    pub slot: String,
    pub publication: String,
    /// The outbox table and which of its columns make an entry's fields.
    pub outbox: Arc<OutboxMapping>,
    /// Create (and recreate) the slot as a failover slot.
    pub failover: bool,
}

/// Everything `run` needs, validated.
#[derive(Clone)]
pub struct RelayConfig {
    pub postgres: PostgresConfig,
    pub redis: RedisTarget,
    pub stream: String,
    pub stream_shards: u32,
    /// Prefixes of the transactional logical decoding messages published as entries.
    pub message_prefixes: Vec<String>,
    /// The most routes a routed stream may have.
    pub max_routes: u32,
    pub admin_addr: Option<SocketAddr>,
    pub batch: BatchLimits,
    /// When a shard falls behind, and the bytes a lane may hold.
    pub lanes: LaneLimits,
    /// The most unread entries a shard's stream may hold; at it, the shard falls behind.
    pub stream_max_len: u64,
    /// The replication connection's deadline (and the walsender's timeout).
    pub replication_timeout: std::time::Duration,
    /// The largest outbox row the replication connection accepts, in bytes.
    pub max_row_bytes: usize,
    /// How long the services keep outbox rows (a shard behind for longer may have lost some).
    pub outbox_retention: std::time::Duration,
    /// This relay's stable identity in Redis locks (a restarted process recognises its own).
    pub instance_id: String,
    pub status_interval: Duration,
    pub redis_timeout: Duration,
    pub connect_timeout: Duration,
    pub standby_retry: Duration,
    pub reconnect_max_backoff: Duration,
    pub shutdown_grace: Duration,
    pub on_lost_slot: OnLostSlot,
    pub slot_metrics_interval: Duration,
    pub rebuild_lock_ttl: Duration,
    pub redis_wait_replicas: u32,
    /// Standbys whose copy of the failover slot the monitor watches.
    pub standbys: Vec<PgEndpoint>,
}

impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The Redis client holds the URL's password: leave it out.
        f.debug_struct("RelayConfig")
            .field("postgres", &self.postgres)
            .field("stream", &self.stream)
            .field("stream_shards", &self.stream_shards)
            .field("admin_addr", &self.admin_addr)
            .field("batch", &self.batch)
            .field("stream_max_len", &self.stream_max_len)
            .finish_non_exhaustive()
    }
}
