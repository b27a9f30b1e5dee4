//! Everything between "connected" and "streaming": taking the slot over ([`takeover`]:
//! read the slot, then Redis; decide; start), the decision itself as a pure function of
//! what was read ([`decide`]), and rebuilding the stream from the outbox table when the
//! slot or Redis lost data or the server's history forked ([`rebuild`]).

mod decide;
mod rebuild;
mod takeover;

pub(crate) use takeover::{take_over, Started};
