//! `migrate`: apply the chat services' SQL migrations to one database, and optionally set
//! the roles' passwords (from files, never from the command line).

use std::path::PathBuf;

use clap::Parser;

/// Apply the SQL migrations (schemas, tables, roles, grants, publications) in order; applied
/// ones are skipped, so running it twice is harmless.
#[derive(Debug, Parser)]
#[command(name = "migrate", version)]
struct Cli {
    /// Postgres URL of a superuser (or a CREATEROLE owner of the database).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    #[command(flatten)]
    secrets: cdc_relay::config::DatabaseSecrets,
    /// Set a role's password from a file, `ROLE=FILE` (repeatable), e.g.
    /// consumers=/run/secrets/consumers-password. Postgres stores it hashed (SCRAM).
    #[arg(long = "role-password", value_parser = parse_role_password)]
    role_passwords: Vec<(String, PathBuf)>,
}

const ROLES: [&str; 4] = ["consumers", "workers", "consumers_relay", "workers_relay"];

fn parse_role_password(s: &str) -> Result<(String, PathBuf), String> {
    let (role, file) = s
        .split_once('=')
        .ok_or_else(|| format!("'{s}' is not ROLE=FILE"))?;
    if !ROLES.contains(&role) {
        return Err(format!("role '{role}' is not one of {}", ROLES.join(", ")));
    }
    Ok((role.to_string(), PathBuf::from(file)))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cli = Cli::parse();
    match run(&cli).await {
        Ok(report) => {
            if report.applied.is_empty() {
                tracing::info!(version = ?report.current_version, "database is up to date");
            } else {
                tracing::info!(applied = ?report.applied, version = ?report.current_version, "migrations applied");
            }
            std::process::ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("migrate: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: &Cli) -> Result<outbox_migrations::Report, String> {
    let endpoint = cli
        .secrets
        .endpoint(&cli.database_url)
        .map_err(|e| e.to_string())?;
    let mut client = endpoint
        .connect_as(std::time::Duration::from_secs(10), "migrate")
        .await
        .map_err(|e| format!("cannot connect to Postgres: {e}"))?;
    let report = outbox_migrations::apply(&mut client)
        .await
        .map_err(|e| e.to_string())?;
    for (role, file) in &cli.role_passwords {
        let password = cdc_relay::pg::read_secret_file(file).map_err(|e| e.to_string())?;
        // The password travels as a literal (ALTER ROLE takes no parameters); quote it.
        let literal = password.replace('\'', "''");
        client
            .batch_execute(&format!("ALTER ROLE {role} PASSWORD '{literal}'"))
            .await
            .map_err(|e| {
                format!(
                    "setting the password of {role}: {}",
                    e.as_db_error()
                        .map_or(e.to_string(), |d| d.message().to_string())
                )
            })?;
        tracing::info!(%role, "password set");
    }
    Ok(report)
}
