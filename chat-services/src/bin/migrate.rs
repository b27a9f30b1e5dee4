//! `migrate`: apply the chat services' SQL migrations to one database (or to one database
//! per side, created when missing and opened to that side's roles only), optionally set
//! the roles' passwords (from files, never from the command line), and load the services'
//! Redis functions (`--redis-url`, as Redis's admin).

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
    #[error("creating database {database}: {message} (the URL's role needs CREATEDB, or create it beforehand)")]
    Create { database: String, message: String },
    #[error("opening database {database} to its side only: {message}")]
    Isolate { database: String, message: String },
    #[error("gave up waiting after --wait-timeout: {0}")]
    WaitTimedOut(String),
    #[error("loading the Redis functions: {0}")]
    Functions(String),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    logging::init(LogFormat::Text, "info");
    let cli = Cli::parse();
    if cli.wait {
        return match wait(&cli).await {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("migrate --wait: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    match run(&cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("migrate: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn said(database: &str, report: &outbox_migrations::Report) {
    if report.applied.is_empty() {
        tracing::info!(%database, version = ?report.current_version, "database is up to date");
    } else {
        tracing::info!(%database, applied = ?report.applied, version = ?report.current_version, "migrations applied");
    }
}

async fn run(cli: &Cli) -> Result<(), Error> {
    let endpoint = cli.secrets.endpoint(&cli.database_url)?;
    for (i, (side, database)) in cli.side_databases.iter().enumerate() {
        if let Some((other, _)) = cli.side_databases[..i]
            .iter()
            .find(|(s, d)| s == side || d == database)
        {
            return Err(outbox_core::ConfigError::new(format!(
                "--side-database: {side}={database} repeats {other}'s side or database; give each side its own database once"
            ))
            .into());
        }
    }
    let connect = |endpoint: outbox_core::connect::PgEndpoint| async move {
        endpoint
            .connect_as(std::time::Duration::from_secs(10), "migrate")
            .await
            .map_err(Error::Connect)
    };
    let mut client = connect(endpoint.clone()).await?;
    if cli.side_databases.is_empty() {
        let report = outbox_migrations::apply(&mut client).await?;
        said(endpoint.dbname(), &report);
    }
    for (side, database) in &cli.side_databases {
        create_if_missing(&client, database).await?;
        let mut own = connect(endpoint.clone().with_dbname(database)).await?;
        let report = outbox_migrations::apply(&mut own).await?;
        said(database, &report);
        // After the migrations: they create the roles. The relay keeps TEMPORARY (PUBLIC's
        // by default): its catch-up compares the stream with the table in a temporary table.
        own.batch_execute(&format!(
            "REVOKE ALL ON DATABASE \"{database}\" FROM PUBLIC; GRANT CONNECT ON DATABASE \"{database}\" TO {side}, {side}_relay; GRANT TEMPORARY ON DATABASE \"{database}\" TO {side}_relay"
        ))
        .await
        .map_err(|e| Error::Isolate {
            database: database.clone(),
            message: server_message(&e),
        })?;
        tracing::info!(%database, %side, "open to this side's roles only");
    }
    for (role, file) in &cli.role_passwords {
        let password = outbox_core::connect::read_secret_file(file)?;
        client
            .batch_execute(&password_statement(role, &password))
            .await
            .map_err(|e| Error::Password {
                role: role.clone(),
                message: server_message(&e),
            })?;
        tracing::info!(%role, "password set");
    }
    if let Some(url) = &cli.redis_url {
        load_functions(cli, url).await?;
    }
    Ok(())
}

/// Load the services' Redis functions (on every primary of a cluster) as Redis's admin,
/// waiting up to two minutes for a Redis that is not up yet.
async fn load_functions(cli: &Cli, url: &str) -> Result<(), Error> {
    let timeout = std::time::Duration::from_secs(10);
    let target = cli.redis_secrets.target(url, cli.redis_cluster, timeout)?;
    let names = outbox_core::functions::load_all(
        &target,
        &chat_services::functions::libraries(),
        std::time::Duration::from_secs(120),
    )
    .await
    .map_err(|e| Error::Functions(e.to_string()))?;
    for library in names {
        tracing::info!(%library, "redis functions loaded");
    }
    Ok(())
}

/// `CREATE DATABASE` unless it exists (two runs at once: the loser's duplicate is fine).
/// The name was checked to be a plain identifier (a-z, 0-9, _) when parsed, and is quoted
/// (a reserved word such as `user` is a name too).
async fn create_if_missing(client: &tokio_postgres::Client, database: &str) -> Result<(), Error> {
    let exists = client
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&database])
        .await
        .map_err(|e| Error::Create {
            database: database.to_string(),
            message: e.to_string(),
        })?
        .is_some();
    if exists {
        return Ok(());
    }
    match client
        .batch_execute(&format!("CREATE DATABASE \"{database}\""))
        .await
    {
        Ok(()) => {
            tracing::info!(%database, "database created");
            Ok(())
        }
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_DATABASE) => Ok(()),
        Err(e) => Err(Error::Create {
            database: database.to_string(),
            message: server_message(&e),
        }),
    }
}

