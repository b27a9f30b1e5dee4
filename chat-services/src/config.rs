//! Command line and environment of a chat service, validated at start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use outbox_core::connect::{DatabaseSecrets, PgEndpoint, RedisSecrets, RedisTarget};
use outbox_core::logging::LogFormat;
use outbox_core::stream::{keys, validate_layout};
use outbox_core::ConfigError;

use crate::side::Side;

/// One side of the chat (Consumers or Workers): HTTP API, chat page, outbox writes on send,
/// and the inbox consumer of the other side's stream.
// Field docs are --help text, written for a terminal: `<side>` is a placeholder there, not
// an HTML tag, and a URL is an example, not a link.
#[allow(rustdoc::invalid_html_tags, rustdoc::bare_urls)]
#[derive(Debug, Clone, Parser)]
#[command(name = "chat-service", version)]
pub struct Cli {
    /// Without a command: run the service.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Which service this is.
    #[arg(long, env = "CHAT_SIDE", value_enum)]
    pub side: Side,
    /// Postgres URL of this side's own role (it owns the schema of the same name), e.g.
    /// postgres://consumers@db:5432/chat; sslmode as for cdc-relay (default verify-full).
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
    /// HTTP listen address (the API, the page, event streams, /healthz).
    #[arg(long, env = "LISTEN_ADDR", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Serve --listen over TLS with this certificate chain (PEM), read again when it
    /// changes (a renewal needs no restart). With --tls-key-file.
    #[arg(long, env = "CHAT_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert-file.
    #[arg(long, env = "CHAT_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Admin listen address: /healthz, /readyz and /metrics, kept off the public listener;
    /// empty to disable.
    #[arg(long, env = "CHAT_ADMIN_ADDR", default_value = "127.0.0.1:9090")]
    pub admin_addr: String,
    /// Stable consumer name of this instance in the consumer group (default: <side>-<hostname>).
    #[arg(long, env = "CONSUMER_NAME")]
    pub consumer_name: Option<String>,
    /// Stream to consume (default: the other side's outbox stream, outbox:<other side>).
    #[arg(long, env = "CHAT_INBOUND_STREAM")]
    pub inbound_stream: Option<String>,
    /// Shards of the stream consumed (the other side's; see cdc-relay's --stream-shards):
    /// one lease and one consumer per shard, shared fairly by this side's instances. Must
    /// match what the stream was set up with (its own variable, not the relay's
    /// CDC_STREAM_SHARDS, which counts this side's stream).
    #[arg(long, env = "CHAT_INBOUND_STREAM_SHARDS", default_value_t = 1)]
    pub stream_shards: u32,
    /// Where entries that cannot be recorded go, with the reason (default: deadletter:<side>).
    #[arg(long, env = "CHAT_DEAD_LETTER_STREAM")]
    pub dead_letter_stream: Option<String>,
    /// Dead letters kept at most; beyond it the oldest are trimmed (counted in
    /// chat_dead_letters_trimmed_total and logged): a flood of poison cannot fill Redis.
    #[arg(long, env = "CHAT_DEAD_LETTER_MAX_LEN", default_value_t = 100_000)]
    pub dead_letter_max_len: u64,
    /// Pending entries idle this long are claimed from the consumer holding them.
    #[arg(long, env = "CHAT_CLAIM_IDLE", value_parser = humantime::parse_duration, default_value = "30s")]
    pub claim_idle: Duration,
    /// Deliveries without acknowledgement after which an entry is dead-lettered.
    #[arg(long, env = "CHAT_MAX_DELIVERIES", default_value_t = 5)]
    pub max_deliveries: u64,
    /// TTL of the inbox consumer lease (one active consumer per side).
    #[arg(long, env = "CHAT_LEASE_TTL", value_parser = humantime::parse_duration, default_value = "10s")]
    pub lease_ttl: Duration,
    /// Interval of SSE heartbeat events (`event: heartbeat`, an event a browser's
    /// EventSource sees): the chat page takes a stream silent for one and a half of them
    /// and half a second for dead (a frozen instance, a connection that forwards nothing)
    /// and opens another.
    #[arg(long, env = "CHAT_SSE_HEARTBEAT", value_parser = humantime::parse_duration, default_value = "2s")]
    pub sse_heartbeat: Duration,
    /// Bytes queued for all event-stream clients of the instance together at most: past
    /// it, a client with a backlog is dropped (it resumes with Last-Event-ID), so slow
    /// readers cannot add up to more memory than the container has.
    #[arg(long, env = "CHAT_SSE_BUFFER_TOTAL", default_value_t = 64 << 20)]
    pub sse_buffer_total: usize,
    /// Bytes queued for one event-stream client at most; a client that reads slower than
    /// its chat fills it is dropped (it resumes with Last-Event-ID, missing nothing).
    #[arg(long, env = "CHAT_SSE_CLIENT_BUFFER", default_value_t = 256 * 1024)]
    pub sse_client_buffer: usize,
    /// How often each instance compares the newest position of every chat it streams with
    /// what its streams sent: the bound on how late a message whose live hint was lost (its
    /// writer killed between commit and hint) is shown. One small query per interval.
    #[arg(long, env = "CHAT_FEED_CHECK_INTERVAL", value_parser = humantime::parse_duration, default_value = "2s")]
    pub feed_check_interval: Duration,
    /// Outbox rows older than this are deleted. It bounds recovery: a relay whose slot or
    /// Redis lost data can republish only rows still in the outbox.
    #[arg(long, env = "CHAT_OUTBOX_RETENTION", value_parser = humantime::parse_duration, default_value = "24h")]
    pub outbox_retention: Duration,
    /// Sent messages written, and received messages recorded, longer ago than this are
    /// deleted (off unless set): history, feeds and resuming streams show what remains. A
    /// received message's row is what keeps a redelivery from being recorded twice, so this
    /// must exceed how long after recording one can come again: the other side's
    /// --outbox-retention (a rebuild republishes from it) and how long dead letters wait
    /// before a replay. At least twice this side's --outbox-retention, and 2 days.
    #[arg(long, env = "CHAT_MESSAGE_RETENTION", value_parser = humantime::parse_duration)]
    pub message_retention: Option<Duration>,
    /// How often retention runs.
    #[arg(long, env = "CHAT_OUTBOX_RETENTION_INTERVAL", value_parser = humantime::parse_duration, default_value = "1m")]
    pub outbox_retention_interval: Duration,
    /// Postgres connections in the pool.
    #[arg(long, env = "CHAT_DB_POOL_SIZE", default_value_t = 16)]
    pub db_pool_size: usize,
    /// Open HTTP connections at most; beyond it a new connection gets 503 and is closed.
    #[arg(long, env = "CHAT_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,
    /// Open event streams (SSE) at most on this instance; beyond it 503 (clients retry).
    #[arg(long, env = "CHAT_MAX_EVENT_STREAMS", default_value_t = 5_000)]
    pub max_event_streams: usize,
    /// Sends per second one user may keep up on this instance (a token bucket); past it
    /// 429 with Retry-After. Not applied with --allow-anonymous (there is no user).
    #[arg(long, env = "CHAT_SEND_RATE", default_value_t = 5.0)]
    pub send_rate: f64,
    /// Sends one user may make at once after being idle (the bucket's size).
    #[arg(long, env = "CHAT_SEND_BURST", default_value_t = 20)]
    pub send_burst: u32,
    /// Event streams one user may hold open on this instance; past it 429.
    #[arg(long, env = "CHAT_MAX_EVENT_STREAMS_PER_USER", default_value_t = 16)]
    pub max_event_streams_per_user: usize,
    /// How long a request's body may take to arrive; past it 408 and the connection closes.
    #[arg(long, env = "CHAT_BODY_READ_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10s")]
    pub body_read_timeout: Duration,
    /// How long writing an answer may wait for a client that does not read; past it the
    /// connection is closed (memory and a connection slot are freed; an event stream
    /// resumes with Last-Event-ID).
    #[arg(long, env = "CHAT_WRITE_TIMEOUT", value_parser = humantime::parse_duration, default_value = "30s")]
    pub write_timeout: Duration,
    /// How long a connection may take to send a request's headers, and stay idle between
    /// requests, before it is closed.
    #[arg(long, env = "CHAT_HEADER_READ_TIMEOUT", value_parser = humantime::parse_duration, default_value = "30s")]
    pub header_read_timeout: Duration,
    /// Log line format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub auth: AuthArgs,
    #[command(flatten)]
    pub trace: outbox_core::telemetry::TraceArgs,
    /// Continue the `traceparent` a send carries (its trace id, parent and sampling
    /// decision), and pass it on when spans are off. Only behind a gateway or front end
    /// that sets or checks it: otherwise any client picks its own trace ids and sampling.
    /// Off: each send starts a trace of its own, linked to the client's context.
    #[arg(long, env = "CHAT_TRUST_TRACEPARENT", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub trust_traceparent: bool,
    /// Fault injection for tests and the lab: SIGKILL the process right after the n-th
    /// received message is committed to the inbox, before XACK. Only in builds with the
    /// `failpoints` feature.
    #[cfg(feature = "failpoints")]
    #[arg(long, env = "CHAT_CRASH_AFTER_INBOX_COMMIT", hide = true)]
    pub crash_after_inbox_commit: Option<u64>,
    /// Fault injection: SIGKILL the process when about to record a received message with
    /// exactly this body (a message that crashes its consumer). Only with `failpoints`.
    #[cfg(feature = "failpoints")]
    #[arg(long, env = "CHAT_CRASH_ON_BODY", hide = true)]
    pub crash_on_body: Option<String>,
    /// Fault injection: answer history requests of this chat this much later
    /// (`<chat>:<duration>`, e.g. `5:2s`), as a slow network or database would. Only with
    /// `failpoints`.
    #[cfg(feature = "failpoints")]
    #[arg(long, env = "CHAT_SLOW_HISTORY", hide = true, value_parser = parse_slow_history)]
    pub slow_history: Option<(i64, Duration)>,
    /// Fault injection: answer the first sends to this chat 503 (`<chat>:<count>`, e.g.
    /// `5:2`), as an unavailable database would. Only with `failpoints`.
    #[cfg(feature = "failpoints")]
    #[arg(long, env = "CHAT_REFUSE_SENDS", hide = true, value_parser = parse_refuse_sends)]
    pub refuse_sends: Option<(i64, u64)>,
}

