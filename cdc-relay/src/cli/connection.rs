//! The connection group: where the relay's database, slot, Redis and stream are. Every
//! subcommand flattens the same group, so one set of flags or environment variables serves
//! `run`, `setup` and the operator commands alike; each command takes what it needs and
//! says which flag it misses.

use std::time::Duration;

use clap::Args;
use outbox_core::connect::{DatabaseSecrets, PgEndpoint, RedisSecrets, RedisTarget};

use crate::config::PostgresConfig;
use crate::error::RelayError;

/// Where the relay connects, and what it reads and writes.
#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// Postgres URL of the relay's role (LOGIN REPLICATION), e.g.
    /// postgres://consumers_relay@db:5432/chat_consumers?sslmode=verify-full. sslmode: disable, prefer,
    /// require, verify-ca, verify-full (the default); sslrootcert=FILE names the CA. Needed
    /// by every command but `streams`, which reads Redis only.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    #[command(flatten)]
    pub database_secrets: DatabaseSecrets,
    /// Logical replication slot (pgoutput) the relay reads and acknowledges. Needed by
    /// every command but `slots`, which lists them all, and `streams`, which reads Redis.
    #[arg(long, env = "CDC_SLOT")]
    pub slot: Option<String>,
    /// Publication that contains the outbox table (run, setup, reshard).
    #[arg(long, env = "CDC_PUBLICATION")]
    pub publication: Option<String>,
    /// The outbox table, schema.table (run, setup, reshard).
    #[arg(long, env = "CDC_OUTBOX_TABLE")]
    pub outbox_table: Option<String>,
    /// A failover slot (Postgres 17+): `setup` creates it, and a rebuild recreates it, with
    /// `failover => true`, so a standby with `sync_replication_slots` keeps a copy and a
    /// promoted standby streams on where the primary left off (docs/deployment.md).
    #[arg(long, env = "CDC_FAILOVER_SLOT", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub failover: bool,
    /// Redis URL (redis://, rediss:// or redis+unix://) (run, reshard; setup with --stream
    /// records where the new stream starts).
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// The Redis URL names any node of a Redis Cluster, or several comma-separated
    /// (redis-rs's cluster client finds the others and follows MOVED/ASK and failovers). Needs --stream-shards 2 or more: the
    /// keys of a shard share a hash tag, which the plain one-shard keys do not have.
    #[arg(long, env = "REDIS_CLUSTER", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub redis_cluster: bool,
    /// Stream key the relay writes (only the relay writes it; never DEL it) (run, reshard,
    /// setup with --redis-url).
    #[arg(long, env = "CDC_STREAM")]
    pub stream: Option<String>,
    /// Shards of the stream, fixed when it is set up: a row goes to the shard its
    /// `partition_key` hashes to (one chat, one shard). 1 keeps the plain key; N > 1 writes
    /// `<stream>:{0}` .. `<stream>:{N-1}`. Every binary of the side must say the same.
    #[arg(long, env = "CDC_STREAM_SHARDS", default_value_t = 1)]
    pub stream_shards: u32,
    #[command(flatten)]
    pub redis_secrets: RedisSecrets,
}

/// A flag the command needs and was not given.
fn missing(flag: &str, env: &str) -> RelayError {
    RelayError::Config(format!("{flag} is required here (or set {env})"))
}

/// Postgres identifiers the relay passes around unquoted: lowercase, digits, underscores.
fn check_identifier(flag: &str, value: &str) -> Result<(), RelayError> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(RelayError::Config(format!(
            "{flag} '{value}' is not a valid name: use 1-63 lowercase letters, digits and underscores"
        )))
    }
}

impl ConnectionArgs {
    /// The database endpoint.
    pub fn database(&self) -> Result<PgEndpoint, RelayError> {
        let url = self
            .database_url
            .as_deref()
            .ok_or_else(|| missing("--database-url", "DATABASE_URL"))?;
        Ok(self.database_secrets.endpoint(url)?)
    }

    /// The slot, required.
    pub fn slot(&self) -> Result<&str, RelayError> {
        let slot = self
            .slot
            .as_deref()
            .ok_or_else(|| missing("--slot", "CDC_SLOT"))?;
        check_identifier("--slot", slot)?;
        Ok(slot)
    }

    /// The Postgres side, validated: database, slot, publication and outbox table.
    pub fn postgres(&self) -> Result<PostgresConfig, RelayError> {
        let endpoint = self.database()?;
        let slot = self.slot()?.to_string();
        let publication = self
            .publication
            .clone()
            .ok_or_else(|| missing("--publication", "CDC_PUBLICATION"))?;
        check_identifier("--publication", &publication)?;
        let outbox_table = self
            .outbox_table
            .as_deref()
            .ok_or_else(|| missing("--outbox-table", "CDC_OUTBOX_TABLE"))?
            .parse()
            .map_err(|e| RelayError::Config(format!("--outbox-table {e}")))?;
        Ok(PostgresConfig {
            endpoint,
            slot,
            publication,
            outbox_table,
            failover: self.failover,
        })
    }

    /// The stream's name, required and checked.
    pub fn stream(&self) -> Result<&str, RelayError> {
        let stream = self
            .stream
            .as_deref()
            .ok_or_else(|| missing("--stream", "CDC_STREAM"))?;
        if stream.is_empty() || stream.chars().any(char::is_whitespace) {
            return Err(RelayError::Config(
                "--stream must be a non-empty key without whitespace, e.g. outbox:consumers".into(),
            ));
        }
        Ok(stream)
    }

    /// Redis, required.
    pub fn redis(&self, timeout: Duration) -> Result<RedisTarget, RelayError> {
        let url = self
            .redis_url
            .as_deref()
            .ok_or_else(|| missing("--redis-url", "REDIS_URL"))?;
        Ok(self
            .redis_secrets
            .target(url, self.redis_cluster, timeout)?)
    }

    /// Redis and the stream when both are given (`setup`), else `None`.
    pub fn redis_and_stream(
        &self,
        timeout: Duration,
    ) -> Result<Option<(RedisTarget, &str)>, RelayError> {
        match (&self.redis_url, &self.stream) {
            (Some(_), Some(_)) => Ok(Some((self.redis(timeout)?, self.stream()?))),
            _ => Ok(None),
        }
    }
}
