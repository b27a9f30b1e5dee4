//! The command line: the subcommands, their flags and environment variables, parsed once
//! and validated at start into the relay's configuration ([`crate::config`]), so a
//! misconfiguration is refused with a message that says what to change before anything
//! connects. Every subcommand takes the same connection group ([`ConnectionArgs`]).

use clap::{Parser, Subcommand};
use outbox_core::logging::LogFormat;

mod connection;
mod operator;
mod run;

pub use connection::ConnectionArgs;
pub use operator::{CheckArgs, DropSlotArgs, FunctionsArgs, SetupArgs, SlotsArgs, StreamsArgs};
pub use run::{RunArgs, Tuning};

/// Relays a transactional outbox from Postgres (logical replication, pgoutput) into a Redis
/// stream, in commit order, acknowledging the slot only after Redis confirmed.
#[derive(Debug, Parser)]
#[command(name = "cdc-relay", version)]
pub struct Cli {
    /// Log line format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream the outbox into Redis until SIGTERM/SIGINT.
    Run(RunArgs),
    /// Create the replication slot if it is missing (idempotent); checks wal_level and the
    /// publication first.
    Setup(SetupArgs),
    /// List every logical replication slot of the database with its health.
    Slots(SlotsArgs),
    /// Show the stream in Redis, shard by shard: length, first and last id, and per consumer
    /// group its lag (entries not yet delivered), pending entries and the oldest one's age,
    /// consumers and dead letters.
    Streams(StreamsArgs),
    /// Nagios-style check of one slot: exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.
    Check(CheckArgs),
    /// Drop a replication slot (refused while it is active).
    DropSlot(DropSlotArgs),
    /// Move a drained stream to the count given by --stream-shards (every relay of the side
    /// stopped, every shard read and acknowledged by every group); takes `run`'s flags. See
    /// docs/deployment.md, "Resizing a stream".
    Reshard(RunArgs),
    /// Load the relay's Redis functions as Redis's admin user (`--redis-url` with the admin's
    /// credentials): once per Redis, and again after it lost its data. The relay's own user
    /// may only call them. See docs/deployment.md, "Redis functions".
    Functions(FunctionsArgs),
}