/// Who may use the API: bearer tokens of the team's identity provider (JWTs), verified
/// here against its published keys. One of `--jwks-file`, `--jwks-url` or
/// `--allow-anonymous` is needed.
// --help text (see `Cli`).
#[allow(rustdoc::bare_urls)]
#[derive(Debug, Clone, clap::Args)]
pub struct AuthArgs {
    /// The identity provider's keys (a JWKS document, JSON) that bearer tokens are verified
    /// with; read again when a token names a key it does not hold (a rotation).
    #[arg(long, env = "CHAT_JWKS_FILE", conflicts_with = "jwks_url")]
    pub jwks_file: Option<PathBuf>,
    /// The identity provider's `jwks_uri` (https://): fetched at start, every
    /// --jwks-refresh, and when a token names a key the set does not hold (at most every
    /// 10 s). Instead of --jwks-file.
    #[arg(long, env = "CHAT_JWKS_URL")]
    pub jwks_url: Option<String>,
    /// The CA that signed the identity provider's certificate (PEM), for --jwks-url
    /// (default: the well-known public roots).
    #[arg(long, env = "CHAT_JWKS_CA_FILE")]
    pub jwks_ca_file: Option<PathBuf>,
    /// How often --jwks-url is fetched again.
    #[arg(long, env = "CHAT_JWKS_REFRESH", value_parser = humantime::parse_duration, default_value = "5m")]
    pub jwks_refresh: Duration,
    /// The issuer (`iss`) every token must name, e.g. https://id.example.com/.
    #[arg(long, env = "CHAT_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// The audience (`aud`) a token must name; comma-separated for several.
    #[arg(long, env = "CHAT_JWT_AUDIENCE", value_delimiter = ',')]
    pub jwt_audience: Vec<String>,
    /// Clock skew allowed when checking a token's `exp` and `nbf`.
    #[arg(long, env = "CHAT_JWT_LEEWAY", value_parser = humantime::parse_duration, default_value = "30s")]
    pub jwt_leeway: Duration,
    /// The scope (`scope` or `scp` claim) a token needs to manage chat members.
    #[arg(long, env = "CHAT_ADMIN_SCOPE", default_value = "chat:admin")]
    pub admin_scope: String,
    /// Run without authentication: nobody is identified, every chat is open to anyone who
    /// reaches --listen, messages carry no sender. For a trusted test setup only; logged as
    /// a warning at every start.
    #[arg(long, env = "CHAT_ALLOW_ANONYMOUS", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub allow_anonymous: bool,
    /// Mark the session cookie `Secure` (sent over HTTPS only, named `__Host-chat_session`).
    /// Set it wherever clients reach the service through TLS (implied by --tls-cert-file).
    #[arg(long, env = "CHAT_COOKIE_SECURE", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub cookie_secure: bool,
}

