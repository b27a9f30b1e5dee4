//! Connecting: Postgres URLs with libpq's `sslmode` (SQL connections and pools), Redis URLs
//! for one server or a cluster, TLS verified against a CA file or the well-known roots,
//! and passwords from files. Nothing here ever prints a password.

mod pg;
mod redis;
mod secrets;
mod tls;

pub use self::redis::{
    client as redis_client, target as redis_target, RedisConn, RedisTarget, SharedCluster,
};
pub use pg::{read_secret_file, PgEndpoint};
pub use secrets::{DatabaseSecrets, RedisSecrets};
pub use tls::{client_config, root_store, SslMode};
