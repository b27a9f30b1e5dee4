//! The services' integration tests, one module per topic in one binary (every test binary
//! links the whole stack again): real Postgres, Redis (single and cluster) and relays,
//! the services in-process or as real processes, a real browser for the page. Fixtures are
//! in [`support`].

#[macro_use]
mod support;

mod api;
mod attempts;
mod auth;
mod backlog;
mod browser;
mod cluster;
mod crash;
mod database_state;
mod dead_letters;
mod delivery;
mod deploys;
mod feed_positions;
mod fence;
mod frozen;
mod limits;
mod member_reads;
mod migrations;
mod plans;
mod public_tls;
mod retention;
mod revocation;
mod send_outcome;
mod shards;
mod shown;
mod slow_database;
mod stages;
mod strangers;
mod trace_context;
mod user_limits;
mod valkey;
