//! `cdc-relay setup`: create the slot if it is missing (idempotent, after checking the
//! prerequisites), make an existing one a failover slot when asked, and, when this call made
//! the slot and the stream is new, record in Redis that the stream starts at the slot's
//! position (so the first `run` streams instead of rebuilding from the outbox table).

use std::time::Duration;

use outbox_core::connect::RedisTarget;
use outbox_core::stream::validate_layout;
use pgwire_replication::ReplicationClient;

use crate::cli::SetupArgs;
use crate::config::PostgresConfig;
use crate::error::RelayError;
use crate::sink::{offset_above, read_all, NewRecord, Publisher};
use crate::source::{
    check_effective_wal_level, check_prerequisites, check_slot, create_slot, make_failover,
    replication_config, replication_error, take_watermark, wait_durable, Origin, ReplicationPhase,
};

/// Connecting and each step's wait.
const TIMEOUT: Duration = Duration::from_secs(10);

/// How long `setup` waits for a Redis that is not there yet (or fails transiently).
const REDIS_PATIENCE: Duration = Duration::from_secs(120);

/// `setup`: the slot, and with --redis-url and --stream the stream's starting record; what
/// was done, a line per step as it is done (so the slot's line is there even when the
/// record's step fails), to `out`.
pub async fn setup_command(
    args: &SetupArgs,
    out: &mut dyn std::io::Write,
) -> Result<(), RelayError> {
    let pg = args.connection.postgres()?;
    let outcome = setup(&pg, TIMEOUT).await?;
    let line = match &outcome {
        SetupOutcome::Created { consistent_point } => format!(
            "created replication slot {} (pgoutput) at {consistent_point}",
            pg.slot
        ),
        SetupOutcome::AlreadyExists => format!("replication slot {} already exists", pg.slot),
        SetupOutcome::MadeFailover => format!(
            "replication slot {} already existed; it is a failover slot now",
            pg.slot
        ),
    };
    say(out, &line);
    let redis_and_stream = args
        .connection
        .redis_and_stream(TIMEOUT)?
        // A routed stream's routes are made by `run` as rows name them; each starts from
        // the outbox table (empty on a fresh install), so there is no record to write here.
        .filter(|(_, stream)| !crate::sink::layout::is_routed(stream));
    if let Some((redis, stream)) = redis_and_stream {
        let shards = validate_layout(
            "--stream-shards",
            args.connection.stream_shards,
            args.connection.redis_cluster,
            &[("--stream", stream)],
        )?;
        // Redis may come up after Postgres (an init container, a compose start): a transient
        // failure is retried for REDIS_PATIENCE, said once per cause, before giving up.
        let deadline = tokio::time::Instant::now() + REDIS_PATIENCE;
        let mut said = String::new();
        let recorded = loop {
            match init_stream_record(&pg, &outcome, &redis, stream, shards, TIMEOUT).await {
                Err(e) if e.is_transient() && tokio::time::Instant::now() < deadline => {
                    let why = e.to_string();
                    if why != said {
                        say(out, &format!("waiting for Redis: {why}"));
                        said = why;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                other => break other?,
            }
        };
        let line = match recorded {
            RecordOutcome::Written => format!("stream {stream} starts at the slot's position"),
            RecordOutcome::LeftAlone(why) => {
                format!("stream {stream}: record left alone ({why}); `run` checks it")
            }
        };
        say(out, &line);
    }
    Ok(())
}

/// One line of what `setup` did (stdout gone is no reason to stop).
fn say(out: &mut dyn std::io::Write, line: &str) {
    let _ = writeln!(out, "{line}");
}

/// What `setup` did about the stream's record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
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
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub async fn init_stream_record(
    cfg: &PostgresConfig,
    setup: &SetupOutcome,
    redis: &RedisTarget,
    stream: &str,
    shards: u32,
    timeout: Duration,
) -> Result<RecordOutcome, RelayError> {
    let SetupOutcome::Created { consistent_point } = setup else {
        return Ok(RecordOutcome::LeftAlone("the slot existed before"));
    };
    let consistent_point = pgwire_replication::Lsn::parse(consistent_point)
        .map_err(|e| RelayError::Protocol(format!("consistent point: {}", e.0)))?;
    let mut publisher = Publisher::connect(redis, stream, shards, 0, timeout).await?;
    let mut records = publisher.records();
    let all = read_all(&mut records).await?;
    publisher
        .check_layout(&all.iter().cloned().map(Some).collect::<Vec<_>>())
        .await?;
    if all
        .iter()
        .any(|r| r.slot.as_deref() == Some(cfg.slot.as_str()))
    {
        // Said loudly: nobody but a relay session or this `setup` makes or drops it.
        return Ok(RecordOutcome::LeftAlone(
            "WARNING: the stream was read from this slot and it was gone, so it was dropped (by an operator, or by any role with REPLICATION); made anew, and `run` catches the stream up from the outbox table",
        ));
    }
    if all.iter().any(|r| r.exists()) {
        return Ok(RecordOutcome::LeftAlone("the stream already has a record"));
    }
    if all.iter().any(|r| r.len > 0) {
        return Ok(RecordOutcome::LeftAlone("the stream already has entries"));
    }
    // Rows committed after the slot's consistent point come from the slot; any row seen
    // here may be from before it. The watermark is taken before looking: with no row to
    // see, it shows none, so it is a true lower bound for a shard that falls behind later.
    let client = cfg.endpoint.connect(timeout).await?;
    let watermark = take_watermark(&client).await?;
    // Recorded only once flushed (see `source::wait_durable`); without it a shard that falls
    // behind before its first acknowledgement compares everything.
    let durable = wait_durable(&client, &watermark, timeout).await?;
    let table = format!(
        "\"{}\".\"{}\"",
        cfg.outbox.table.schema, cfg.outbox.table.table
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
        .map(|r| offset_above(r.top, consistent_point.as_u64(), 0))
        .max()
        .unwrap_or(0);
    let mut written = false;
    for r in records.iter_mut() {
        written |= r
            .create(&NewRecord {
                origin: &origin,
                shards,
                acked_through: consistent_point.as_u64(),
                id_offset,
                last_id: None,
                watermark: durable.then_some(&watermark),
                rebuilding: None,
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
async fn server_origin(cfg: &PostgresConfig, timeout: Duration) -> Result<Origin, RelayError> {
    let replication = replication_config(
        &cfg.endpoint,
        &cfg.slot,
        &cfg.publication,
        Duration::from_secs(1),
        TIMEOUT,
    );
    let mut session = ReplicationClient::connect_gated(replication).await?;
    Ok(Origin::identify(&mut session, timeout).await?.0)
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
    let outcome = setup_slot(&client, cfg, connect_timeout).await?;
    check_effective_wal_level(&client).await?;
    Ok(outcome)
}

async fn setup_slot(
    client: &tokio_postgres::Client,
    cfg: &PostgresConfig,
    connect_timeout: Duration,
) -> Result<SetupOutcome, RelayError> {
    if let Some(existing) = check_slot(client, cfg).await? {
        if cfg.failover && existing.failover == Some(false) {
            return make_failover_slot(cfg, existing.active_pid.is_some(), connect_timeout).await;
        }
        return Ok(SetupOutcome::AlreadyExists);
    }
    match create_slot(client, &cfg.slot, cfg.failover).await {
        Ok(Some(consistent_point)) => Ok(SetupOutcome::Created { consistent_point }),
        Ok(None) => {
            // Created concurrently by another `setup`.
            check_slot(client, cfg).await?.ok_or_else(|| RelayError::SlotMissing {
                slot: cfg.slot.clone(),
            })?;
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

/// `setup --failover` on an ordinary slot: make it a failover slot in place, unless a relay
/// holds it (then say to stop the relays first).
async fn make_failover_slot(
    cfg: &PostgresConfig,
    held: bool,
    connect_timeout: Duration,
) -> Result<SetupOutcome, RelayError> {
    let refused = || {
        RelayError::Config(format!(
            "slot {} exists but is not a failover slot, and a relay holds it: stop the side's relays and run `setup --failover` again, which makes it one (ALTER_REPLICATION_SLOT {} (FAILOVER true)); the position and the stream stay as they are",
            cfg.slot, cfg.slot
        ))
    };
    if held {
        return Err(refused());
    }
    // The ALTER acquires the slot and waits while a relay that took it meanwhile holds it:
    // give up after a while (closing the session cancels the wait) rather than hang an init
    // container.
    let replication = replication_config(
        &cfg.endpoint,
        &cfg.slot,
        &cfg.publication,
        Duration::from_secs(1),
        TIMEOUT,
    );
    let mut session = ReplicationClient::connect_gated(replication).await?;
    match tokio::time::timeout(connect_timeout, make_failover(&mut session, &cfg.slot)).await {
        Err(_) => Err(refused()),
        Ok(Ok(())) => Ok(SetupOutcome::MadeFailover),
        Ok(Err(e)) => match replication_error(e, ReplicationPhase::Start, cfg, false, None) {
            RelayError::SlotBusy { .. } => Err(refused()),
            e => Err(e),
        },
    }
}
