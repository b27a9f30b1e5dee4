//! The chat services. One library, two sides (`Consumers` and `Workers`): each writes a
//! sent message and its outbox event in one transaction (and nothing else on the request
//! path), consumes the other side's stream into its inbox exactly once per message, and
//! shows each chat's feed (sent and received) live over Server-Sent Events, replayable from
//! the database.
//!
//! The folders follow a message:
//! - sending: `http` (the routes: the API, the page, event streams) → `store` (every
//!   statement: the send with its outbox event, feeds, the inbox, members, retention);
//! - receiving: `outbox_consumer` (the receiving protocol: leases, claims, dead letters,
//!   sharing the shards) → `inbox` (this side's inbox: each message recorded once) →
//! - `live`: delivery to open event streams on every instance (`hub`, `hints` between
//!   instances, `tips` as the safety net);
//! - `access`: who is asking (`auth`, `token`), what one user may take (`quota`), streams
//!   held to membership (`streams`);
//! - `operations`: the dead-letter command and retention;
//! - `service`: the runtime; `cli` (flags, one group per part) → `config` (each part's
//!   validated settings), `metrics`, `model`, `side`.
//!
//! Connecting, the stream's format and key names, the lease and the admin endpoints are
//! `outbox_core`'s; the services do not depend on the relay.

mod access;
mod cli;
mod config;
pub mod functions;
mod http;
mod inbox;
mod live;
mod metrics;
mod model;
mod operations;
mod service;
mod side;
mod stamp;
mod store;

pub use access::auth::{KeySource, SessionKey, TokenConfig, TokenVerifier};
pub use access::token;
#[cfg(feature = "failpoints")]
pub use cli::FailpointArgs;
pub use cli::{
    AuthArgs, Cli, Command, ConnectionArgs, DeadLetterCommand, HttpArgs, InboxArgs, LiveArgs,
    MigrateCli, RetentionArgs,
};
pub use config::{HttpSettings, LiveSettings, ServiceConfig};
pub use model::{parse_chat_id, parse_send_request, Message, MESSAGE_CREATED};
pub use operations::dead_letters::{run as dead_letters, Outcome as DeadLetterOutcome};
pub use outbox_consumer::{ConsumerRole, ConsumerStatus};
pub use service::{Service, StartError};
pub use side::Side;

/// Internals the integration tests drive directly.
#[cfg(any(test, feature = "test-support"))]
pub mod test_support {
    pub use crate::store::{Received, Store, StoreError};
}
