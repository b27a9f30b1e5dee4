//! `run`'s flags: the connection group, the standbys to watch, and the knobs with
//! production defaults; validated into a [`RelayConfig`].

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use outbox_core::connect::PgEndpoint;
use outbox_core::stream::validate_layout;

use crate::sink::layout;

use super::ConnectionArgs;
use crate::config::{BatchLimits, LaneLimits, OnLostSlot, RelayConfig};
use crate::error::RelayError;

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
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
    /// Also publish transactional logical decoding messages whose prefix is one of these
    /// (comma-separated): `pg_logical_emit_message(true, prefix, content)` becomes an entry
    /// with `event` = the prefix and `payload` = the content, after the rows of its
    /// transaction. Such an event exists only in the WAL: with this flag no shard falls
    /// behind (one that cannot confirm holds the slot, within max_slot_wal_keep_size), and a
    /// Redis that loses data loses the events it held (docs/deployment.md, "Tableless events").
    #[arg(long, env = "CDC_MESSAGE_PREFIXES", value_delimiter = ',')]
    pub message_prefixes: Vec<String>,
    /// The most routes a routed --stream (`${routedByValue}`) may have: each is
    /// --stream-shards streams, records and lanes. A relay that meets more stops, saying so.
    #[arg(long, env = "CDC_MAX_ROUTES", default_value_t = 256)]
    pub max_routes: u32,
    #[command(flatten)]
    pub tuning: Tuning,
    #[command(flatten)]
    pub trace: outbox_core::telemetry::TraceArgs,
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
    /// The most entries a shard's stream may hold that some consumer group has not
    /// acknowledged (0: no bound). Entries are trimmed once every group acknowledged them, and
    /// never before: a shard at the bound falls behind (the slot stops waiting for it, its rows
    /// wait in the outbox table) and is caught up from the table as its groups read.
    #[arg(long, env = "CDC_STREAM_MAX_LEN", default_value_t = 1_000_000)]
    pub stream_max_len: u64,
    /// How long a shard may be unable to confirm before it falls behind: the slot then stops
    /// waiting for it (WAL is not retained for it) and its rows are published from the outbox
    /// table once it accepts writes again.
    #[arg(long, env = "CDC_SHARD_DETACH_AFTER", value_parser = humantime::parse_duration, default_value = "5s")]
    pub shard_detach_after: Duration,
    /// Bytes a shard's lane may hold while it cannot confirm before it falls behind (the
    /// relay's memory: at most this per shard that fails, beside one batch per healthy one).
    #[arg(long, env = "CDC_LANE_MAX_BYTES", default_value_t = 16 << 20)]
    pub lane_max_bytes: usize,
    /// The replication connection's deadline: the walsender's timeout for this relay, and how
    /// long the connection may be silent before the relay gives it up and connects again.
    #[arg(long, env = "CDC_REPLICATION_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10s")]
    pub replication_timeout: Duration,
    /// The largest outbox row (one pgoutput message) the relay accepts, in bytes; a larger
    /// one stops it, saying so. With 64 events buffered, also what bounds that buffer.
    #[arg(long, env = "CDC_MAX_ROW_BYTES", default_value_t = 1 << 20)]
    pub max_row_bytes: usize,
    /// How long the services keep outbox rows (their --outbox-retention): a shard behind for
    /// longer may miss rows that were deleted, which the relay counts and says.
    #[arg(long, env = "CDC_OUTBOX_RETENTION", value_parser = humantime::parse_duration, default_value = "24h")]
    pub outbox_retention: Duration,
    /// This relay's identity in Redis locks: unique among the side's running relays and
    /// stable across restarts of one (the pod's name: the manifests set it), so a relay that
    /// was killed and restarted takes its own rebuild lock back at once instead of waiting
    /// out its TTL. Default: a random one per process (safe, but a restart waits the TTL).
    #[arg(long, env = "CDC_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// How often acknowledgements are reported to Postgres at most.
    #[arg(long, env = "CDC_STATUS_INTERVAL", value_parser = humantime::parse_duration, default_value = "200ms")]
    pub status_interval: Duration,
    /// Redis response timeout; a timed-out batch is sent again (ids make that safe).
    #[arg(long, env = "CDC_REDIS_TIMEOUT", value_parser = humantime::parse_duration, default_value = "5s")]
    pub redis_timeout: Duration,
    /// Postgres connect timeout.
    #[arg(long, env = "CDC_CONNECT_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10s")]
    pub connect_timeout: Duration,
    /// How often a standby relay looks whether the slot is free (one query on a connection
    /// it keeps; jittered).
    #[arg(long, env = "CDC_STANDBY_RETRY", value_parser = humantime::parse_duration, default_value = "200ms")]
    pub standby_retry: Duration,
    /// Longest pause between reconnect attempts (exponential backoff with jitter up to it).
    #[arg(long, env = "CDC_RECONNECT_MAX_BACKOFF", value_parser = humantime::parse_duration, default_value = "1s")]
    pub reconnect_max_backoff: Duration,
    /// What to do when the slot is lost (invalidated by max_slot_wal_keep_size) or dropped
    /// while the stream was streaming from it: `fail` stops with an error; `recover` makes the
    /// slot anew and republishes from the outbox table the rows the stream may be missing.
    #[arg(long, env = "CDC_ON_LOST_SLOT", value_enum, default_value_t = OnLostSlot::Fail)]
    pub on_lost_slot: OnLostSlot,
    /// How often slot health (lag, retained WAL, wal_status) is read for /metrics.
    #[arg(long, env = "CDC_SLOT_METRICS_INTERVAL", value_parser = humantime::parse_duration, default_value = "5s")]
    pub slot_metrics_interval: Duration,
    /// On SIGTERM, how long to wait for the shards that confirm to confirm what is in flight
    /// before leaving anyway (a shard that cannot confirm is not waited for; nothing
    /// unconfirmed was acknowledged, so nothing is lost: the next relay sends it again).
    /// Also how long a stopping Postgres waits for the relay: a server asking to confirm
    /// everything it sent is let go (the session ends) if that cannot be done by then.
    #[arg(long, env = "CDC_SHUTDOWN_GRACE", value_parser = humantime::parse_duration, default_value = "1s")]
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

