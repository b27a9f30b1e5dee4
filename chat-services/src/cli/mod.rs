//! The command line of a chat service: its flags and environment variables in one group
//! per part of the service (connections, HTTP, live delivery, the inbox consumer,
//! retention, identities, fault injection), validated at start into the settings each part
//! takes ([`crate::config::ServiceConfig`]), so a misconfiguration is refused with what to
//! change before anything connects. Flags and variables are the same whichever group holds
//! them; a group only decides which part's settings they become.

use clap::Parser;
use outbox_core::logging::LogFormat;
use outbox_core::ConfigError;

use crate::config::ServiceConfig;
use crate::side::Side;

mod auth;
mod connection;
#[cfg(feature = "failpoints")]
mod failpoints;
mod http;
mod inbox;
mod live;
mod migrate;
mod retention;

pub use auth::AuthArgs;
pub use connection::ConnectionArgs;
#[cfg(feature = "failpoints")]
pub use failpoints::FailpointArgs;
pub use http::HttpArgs;
pub use inbox::InboxArgs;
pub use live::LiveArgs;
pub use migrate::MigrateCli;
pub use retention::RetentionArgs;

/// One side of the chat (Consumers or Workers): HTTP API, chat page, outbox writes on send,
/// and the inbox consumer of the other side's stream.
#[derive(Debug, Clone, Parser)]
#[command(name = "chat-service", version)]
pub struct Cli {
    /// Without a command: run the service.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Which service this is.
    #[arg(long, env = "CHAT_SIDE", value_enum)]
    pub side: Side,
    #[command(flatten)]
    pub connection: ConnectionArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub inbox: InboxArgs,
    #[command(flatten)]
    pub live: LiveArgs,
    #[command(flatten)]
    pub retention: RetentionArgs,
    /// Log line format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub auth: AuthArgs,
    #[command(flatten)]
    pub trace: outbox_core::telemetry::TraceArgs,
    #[cfg(feature = "failpoints")]
    #[command(flatten)]
    pub failpoints: FailpointArgs,
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
    /// Who does it, for the audit log: only where the side runs without identities
    /// (`--allow-anonymous`); where it verifies tokens, the operator's token says.
    #[arg(long, env = "CHAT_OPERATOR")]
    pub by: Option<String>,
    /// A file holding the operator's access token, an admin token of this side (verified
    /// with the side's identity settings): the audit log names its subject. Required where
    /// the side verifies tokens.
    #[arg(long, env = "CHAT_OPERATOR_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
}

