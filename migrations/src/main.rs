//! `migrate`: apply the chat services' SQL migrations to one database.

use clap::Parser;

/// Apply the SQL migrations (schemas, tables, roles, publications) in order; already
/// applied ones are skipped, so running it twice is harmless.
#[derive(Debug, Parser)]
#[command(name = "migrate", version)]
struct Cli {
    /// Postgres URL of a superuser (or a CREATEROLE owner of the database).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
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
    let config: tokio_postgres::Config = cli
        .database_url
        .parse()
        .map_err(|e| format!("--database-url is not a valid Postgres URL: {e}"))?;
    let (mut client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("cannot connect to Postgres: {e}"))?;
    tokio::spawn(connection);
    outbox_migrations::apply(&mut client)
        .await
        .map_err(|e| e.to_string())
}
