//! The chat services' database schema, as plain SQL files in `sql/` applied in version order.
//!
//! Each applied file is recorded in `refinery_schema_history` (with a checksum), so applying
//! the set again is harmless and an edited, already-applied file is refused. Concurrent
//! runs against one database are serialised with an advisory lock. The migrations create
//! roles (cluster-wide, created only when missing), so the connecting role must be a
//! superuser or hold CREATEROLE and own the database.

use tokio_postgres::error::SqlState;
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
    let result = run_retrying_concurrent_runs(client).await;
    // Unlock even when a migration failed; the session ends soon after anyway.
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY])
        .await;
    let applied = result?;
    unlocked?;
    let current_version = embedded::migrations::runner()
        .get_last_applied_migration_async(client)
        .await?
        .map(|m| m.version());
    Ok(Report {
        applied,
        current_version,
    })
}

/// Runs of other databases in the same cluster the advisory lock does not hold off; a
/// migration failing with one of these SQLSTATEs met one and rolled back whole. Roles are
/// cluster-wide: a role another run created while this one waited on it can stay unseen until
/// this transaction ends ("role ... does not exist", seen with V19 on a fresh cluster), and
/// two runs creating the same roles can deadlock. Run again, the migration sees the other's.
/// (A migration's bounded lock wait running out is not retried here: each try would hold the
/// table's writes for its `lock_timeout` again; the operator or the Job runs it again.)
const CONCURRENT_RUN_STATES: &[SqlState] = &[
    SqlState::UNDEFINED_OBJECT,
    SqlState::UNIQUE_VIOLATION,
    SqlState::T_R_DEADLOCK_DETECTED,
    SqlState::T_R_SERIALIZATION_FAILURE,
];
const CONCURRENT_RUN_ATTEMPTS: u32 = 5;

/// The pending migrations applied; a migration that met a concurrent run is tried again.
/// The names of those this call applied, in order.
async fn run_retrying_concurrent_runs(client: &mut Client) -> Result<Vec<String>, MigrateError> {
    let mut applied = Vec::new();
    let mut attempt = 1;
    loop {
        match embedded::migrations::runner()
            .set_abort_divergent(true)
            .set_abort_missing(true)
            .run_async(client)
            .await
        {
            Ok(report) => {
                applied.extend(report.applied_migrations().iter().map(|m| m.to_string()));
                return Ok(applied);
            }
            Err(e) if attempt < CONCURRENT_RUN_ATTEMPTS && met_concurrent_run(&e) => {
                // Migrations before the failed one are committed and recorded.
                if let Some(report) = e.report() {
                    applied.extend(report.applied_migrations().iter().map(|m| m.to_string()));
                }
                tracing::warn!(attempt, error = %e, "a migration met another database's run; trying it again");
                tokio::time::sleep(std::time::Duration::from_millis(50 * u64::from(attempt))).await;
                attempt += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Whether `e` is one of [`CONCURRENT_RUN_STATES`]; a missing or duplicate object only when
/// it is a role (a broken migration's missing table is not retried).
fn met_concurrent_run(e: &refinery::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(db) = err
            .downcast_ref::<tokio_postgres::Error>()
            .and_then(|pg| pg.as_db_error())
        {
            let code = db.code();
            let about_roles = db.message().starts_with("role ")
                || db.constraint().is_some_and(|c| c.starts_with("pg_authid"));
            return CONCURRENT_RUN_STATES.contains(code)
                && (about_roles
                    || !matches!(
                        *code,
                        SqlState::UNDEFINED_OBJECT | SqlState::UNIQUE_VIOLATION
                    ));
        }
        source = err.source();
    }
    false
}

/// Where a database stands against the migrations this build carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaState {
    /// The newest migration applied to the database (`None`: none yet).
    pub applied: Option<i32>,
    /// The newest migration this build carries.
    pub needed: i32,
    /// Migrations this build carries that the database lacks, or holds with another
    /// checksum (a different migration of the same number, which `migrate` refuses).
    pub missing: Vec<i32>,
}

impl SchemaState {
    /// Every migration this build carries is applied, as this build has it (a newer
    /// release's extra ones may be there too).
    pub fn is_current(&self) -> bool {
        self.missing.is_empty()
    }
}

/// Reads how far the database is migrated, as any role allowed to read the history (V20
/// lets the services' and relays' roles). The history table is found wherever `migrate`
/// created it (its role's first schema on the search path), not through this role's path:
/// the one this role was granted.
/// A database never migrated has no history table yet: an error, as is a role without the
/// grant (a database before V20).
pub async fn state(client: &Client) -> Result<SchemaState, tokio_postgres::Error> {
    let schema: Option<String> = client
        .query_opt(
            "SELECT n.nspname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.relname = 'refinery_schema_history' AND c.relkind = 'r' \
             AND pg_catalog.has_table_privilege(c.oid, 'SELECT') \
             ORDER BY n.nspname = 'public' DESC LIMIT 1",
            &[],
        )
        .await?
        .map(|row| row.get(0));
    let rows = match schema {
        Some(schema) => {
            let schema = schema.replace('"', "\"\"");
            client
                .query(
                    &format!("SELECT version, checksum FROM \"{schema}\".refinery_schema_history"),
                    &[],
                )
                .await?
        }
        None => Vec::new(),
    };
    let history: std::collections::HashMap<i32, String> = rows
        .iter()
        .map(|row| (row.get::<_, i32>(0), row.get::<_, String>(1)))
        .collect();
    let carried = embedded::migrations::runner().get_migrations().to_vec();
    let mut missing: Vec<i32> = carried
        .iter()
        .filter(|m| history.get(&m.version()) != Some(&m.checksum().to_string()))
        .map(|m| m.version())
        .collect();
    missing.sort_unstable();
    Ok(SchemaState {
        applied: history.keys().max().copied(),
        needed: carried
            .iter()
            .map(|m| m.version())
            .max()
            .expect("at least one migration"),
        missing,
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
