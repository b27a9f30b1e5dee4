//! Who may do what: identities (`auth`: bearer tokens verified against the provider's key
//! set, the session cookie; `token`: tokens as a provider issues them, for the local stack
//! and tests), what one user may take of an instance (`quota`), and open event streams held
//! to their chat's membership (`streams`).

pub(crate) mod auth;
pub(crate) mod quota;
pub(crate) mod streams;
pub mod token;
