//! `migrate`: apply the chat services' SQL migrations to one database, and optionally set
//! the roles' passwords (from files, never from the command line).

use chat_services::config::MigrateCli as Cli;
use clap::Parser;

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
