//! What both ends of the outbox stream share, and nothing else: the relay (the writer) and
//! the services (the readers, and the writers of their own outboxes) depend on this crate,
//! not on each other.
//!
//! - [`connect`]: Postgres and Redis URLs, TLS, passwords from files.
//! - [`stream`]: the wire contract: entry ids and fields, key names, shards, the record,
//!   documented there for a consumer in any language.
//! - [`lease`]: the Redis lease (the relay's rebuild lock, a service's shard consumer).
//! - [`functions`]: every server-side script as a Redis function (callers need `FCALL` only).
//! - [`backoff`], [`shutdown`], [`logging`], [`admin`]: what every binary runs on.
//! - [`telemetry`]: trace context through the outbox and stream, spans over OTLP.
//! - [`error`]: configuring and connecting fail with these, classified once.

pub mod admin;
pub mod backoff;
pub mod connect;
pub mod error;
pub mod functions;
pub mod lease;
pub mod logging;
pub mod shutdown;
pub mod stream;
pub mod telemetry;

pub use error::{ConfigError, Error};
