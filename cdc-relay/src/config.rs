//! Command line and environment: the flags operators and scripts rely on, parsed once and
//! validated at start, so a misconfiguration is refused with a message that says what to
//! change before anything connects.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::batch::BatchLimits;
use crate::error::RelayError;
use crate::outbox::OutboxTable;
use crate::pg::PgEndpoint;

/// Relays a transactional outbox from Postgres (logical replication, pgoutput) into a Redis
/// stream, in commit order, acknowledging the slot only after Redis confirmed.
#[derive(Debug, Parser)]
#[command(name = "cdc-relay", version)]
pub struct Cli {
    /// Log line format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnLostSlot {
    Fail,
    Recover,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream the outbox into Redis until SIGTERM/SIGINT.
    Run(RunArgs),
    /// Create the replication slot if it is missing (idempotent); checks wal_level and the
    /// publication first.
    Setup(SetupArgs),
    /// List every logical replication slot of the database with its health.
    Slots(SlotsArgs),
    /// Nagios-style check of one slot: exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.
    Check(CheckArgs),
    /// Drop a replication slot (refused while it is active).
    DropSlot(DropSlotArgs),
    /// Move a drained stream to the count given by --stream-shards (every relay of the side
    /// stopped, every shard read and acknowledged by every group); takes `run`'s flags. See
    /// docs/deployment.md, "Resizing a stream".
    Reshard(RunArgs),
}

/// The connection flags of `run`, for the slot commands: only the database URL is used.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// Postgres URL (the relay's role can read slot status).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    #[command(flatten)]
    pub secrets: DatabaseSecrets,
    /// Accepted so these commands take the same flags as `run`; not used.
    #[arg(long, env = "CDC_PUBLICATION", hide = true)]
    pub publication: Option<String>,
    /// Accepted so these commands take the same flags as `run`; not used.
    #[arg(long, env = "CDC_OUTBOX_TABLE", hide = true)]
    pub outbox_table: Option<String>,
    /// Accepted so these commands take the same flags as `run`; not used.
    #[arg(long, env = "REDIS_URL", hide_env_values = true, hide = true)]
    pub redis_url: Option<String>,
    /// Accepted so these commands take the same flags as `run`; not used.
    #[arg(long, env = "CDC_STREAM", hide = true)]
    pub stream: Option<String>,
    /// Accepted so these commands take the same flags as `run`; not used.
    #[arg(long, env = "CDC_STREAM_SHARDS", hide = true)]
    pub stream_shards: Option<u32>,
}

#[derive(Debug, Clone, Args)]
pub struct SlotsArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Accepted so the command takes the same flags as `run`; every slot is listed.
    #[arg(long, env = "CDC_SLOT", hide = true)]
    pub slot: Option<String>,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The slot to check.
    #[arg(long, env = "CDC_SLOT")]
    pub slot: String,
    /// CRITICAL above this lag (bytes of WAL behind the server).
    #[arg(long)]
    pub max_lag_bytes: u64,
    /// CRITICAL when the slot has been inactive (no relay) longer than this.
    #[arg(long)]
    pub max_inactive_seconds: u64,
    /// WARNING above this lag (default: half of --max-lag-bytes).
    #[arg(long)]
    pub warn_lag_bytes: Option<u64>,
    /// WARNING when inactive longer than this (default: half of --max-inactive-seconds).
    #[arg(long)]
    pub warn_inactive_seconds: Option<u64>,
    /// Where the check remembers since when the slot is inactive (before Postgres 17; 17+ says itself, `inactive_since`).
    #[arg(long, env = "CDC_CHECK_STATE_DIR", default_value = "/var/tmp")]
    pub state_dir: std::path::PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct DropSlotArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The slot to drop.
    #[arg(long, env = "CDC_SLOT")]
    pub slot: String,
    /// Confirm: what the slot had not delivered is then only in the outbox table.
    #[arg(long)]
    pub yes: bool,
}

