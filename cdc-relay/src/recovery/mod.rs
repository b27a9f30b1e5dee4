//! Everything between "connected" and "streaming", and what brings a shard back when it fell
//! behind: taking the slot over ([`takeover`]: read the slot, then Redis; decide; start), the
//! decision itself as a pure function of what was read ([`decide`]), making the slot anew
//! when it cannot continue the stream ([`rebuild`]), and catching a shard up from the
//! outbox table while the others stream ([`catch_up`]).

mod catch_up;
mod decide;
mod rebuild;
mod takeover;

pub(crate) use catch_up::{CatchUps, Handover};
pub(crate) use takeover::{take_over, Started};
