//! The public listener: where it listens (and with which certificate), the admin
//! listener, and what it holds every client to (connections, each user's send rate, the
//! deadlines of a request).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::ConfigError;

use crate::config::HttpSettings;

/// The HTTP listeners and their limits.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
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
    /// Open HTTP connections at most; beyond it a new connection gets 503 and is closed.
    #[arg(long, env = "CHAT_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,
    /// Sends per second one user may keep up on this instance (a token bucket); past it
    /// 429 with Retry-After. Not applied with --allow-anonymous (there is no user).
    #[arg(long, env = "CHAT_SEND_RATE", default_value_t = 5.0)]
    pub send_rate: f64,
    /// Sends one user may make at once after being idle (the bucket's size).
    #[arg(long, env = "CHAT_SEND_BURST", default_value_t = 20)]
    pub send_burst: u32,
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
    /// Continue the `traceparent` a send carries (its trace id, parent and sampling
    /// decision), and pass it on when spans are off. Only behind a gateway or front end
    /// that sets or checks it: otherwise any client picks its own trace ids and sampling.
    /// Off: each send starts a trace of its own, linked to the client's context.
    #[arg(long, env = "CHAT_TRUST_TRACEPARENT", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub trust_traceparent: bool,
}

impl HttpArgs {
    /// The public and admin listen addresses.
    pub(crate) fn addresses(&self) -> Result<(SocketAddr, Option<SocketAddr>), ConfigError> {
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

    /// The TLS certificate of --listen, loaded now so a bad pair refuses the start.
    pub(crate) fn certificate(
        &self,
    ) -> Result<Option<Arc<crate::http::tls::Certificate>>, ConfigError> {
        Ok(match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => Some(crate::http::tls::Certificate::load(
                cert.clone(),
                key.clone(),
            )?),
            _ => None,
        })
    }

    /// The limits, or what to change.
    pub(crate) fn validate(&self) -> Result<HttpSettings, ConfigError> {
        let refuse = |message: &str| Err(ConfigError::new(message));
        if self.max_connections == 0 {
            return refuse("--max-connections must be at least 1");
        }
        if !(self.send_rate.is_finite() && self.send_rate > 0.0) || self.send_burst == 0 {
            return refuse("--send-rate must be a number above 0 and --send-burst at least 1");
        }
        if self.body_read_timeout.is_zero() || self.write_timeout.is_zero() {
            return refuse("--body-read-timeout and --write-timeout must be greater than zero");
        }
        if self.header_read_timeout.is_zero() {
            return refuse("--header-read-timeout must be greater than zero");
        }
        Ok(HttpSettings {
            max_connections: self.max_connections,
            send_rate: self.send_rate,
            send_burst: self.send_burst,
            body_read_timeout: self.body_read_timeout,
            write_timeout: self.write_timeout,
            header_read_timeout: self.header_read_timeout,
            trust_traceparent: self.trust_traceparent,
        })
    }
}
