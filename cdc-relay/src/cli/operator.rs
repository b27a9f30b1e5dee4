//! The flags of `setup` and the operator commands (`slots`, `streams`, `check`, `drop-slot`), each
//! around the shared connection group.

use clap::Args;

use super::ConnectionArgs;

#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    /// The slot to create; with --redis-url and --stream, when this call creates the slot
    /// and the stream is empty, it also records in Redis that the stream starts at the
    /// slot's position (so the first `run` streams instead of rebuilding from the outbox
    /// table); an existing record is never touched.
    #[command(flatten)]
    pub connection: ConnectionArgs,
}

#[derive(Debug, Clone, Args)]
pub struct SlotsArgs {
    /// Where the database is (every logical slot of it is listed).
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct StreamsArgs {
    /// Where the stream is (`--redis-url`, `--stream`, `--stream-shards`).
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct FunctionsArgs {
    /// Where Redis is (`--redis-url`, `--redis-cluster`), with an admin's credentials.
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// Write each library to a file in this directory (`<name>.lua`, one per `redis-cli
    /// FUNCTION LOAD`) instead of loading them.
    #[arg(long)]
    pub print_dir: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Where the slot is (`--slot` names the one to check).
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// CRITICAL above this lag (bytes of WAL behind the server).
    #[arg(long)]
    pub max_lag_bytes: u64,
    /// CRITICAL when the slot has been inactive (no relay) longer than this.
    #[arg(long)]
    pub max_inactive_seconds: u64,
    /// WARNING above this lag (default: half of --max-lag-bytes).
    #[arg(long)]
    pub warn_lag_bytes: Option<u64>,
    /// WARNING when inactive longer than this (default: half of --max-inactive-seconds).
    #[arg(long)]
    pub warn_inactive_seconds: Option<u64>,
    /// Where the check remembers since when the slot is inactive (before Postgres 17; 17+ says itself, `inactive_since`).
    #[arg(long, env = "CDC_CHECK_STATE_DIR", default_value = "/var/tmp")]
    pub state_dir: std::path::PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct DropSlotArgs {
    /// Where the slot is (`--slot` names the one to drop).
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// Confirm: what the slot had not delivered is then only in the outbox table.
    #[arg(long)]
    pub yes: bool,
}
