//! Real, throwaway Postgres 15 and Redis 7 servers for tests and the lab, and control of
//! the processes they run (stop, SIGKILL, restart on the same data directory).
//!
//! Promises:
//! - no fixed TCP ports: servers listen on Unix sockets inside their own scratch directory
//!   (TLS servers add a kernel-chosen loopback port; a Redis Cluster, whose nodes must
//!   reach each other over TCP, uses kernel-chosen loopback ports);
//! - nothing outlives the test process: children get a parent-death SIGKILL, are killed at
//!   exit, and scratch directories of dead test processes are pruned on the next start;
//! - tests wait on conditions with deadlines ([`wait_until`]), never on fixed sleeps.
//!
//! A test binary shares one server of each kind ([`shared_postgres`], [`shared_redis`]) and
//! gives each test its own database ([`PgServer::create_database`]) and stream names
//! ([`unique_name`]); a test that stops or kills a server starts its own.

pub mod balancer;
pub mod http;
pub mod otlp;
mod pids;
mod postgres;
mod process;
pub mod proxy;
mod redis_cluster;
mod redis_server;
mod scratch;
pub mod tls;
mod wait;

pub use postgres::{pg_bin_dir_of, shared_postgres, PgOptions, PgServer, TestDb, NEWER_VERSIONS};
pub use process::{ChildProcess, Signal};
pub use redis_cluster::RedisCluster;
pub use redis_server::{
    run_on_valkey, server_program, shared_redis, valkey_server, RedisOptions, RedisServer,
    REDIS_SERVER_ENV,
};
pub use scratch::{scratch_dir, unique_name};
pub use wait::{wait_until, wait_until_blocking};