impl RunArgs {
    /// Everything `run` needs, or what to change.
    pub fn validate(&self) -> Result<RelayConfig, RelayError> {
        let c = &self.connection;
        let postgres = c.postgres()?;
        let t = &self.tuning;
        let redis = c.redis(t.redis_timeout)?;
        let stream = c.stream()?.to_string();
        // A template is checked as the keys it makes.
        let example = layout::route_stream(&stream, layout::FALLBACK_ROUTE);
        let stream_shards = validate_layout(
            "--stream-shards",
            c.stream_shards,
            c.redis_cluster,
            &[("--stream", &example)],
        )?;
        if layout::is_routed(&stream) && !(1..=100_000).contains(&self.max_routes) {
            return Err(RelayError::Config(format!(
                "--max-routes must be between 1 and 100000 (got {})",
                self.max_routes
            )));
        }
        let standbys = self.standbys()?;
        let admin_addr = t.admin_addr()?;
        t.check()?;
        let batch = BatchLimits {
            max_entries: t.batch_max_entries,
            max_bytes: t.batch_max_bytes,
        };
        let message_prefixes = self.message_prefixes()?;
        // Only what the table can give back may fall behind.
        let may_fall_behind = message_prefixes.is_empty() && postgres.outbox.recovers_from_table();
        Ok(RelayConfig {
            postgres,
            redis,
            stream,
            stream_shards,
            admin_addr,
            batch,
            lanes: LaneLimits {
                batch,
                detach_after: t.shard_detach_after,
                max_bytes: t.lane_max_bytes,
                may_fall_behind,
            },
            message_prefixes,
            max_routes: self.max_routes,
            stream_max_len: t.stream_max_len,
            replication_timeout: t.replication_timeout,
            max_row_bytes: t.max_row_bytes,
            outbox_retention: t.outbox_retention,
            instance_id: t.instance_id(),
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

    /// The message prefixes, checked: printable, at most 128 bytes, no two alike.
    fn message_prefixes(&self) -> Result<Vec<String>, RelayError> {
        let mut prefixes: Vec<String> = Vec::new();
        for prefix in self.message_prefixes.iter().map(|p| p.trim()) {
            if prefix.is_empty()
                || prefix.len() > 128
                || prefix.chars().any(|c| c.is_control() || c.is_whitespace())
            {
                return Err(RelayError::Config(format!(
                    "--message-prefixes '{prefix}' is not a prefix: 1-128 printable characters without spaces"
                )));
            }
            if let Some(stream) = self.connection.stream.as_deref() {
                if layout::is_routed(stream) && !layout::valid_route(prefix) {
                    return Err(RelayError::Config(format!(
                        "--message-prefixes '{prefix}' routes its events to a stream of that name, so it must be a route name: 1-{} letters, digits, '.', '_' and '-', starting with a letter or digit",
                        layout::MAX_ROUTE_LEN
                    )));
                }
            }
            if prefixes.iter().any(|p| p == prefix) {
                return Err(RelayError::Config(format!(
                    "--message-prefixes names '{prefix}' twice"
                )));
            }
            prefixes.push(prefix.to_string());
        }
        Ok(prefixes)
    }

    /// The standbys to watch (only beside a failover slot).
    fn standbys(&self) -> Result<Vec<PgEndpoint>, RelayError> {
        if !self.standby_urls.is_empty() && !self.connection.failover {
            return Err(RelayError::Config(
                "--standby-url watches a failover slot's copy on a standby: add --failover (Postgres 17+), or drop --standby-url".into(),
            ));
        }
        self.standby_urls
            .iter()
            .map(|url| {
                self.connection
                    .database_secrets
                    .endpoint(url)
                    .map_err(|e| RelayError::Config(e.0.replace("--database-url", "--standby-url")))
            })
            .collect()
    }
}

impl Tuning {
    fn admin_addr(&self) -> Result<Option<SocketAddr>, RelayError> {
        if self.admin_addr.is_empty() {
            return Ok(None);
        }
        self.admin_addr.parse().map(Some).map_err(|_| {
            RelayError::Config(format!(
                "--admin-addr '{}' is not host:port (e.g. 0.0.0.0:9187), or empty to disable",
                self.admin_addr
            ))
        })
    }

    /// The configured identity, or a random one (two relays must never share one: each
    /// would take the other's lock for its own).
    fn instance_id(&self) -> String {
        self.instance_id
            .clone()
            .filter(|i| !i.is_empty())
            .unwrap_or_else(|| format!("relay-{:016x}", rand::random::<u64>()))
    }

    /// Bounds every knob must respect.
    fn check(&self) -> Result<(), RelayError> {
        if self.lane_max_bytes < self.batch_max_bytes {
            return Err(RelayError::Config(format!(
                "--lane-max-bytes ({}) must be at least --batch-max-bytes ({}): a lane holds at least one batch",
                self.lane_max_bytes, self.batch_max_bytes
            )));
        }
        if self.instance_id.as_deref().is_some_and(|i| i.contains('/')) {
            return Err(RelayError::Config(
                "--instance-id may not contain '/'".into(),
            ));
        }
        if self.max_row_bytes < 1024 {
            return Err(RelayError::Config(
                "--max-row-bytes must be at least 1024".into(),
            ));
        }
        if self.replication_timeout < Duration::from_secs(2) {
            return Err(RelayError::Config(
                "--replication-timeout must be at least 2s (the server pings every half of it)"
                    .into(),
            ));
        }
        if self.batch_max_entries == 0 || self.batch_max_bytes < 1024 {
            return Err(RelayError::Config(
                "--batch-max-entries must be at least 1 and --batch-max-bytes at least 1024".into(),
            ));
        }
        for (flag, value) in [
            ("--status-interval", self.status_interval),
            ("--redis-timeout", self.redis_timeout),
            ("--connect-timeout", self.connect_timeout),
            ("--standby-retry", self.standby_retry),
            ("--reconnect-max-backoff", self.reconnect_max_backoff),
            ("--slot-metrics-interval", self.slot_metrics_interval),
            ("--rebuild-lock-ttl", self.rebuild_lock_ttl),
            ("--shard-detach-after", self.shard_detach_after),
            ("--outbox-retention", self.outbox_retention),
        ] {
            if value.is_zero() {
                return Err(RelayError::Config(format!(
                    "{flag} must be greater than zero"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

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
        assert_eq!(config.postgres.outbox.table.to_string(), "consumers.outbox");
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