impl AuthArgs {
    /// The token verifier, its key set read now (so a missing or malformed one refuses the
    /// start with its reason); `None` with `--allow-anonymous`.
    fn validate(
        &self,
        cookie_secure: bool,
    ) -> Result<Option<crate::access::auth::Verifier>, ConfigError> {
        let refuse = |message: String| Err(ConfigError(message));
        let jwks = match (&self.jwks_file, &self.jwks_url) {
            (Some(file), _) => crate::access::auth::KeySource::File(file.clone()),
            (None, Some(url)) => {
                let uri = url.parse::<hyper::Uri>().ok();
                let authority = uri.as_ref().and_then(|u| u.authority()).map(|a| a.as_str());
                if !url.starts_with("https://")
                    || authority.is_none_or(|a| a.contains('@') || a.starts_with('['))
                {
                    return refuse(format!(
                        "--jwks-url '{url}' must be an https:// URL of a host name or IPv4 address, without credentials (the provider's jwks_uri)"
                    ));
                }
                if self.jwks_refresh < Duration::from_secs(10) {
                    return refuse("--jwks-refresh must be at least 10s".into());
                }
                if let Some(ca) = &self.jwks_ca_file {
                    outbox_core::connect::root_store(Some(ca))?;
                }
                crate::access::auth::KeySource::Url {
                    url: url.clone(),
                    ca_file: self.jwks_ca_file.clone(),
                    refresh: self.jwks_refresh,
                }
            }
            (None, None) => {
                if self.allow_anonymous {
                    return Ok(None);
                }
                return refuse("no authentication configured: set --jwks-file (CHAT_JWKS_FILE) or --jwks-url (CHAT_JWKS_URL) to the identity provider's keys, with --jwt-issuer and --jwt-audience, or --allow-anonymous (CHAT_ALLOW_ANONYMOUS=true) for a trusted test setup where anyone may read and post".into());
            }
        };
        if self.allow_anonymous {
            return refuse(
                "--allow-anonymous and --jwks-file/--jwks-url exclude each other: choose one"
                    .into(),
            );
        }
        let Some(issuer) = self.jwt_issuer.clone().filter(|i| !i.is_empty()) else {
            return refuse("--jwks-file needs --jwt-issuer (CHAT_JWT_ISSUER): the `iss` the provider's tokens carry".into());
        };
        let audiences: Vec<String> = self
            .jwt_audience
            .iter()
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .collect();
        if audiences.is_empty() {
            return refuse("--jwks-file needs --jwt-audience (CHAT_JWT_AUDIENCE): the `aud` tokens meant for this service carry".into());
        }
        if self.jwt_leeway > Duration::from_secs(300) {
            return refuse(format!(
                "--jwt-leeway {:?} is over 5m: a clock that far off needs fixing, not tolerating",
                self.jwt_leeway
            ));
        }
        if self.admin_scope.is_empty() || self.admin_scope.contains(' ') {
            return refuse("--admin-scope must be one scope, without spaces".into());
        }
        let config = crate::access::auth::TokenConfig {
            jwks,
            cookie_secure,
            issuer,
            audiences,
            leeway: self.jwt_leeway,
            admin_scope: self.admin_scope.clone(),
        };
        crate::access::auth::Verifier::load(config).map(Some)
    }
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Act on this side's dead letters (with the service's configuration), e.g.
    /// `chat-service dead-letters list`.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
}

