//! The relay's integration tests, one module per topic in one binary (every test binary
//! links the whole stack again): real Postgres and Redis servers that testkit starts,
//! faults as real signals to real processes. Fixtures are in [`support`].

#[macro_use]
mod support;

mod cluster;
mod faults;
mod ha;
mod healthcheck;
mod lasting;
mod mapping;
mod messages;
mod misconfiguration;
mod monitoring;
mod operations;
mod recovery;
mod security;
mod shards;
mod stream;
mod valkey;
