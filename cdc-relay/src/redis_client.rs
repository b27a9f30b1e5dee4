//! A Redis client from a URL (`redis://`, `rediss://` for TLS, `redis+unix://`), with the
//! password optionally from a file and TLS verified against a CA file when one is given.

use std::path::Path;

use redis::IntoConnectionInfo;

use crate::error::RelayError;
use crate::pg::read_secret_file;

/// Build a client; `flag` names the URL's flag in error messages (which never show it).
pub fn client(
    url: &str,
    password_file: Option<&Path>,
    ca_file: Option<&Path>,
    flag: &str,
) -> Result<redis::Client, RelayError> {
    let mut info = url.into_connection_info().map_err(|_| {
        RelayError::Config(format!(
            "{flag} is not a valid Redis URL (redis://[user:password@]host[:port][/db], rediss://... for TLS, or redis+unix:///path)"
        ))
    })?;
    if let redis::ConnectionAddr::Tcp(host, _) = info.addr() {
        if !is_loopback(host) {
            // Allowed (some networks encrypt below us), but never silently.
            tracing::warn!(
                %host,
                flag,
                "Redis connection without TLS to a remote host: use rediss:// unless the network is already encrypted"
            );
        }
    }
    if let Some(path) = password_file {
        let password = read_secret_file(path)?;
        let settings = info.redis_settings().clone().set_password(password);
        info = info.set_redis_settings(settings);
    }
    match ca_file {
        None => redis::Client::open(info),
        Some(path) => {
            let root_cert = std::fs::read(path)
                .map_err(|e| RelayError::Config(format!("CA file {}: {e}", path.display())))?;
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root_cert),
                },
            )
        }
    }
    .map_err(|e| {
        RelayError::Config(format!(
            "{flag}: {}",
            e.detail().unwrap_or("invalid client configuration")
        ))
    })
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_recognised() {
        for host in ["localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]"] {
            assert!(is_loopback(host), "{host}");
        }
        for host in ["redis", "10.0.0.1", "example.com", "::2"] {
            assert!(!is_loopback(host), "{host}");
        }
    }
}