/// `chat-service dead-letters ...` (see `dead_letters` for what each does).
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DeadLetterCommand {
    /// Print the dead letters, oldest first, one JSON object per line.
    List {
        /// Print at most this many.
        #[arg(long, default_value_t = 100)]
        count: usize,
    },
    /// Record dead letters in the inbox (after fixing their cause) and remove them.
    Replay(Selection),
    /// Remove dead letters without recording them.
    Drop(Selection),
}

#[derive(Debug, Clone, clap::Args)]
pub struct Selection {
    /// Dead-letter entry ids, as `list` prints them (`<stream>@<id>` where the same id is
    /// in two shards' dead-letter streams).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub ids: Vec<String>,
    /// Every dead letter.
    #[arg(long)]
    pub all: bool,
    /// Who does it, for the audit log.
    #[arg(long, env = "CHAT_OPERATOR")]
    pub by: String,
}

/// Everything a service needs, validated.
#[derive(Clone)]
pub struct ServiceConfig {
    pub side: Side,
    pub postgres: PgEndpoint,
    pub redis: RedisTarget,
    pub listen: SocketAddr,
    /// TLS on --listen: the certificate chain and key, loaded once at start (and watched for
    /// renewal while serving).
    pub(crate) certificate: Option<std::sync::Arc<crate::http::tls::Certificate>>,
    /// The token verifier, its key set read; `None`: anonymous (`--allow-anonymous`, or an
    /// operator's command, which serves nobody).
    pub(crate) verifier: Option<std::sync::Arc<crate::access::auth::Verifier>>,
    pub admin_addr: Option<SocketAddr>,
    pub consumer_name: String,
    pub inbound_stream: String,
    pub stream_shards: u32,
    pub dead_letter_stream: String,
    pub dead_letter_max_len: u64,
    pub claim_idle: Duration,
    pub max_deliveries: u64,
    pub lease_ttl: Duration,
    pub sse_heartbeat: Duration,
    pub feed_check_interval: Duration,
    pub sse_client_buffer: usize,
    pub sse_buffer_total: usize,
    pub trust_traceparent: bool,
    pub db_pool_size: usize,
    pub max_connections: usize,
    pub max_event_streams: usize,
    pub send_rate: f64,
    pub send_burst: u32,
    pub max_event_streams_per_user: usize,
    pub body_read_timeout: Duration,
    pub write_timeout: Duration,
    pub header_read_timeout: Duration,
    pub outbox_retention: Duration,
    pub outbox_retention_interval: Duration,
    pub message_retention: Option<Duration>,
    pub cookie_secure: bool,
    pub crash_after_inbox_commit: Option<u64>,
    pub crash_on_body: Option<String>,
    /// Test hook: history of this chat answers this much later.
    pub slow_history: Option<(i64, Duration)>,
    /// Test hook: the first sends to this chat answer 503.
    pub refuse_sends: Option<(i64, u64)>,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URLs may carry passwords: leave them out.
        f.debug_struct("ServiceConfig")
            .field("side", &self.side)
            .field("listen", &self.listen)
            .field("consumer_name", &self.consumer_name)
            .field("inbound_stream", &self.inbound_stream)
            .finish_non_exhaustive()
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "local".into())
}