impl Cli {
    /// Everything the service needs, or what to change.
    pub fn validate(&self) -> Result<ServiceConfig, ConfigError> {
        let (postgres, redis) = self.connection.validate()?;
        let (listen, admin_addr) = self.http.addresses()?;
        let live = self.live.validate()?;
        let inbox = self
            .inbox
            .validate(self.side, &redis, self.connection.redis_cluster)?;
        // Loaded now (and only now), so a bad pair refuses the start with its reason.
        let certificate = self.http.certificate()?;
        // Served over TLS, the session cookie is for HTTPS only.
        let cookie_secure = self.auth.cookie_secure || certificate.is_some();
        // An operator's command serves nobody: `list` needs no identities; `replay` and
        // `drop` verify their operator's token with the side's (the audit names its subject).
        let verifier = match &self.command {
            Some(Command::DeadLetters(DeadLetterCommand::List { .. })) => None,
            _ => self.auth.validate(cookie_secure, self.side.as_str())?,
        };
        Ok(ServiceConfig {
            side: self.side,
            postgres,
            redis,
            db_pool_size: self.connection.pool_size()?,
            listen,
            admin_addr,
            certificate,
            verifier: verifier.map(std::sync::Arc::new),
            cookie_secure,
            http: self.http.validate(&live)?,
            live,
            inbox,
            retention: self.retention.validate()?,
            #[cfg(feature = "failpoints")]
            failpoints: self.failpoints.settings(),
            #[cfg(not(feature = "failpoints"))]
            failpoints: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smallest valid command line, with `extra` flags after it.
    fn parse(extra: &[&str]) -> Result<ServiceConfig, ConfigError> {
        let mut argv = vec![
            "chat-service",
            "--side",
            "workers",
            "--database-url",
            "postgres://workers@%2Frun%2Fpostgresql/chat",
            "--redis-url",
            "redis://127.0.0.1:6379",
            "--allow-anonymous=true",
        ];
        if !extra.contains(&"--consumer-name") {
            argv.extend(["--consumer-name", "workers-1"]);
        }
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).expect("flags parse").validate()
    }

    fn refusal(extra: &[&str]) -> String {
        parse(extra).expect_err("refused").to_string()
    }

    #[test]
    fn defaults_become_each_parts_settings() {
        let config = parse(&[]).unwrap();
        assert_eq!(config.db_pool_size, 16);
        assert_eq!(config.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(config.admin_addr, Some("127.0.0.1:9090".parse().unwrap()));
        // The inbox reads the other side's stream in a group named for this side.
        assert_eq!(config.inbox.stream, "outbox:consumers");
        assert_eq!(config.inbox.group, "workers");
        assert_eq!(config.inbox.consumer, "workers-1");
        assert_eq!(config.inbox.dead_letter_stream, "deadletter:workers");
        assert!(config.inbox.check_layout);
        // As many connections as the memory budget holds beside the event-stream buffers.
        assert_eq!(config.http.max_connections, (128 << 20) / (112 << 10));
        assert_eq!(config.http.max_connections_per_address, 256);
        assert_eq!(config.live.max_event_streams, 5_000);
        assert_eq!(config.live.sse_heartbeat, std::time::Duration::from_secs(2));
        assert_eq!(config.retention.messages, None);
        // The session cookie is `__Host-` and `Secure` unless plain HTTP is asked for.
        assert!(config.cookie_secure);
        assert!(!parse(&["--cookie-secure=false"]).unwrap().cookie_secure);
    }

    #[test]
    fn a_stream_named_by_the_operator_keeps_its_own_layout() {
        let config = parse(&["--inbound-stream", "events:billing"]).unwrap();
        assert_eq!(config.inbox.stream, "events:billing");
        assert!(!config.inbox.check_layout);
    }

    #[test]
    fn each_group_refuses_a_bad_value_naming_its_flag() {
        for (flags, names) in [
            (&["--db-pool-size", "0"][..], "--db-pool-size"),
            (&["--listen", "nowhere"], "--listen"),
            (&["--admin-addr", "x"], "--admin-addr"),
            (&["--max-connections", "0"], "--max-connections"),
            (&["--max-connections", "5000"], "--memory-budget"),
            (&["--memory-budget", "70MiB"], "--memory-budget"),
            (
                &["--max-connections-per-address", "0"],
                "--max-connections-per-address",
            ),
            (&["--send-rate", "NaN"], "--send-rate"),
            (&["--send-burst", "0"], "--send-burst"),
            (&["--write-timeout", "0s"], "--write-timeout"),
            (&["--header-read-timeout", "0s"], "--header-read-timeout"),
            (&["--sse-heartbeat", "0s"], "--sse-heartbeat"),
            (&["--sse-client-buffer", "1024"], "--sse-client-buffer"),
            (
                &[
                    "--sse-buffer-total",
                    "70000",
                    "--sse-client-buffer",
                    "80000",
                ],
                "--sse-buffer-total",
            ),
            (&["--feed-check-interval", "10ms"], "--feed-check-interval"),
            (
                &["--max-event-streams-per-user", "0"],
                "--max-event-streams-per-user",
            ),
            (&["--consumer-name", "a b"], "--consumer-name"),
            (&["--stream-shards", "0"], "--stream-shards"),
            (&["--dead-letter-max-len", "0"], "--dead-letter-max-len"),
            (&["--max-deliveries", "0"], "--max-deliveries"),
            (&["--lease-ttl", "500ms"], "--lease-ttl"),
            (&["--claim-idle", "0s"], "--claim-idle"),
            (&["--outbox-retention", "10s"], "--outbox-retention"),
            (&["--message-retention", "1d"], "--message-retention"),
        ] {
            let refused = refusal(flags);
            assert!(refused.contains(names), "{flags:?}: {refused}");
        }
    }

    #[test]
    fn message_retention_must_outlast_redelivery() {
        // Twice the outbox retention (24 h) and two days at least.
        assert!(refusal(&["--message-retention", "47h"]).contains("below 2days"));
        let config = parse(&["--message-retention", "2d"]).unwrap();
        assert_eq!(
            config.retention.messages,
            Some(std::time::Duration::from_secs(2 * 24 * 3600))
        );
    }
}
