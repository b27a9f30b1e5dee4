//! One Postgres URL, two kinds of connection: ordinary SQL (checks, slot administration)
//! through tokio-postgres, and the replication stream through pgwire-replication.

use std::time::Duration;

use pgwire_replication::{ReplicationConfig, SslMode as ReplicationSslMode, TlsConfig};
use tokio_postgres::config::{Host, SslMode};

use crate::error::RelayError;

/// Session settings the relay pins: pgoutput prints column values with the walsender's
/// own DateStyle and TimeZone, and the stream must not depend on the server's defaults.
const SESSION_OPTIONS: &str = "-c DateStyle=ISO -c TimeZone=UTC";

/// A parsed and validated Postgres URL.
#[derive(Clone)]
pub struct PgEndpoint {
    config: tokio_postgres::Config,
}

impl std::fmt::Debug for PgEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl PgEndpoint {
    pub fn parse(url: &str) -> Result<Self, RelayError> {
        // Never echo the URL: it may carry a password.
        let config: tokio_postgres::Config = url.parse().map_err(|_| {
            RelayError::Config(
                "--database-url is not a valid Postgres URL (postgres://user[:password]@host[:port]/database)".into(),
            )
        })?;
        if config.get_user().is_none() {
            return Err(RelayError::Config(
                "--database-url names no user: put the relay's role in it (postgres://consumers_relay@host/db)".into(),
            ));
        }
        if config.get_hosts().is_empty() {
            return Err(RelayError::Config(
                "--database-url names no host (a host name, or a socket directory such as %2Frun%2Fpostgresql)".into(),
            ));
        }
        Ok(Self { config })
    }

    pub fn user(&self) -> &str {
        self.config.get_user().unwrap_or_default()
    }

    pub fn dbname(&self) -> &str {
        self.config.get_dbname().unwrap_or_else(|| self.user())
    }

    /// `user@host:port/db`, without the password, for logs.
    pub fn describe(&self) -> String {
        let host = match self.config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
            None => String::new(),
        };
        format!("{}@{}:{}/{}", self.user(), host, self.port(), self.dbname())
    }

    fn port(&self) -> u16 {
        self.config.get_ports().first().copied().unwrap_or(5432)
    }

    /// An SQL connection; its driver task runs in the background until the client drops.
    pub async fn connect(
        &self,
        connect_timeout: Duration,
    ) -> Result<tokio_postgres::Client, RelayError> {
        let mut config = self.config.clone();
        config.connect_timeout(connect_timeout);
        config.application_name("cdc-relay");
        let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "sql connection closed");
            }
        });
        Ok(client)
    }

    /// The replication connection's settings for `slot` and `publication`.
    pub fn replication_config(
        &self,
        slot: &str,
        publication: &str,
        status_interval: Duration,
    ) -> Result<ReplicationConfig, RelayError> {
        let host = match self.config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
            None => return Err(RelayError::Config("--database-url names no host".into())),
        };
        let password = self
            .config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        let tls = match self.config.get_ssl_mode() {
            SslMode::Disable => TlsConfig::disabled(),
            SslMode::Prefer => TlsConfig {
                mode: ReplicationSslMode::Prefer,
                ..TlsConfig::default()
            },
            SslMode::Require => TlsConfig::require(),
            _ => TlsConfig::require(),
        };
        let tls = if host.starts_with('/') {
            TlsConfig::disabled()
        } else {
            tls
        };
        Ok(ReplicationConfig::new(
            host,
            self.user(),
            password,
            self.dbname(),
            slot,
            publication,
        )
        .with_port(self.port())
        .with_tls(tls)
        .with_options(SESSION_OPTIONS)
        .with_application_name("cdc-relay")
        .with_status_interval(status_interval)
        .with_wakeup_interval(Duration::from_secs(5)))
    }
}
