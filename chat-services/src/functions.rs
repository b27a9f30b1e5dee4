//! The services' Redis functions (`outbox_core::functions`): users' budgets and the removal
//! of a dead letter with its audit line. With the consumer's and the lease's
//! ([`libraries`]) they are all a service's Redis user calls; it can run no script of its
//! own. `migrate --redis-url` loads them as Redis's admin. Both write a few bytes and run
//! when Redis is out of memory (`allow-oom`): an operator can still act on dead letters, and
//! budgets stay shared.

use std::sync::LazyLock;

use outbox_core::functions::{Body, Library};

/// Every function the services call, but the consumer's and the lease's.
pub static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    Library::new(
        "chat",
        &[
            Body {
                name: "take_budget",
                body: crate::access::budgets::TAKE,
                flags: &["allow-oom"],
            },
            Body {
                name: "remove_dead_letter",
                body: crate::operations::dead_letters::REMOVE_BODY,
                flags: &["allow-oom"],
            },
        ],
    )
});

/// The libraries a service calls: its own, the consumer's and the lease's.
pub fn libraries() -> Vec<&'static Library> {
    let mut all = outbox_consumer::functions::libraries().to_vec();
    all.push(&LIBRARY);
    all
}
