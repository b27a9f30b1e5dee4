//! `migrate`'s command line (the binary is src/bin/migrate.rs), here so the repository's
//! checks can read the flags it accepts.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use outbox_core::connect::{DatabaseSecrets, RedisSecrets};

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
    /// One database per side, `SIDE=DATABASE` (repeatable; both sides for the shipped
    /// layout: consumers=chat_consumers, workers=chat_workers): each is created when missing
    /// (the URL's database is only where `migrate` connects to create it), migrated, and
    /// opened to that side's roles only (`CONNECT` revoked from everyone else), so neither
    /// side's roles, its relay's included, can connect to the other's. Without it the URL's
    /// database is migrated as it is, holding both sides.
    #[arg(long = "side-database", env = "MIGRATE_SIDE_DATABASES", value_delimiter = ',', value_parser = parse_side_database, conflicts_with = "wait")]
    pub side_databases: Vec<(String, String)>,
    /// How long --wait waits.
    #[arg(long, env = "MIGRATE_WAIT_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10m")]
    pub wait_timeout: Duration,
    /// Redis URL of Redis's admin user: load the services' Redis functions there too (their
    /// own users may only call them; see docs/deployment.md, "Redis functions"). The relays'
    /// are loaded by `cdc-relay functions`.
    #[arg(
        long,
        env = "MIGRATE_REDIS_URL",
        hide_env_values = true,
        conflicts_with = "wait"
    )]
    pub redis_url: Option<String>,
    /// --redis-url is a Redis Cluster: the functions are loaded on every primary.
    #[arg(long, env = "MIGRATE_REDIS_CLUSTER", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub redis_cluster: bool,
    #[command(flatten)]
    pub redis_secrets: RedisSecrets,
}

/// The roles `--role-password` may set.
const PASSWORD_ROLES: [&str; 4] = ["consumers", "workers", "consumers_relay", "workers_relay"];

fn parse_side_database(s: &str) -> Result<(String, String), String> {
    let (side, database) = s
        .split_once('=')
        .ok_or_else(|| format!("'{s}' is not SIDE=DATABASE"))?;
    if !["consumers", "workers"].contains(&side) {
        return Err(format!("side '{side}' is not consumers or workers"));
    }
    let valid = !database.is_empty()
        && database.len() <= 63
        && database
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !database.starts_with(|c: char| c.is_ascii_digit());
    if !valid {
        return Err(format!(
            "database '{database}' must be 1-63 of a-z, 0-9 and _, not starting with a digit"
        ));
    }
    Ok((side.to_string(), database.to_string()))
}

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
