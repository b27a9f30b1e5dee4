//! Everything between "connected" and "streaming", and what brings a shard back when it fell
//! behind: taking the slot over ([`takeover`]: read the slot, then Redis; decide; start), the
//! decision itself as a pure function of what was read ([`decide`]), making the slot anew
//! when it cannot continue the stream ([`rebuild`]), and catching a shard up from the
//! outbox table while the others stream ([`catch_up`]).

mod catch_up;
mod decide;
mod rebuild;
mod routes;
mod takeover;

pub(crate) use catch_up::{CatchUps, Handover};
pub(crate) use takeover::{take_over, Started};

/// Register `route`, first seen at `at`, so the next session loads it.
pub(crate) async fn register_route(
    ctx: &crate::context::Context,
    publisher: &crate::sink::Publisher,
    route: &str,
    at: u64,
) -> Result<(), crate::error::RelayError> {
    routes::register(ctx, publisher, route, at).await
}