impl ServiceConfig {
    /// What the HTTP server holds clients to.
    pub(crate) fn http_limits(&self) -> crate::http::Limits {
        use std::sync::Arc;
        use tokio::sync::Semaphore;
        crate::http::Limits {
            connections: Arc::new(Semaphore::new(self.max_connections)),
            event_streams: Arc::new(Semaphore::new(self.max_event_streams)),
            feed_reads: Semaphore::new((self.db_pool_size / 2).max(1)),
            sse_client_buffer: self.sse_client_buffer,
            sse_buffer_total: self.sse_buffer_total,
            sse_queued: Arc::default(),
            header_read_timeout: self.header_read_timeout,
            quotas: Arc::new(crate::access::quota::Quotas::new(
                self.send_rate,
                self.send_burst,
                self.max_event_streams_per_user,
            )),
            body_read_timeout: self.body_read_timeout,
            write_timeout: self.write_timeout,
        }
    }

    /// The receiving protocol's settings (`outbox_consumer`).
    pub(crate) fn consumer(&self) -> outbox_consumer::ConsumerConfig {
        let cfg = self;
        let group = cfg.side.as_str();
        outbox_consumer::ConsumerConfig {
            redis: cfg.redis.clone(),
            stream: cfg.inbound_stream.clone(),
            shards: cfg.stream_shards,
            group: group.to_string(),
            consumer: cfg.consumer_name.clone(),
            dead_letter_stream: cfg.dead_letter_stream.clone(),
            dead_letter_max_len: cfg.dead_letter_max_len,
            claim_idle: cfg.claim_idle,
            max_deliveries: cfg.max_deliveries,
            lease_ttl: cfg.lease_ttl,
            // A stream named by --inbound-stream: its layout is the operator's.
            check_layout: cfg
                .inbound_stream
                .starts_with(&cfg.side.other().outbox_stream()),
            count_unsharded_dead_letters: true,
        }
    }
}

