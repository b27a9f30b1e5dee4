//! The consumer's Redis functions (`outbox_core::functions`): the member set's heartbeat and
//! the release of attempt records. With the lease's ([`outbox_core::lease::LIBRARY`]) they
//! are all a consumer's Redis user calls; it can run no script of its own. Both write a
//! few bytes of bookkeeping and run when Redis is out of memory (`allow-oom`): the consumer
//! is what reads and acknowledges, so what lets the relay free memory.

use std::sync::LazyLock;

use outbox_core::functions::{Body, Library};

/// Every function the consumer calls, but the lease's.
pub static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    Library::new(
        "outbox_consumer",
        &[
            Body {
                name: "members",
                body: crate::members::MEMBERS_BODY,
                flags: &["allow-oom"],
            },
            Body {
                name: "release_attempts",
                body: crate::shard::group::RELEASE_BODY,
                flags: &["allow-oom"],
            },
        ],
    )
});

/// The libraries a consumer calls: its own and the lease's.
pub fn libraries() -> [&'static Library; 2] {
    [&outbox_core::lease::LIBRARY, &LIBRARY]
}
