//! cdc-relay: a transactional outbox relayed from Postgres into a Redis stream through a
//! logical replication slot (pgoutput), in commit order, exactly once per stream id.
//!
//! The folders are the path of a message:
//! - `source` (private): the slot, the prerequisites, the replication
//!   connection and the server's timeline history;
//! - [`decode`]: pgoutput bytes into outbox rows, without I/O;
//! - `relay`: the streaming loop (events in, batches out, acknowledgements back behind
//!   what Redis confirmed) and its supervisor (standby, reconnect, shutdown);
//! - `sink`: batches, the ordered publish pipeline, the idempotent publish script, the
//!   stream's record and the rebuild lock;
//! - `recovery`: taking the slot over, and rebuilding the stream from the outbox table
//!   when the slot or Redis lost data;
//! - `ops`: the admin endpoints, slot metrics and the operator commands;
//! - [`cli`] and [`config`]: the command line, and what it validates into.
//!
//! What both ends of the stream share (connecting, the entry format and key names, shards,
//! the lease) is `outbox_core`'s.

pub mod cli;
pub mod config;
mod context;
pub mod decode;
mod error;
mod metrics;
mod ops;
mod recovery;
mod relay;
mod sink;
mod source;
mod status;

pub use config::RelayConfig;
pub use error::RelayError;
pub use metrics::Metrics;
pub use ops::{
    check, drop_slot, functions, libraries, reshard, setup, setup_command, slots, streams,
    CheckStatus, SetupOutcome,
};
pub use relay::{run, Relay};
pub use status::{RelayStatus, Role};

/// Internals the integration tests drive directly.
#[cfg(any(test, feature = "test-support"))]
pub mod test_support {
    pub use crate::ops::{init_stream_record, RecordOutcome};
}