/// Where the outbox is.
#[derive(Debug, Clone, Args)]
pub struct PostgresArgs {
    /// Postgres URL of the relay's role (LOGIN REPLICATION), e.g.
    /// postgres://consumers_relay@db:5432/chat?sslmode=verify-full. sslmode: disable, prefer,
    /// require, verify-ca, verify-full (the default); sslrootcert=FILE names the CA
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Logical replication slot (pgoutput) the relay reads and acknowledges.
    #[arg(long, env = "CDC_SLOT")]
    pub slot: String,
    /// Publication that contains the outbox table.
    #[arg(long, env = "CDC_PUBLICATION")]
    pub publication: String,
    /// The outbox table, schema.table.
    #[arg(long, env = "CDC_OUTBOX_TABLE")]
    pub outbox_table: String,
    /// A failover slot (Postgres 17+): `setup` creates it, and a rebuild recreates it, with
    /// `failover => true`, so a standby with `sync_replication_slots` keeps a copy and a
    /// promoted standby streams on where the primary left off (docs/deployment.md).
    #[arg(long, env = "CDC_FAILOVER_SLOT", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub failover: bool,
    #[command(flatten)]
    pub secrets: DatabaseSecrets,
}

/// Where the database password and CA come from, besides the URL.
#[derive(Debug, Clone, Default, Args)]
pub struct DatabaseSecrets {
    /// Read the database password from this file (overrides one in the URL).
    #[arg(long, env = "DATABASE_PASSWORD_FILE")]
    pub database_password_file: Option<std::path::PathBuf>,
    /// CA certificate(s), PEM, to verify the server with sslmode=verify-ca or verify-full
    /// (overrides sslrootcert in the URL; default: the well-known public roots).
    #[arg(long, env = "DATABASE_CA_FILE")]
    pub database_ca_file: Option<std::path::PathBuf>,
}

impl DatabaseSecrets {
    /// The endpoint of `url` with these secrets applied.
    pub fn endpoint(&self, url: &str) -> Result<PgEndpoint, RelayError> {
        Ok(PgEndpoint::parse(url)?
            .with_password_file(self.database_password_file.as_deref())?
            .with_ca_file(self.database_ca_file.as_deref()))
    }
}

/// Where the Redis password and CA come from, besides the URL.
#[derive(Debug, Clone, Default, Args)]
pub struct RedisSecrets {
    /// Read the Redis password from this file (overrides one in the URL).
    #[arg(long, env = "REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<std::path::PathBuf>,
    /// CA certificate, PEM, to verify a rediss:// server (default: the system's roots).
    #[arg(long, env = "REDIS_CA_FILE")]
    pub redis_ca_file: Option<std::path::PathBuf>,
}

impl RedisSecrets {
    pub fn client(&self, url: &str) -> Result<redis::Client, RelayError> {
        crate::redis_client::client(
            url,
            self.redis_password_file.as_deref(),
            self.redis_ca_file.as_deref(),
            "--redis-url",
        )
    }

    /// A single server's client, or a cluster's when `cluster`.
    pub fn target(
        &self,
        url: &str,
        cluster: bool,
        timeout: Duration,
    ) -> Result<crate::redis_client::RedisTarget, RelayError> {
        crate::redis_client::target(
            url,
            cluster,
            self.redis_password_file.as_deref(),
            self.redis_ca_file.as_deref(),
            "--redis-url",
            timeout,
        )
    }
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub postgres: PostgresArgs,
    /// Redis URL (redis://, rediss:// or redis+unix://).
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: String,
    /// The Redis URL names any node of a Redis Cluster, or several comma-separated
    /// (redis-rs's cluster client finds the others and follows MOVED/ASK and failovers). Needs --stream-shards 2 or more: the
    /// keys of a shard share a hash tag, which the plain one-shard keys do not have.
    #[arg(long, env = "REDIS_CLUSTER", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub redis_cluster: bool,
    /// Stream key the relay writes (only the relay writes it; never DEL it).
    #[arg(long, env = "CDC_STREAM")]
    pub stream: String,
    /// Shards of the stream, fixed when it is set up: a row goes to the shard its
    /// `partition_key` hashes to (one chat, one shard). 1 keeps the plain key; N > 1 writes
    /// `<stream>:{0}` .. `<stream>:{N-1}`. Every binary of the side must say the same.
    #[arg(long, env = "CDC_STREAM_SHARDS", default_value_t = 1)]
    pub stream_shards: u32,
    /// Standbys to watch for the failover slot's synced copy (`--failover`, Postgres 17+):
    /// Postgres URLs, repeated or comma-separated, using the --database-url's password file
    /// and CA. Exported as cdc_relay_standby_slot_ready{standby} (1 when a promotion there
    /// would keep the slot) and cdc_relay_standby_slot_behind_bytes{standby}.
    #[arg(
        long = "standby-url",
        env = "CDC_STANDBY_URLS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub standby_urls: Vec<String>,
    #[command(flatten)]
    pub redis_secrets: RedisSecrets,
    #[command(flatten)]
    pub tuning: Tuning,
}