impl Cli {
    /// Everything the service needs, or what to change.
    pub fn validate(&self) -> Result<ServiceConfig, ConfigError> {
        let postgres = self.database_secrets.endpoint(&self.database_url)?;
        let redis = self.redis_secrets.target(
            &self.redis_url,
            self.redis_cluster,
            Duration::from_secs(5),
        )?;
        let (listen, admin_addr) = self.addresses()?;
        let consumer_name = self.consumer_name()?;
        let stream_shards = self.stream_layout()?;
        self.check_bounds()?;
        // An operator's command (dead letters) serves nobody: it needs no identities.
        // Loaded now (and only now), so a bad pair refuses the start with its reason.
        let certificate = match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => Some(crate::http::tls::Certificate::load(
                cert.clone(),
                key.clone(),
            )?),
            _ => None,
        };
        // Served over TLS, the session cookie is for HTTPS only.
        let cookie_secure = self.auth.cookie_secure || certificate.is_some();
        let verifier = match self.command {
            Some(_) => None,
            None => self.auth.validate(cookie_secure)?,
        };
        Ok(ServiceConfig {
            certificate,
            verifier: verifier.map(std::sync::Arc::new),
            cookie_secure,
            side: self.side,
            postgres,
            redis,
            listen,
            admin_addr,
            consumer_name,
            inbound_stream: self
                .inbound_stream
                .clone()
                .unwrap_or_else(|| self.side.other().outbox_stream()),
            stream_shards,
            dead_letter_stream: self
                .dead_letter_stream
                .clone()
                .unwrap_or_else(|| keys::dead_letter_base(self.side.as_str())),
            dead_letter_max_len: self.dead_letter_max_len,
            claim_idle: self.claim_idle,
            max_deliveries: self.max_deliveries,
            lease_ttl: self.lease_ttl,
            sse_heartbeat: self.sse_heartbeat,
            feed_check_interval: self.feed_check_interval,
            sse_client_buffer: self.sse_client_buffer,
            sse_buffer_total: self.sse_buffer_total,
            trust_traceparent: self.trust_traceparent,
            db_pool_size: self.db_pool_size,
            max_connections: self.max_connections,
            max_event_streams: self.max_event_streams,
            send_rate: self.send_rate,
            send_burst: self.send_burst,
            max_event_streams_per_user: self.max_event_streams_per_user,
            body_read_timeout: self.body_read_timeout,
            write_timeout: self.write_timeout,
            header_read_timeout: self.header_read_timeout,
            outbox_retention: self.outbox_retention,
            outbox_retention_interval: self.outbox_retention_interval,
            message_retention: self.message_retention,
            #[cfg(feature = "failpoints")]
            crash_after_inbox_commit: self.crash_after_inbox_commit,
            #[cfg(not(feature = "failpoints"))]
            crash_after_inbox_commit: None,
            #[cfg(feature = "failpoints")]
            crash_on_body: self.crash_on_body.clone(),
            #[cfg(not(feature = "failpoints"))]
            crash_on_body: None,
            #[cfg(feature = "failpoints")]
            slow_history: self.slow_history,
            #[cfg(not(feature = "failpoints"))]
            slow_history: None,
            #[cfg(feature = "failpoints")]
            refuse_sends: self.refuse_sends,
            #[cfg(not(feature = "failpoints"))]
            refuse_sends: None,
        })
    }

    /// The public and admin listen addresses.
    fn addresses(&self) -> Result<(SocketAddr, Option<SocketAddr>), ConfigError> {
        let listen = self.listen.parse().map_err(|_| {
            ConfigError(format!(
                "--listen '{}' is not host:port (e.g. 0.0.0.0:8080)",
                self.listen
            ))
        })?;
        let admin_addr = if self.admin_addr.is_empty() {
            None
        } else {
            Some(self.admin_addr.parse().map_err(|_| {
                ConfigError(format!(
                    "--admin-addr '{}' is not host:port (e.g. 0.0.0.0:9090), or empty to disable",
                    self.admin_addr
                ))
            })?)
        };
        Ok((listen, admin_addr))
    }

    /// This instance's stable consumer name.
    fn consumer_name(&self) -> Result<String, ConfigError> {
        let consumer_name = self
            .consumer_name
            .clone()
            .unwrap_or_else(|| format!("{}-{}", self.side, hostname()));
        if consumer_name.is_empty()
            || consumer_name.contains('/')
            || consumer_name.chars().any(char::is_whitespace)
        {
            return Err(ConfigError(format!(
                "--consumer-name '{consumer_name}' must be non-empty, without '/' or whitespace"
            )));
        }
        Ok(consumer_name)
    }

    /// The inbound stream's shard count, checked with the key names it splits.
    fn stream_layout(&self) -> Result<u32, ConfigError> {
        let named: Vec<(&str, &str)> = [
            ("--inbound-stream", &self.inbound_stream),
            ("--dead-letter-stream", &self.dead_letter_stream),
        ]
        .into_iter()
        .filter_map(|(flag, name)| name.as_deref().map(|n| (flag, n)))
        .collect();
        validate_layout(
            "--stream-shards",
            self.stream_shards,
            self.redis_cluster,
            &named,
        )
    }

    /// Bounds every knob must respect.
    fn check_bounds(&self) -> Result<(), ConfigError> {
        let refuse = |message: &str| Err(ConfigError::new(message));
        if self.dead_letter_max_len == 0 {
            return refuse("--dead-letter-max-len must be at least 1");
        }
        if self.max_deliveries == 0 {
            return refuse("--max-deliveries must be at least 1");
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return refuse("--lease-ttl must be at least 1s");
        }
        if self.sse_heartbeat.is_zero() || self.claim_idle.is_zero() {
            return refuse("--sse-heartbeat and --claim-idle must be greater than zero");
        }
        if self.sse_client_buffer < 64 * 1024 {
            return refuse("--sse-client-buffer must be at least 65536 bytes (one message's frame can reach ~24 KiB)");
        }
        if self.sse_buffer_total < self.sse_client_buffer {
            return refuse("--sse-buffer-total must be at least --sse-client-buffer");
        }
        if self.feed_check_interval < Duration::from_millis(100) {
            return refuse("--feed-check-interval must be at least 100ms");
        }
        if self.outbox_retention < Duration::from_secs(60)
            || self.outbox_retention_interval.is_zero()
        {
            return refuse("--outbox-retention must be at least 1m and --outbox-retention-interval greater than zero");
        }
        if let Some(messages) = self.message_retention {
            let floor = (self.outbox_retention * 2).max(Duration::from_secs(2 * 24 * 3600));
            if messages < floor {
                return Err(ConfigError(format!(
                    "--message-retention {} is below {}: the inbox must remember a message for as long as the other side may deliver it again (twice --outbox-retention, and 2 days at least)",
                    humantime::format_duration(messages),
                    humantime::format_duration(floor)
                )));
            }
        }
        if self.db_pool_size == 0 {
            return refuse("--db-pool-size must be at least 1");
        }
        if self.max_connections == 0 || self.max_event_streams == 0 {
            return refuse("--max-connections and --max-event-streams must be at least 1");
        }
        if !(self.send_rate.is_finite() && self.send_rate > 0.0) || self.send_burst == 0 {
            return refuse("--send-rate must be a number above 0 and --send-burst at least 1");
        }
        if self.max_event_streams_per_user == 0
            || self.body_read_timeout.is_zero()
            || self.write_timeout.is_zero()
        {
            return refuse("--max-event-streams-per-user must be at least 1, --body-read-timeout and --write-timeout greater than zero");
        }
        if self.header_read_timeout.is_zero() {
            return refuse("--header-read-timeout must be greater than zero");
        }
        Ok(())
    }
}

