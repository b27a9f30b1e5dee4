//! The relay itself: a supervisor ([`supervisor`]) that connects, takes the slot over (or
//! stands by) and reconnects after transient errors, around the streaming loop
//! ([`session`]) that turns replication events into stream entries and acknowledges the
//! slot only behind what Redis confirmed.

mod session;
mod supervisor;

pub use supervisor::{run, Relay};
