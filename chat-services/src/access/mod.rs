//! Who may do what: identities (`auth`: bearer tokens verified against the provider's key
//! set, the session cookie; `token`: tokens as a provider issues them, for the local stack
//! and tests), what one user may take (`budgets`, shared by the side's instances; `quota`,
//! on one instance), who is a member of which chat (`members`, a short-lived cache), and
//! open event streams held to their chat's membership (`streams`).

pub(crate) mod auth;
pub(crate) mod budgets;
pub(crate) mod members;
pub(crate) mod quota;
pub(crate) mod streams;
pub mod token;