// `migrate`'s command line (the binary is src/bin/migrate.rs), here so tests can inspect it.
/// Apply the SQL migrations (schemas, tables, roles, grants, publications) in order; applied
/// ones are skipped, so running it twice is harmless.
#[derive(Debug, Clone, Parser)]
#[command(name = "migrate", version)]
pub struct MigrateCli {
    /// Postgres URL of a superuser (or a CREATEROLE owner of the database); with --wait, of any role of the system.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    #[command(flatten)]
    pub secrets: DatabaseSecrets,
    /// Set a role's password from a file, `ROLE=FILE` (repeatable), e.g.
    /// consumers=/run/secrets/consumers-password. It is sent as a SCRAM-SHA-256 verifier computed here, never the password itself.
    #[arg(long = "role-password", value_parser = parse_role_password)]
    pub role_passwords: Vec<(String, PathBuf)>,
    /// Apply nothing: wait until the database has every migration this release carries, then exit 0 (1 after --wait-timeout). Any role of the system may run it with its own credentials: the init container that holds a pod back until the migration Job ran.
    #[arg(long, env = "MIGRATE_WAIT", conflicts_with = "role_passwords")]
    pub wait: bool,
    /// How long --wait waits.
    #[arg(long, env = "MIGRATE_WAIT_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10m")]
    pub wait_timeout: Duration,
}