#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    #[command(flatten)]
    pub postgres: PostgresArgs,
    /// With --stream: when this call creates the slot and the stream is empty, record in
    /// Redis that the stream starts at the slot's position (so the first `run` streams
    /// instead of rebuilding from the outbox table); an existing record is never touched.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// The Redis URL names any node of a Redis Cluster (see `run`).
    #[arg(long, env = "REDIS_CLUSTER", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub redis_cluster: bool,
    /// The stream `run` will write (see --redis-url).
    #[arg(long, env = "CDC_STREAM")]
    pub stream: Option<String>,
    /// The stream's shard count (see `run --stream-shards`); written into every shard's
    /// record.
    #[arg(long, env = "CDC_STREAM_SHARDS", default_value_t = 1)]
    pub stream_shards: u32,
    #[command(flatten)]
    pub redis_secrets: RedisSecrets,
}

/// Knobs with production defaults.
#[derive(Debug, Clone, Args)]
pub struct Tuning {
    /// Address of the admin HTTP server (/healthz, /readyz, /metrics); empty to disable.
    #[arg(long, env = "CDC_ADMIN_ADDR", default_value = "127.0.0.1:9187")]
    pub admin_addr: String,
    /// Most entries in one Redis call.
    #[arg(long, env = "CDC_BATCH_MAX_ENTRIES", default_value_t = 2000)]
    pub batch_max_entries: usize,
    /// Most bytes of entry data in one Redis call.
    #[arg(long, env = "CDC_BATCH_MAX_BYTES", default_value_t = 4 << 20)]
    pub batch_max_bytes: usize,
    /// Last-resort cap on the stream's length (0: none). Entries are trimmed once every
    /// consumer group acknowledged them; only at this cap are unread entries trimmed too,
    /// counted in cdc_relay_unread_entries_trimmed_total. Keep it well above consumer lag.
    #[arg(long, env = "CDC_STREAM_MAX_LEN", default_value_t = 1_000_000)]
    pub stream_max_len: u64,
    /// How often acknowledgements are reported to Postgres at most.
    #[arg(long, env = "CDC_STATUS_INTERVAL", value_parser = humantime::parse_duration, default_value = "200ms")]
    pub status_interval: Duration,
    /// Redis response timeout; a timed-out batch is sent again (ids make that safe).
    #[arg(long, env = "CDC_REDIS_TIMEOUT", value_parser = humantime::parse_duration, default_value = "5s")]
    pub redis_timeout: Duration,
    /// Postgres connect timeout.
    #[arg(long, env = "CDC_CONNECT_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10s")]
    pub connect_timeout: Duration,
    /// How often a standby relay tries to take the slot (jittered).
    #[arg(long, env = "CDC_STANDBY_RETRY", value_parser = humantime::parse_duration, default_value = "500ms")]
    pub standby_retry: Duration,
    /// Longest pause between reconnect attempts (exponential backoff with jitter up to it).
    #[arg(long, env = "CDC_RECONNECT_MAX_BACKOFF", value_parser = humantime::parse_duration, default_value = "5s")]
    pub reconnect_max_backoff: Duration,
    /// What to do when the slot is lost (invalidated by max_slot_wal_keep_size): `fail` stops
    /// with an error; `recover` recreates the slot and republishes from the outbox table the
    /// rows the stream may be missing.
    #[arg(long, env = "CDC_ON_LOST_SLOT", value_enum, default_value_t = OnLostSlot::Fail)]
    pub on_lost_slot: OnLostSlot,
    /// How often slot health (lag, retained WAL, wal_status) is read for /metrics.
    #[arg(long, env = "CDC_SLOT_METRICS_INTERVAL", value_parser = humantime::parse_duration, default_value = "5s")]
    pub slot_metrics_interval: Duration,
    /// On SIGTERM, how long to wait for the in-flight batch before leaving anyway (nothing
    /// unconfirmed was acknowledged, so nothing is lost).
    #[arg(long, env = "CDC_SHUTDOWN_GRACE", value_parser = humantime::parse_duration, default_value = "10s")]
    pub shutdown_grace: Duration,
    /// Replicas that must acknowledge each write (Redis `WAIT`) before a batch counts as
    /// confirmed and the slot may be acknowledged: with 1 or more, a Redis failover cannot
    /// lose what the slot was told was delivered; with 0, such a loss is detected and the
    /// stream (shard) rebuilt from the outbox.
    #[arg(long, env = "CDC_REDIS_WAIT_REPLICAS", default_value_t = 0)]
    pub redis_wait_replicas: u32,
    /// TTL of the rebuild lock in Redis; the rebuilding relay extends it every third of it,
    /// and other relays stand by while it lives.
    #[arg(long, env = "CDC_REBUILD_LOCK_TTL", value_parser = humantime::parse_duration, default_value = "30s")]
    pub rebuild_lock_ttl: Duration,
}

