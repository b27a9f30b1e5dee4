//! A Postgres URL, parsed and validated once: ordinary SQL connections and pools through
//! tokio-postgres, and the parts a replication client needs (the relay builds its
//! replication session from them), all with the same TLS settings and credentials.
//!
//! The URL's `sslmode` keeps libpq's meaning (disable, prefer, require, verify-ca,
//! verify-full) and `sslrootcert` names a CA file; both are read here because tokio-postgres
//! knows only the first three modes. Unlike libpq, a URL without `sslmode` means
//! `verify-full`: the safe setting is the default, and plaintext must be asked for. A password may come from a file instead of the URL
//! (`--database-password-file`, the container convention). Nothing here ever prints the
//! password: `describe()` is what logs show.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_postgres::config::{Host, SslMode as PgSslMode};

use super::tls::{self, SslMode};
use crate::error::{ConfigError, Error};

/// A parsed and validated Postgres URL.
#[derive(Clone)]
pub struct PgEndpoint {
    config: tokio_postgres::Config,
    ssl: SslMode,
    ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for PgEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// The contents of a secret file, without the trailing newline editors and `echo` add.
pub fn read_secret_file(path: &Path) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("secret file {}: {e}", path.display())))?;
    Ok(text.trim_end_matches(['\n', '\r']).to_string())
}

/// Take `sslmode` and `sslrootcert` out of a URL (or key=value string).
fn split_tls_params(url: &str) -> (String, Option<String>, Option<String>) {
    let mut sslmode = None;
    let mut sslrootcert = None;
    let mut keep = |key: &str, value: &str| match key {
        "sslmode" => {
            sslmode = Some(value.to_string());
            false
        }
        "sslrootcert" => {
            sslrootcert = Some(value.to_string());
            false
        }
        _ => true,
    };
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            return (url.to_string(), None, None);
        };
        let kept: Vec<&str> = query
            .split('&')
            .filter(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                keep(k, &percent_decode(v))
            })
            .collect();
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        (rest, sslmode, sslrootcert)
    } else {
        let kept: Vec<&str> = url
            .split_whitespace()
            .filter(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                keep(k, v.trim_matches('\''))
            })
            .collect();
        (kept.join(" "), sslmode, sslrootcert)
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(
                std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz"),
                16,
            ) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl PgEndpoint {
    pub fn parse(url: &str) -> Result<Self, ConfigError> {
        let (rest, sslmode, sslrootcert) = split_tls_params(url);
        // Never echo the URL: it may carry a password.
        let config: tokio_postgres::Config = rest.parse().map_err(|_| {
            ConfigError::new(
                "--database-url is not a valid Postgres URL (postgres://user[:password]@host[:port]/database[?sslmode=...])",
            )
        })?;
        if config.get_user().is_none() {
            return Err(ConfigError::new(
                "--database-url names no user: put the role in it (postgres://consumers_relay@host/db)",
            ));
        }
        if config.get_hosts().is_empty() {
            return Err(ConfigError::new(
                "--database-url names no host (a host name, or a socket directory such as %2Frun%2Fpostgresql)",
            ));
        }
        let ssl = match sslmode {
            Some(mode) => mode
                .parse()
                .map_err(|e| ConfigError(format!("--database-url: {e}")))?,
            None => SslMode::VerifyFull,
        };
        Ok(Self {
            config,
            ssl,
            ca_file: sslrootcert.map(PathBuf::from),
        })
    }

    /// Take the password from a file (overrides one in the URL).
    pub fn with_password_file(mut self, path: Option<&Path>) -> Result<Self, ConfigError> {
        if let Some(path) = path {
            self.config.password(read_secret_file(path)?);
        }
        Ok(self)
    }

    /// Verify the server against this CA file (overrides `sslrootcert` in the URL).
    pub fn with_ca_file(mut self, path: Option<&Path>) -> Self {
        if let Some(path) = path {
            self.ca_file = Some(path.to_path_buf());
        }
        self
    }

    pub fn user(&self) -> &str {
        self.config.get_user().unwrap_or_default()
    }

    /// The same server, role and TLS settings, another database.
    pub fn with_dbname(mut self, dbname: &str) -> Self {
        self.config.dbname(dbname);
        self
    }

    pub fn dbname(&self) -> &str {
        self.config.get_dbname().unwrap_or_else(|| self.user())
    }

    pub fn ssl_mode(&self) -> SslMode {
        self.ssl
    }

    /// The first host, and whether it is a Unix socket directory.
    fn host(&self) -> (String, bool) {
        match self.config.get_hosts().first() {
            Some(Host::Tcp(h)) => (h.clone(), false),
            Some(Host::Unix(p)) => (p.display().to_string(), true),
            None => (String::new(), false),
        }
    }

    /// `user@host:port/db`, without the password, for logs.
    pub fn describe(&self) -> String {
        format!(
            "{}@{}:{}/{}",
            self.user(),
            self.host().0,
            self.port(),
            self.dbname()
        )
    }

    /// `host:port` (a socket directory for a Unix socket): what a metric label names.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host().0, self.port())
    }

    pub fn port(&self) -> u16 {
        self.config.get_ports().first().copied().unwrap_or(5432)
    }

    /// The host name, or the socket directory of a Unix socket.
    pub fn host_name(&self) -> String {
        self.host().0
    }

    /// The password (from the URL or its file), empty when none.
    pub fn password(&self) -> String {
        self.config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default()
    }

    /// The CA file to verify the server with (`None`: the well-known roots).
    pub fn ca_file(&self) -> Option<&Path> {
        self.ca_file.as_deref()
    }

    /// TLS never runs over a Unix socket (as with libpq).
    pub fn effective_ssl(&self) -> SslMode {
        if self.host().1 {
            SslMode::Disable
        } else {
            self.ssl
        }
    }

    /// An SQL connection; its driver task runs in the background until the client drops.
    pub async fn connect(
        &self,
        connect_timeout: Duration,
    ) -> Result<tokio_postgres::Client, Error> {
        self.connect_as(connect_timeout, "cdc-relay").await
    }

    /// An SQL connection that shows as `application` in `pg_stat_activity`.
    pub async fn connect_as(
        &self,
        connect_timeout: Duration,
        application: &str,
    ) -> Result<tokio_postgres::Client, Error> {
        let mut config = self.config.clone();
        config.connect_timeout(connect_timeout);
        config.application_name(application);
        with_tcp_deadlines(&mut config);
        let client = match self.effective_ssl() {
            SslMode::Disable => {
                config.ssl_mode(PgSslMode::Disable);
                let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
                tokio::spawn(drive(connection));
                client
            }
            mode => {
                config.ssl_mode(if mode == SslMode::Prefer {
                    PgSslMode::Prefer
                } else {
                    PgSslMode::Require
                });
                let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls::client_config(
                    mode,
                    self.ca_file.as_deref(),
                )?);
                let (client, connection) = config.connect(tls).await?;
                tokio::spawn(drive(connection));
                client
            }
        };
        Ok(client)
    }

    /// The tokio-postgres configuration and the TLS connector, for connection pools.
    pub fn pool_parts(
        &self,
        application: &str,
    ) -> Result<(tokio_postgres::Config, Option<rustls::ClientConfig>), ConfigError> {
        let mut config = self.config.clone();
        config.application_name(application);
        with_tcp_deadlines(&mut config);
        match self.effective_ssl() {
            SslMode::Disable => {
                config.ssl_mode(PgSslMode::Disable);
                Ok((config, None))
            }
            mode => {
                config.ssl_mode(if mode == SslMode::Prefer {
                    PgSslMode::Prefer
                } else {
                    PgSslMode::Require
                });
                Ok((
                    config,
                    Some(tls::client_config(mode, self.ca_file.as_deref())?),
                ))
            }
        }
    }
}

