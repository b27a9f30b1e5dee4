//! Shared fixtures of the relay's integration tests: a database with the migrations, a slot
//! and a stream per test, a witness slot that reads the same changes independently, the
//! relay in-process or as a real process, and readers for the stream and the slot.
//!
//! One file per concern: fixture, relays, entries, writes.

mod entries;
mod fixture;
mod relays;
mod writes;

pub(crate) use entries::*;
pub(crate) use fixture::*;
pub(crate) use relays::*;
pub(crate) use writes::*;

/// Test functions running `body` on Postgres 16, 17 and 18 (the version matrix's focused
/// subset; the default server, 15, runs every test). `server:` bodies take a fresh
/// `&PgServer` of the version; `options:` bodies take `PgOptions` naming it, for servers
/// with settings of their own.
#[macro_export]
macro_rules! on_newer_versions {
    (server: $body:ident, $($name:ident => $version:expr),+ $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let pg = testkit::PgServer::start_with(testkit::PgOptions::default().version($version))
                .unwrap();
            $body(&pg).await;
        }
    )+};
    (options: $body:ident, $($name:ident => $version:expr),+ $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            $body(testkit::PgOptions::default().version($version)).await;
        }
    )+};
}