#[cfg(feature = "failpoints")]
fn parse_slow_history(s: &str) -> Result<(i64, Duration), String> {
    let (chat, delay) = s
        .split_once(':')
        .ok_or_else(|| format!("'{s}' is not <chat>:<duration>"))?;
    let chat = chat
        .parse()
        .map_err(|_| format!("'{chat}' is not a chat id"))?;
    let delay = humantime::parse_duration(delay).map_err(|e| e.to_string())?;
    Ok((chat, delay))
}

#[cfg(feature = "failpoints")]
fn parse_refuse_sends(s: &str) -> Result<(i64, u64), String> {
    let (chat, count) = s
        .split_once(':')
        .ok_or_else(|| format!("'{s}' is not <chat>:<count>"))?;
    let chat = chat
        .parse()
        .map_err(|_| format!("'{chat}' is not a chat id"))?;
    let count = count
        .parse()
        .map_err(|_| format!("'{count}' is not a count"))?;
    Ok((chat, count))
}

/// The roles `--role-password` may set.
const PASSWORD_ROLES: [&str; 4] = ["consumers", "workers", "consumers_relay", "workers_relay"];

fn parse_role_password(s: &str) -> Result<(String, PathBuf), String> {
    let (role, file) = s
        .split_once('=')
        .ok_or_else(|| format!("'{s}' is not ROLE=FILE"))?;
    if !PASSWORD_ROLES.contains(&role) {
        return Err(format!(
            "role '{role}' is not one of {}",
            PASSWORD_ROLES.join(", ")
        ));
    }
    Ok((role.to_string(), PathBuf::from(file)))
}
