//! Where passwords and CA certificates come from besides the URLs: the flags (and their
//! environment variables) every binary takes, flattened into each command line.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::pg::PgEndpoint;
use super::redis::{self, RedisTarget};
use crate::error::ConfigError;

/// Where the database password and CA come from, besides the URL.
#[derive(Debug, Clone, Default, Args)]
pub struct DatabaseSecrets {
    /// Read the database password from this file (overrides one in the URL).
    #[arg(long, env = "DATABASE_PASSWORD_FILE")]
    pub database_password_file: Option<PathBuf>,
    /// CA certificate(s), PEM, to verify the server with sslmode=verify-ca or verify-full
    /// (overrides sslrootcert in the URL; default: the well-known public roots).
    #[arg(long, env = "DATABASE_CA_FILE")]
    pub database_ca_file: Option<PathBuf>,
}

impl DatabaseSecrets {
    /// The endpoint of `url` with these secrets applied.
    pub fn endpoint(&self, url: &str) -> Result<PgEndpoint, ConfigError> {
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
    pub redis_password_file: Option<PathBuf>,
    /// CA certificate, PEM, to verify a rediss:// server (default: the system's roots).
    #[arg(long, env = "REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
}

impl RedisSecrets {
    /// A single server's client for `url`.
    pub fn client(&self, url: &str) -> Result<::redis::Client, ConfigError> {
        redis::client(
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
    ) -> Result<RedisTarget, ConfigError> {
        redis::target(
            url,
            cluster,
            self.redis_password_file.as_deref(),
            self.redis_ca_file.as_deref(),
            "--redis-url",
            timeout,
        )
    }
}
