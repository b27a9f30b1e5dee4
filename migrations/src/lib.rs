//! The chat services' database schema, as plain SQL files in `sql/` applied in version order.
//!
//! Each applied file is recorded in `refinery_schema_history` (with a checksum), so applying
//! the set again is harmless and an edited, already-applied file is refused. Concurrent
//! runs against one database are serialised with an advisory lock. The migrations create
//! roles (cluster-wide, created only when missing), so the connecting role must be a
//! superuser or hold CREATEROLE and own the database.

use tokio_postgres::Client;

mod embedded {
    refinery::embed_migrations!("sql");
}

/// Key of the advisory lock that serialises concurrent `migrate` runs on one database.
const MIGRATION_LOCK_KEY: i64 = 0x6f75_7462_6f78; // "outbox"

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("migration failed: {0}")]
    Migration(#[from] refinery::Error),
}

/// What one run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// Names of the migrations applied by this run, in order (empty when up to date).
    pub applied: Vec<String>,
    /// Version of the newest migration now in the database.
    pub current_version: Option<i32>,
}

/// Apply every migration not yet applied, in order, each in its own transaction.
pub async fn apply(client: &mut Client) -> Result<Report, MigrateError> {
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY])
        .await?;
    let result = embedded::migrations::runner()
        .set_abort_divergent(true)
        .set_abort_missing(true)
        .run_async(client)
        .await;
    // Unlock even when a migration failed; the session ends soon after anyway.
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY])
        .await;
    let report = result?;
    unlocked?;
    let applied = report
        .applied_migrations()
        .iter()
        .map(|m| m.to_string())
        .collect();
    let current_version = embedded::migrations::runner()
        .get_last_applied_migration_async(client)
        .await?
        .map(|m| m.version());
    Ok(Report {
        applied,
        current_version,
    })
}

/// Names of all migrations this build carries, in order.
pub fn known() -> Vec<String> {
    embedded::migrations::runner()
        .get_migrations()
        .iter()
        .map(|m| m.to_string())
        .collect()
}
