//! cdc-relay: a transactional outbox relayed from Postgres into a Redis stream through a
//! logical replication slot (pgoutput), in commit order, exactly once per stream id.
//!
//! The path: [`session`] reads the slot with `pgwire-replication`, [`pgoutput`] decodes
//! Relation and Insert messages, [`outbox`] turns outbox rows into stream entries,
//! [`batch`] groups them across transactions, [`publisher`] writes each batch with one
//! idempotent script call, and the slot is acknowledged only at the `end_lsn` of the last
//! transaction Redis confirmed. [`relay`] supervises sessions (standby, reconnect,
//! shutdown); [`setup`] checks prerequisites and creates the slot.

pub mod admin;
pub mod backoff;
pub mod batch;
pub mod config;
mod context;
pub mod error;
pub mod lease;
pub mod metrics;
pub mod monitor;
pub mod outbox;
pub mod pg;
pub mod pgoutput;
mod pipeline;
pub mod publisher;
pub mod rebuild;
pub mod record;
pub mod redis_client;
pub mod relay;
pub mod reshard;
mod session;
pub mod setup;
pub mod shard;
pub mod shutdown;
pub mod slots;
pub mod status;
mod takeover;
pub mod tls;

pub use config::{Cli, RelayConfig};
pub use error::RelayError;
pub use relay::{run, Relay};
pub use status::{RelayStatus, Role};
