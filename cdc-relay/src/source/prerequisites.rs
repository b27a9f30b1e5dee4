//! What the database must offer before the relay streams, checked before every
//! replication session: `wal_level = logical`, a publication that publishes inserts of the
//! outbox table (Postgres 17+ for a failover slot), and the outbox table's `tx` column (the
//! writing transaction, which lets a shard that fell behind be caught up from the table).
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
    if wal_level != "logical" {
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
                &cfg.outbox_table.schema,
                &cfg.outbox_table.table,
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
                table: cfg.outbox_table.to_string(),
            })
        }
        Some(_) => check_tx_column(client, cfg).await,
    }
}

/// The outbox table has `tx xid8` filled by `pg_current_xact_id()`.
async fn check_tx_column(client: &Client, cfg: &PostgresConfig) -> Result<(), RelayError> {
    let row = client
        .query_opt(
            "SELECT a.atttypid = 'xid8'::regtype,
                    coalesce(pg_get_expr(d.adbin, d.adrelid) LIKE '%pg_current_xact_id()%', false)
               FROM pg_attribute a
               LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
              WHERE a.attrelid = to_regclass(format('%I.%I', $1::text, $2::text))
                AND a.attname = 'tx' AND NOT a.attisdropped",
            &[&cfg.outbox_table.schema, &cfg.outbox_table.table],
        )
        .await?;
    match row {
        Some(row) if row.get::<_, bool>(0) && row.get::<_, bool>(1) => Ok(()),
        _ => Err(RelayError::Config(format!(
            "{table} has no column `tx xid8 DEFAULT pg_current_xact_id()`: the relay needs it to catch a shard up from the table after an outage; run the migrations (V23/V24), or add it with `ALTER TABLE {table} ADD COLUMN tx xid8; ALTER TABLE {table} ALTER COLUMN tx SET DEFAULT pg_current_xact_id(); CREATE INDEX ON {table} (tx) WHERE tx IS NOT NULL`",
            table = cfg.outbox_table
        ))),
    }
}