/// `--wait`: polls until the database has every migration this build carries. Anything
/// in the way (Postgres not up, the history not there or not readable yet) is waited out and
/// said once per change, with the deadline as the only way to fail.
async fn wait(cli: &Cli) -> Result<(), Error> {
    let endpoint = cli.secrets.endpoint(&cli.database_url)?;
    let deadline = tokio::time::Instant::now() + cli.wait_timeout;
    let mut last = String::new();
    loop {
        let attempt = async {
            let client = endpoint
                .connect_as(std::time::Duration::from_secs(10), "migrate-wait")
                .await
                .map_err(|e| format!("cannot connect yet: {e}"))?;
            outbox_migrations::state(&client).await.map_err(|e| {
                format!(
                    "cannot read the migration history yet: {}",
                    server_message(&e)
                )
            })
        };
        // The deadline bounds an attempt too (a server that accepts and never answers).
        let seen = match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(state)) if state.is_current() => {
                tracing::info!(version = ?state.applied, "the database has every migration this release needs");
                return Ok(());
            }
            Ok(Ok(state)) => format!(
                "the database lacks migrations {:?} of this release (it is at {}, this release needs {})",
                state.missing,
                state.applied.map_or("none".into(), |v| v.to_string()),
                state.needed
            ),
            Ok(Err(why)) => why,
            Err(_) if last.is_empty() => "the database did not answer".to_string(),
            Err(_) => format!("{last} (the last attempt did not finish)"),
        };
        if seen != last {
            tracing::info!(state = %seen, "waiting for the migrations");
            last = seen;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left < std::time::Duration::from_secs(2) {
            return Err(Error::WaitTimedOut(last));
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
}

/// What the server said (its message alone), or the error itself when it said nothing.
fn server_message(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map_or(e.to_string(), |d| d.message().to_string())
}

/// `ALTER ROLE` with the SCRAM-SHA-256 verifier of `password`, computed here (a fresh salt
/// each time): the password itself never reaches the server, so it cannot land in its log
/// (on an error, or with `log_statement = ddl`) nor in anything that records statements.
fn password_statement(role: &str, password: &str) -> String {
    let verifier = postgres_protocol::password::scram_sha_256(password.as_bytes());
    // A verifier is base64, digits and `$:` only: nothing to quote.
    format!("ALTER ROLE {role} PASSWORD '{verifier}'")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_statement_carries_a_verifier_never_the_password() {
        let statement = super::password_statement("consumers", "hunter2-s3cret'");
        assert!(!statement.contains("hunter2"), "{statement}");
        assert!(
            statement.starts_with("ALTER ROLE consumers PASSWORD 'SCRAM-SHA-256$4096:"),
            "{statement}"
        );
        assert_ne!(
            statement,
            super::password_statement("consumers", "hunter2-s3cret'"),
            "salted"
        );
    }
}