/// Validated Postgres side of the configuration.
#[derive(Debug, Clone)]
pub struct PostgresConfig {
    pub endpoint: PgEndpoint,
    pub slot: String,
    pub publication: String,
    pub outbox_table: OutboxTable,
    /// Create (and recreate) the slot as a failover slot.
    pub failover: bool,
}

/// Everything `run` needs, validated.
#[derive(Clone)]
pub struct RelayConfig {
    pub postgres: PostgresConfig,
    pub redis: crate::redis_client::RedisTarget,
    pub stream: String,
    pub stream_shards: u32,
    pub admin_addr: Option<SocketAddr>,
    pub batch: BatchLimits,
    pub stream_max_len: u64,
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

impl PostgresArgs {
    pub fn validate(&self) -> Result<PostgresConfig, RelayError> {
        let endpoint = self.secrets.endpoint(&self.database_url)?;
        check_identifier("--slot", &self.slot)?;
        check_identifier("--publication", &self.publication)?;
        let outbox_table = self
            .outbox_table
            .parse()
            .map_err(|e| RelayError::Config(format!("--outbox-table {e}")))?;
        Ok(PostgresConfig {
            endpoint,
            slot: self.slot.clone(),
            publication: self.publication.clone(),
            outbox_table,
            failover: self.failover,
        })
    }
}

impl RunArgs {
    pub fn validate(&self) -> Result<RelayConfig, RelayError> {
        let postgres = self.postgres.validate()?;
        let redis = self.redis_secrets.target(
            &self.redis_url,
            self.redis_cluster,
            self.tuning.redis_timeout,
        )?;
        if self.stream.is_empty() || self.stream.chars().any(|c| c.is_whitespace()) {
            return Err(RelayError::Config(
                "--stream must be a non-empty key without whitespace, e.g. outbox:consumers".into(),
            ));
        }
        let stream_shards = crate::shard::validate_count("--stream-shards", self.stream_shards)
            .map_err(RelayError::Config)?;
        crate::shard::check_cluster(self.redis_cluster, stream_shards)
            .map_err(RelayError::Config)?;
        crate::shard::check_cluster_key(self.redis_cluster, "--stream", &self.stream)
            .map_err(RelayError::Config)?;
        if !self.standby_urls.is_empty() && !self.postgres.failover {
            return Err(RelayError::Config(
                "--standby-url watches a failover slot's copy on a standby: add --failover (Postgres 17+), or drop --standby-url".into(),
            ));
        }
        let standbys = self
            .standby_urls
            .iter()
            .map(|url| {
                self.postgres.secrets.endpoint(url).map_err(|e| match e {
                    RelayError::Config(m) => {
                        RelayError::Config(m.replace("--database-url", "--standby-url"))
                    }
                    e => e,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let t = &self.tuning;
        let admin_addr = if t.admin_addr.is_empty() {
            None
        } else {
            Some(t.admin_addr.parse().map_err(|_| {
                RelayError::Config(format!(
                    "--admin-addr '{}' is not host:port (e.g. 0.0.0.0:9187), or empty to disable",
                    t.admin_addr
                ))
            })?)
        };
        if t.batch_max_entries == 0 || t.batch_max_bytes < 1024 {
            return Err(RelayError::Config(
                "--batch-max-entries must be at least 1 and --batch-max-bytes at least 1024".into(),
            ));
        }
        for (flag, value) in [
            ("--status-interval", t.status_interval),
            ("--redis-timeout", t.redis_timeout),
            ("--connect-timeout", t.connect_timeout),
            ("--standby-retry", t.standby_retry),
            ("--reconnect-max-backoff", t.reconnect_max_backoff),
            ("--slot-metrics-interval", t.slot_metrics_interval),
            ("--rebuild-lock-ttl", t.rebuild_lock_ttl),
        ] {
            if value.is_zero() {
                return Err(RelayError::Config(format!(
                    "{flag} must be greater than zero"
                )));
            }
        }
        Ok(RelayConfig {
            postgres,
            redis,
            stream: self.stream.clone(),
            stream_shards,
            admin_addr,
            batch: BatchLimits {
                max_entries: t.batch_max_entries,
                max_bytes: t.batch_max_bytes,
            },
            stream_max_len: t.stream_max_len,
            status_interval: t.status_interval,
            redis_timeout: t.redis_timeout,
            connect_timeout: t.connect_timeout,
            standby_retry: t.standby_retry,
            reconnect_max_backoff: t.reconnect_max_backoff,
            shutdown_grace: t.shutdown_grace,
            on_lost_slot: t.on_lost_slot,
            slot_metrics_interval: t.slot_metrics_interval,
            rebuild_lock_ttl: t.rebuild_lock_ttl,
            redis_wait_replicas: t.redis_wait_replicas,
            standbys,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run` with valid flags, where `overrides` (flag, value pairs) replace or add some.
    fn run_args(overrides: &[&str]) -> Result<RunArgs, clap::Error> {
        let mut flags = vec![
            (
                "--database-url",
                "postgres://consumers_relay:s3cret@localhost/chat",
            ),
            ("--slot", "consumers_relay"),
            ("--publication", "consumers_outbox"),
            ("--outbox-table", "consumers.outbox"),
            ("--redis-url", "redis://localhost"),
            ("--stream", "outbox:consumers"),
        ];
        for pair in overrides.chunks(2) {
            match flags.iter_mut().find(|(flag, _)| *flag == pair[0]) {
                Some(entry) => entry.1 = pair[1],
                None => flags.push((pair[0], pair[1])),
            }
        }
        let mut argv = vec!["cdc-relay", "run"];
        for (flag, value) in flags {
            argv.push(flag);
            argv.push(value);
        }
        let cli = Cli::try_parse_from(argv)?;
        match cli.command {
            Command::Run(args) => Ok(args),
            _ => unreachable!(),
        }
    }

    #[test]
    fn defaults_validate() {
        let config = run_args(&[]).unwrap().validate().unwrap();
        assert_eq!(config.batch.max_entries, 2000);
        assert_eq!(config.status_interval, Duration::from_millis(200));
        assert_eq!(config.postgres.outbox_table.to_string(), "consumers.outbox");
        assert!(!format!("{config:?}").contains("s3cret"));
    }

    #[test]
    fn bad_values_are_refused_with_what_to_change() {
        let err = |extra: &[&str]| run_args(extra).unwrap().validate().unwrap_err().to_string();
        assert!(err(&["--slot", "Bad-Slot"]).contains("--slot 'Bad-Slot' is not a valid name"));
        assert!(err(&["--outbox-table", "outbox"]).contains("--outbox-table"));
        assert!(err(&["--admin-addr", "nowhere"]).contains("--admin-addr"));
        assert!(err(&["--batch-max-entries", "0"]).contains("--batch-max-entries"));
        assert!(err(&["--redis-url", "http://x"]).contains("--redis-url"));
        let e = err(&["--database-url", "postgres://:pw@/"]);
        assert!(e.contains("--database-url") && !e.contains("pw"), "{e}");
        assert!(run_args(&["--status-interval", "soon"]).is_err());
        assert!(
            err(&["--standby-url", "postgres://consumers_relay@pg-1/chat"])
                .contains("add --failover")
        );
        let e = err(&["--failover", "true", "--standby-url", "postgres://:pw@/"]);
        assert!(e.contains("--standby-url") && !e.contains("pw"), "{e}");
    }

    #[test]
    fn standbys_are_watched_by_address() {
        let config = run_args(&[
            "--failover",
            "true",
            "--standby-url",
            "postgres://consumers_relay@pg-1:5433/chat,postgres://consumers_relay@pg-2/chat",
        ])
        .unwrap()
        .validate()
        .unwrap();
        let addresses: Vec<String> = config.standbys.iter().map(|e| e.address()).collect();
        assert_eq!(addresses, ["pg-1:5433", "pg-2:5432"]);
    }
}
