//! What the database must offer before the relay streams, checked before every
//! replication session: `wal_level = logical`, a publication that publishes inserts of the
//! outbox table (Postgres 17+ for a failover slot), and the columns the outbox mapping names:
//! the ones published, an integer order column and the `tx` column (the writing transaction),
//! which let a shard that fell behind be caught up from the table.
//!
//! Order matters for `setup`: the publication must exist before the slot is created. A slot
//! created first fails with "publication ... does not exist" for good, even after the
//! publication appears, so `setup` refuses to create a slot while the publication is missing.

use tokio_postgres::Client;

use crate::config::PostgresConfig;
use crate::error::RelayError;

/// wal_level, and the publication publishing inserts of the outbox table.
pub(crate) async fn check_prerequisites(
    client: &Client,
    cfg: &PostgresConfig,
) -> Result<(), RelayError> {
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), current_setting('server_version_num')::int",
            &[],
        )
        .await?;
    let (wal_level, version): (String, i32) = (row.get(0), row.get(1));
    if !wal_level_suffices(&wal_level, version) {
        return Err(RelayError::WalLevelNotLogical { actual: wal_level });
    }
    if cfg.failover && version < 170_000 {
        return Err(RelayError::Config(format!(
            "--failover needs Postgres 17 or newer (failover slots); this server is {}: drop the flag, or upgrade",
            version / 10_000
        )));
    }
    let row = client
        .query_opt(
            "SELECT p.pubinsert,
                    EXISTS (SELECT 1 FROM pg_publication_tables t
                             WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)
               FROM pg_publication p WHERE p.pubname = $1",
            &[
                &cfg.publication,
                &cfg.outbox.table.schema,
                &cfg.outbox.table.table,
            ],
        )
        .await?;
    match row {
        None => Err(RelayError::PublicationMissing {
            publication: cfg.publication.clone(),
        }),
        Some(row) if !(row.get::<_, bool>(0) && row.get::<_, bool>(1)) => {
            Err(RelayError::PublicationIncomplete {
                publication: cfg.publication.clone(),
                table: cfg.outbox.table.to_string(),
            })
        }
        Some(_) => check_columns(client, cfg).await,
    }
}

/// Postgres 19 turns logical decoding on while a logical slot exists (`effective_wal_level`
/// says so) when `wal_level` is `replica`; earlier servers need `logical`.
fn wal_level_suffices(wal_level: &str, version: i32) -> bool {
    wal_level == "logical" || (version >= 190_000 && wal_level == "replica")
}

/// After `setup` made or found the slot: the server decodes logically now. Before 19 the
/// setting does not exist and `wal_level` said so already.
pub(crate) async fn check_effective_wal_level(client: &Client) -> Result<(), RelayError> {
    let row = client
        .query_one("SELECT current_setting('effective_wal_level', true)", &[])
        .await?;
    match row.get::<_, Option<String>>(0) {
        Some(level) if level != "logical" => Err(RelayError::WalLevelNotLogical {
            actual: format!("{level} (effective_wal_level, with the slot in place)"),
        }),
        _ => Ok(()),
    }
}

/// Every column the mapping names exists; the order column is an integer; the tx column is
/// `xid8` filled by `pg_current_xact_id()`.
async fn check_columns(client: &Client, cfg: &PostgresConfig) -> Result<(), RelayError> {
    let m = &cfg.outbox;
    let rows = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod),
                    coalesce(pg_get_expr(d.adbin, d.adrelid) LIKE '%pg_current_xact_id()%', false)
               FROM pg_attribute a
               LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
              WHERE a.attrelid = to_regclass(format('%I.%I', $1::text, $2::text))
                AND a.attnum > 0 AND NOT a.attisdropped",
            &[&m.table.schema, &m.table.table],
        )
        .await?;
    let column = |name: &str| {
        rows.iter()
            .find(|r| r.get::<_, String>(0) == name)
            .map(|r| (r.get::<_, String>(1), r.get::<_, bool>(2)))
    };
    let table = &m.table;
    for (role, name) in m.columns() {
        if role == "tx" || role == "order" {
            continue;
        }
        if column(name.as_str()).is_none() {
            return Err(RelayError::Config(format!(
                "{table} has no column '{name}', which the outbox mapping reads as the {role}: rename it with the --outbox-*-column flags (docs/deployment.md, \"The outbox mapping\"), or pick the right --outbox-preset"
            )));
        }
    }
    if !m.recovers_from_table() {
        // Slot-only: the order and tx columns are never read.
        return Ok(());
    }
    match column(m.order.as_str()) {
        Some((ty, _)) if matches!(ty.as_str(), "bigint" | "integer" | "smallint") => {}
        found => {
            return Err(RelayError::Config(format!(
                "{table} {what}: the relay publishes a catch-up from the table in the order of an integer column that grows with every insert (--outbox-order-column, now '{order}'); add one with `ALTER TABLE {table} ADD COLUMN {order} bigint GENERATED ALWAYS AS IDENTITY` (writers need not name it)",
                what = match found {
                    Some((ty, _)) => format!("column '{}' is {ty}, not an integer", m.order),
                    None => format!("has no column '{}'", m.order),
                },
                order = m.order,
            )))
        }
    }
    match column(m.tx.as_str()) {
        Some((ty, true)) if ty == "xid8" => Ok(()),
        _ => Err(RelayError::Config(format!(
            "{table} has no column `{tx} xid8 DEFAULT pg_current_xact_id()`: the relay needs it to catch a shard up from the table after an outage; run the migrations (V23/V24), or add it with `ALTER TABLE {table} ADD COLUMN {tx} xid8; ALTER TABLE {table} ALTER COLUMN {tx} SET DEFAULT pg_current_xact_id(); CREATE INDEX ON {table} ({tx}) WHERE {tx} IS NOT NULL` (writers need not name it)",
            tx = m.tx,
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::wal_level_suffices;

    #[test]
    fn replica_suffices_from_postgres_19_on() {
        assert!(wal_level_suffices("logical", 150_000));
        assert!(!wal_level_suffices("replica", 180_004));
        assert!(wal_level_suffices("replica", 190_000));
        assert!(!wal_level_suffices("minimal", 190_000));
    }
}
