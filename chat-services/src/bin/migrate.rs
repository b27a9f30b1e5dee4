//! `migrate`: apply the chat services' SQL migrations to one database, and optionally set
//! the roles' passwords (from files, never from the command line).

use chat_services::MigrateCli as Cli;
use clap::Parser;
use outbox_core::logging::{self, LogFormat};

/// Why `migrate` stopped.
#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] outbox_core::ConfigError),
    #[error("cannot connect to Postgres: {0}")]
    Connect(outbox_core::Error),
    #[error(transparent)]
    Migrate(#[from] outbox_migrations::MigrateError),
    #[error("setting the password of {role}: {message}")]
    Password { role: String, message: String },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    logging::init(LogFormat::Text, "info");
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
        Err(e) => {
            eprintln!("migrate: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: &Cli) -> Result<outbox_migrations::Report, Error> {
    let endpoint = cli.secrets.endpoint(&cli.database_url)?;
    let mut client = endpoint
        .connect_as(std::time::Duration::from_secs(10), "migrate")
        .await
        .map_err(Error::Connect)?;
    let report = outbox_migrations::apply(&mut client).await?;
    for (role, file) in &cli.role_passwords {
        let password = outbox_core::connect::read_secret_file(file)?;
        // The password travels as a literal (ALTER ROLE takes no parameters); quote it.
        let literal = password.replace('\'', "''");
        client
            .batch_execute(&format!("ALTER ROLE {role} PASSWORD '{literal}'"))
            .await
            .map_err(|e| Error::Password {
                role: role.clone(),
                message: e
                    .as_db_error()
                    .map_or(e.to_string(), |d| d.message().to_string()),
            })?;
        tracing::info!(%role, "password set");
    }
    Ok(report)
}
