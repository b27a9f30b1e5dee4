//! Where the service's data is: its own Postgres role and the Redis both sides share, with
//! the secrets (passwords, TLS) of each, and the size of the database pool.

use std::time::Duration;

use outbox_core::connect::{DatabaseSecrets, PgEndpoint, RedisSecrets, RedisTarget};
use outbox_core::ConfigError;

/// The service's connections.
#[allow(rustdoc::bare_urls)] // --help text: a URL is an example, not a link.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectionArgs {
    /// Postgres URL of this side's own role (it owns the schema of the same name), e.g.
    /// postgres://consumers@db:5432/chat_consumers; sslmode as for cdc-relay (default verify-full).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Redis URL (redis://, rediss:// or redis+unix://).
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: String,
    /// The Redis URL names any node of a Redis Cluster, or several comma-separated (as
    /// cdc-relay's --redis-cluster).
    /// Needs --stream-shards 2 or more; live hints then use sharded pub/sub.
    #[arg(long, env = "REDIS_CLUSTER", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub redis_cluster: bool,
    #[command(flatten)]
    pub database_secrets: DatabaseSecrets,
    #[command(flatten)]
    pub redis_secrets: RedisSecrets,
    /// Postgres connections in the pool.
    #[arg(long, env = "CHAT_DB_POOL_SIZE", default_value_t = 16)]
    pub db_pool_size: usize,
}

impl ConnectionArgs {
    /// The database endpoint and the Redis target, or what to change.
    pub(crate) fn validate(&self) -> Result<(PgEndpoint, RedisTarget), ConfigError> {
        let postgres = self.database_secrets.endpoint(&self.database_url)?;
        let redis = self.redis_secrets.target(
            &self.redis_url,
            self.redis_cluster,
            Duration::from_secs(5),
        )?;
        Ok((postgres, redis))
    }

    /// Connections in the database pool.
    pub(crate) fn pool_size(&self) -> Result<usize, ConfigError> {
        if self.db_pool_size == 0 {
            return Err(ConfigError::new("--db-pool-size must be at least 1"));
        }
        Ok(self.db_pool_size)
    }
}
