//! Checks that the database is ready for the relay (run before every replication session),
//! and `cdc-relay setup`, which creates the slot.
//!
//! Order matters: the publication must exist before the slot is created. A slot created
//! first fails with "publication ... does not exist" for good, even after the publication
//! appears, so `setup` refuses to create a slot while the publication is missing.

use std::time::Duration;

use tokio_postgres::Client;

use crate::config::PostgresConfig;
use crate::error::{sqlstates, RelayError};

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub plugin: Option<String>,
    pub slot_type: String,
    pub database: Option<String>,
    pub active_pid: Option<i32>,
    pub wal_status: Option<String>,
    pub confirmed_flush_lsn: Option<pgwire_replication::Lsn>,
    /// Why the server invalidated the slot (Postgres 17+: `wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, 18's `idle_timeout`).
    pub invalidation_reason: Option<String>,
    /// A failover slot (Postgres 17+; `None` before).
    pub failover: Option<bool>,
}

impl SlotInfo {
    /// The slot can no longer be streamed from: its WAL was removed, or the server
    /// invalidated it for another reason (17+: rows removed, wal_level lowered, idle).
    pub fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost") || self.invalidation_reason.is_some()
    }
}

/// wal_level, and the publication publishing inserts of the outbox table.
pub async fn check_prerequisites(client: &Client, cfg: &PostgresConfig) -> Result<(), RelayError> {
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
        Some(_) => Ok(()),
    }
}

pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, RelayError> {
    let row = client
        .query_opt(
            "SELECT plugin::text, slot_type, database::text, active_pid, wal_status,
                    confirmed_flush_lsn::text, to_jsonb(s) ->> 'invalidation_reason',
                    (to_jsonb(s) ->> 'failover')::boolean
               FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotInfo {
        plugin: r.get(0),
        slot_type: r.get(1),
        database: r.get(2),
        active_pid: r.get(3),
        wal_status: r.get(4),
        confirmed_flush_lsn: r
            .get::<_, Option<String>>(5)
            .and_then(|l| pgwire_replication::Lsn::parse(&l).ok()),
        invalidation_reason: r.get(6),
        failover: r.get(7),
    }))
}

/// The slot exists and is a pgoutput slot of this database.
pub async fn check_slot(client: &Client, cfg: &PostgresConfig) -> Result<SlotInfo, RelayError> {
    let info = slot_info(client, &cfg.slot)
        .await?
        .ok_or_else(|| RelayError::SlotMissing {
            slot: cfg.slot.clone(),
        })?;
    let dbname = cfg.endpoint.dbname();
    let problem = if info.slot_type != "logical" {
        Some(format!("it is a {} slot", info.slot_type))
    } else if info.plugin.as_deref() != Some("pgoutput") {
        Some(format!(
            "it uses plugin {}, not pgoutput",
            info.plugin.as_deref().unwrap_or("?")
        ))
    } else if info.database.as_deref() != Some(dbname) {
        Some(format!(
            "it belongs to database {}, not {dbname}",
            info.database.as_deref().unwrap_or("?")
        ))
    } else {
        None
    };
    match problem {
        Some(problem) => Err(RelayError::SlotMismatch {
            slot: cfg.slot.clone(),
            problem,
        }),
        None => Ok(info),
    }
}

/// What `setup` did about the stream's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordOutcome {
    /// The stream starts at the new slot's consistent point.
    Written,
    /// Left alone: the slot existed before (the record, or its absence, is `run`'s to judge),
    /// or the stream already has a record or entries.
    LeftAlone(&'static str),
}

/// Write the stream's first record, only when this `setup` call created the slot, the
/// stream has neither a record nor entries, and the outbox table is empty: then nothing
/// committed before the slot's consistent point is owed to the stream (a fresh install).
/// In every other case the record is left alone, so a Redis that lost its data, or a slot
/// made anew after a failover, is rebuilt by `run` from the outbox, never silently adopted.
pub async fn init_stream_record(
    cfg: &PostgresConfig,
    setup: &SetupOutcome,
    redis: crate::redis_client::RedisTarget,
    stream: &str,
    shards: u32,
    timeout: Duration,
) -> Result<RecordOutcome, RelayError> {
    let SetupOutcome::Created { consistent_point } = setup else {
        return Ok(RecordOutcome::LeftAlone("the slot existed before"));
    };
    let consistent_point = pgwire_replication::Lsn::parse(consistent_point)
        .map_err(|e| RelayError::Protocol(format!("consistent point: {}", e.0)))?;
    let mut publisher =
        crate::publisher::Publisher::connect(&redis, stream, shards, 0, timeout).await?;
    let mut records = publisher.records();
    let all = crate::record::read_all(&mut records).await?;
    publisher.check_layout(&all).await?;
    if all.iter().any(|r| r.exists()) {
        return Ok(RecordOutcome::LeftAlone("the stream already has a record"));
    }
    if all.iter().any(|r| r.len > 0) {
        return Ok(RecordOutcome::LeftAlone("the stream already has entries"));
    }
    // Rows committed after the slot's consistent point come from the slot; any row seen
    // here may be from before it.
    let client = cfg.endpoint.connect(timeout).await?;
    let table = format!(
        "\"{}\".\"{}\"",
        cfg.outbox_table.schema, cfg.outbox_table.table
    );
    let has_rows: bool = client
        .query_one(&format!("SELECT EXISTS (SELECT 1 FROM {table})"), &[])
        .await?
        .get(0);
    if has_rows {
        return Ok(RecordOutcome::LeftAlone(
            "the outbox has rows the stream may not hold",
        ));
    }
    let origin = server_origin(cfg, timeout).await?;
    // One offset for every shard: above the highest top of any of them.
    let id_offset = all
        .iter()
        .map(|r| crate::record::offset_above(r.top, consistent_point.as_u64(), 0))
        .max()
        .unwrap_or(0);
    let mut written = false;
    for r in records.iter_mut() {
        written |= r
            .create(&crate::record::NewRecord {
                origin: &origin,
                shards,
                acked_through: consistent_point.as_u64(),
                id_offset,
                last_id: None,
            })
            .await?;
    }
    Ok(if written {
        RecordOutcome::Written
    } else {
        RecordOutcome::LeftAlone("the stream already has a record")
    })
}