/// TCP keepalives and a user timeout on every SQL connection: a server host that vanished
/// (a partition, a powered-off node) fails the connection within about 10 s instead of
/// after the kernel's default of many minutes. (A server process that stops answering on a
/// live host is the callers' deadlines' to catch: its kernel still acknowledges.)
fn with_tcp_deadlines(config: &mut tokio_postgres::Config) {
    config
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(2))
        .keepalives_retries(3)
        .tcp_user_timeout(Duration::from_secs(10));
}

async fn drive<S, T>(connection: tokio_postgres::Connection<S, T>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if let Err(e) = connection.await {
        tracing::debug!(error = %e, "sql connection closed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_of_the_url() {
        let e = PgEndpoint::parse(
            "postgres://relay:pw@db.example.com:5433/chat?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(e.ssl_mode(), SslMode::VerifyFull);
        assert_eq!(e.ca_file.as_deref(), Some(Path::new("/etc/ca.pem")));
        assert_eq!(e.describe(), "relay@db.example.com:5433/chat");
        let e = PgEndpoint::parse("host=db user=relay dbname=chat sslmode=verify-ca").unwrap();
        assert_eq!(e.ssl_mode(), SslMode::VerifyCa);
        assert_eq!(
            PgEndpoint::parse("postgres://relay@db/chat")
                .unwrap()
                .ssl_mode(),
            SslMode::VerifyFull
        );
        let err = PgEndpoint::parse("postgres://relay:pw@db/chat?sslmode=sometimes").unwrap_err();
        assert!(err.to_string().contains("sslmode 'sometimes'") && !err.to_string().contains("pw"));
    }

    #[test]
    fn the_password_file_overrides_the_url_and_never_shows() {
        let dir = std::env::temp_dir().join(format!("pg-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "s3cret-from-file\n").unwrap();
        let e = PgEndpoint::parse("postgres://relay:in-url@db/chat")
            .unwrap()
            .with_password_file(Some(&file))
            .unwrap();
        assert_eq!(e.password(), "s3cret-from-file");
        assert!(!format!("{e:?}").contains("s3cret") && !format!("{e:?}").contains("in-url"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
