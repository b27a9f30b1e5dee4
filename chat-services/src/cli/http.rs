//! The public listener: where it listens (and with which certificate), the admin
//! listener, and what it holds every client to (connections, each user's send rate, the
//! deadlines of a request).

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::ConfigError;

use crate::access::budgets::Budget;
use crate::config::{HttpSettings, LiveSettings};
use crate::http::connections::CONNECTION_COST;

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
    /// Default: as many as --memory-budget holds beside --sse-buffer-total, at ~112 KiB
    /// each at worst (1,170 with the defaults); more than that is refused at start.
    #[arg(long, env = "CHAT_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Open connections one client address may hold (an IPv6 client: its /64); past it 429
    /// and the connection is closed, so one address cannot keep others out. Behind a proxy
    /// or load balancer that connects from its own address, name it with --trusted-proxy
    /// and enforce the share there (docs/deployment.md, "Internet exposure").
    #[arg(long, env = "CHAT_MAX_CONNECTIONS_PER_ADDRESS", default_value_t = 256)]
    pub max_connections_per_address: usize,
    /// Addresses or networks exempt from --max-connections-per-address and from the limit
    /// on failed sign-ins per address (comma-separated, e.g. 10.0.0.0/8): the proxies or
    /// ingress that connect on behalf of many clients, and must hold each to its share.
    #[arg(long = "trusted-proxy", env = "CHAT_TRUSTED_PROXIES", value_delimiter = ',', value_parser = parse_network)]
    pub trusted_proxies: Vec<IpNet>,
    /// Requests with credentials that fail verification one client address may make at
    /// once; past it they are answered 429 before their token is verified (a stranger cannot
    /// buy signature checks at line rate). Refilled at --failed-auth-rate.
    #[arg(long, env = "CHAT_FAILED_AUTH_BURST", default_value_t = 20)]
    pub failed_auth_burst: u32,
    /// Failed verifications per second an address may keep up after its burst.
    #[arg(long, env = "CHAT_FAILED_AUTH_RATE", default_value_t = 1.0)]
    pub failed_auth_rate: f64,
    /// Memory the instance may spend on its clients (connections, and event-stream
    /// buffers, --sse-buffer-total), e.g. 192MiB: three quarters of the container's limit
    /// leaves room for the rest. --max-connections is derived from it, or checked against it.
    #[arg(long, env = "CHAT_MEMORY_BUDGET", value_parser = parse_bytes, default_value = "192MiB")]
    pub memory_budget: u64,
    /// Sends per second one user may keep up (a token bucket); past it 429 with
    /// Retry-After. Each user's budgets are held in Redis, so all instances of the side
    /// together allow this much; while Redis does not answer, each instance counts alone.
    /// Not applied with --allow-anonymous (there is no user), like every budget below.
    #[arg(long, env = "CHAT_SEND_RATE", default_value_t = 5.0)]
    pub send_rate: f64,
    /// Sends one user may make at once after being idle (the bucket's size).
    #[arg(long, env = "CHAT_SEND_BURST", default_value_t = 20)]
    pub send_burst: u32,
    /// History pages one user may read per second (each at most 500 messages and 1 MiB).
    #[arg(long, env = "CHAT_HISTORY_RATE", default_value_t = 5.0)]
    pub history_rate: f64,
    /// History pages one user may read at once after being idle.
    #[arg(long, env = "CHAT_HISTORY_BURST", default_value_t = 30)]
    pub history_burst: u32,
    /// Event streams one user may open per second (each replays at most --sse-max-replay
    /// messages).
    #[arg(long, env = "CHAT_STREAM_OPEN_RATE", default_value_t = 1.0)]
    pub stream_open_rate: f64,
    /// Event streams one user may open at once after being idle (tabs opened together).
    #[arg(long, env = "CHAT_STREAM_OPEN_BURST", default_value_t = 20)]
    pub stream_open_burst: u32,
    /// Sign-ins (`POST /session`) one user may make per second.
    #[arg(long, env = "CHAT_SIGN_IN_RATE", default_value_t = 0.1)]
    pub sign_in_rate: f64,
    /// Sign-ins one user may make at once after being idle.
    #[arg(long, env = "CHAT_SIGN_IN_BURST", default_value_t = 10)]
    pub sign_in_burst: u32,
    /// Requests one user may have in flight on this instance at once, an answer counting
    /// until it is written (one never read counts until --write-timeout); past it 429.
    #[arg(long, env = "CHAT_MAX_REQUESTS_PER_USER", default_value_t = 8)]
    pub max_requests_per_user: usize,
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

    /// The limits, or what to change. `live` says what event streams may buffer, which
    /// comes out of the same memory budget.
    pub(crate) fn validate(&self, live: &LiveSettings) -> Result<HttpSettings, ConfigError> {
        let refuse = |message: &str| Err(ConfigError::new(message));
        let max_connections = self.max_connections(live)?;
        if self.max_connections_per_address == 0 {
            return refuse("--max-connections-per-address must be at least 1");
        }
        // A rate below one a day would make a wait too long to express (and is no limit).
        if !(self.failed_auth_rate.is_finite() && self.failed_auth_rate >= 1e-5)
            || self.failed_auth_burst == 0
        {
            return refuse(
                "--failed-auth-rate must be a number of at least 0.00001 (per second) and --failed-auth-burst at least 1",
            );
        }
        let budget = |rate: f64, burst: u32, name: &str| {
            // A rate below one a day would make a wait too long to express.
            if rate.is_finite() && rate >= 1e-5 && burst > 0 {
                Ok(Budget { rate, burst })
            } else {
                Err(ConfigError(format!(
                    "--{name}-rate must be a number of at least 0.00001 (per second) and --{name}-burst at least 1"
                )))
            }
        };
        let budgets = [
            budget(self.send_rate, self.send_burst, "send")?,
            budget(self.history_rate, self.history_burst, "history")?,
            budget(self.stream_open_rate, self.stream_open_burst, "stream-open")?,
            budget(self.sign_in_rate, self.sign_in_burst, "sign-in")?,
        ];
        if self.max_requests_per_user == 0 {
            return refuse("--max-requests-per-user must be at least 1");
        }
        if self.body_read_timeout.is_zero() || self.write_timeout.is_zero() {
            return refuse("--body-read-timeout and --write-timeout must be greater than zero");
        }
        if self.header_read_timeout.is_zero() {
            return refuse("--header-read-timeout must be greater than zero");
        }
        Ok(HttpSettings {
            max_connections,
            max_connections_per_address: self.max_connections_per_address,
            trusted_proxies: self.trusted_proxies.clone(),
            failed_auth_burst: self.failed_auth_burst,
            failed_auth_rate: self.failed_auth_rate,
            budgets,
            max_requests_per_user: self.max_requests_per_user,
            body_read_timeout: self.body_read_timeout,
            write_timeout: self.write_timeout,
            header_read_timeout: self.header_read_timeout,
            trust_traceparent: self.trust_traceparent,
        })
    }

    /// --max-connections, derived from the memory budget or checked against it.
    fn max_connections(&self, live: &LiveSettings) -> Result<usize, ConfigError> {
        let budget = self.memory_budget;
        let buffers = live.sse_buffer_total as u64;
        let fits = budget.saturating_sub(buffers) / CONNECTION_COST;
        let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
        if fits < 64 {
            return Err(ConfigError(format!(
                "--memory-budget {:.0} MiB leaves room for {fits} connections beside --sse-buffer-total {:.0} MiB: raise it to {:.0} MiB at least, or lower --sse-buffer-total",
                mib(budget),
                mib(buffers),
                mib(buffers + 64 * CONNECTION_COST).ceil(),
            )));
        }
        match self.max_connections {
            None => Ok(fits as usize),
            Some(0) => Err(ConfigError::new("--max-connections must be at least 1")),
            Some(n) if n as u64 > fits => Err(ConfigError(format!(
                "--max-connections {n} does not fit --memory-budget {:.0} MiB: at ~{} KiB each beside --sse-buffer-total {:.0} MiB it holds {fits}; lower --max-connections or raise --memory-budget to {:.0} MiB",
                mib(budget),
                CONNECTION_COST / 1024,
                mib(buffers),
                mib(buffers.saturating_add((n as u64).saturating_mul(CONNECTION_COST))).ceil(),
            ))),
            Some(n) => Ok(n),
        }
    }
}