/// The server's system id, timeline and timeline history, over a replication session.
pub async fn server_origin(
    cfg: &PostgresConfig,
    timeout: Duration,
) -> Result<crate::record::Origin, RelayError> {
    let replication =
        cfg.endpoint
            .replication_config(&cfg.slot, &cfg.publication, Duration::from_secs(1))?;
    let mut session = pgwire_replication::ReplicationClient::connect_gated(replication).await?;
    Ok(crate::record::Origin::identify(&mut session, timeout)
        .await?
        .0)
}

/// What `setup` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetupOutcome {
    Created {
        consistent_point: String,
    },
    AlreadyExists,
    /// It existed as an ordinary slot and `--failover` made it a failover slot.
    MadeFailover,
}

/// Create the slot if it is missing, after checking wal_level and the publication.
pub async fn setup(
    cfg: &PostgresConfig,
    connect_timeout: Duration,
) -> Result<SetupOutcome, RelayError> {
    let client = cfg.endpoint.connect(connect_timeout).await?;
    check_prerequisites(&client, cfg).await?;
    if let Some(existing) = slot_info(&client, &cfg.slot).await? {
        check_slot(&client, cfg).await?;
        if cfg.failover && existing.failover == Some(false) {
            let refused = || {
                RelayError::Config(format!(
                    "slot {} exists but is not a failover slot, and a relay holds it: stop the side's relays and run `setup --failover` again, which makes it one (ALTER_REPLICATION_SLOT {} (FAILOVER true)); the position and the stream stay as they are",
                    cfg.slot, cfg.slot
                ))
            };
            if existing.active_pid.is_some() {
                return Err(refused());
            }
            // Only a replication connection may alter a slot. It acquires the slot and waits
            // while a relay that took it meanwhile holds it: give up after a while (closing
            // the session cancels the wait) rather than hang an init container.
            let replication = cfg.endpoint.replication_config(
                &cfg.slot,
                &cfg.publication,
                Duration::from_secs(1),
            )?;
            let mut session =
                pgwire_replication::ReplicationClient::connect_gated(replication).await?;
            let altered = tokio::time::timeout(
                connect_timeout,
                session.simple_query(&format!(
                    "ALTER_REPLICATION_SLOT \"{}\" (FAILOVER true)",
                    cfg.slot
                )),
            )
            .await;
            return match altered {
                Err(_) => Err(refused()),
                Ok(Ok(_)) => Ok(SetupOutcome::MadeFailover),
                Ok(Err(e)) => match crate::error::replication_error(
                    e,
                    crate::error::ReplicationPhase::Start,
                    cfg,
                    false,
                    None,
                ) {
                    RelayError::SlotBusy { .. } => Err(refused()),
                    e => Err(e),
                },
            };
        }
        return Ok(SetupOutcome::AlreadyExists);
    }
    let created = if cfg.failover {
        client
            .query_one(
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)",
                &[&cfg.slot],
            )
            .await
    } else {
        client
            .query_one(
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&cfg.slot],
            )
            .await
    };
    match created {
        Ok(row) => Ok(SetupOutcome::Created {
            consistent_point: row.get(0),
        }),
        Err(e) if e.code().map(|c| c.code()) == Some(sqlstates::DUPLICATE_OBJECT) => {
            // Created concurrently by another `setup`.
            check_slot(&client, cfg).await?;
            Ok(SetupOutcome::AlreadyExists)
        }
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            Err(RelayError::Config(format!(
                "role {} may not create replication slots: grant it with `ALTER ROLE {} REPLICATION`",
                cfg.endpoint.user(),
                cfg.endpoint.user()
            )))
        }
        Err(e) => Err(e.into()),
    }
}
