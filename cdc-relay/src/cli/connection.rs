//! The connection group: where the relay's database, slot, Redis and stream are. Every
//! subcommand flattens the same group, so one set of flags or environment variables serves
//! `run`, `setup` and the operator commands alike; each command takes what it needs and
//! says which flag it misses.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use outbox_core::connect::{DatabaseSecrets, PgEndpoint, RedisSecrets, RedisTarget};

use crate::config::PostgresConfig;
use crate::decode::{OutboxMapping, Overrides, Preset, Recovery};
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
    #[command(flatten)]
    pub mapping: MappingArgs,
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
    /// setup with --redis-url). With `${routedByValue}` in it, a template: each row goes to
    /// the stream its route column names, e.g. outbox.event.${routedByValue} (Debezium:
    /// route.topic.replacement).
    #[arg(long, env = "CDC_STREAM", alias = "route-topic-replacement")]
    pub stream: Option<String>,
    /// Shards of the stream, fixed when it is set up: a row goes to the shard its key
    /// (the mapping's key column: the chat's `partition_key`) hashes to (one chat, one shard). 1 keeps the plain key; N > 1 writes
    /// `<stream>:{0}` .. `<stream>:{N-1}`. Every binary of the side must say the same.
    #[arg(long, env = "CDC_STREAM_SHARDS", default_value_t = 1)]
    pub stream_shards: u32,
    #[command(flatten)]
    pub redis_secrets: RedisSecrets,
}

/// Which columns of the outbox table make an entry's fields (docs/deployment.md, "The
/// outbox mapping"). Each column flag overrides the preset's; Debezium's Outbox Event Router
/// option names are accepted as aliases where they mean the same.
#[derive(Debug, Clone, Args)]
pub struct MappingArgs {
    /// The column layout to start from: chat (id, event, payload, created_at, optional
    /// partition_key and traceparent) or debezium (Debezium's defaults: id, aggregatetype,
    /// aggregateid as the key, type, payload; no timestamp).
    #[arg(long, env = "CDC_OUTBOX_PRESET", value_enum, default_value_t = Preset::Chat)]
    pub outbox_preset: Preset,
    /// The row's id, published as `outbox_id` (Debezium: table.field.event.id).
    #[arg(long, env = "CDC_OUTBOX_ID_COLUMN", alias = "table-field-event-id")]
    pub outbox_id_column: Option<String>,
    /// The key: picks the shard (the unit whose order is kept) and is published as `key`
    /// (Debezium: table.field.event.key).
    #[arg(long, env = "CDC_OUTBOX_KEY_COLUMN", alias = "table-field-event-key")]
    pub outbox_key_column: Option<String>,
    /// The event type, published as `event` (Debezium: table.field.event.type).
    #[arg(long, env = "CDC_OUTBOX_TYPE_COLUMN", alias = "table-field-event-type")]
    pub outbox_type_column: Option<String>,
    /// The payload, published as stored as `payload` (Debezium: table.field.event.payload).
    #[arg(
        long,
        env = "CDC_OUTBOX_PAYLOAD_COLUMN",
        alias = "table-field-event-payload"
    )]
    pub outbox_payload_column: Option<String>,
    /// A timestamptz column published as `created_at` (RFC 3339 UTC); empty: none
    /// (Debezium: table.field.event.timestamp).
    #[arg(
        long,
        env = "CDC_OUTBOX_TIMESTAMP_COLUMN",
        alias = "table-field-event-timestamp"
    )]
    pub outbox_timestamp_column: Option<String>,
    /// A column of W3C trace context, carried as `traceparent` when valid; empty: none.
    #[arg(long, env = "CDC_OUTBOX_TRACEPARENT_COLUMN")]
    pub outbox_traceparent_column: Option<String>,
    /// Extra columns published as fields of their own, comma-separated: column, column:alias,
    /// or Debezium's column:header:alias / column:envelope:alias (both mean a field) (Debezium:
    /// table.fields.additional.placement).
    #[arg(
        long,
        env = "CDC_OUTBOX_FIELDS",
        alias = "table-fields-additional-placement"
    )]
    pub outbox_fields: Option<String>,
    /// An integer column that grows with every insert (an identity): the order a catch-up
    /// from the table publishes rows in. chat: id; debezium: seq.
    #[arg(long, env = "CDC_OUTBOX_ORDER_COLUMN")]
    pub outbox_order_column: Option<String>,
    /// The writing transaction's column (xid8 DEFAULT pg_current_xact_id()).
    #[arg(long, env = "CDC_OUTBOX_TX_COLUMN")]
    pub outbox_tx_column: Option<String>,
    /// Where what a stream lost is brought back from: table (a catch-up from the outbox, by
    /// the order and tx columns; shards may fall behind) or slot-only (a table without
    /// them, such as Debezium's unmodified: no shard falls behind, and what Redis loses is
    /// lost) (docs/deployment.md, "Without a table to recover from").
    #[arg(long, env = "CDC_OUTBOX_RECOVERY", value_enum, default_value_t = Recovery::Table)]
    pub outbox_recovery: Recovery,
    /// The column whose value names the row's stream, with a routed --stream
    /// (`${routedByValue}`); debezium: aggregatetype (Debezium: route.by.field).
    #[arg(long, env = "CDC_OUTBOX_ROUTE_COLUMN", alias = "route-by-field")]
    pub outbox_route_column: Option<String>,
}

impl MappingArgs {
    fn overrides(&self) -> Overrides {
        Overrides {
            id: self.outbox_id_column.clone(),
            key: self.outbox_key_column.clone(),
            event_type: self.outbox_type_column.clone(),
            payload: self.outbox_payload_column.clone(),
            timestamp: self.outbox_timestamp_column.clone(),
            traceparent: self.outbox_traceparent_column.clone(),
            extra: self.outbox_fields.clone(),
            order: self.outbox_order_column.clone(),
            tx: self.outbox_tx_column.clone(),
            route: self.outbox_route_column.clone(),
            recovery: self.outbox_recovery,
        }
    }
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
        let routed = self
            .stream
            .as_deref()
            .is_some_and(crate::sink::layout::is_routed);
        let outbox = OutboxMapping::build(
            self.mapping.outbox_preset,
            outbox_table,
            &self.mapping.overrides(),
            routed,
        )
        .map_err(RelayError::Config)?;
        Ok(PostgresConfig {
            endpoint,
            slot,
            publication,
            outbox: Arc::new(outbox),
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