/// A network (`10.0.0.0/8`) or one address (as its /32 or /128).
fn parse_network(s: &str) -> Result<IpNet, String> {
    let s = s.trim();
    s.parse::<IpNet>()
        .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| format!("'{s}' is not an IP address or network (e.g. 10.0.0.0/8)"))
}

/// A size in bytes: a number with an optional unit, B, KiB, MiB or GiB (e.g. `192MiB`).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("'{s}' is not a size (e.g. 192MiB)"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "'{other}' is not a unit of size: B, KiB, MiB or GiB"
            ))
        }
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("'{s}' is too large"))
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_network};

    #[test]
    fn proxies_are_addresses_or_networks() {
        assert_eq!(
            parse_network("10.0.0.0/8").unwrap().to_string(),
            "10.0.0.0/8"
        );
        assert_eq!(
            parse_network("10.1.2.3").unwrap().to_string(),
            "10.1.2.3/32"
        );
        assert_eq!(parse_network("fd00::1").unwrap().to_string(), "fd00::1/128");
        assert!(parse_network("proxy.local").is_err());
    }

    #[test]
    fn sizes_parse_with_binary_units_and_refuse_others() {
        assert_eq!(parse_bytes("192MiB"), Ok(192 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64 KiB"), Ok(64 << 10));
        assert!(parse_bytes("1TB").unwrap_err().contains("unit"));
        assert!(parse_bytes("MiB").unwrap_err().contains("not a size"));
        assert!(parse_bytes("99999999999999GiB")
            .unwrap_err()
            .contains("too large"));
    }
}
