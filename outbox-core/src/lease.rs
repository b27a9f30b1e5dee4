//! A lease in Redis, the one implementation shared by the relay's rebuild lock and the chat
//! services' inbox consumer (one active consumer per receiving side).
//!
//! A Redis key holds `<owner>/<nonce>` with a TTL that the holder extends. A process
//! restarted under the same stable owner name takes its own lease over at once instead of
//! waiting for the TTL (two live processes must never share an owner name).

use std::time::Duration;

use redis::aio::ConnectionLike;

use crate::functions::{Body, Function, Library};

const ACQUIRE: &str = r#"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if (not v) or string.sub(v, 1, #ARGV[2] + 1) == ARGV[2] .. '/' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"#;

const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// The lease's functions, shared by every component that holds a lease.
pub static LIBRARY: std::sync::LazyLock<Library> = std::sync::LazyLock::new(|| {
    Library::new(
        "outbox_lease",
        &[
            // Holding a lease must outlast an out-of-memory Redis: its holder is what reads
            // and acknowledges, so what frees memory (a key of a few bytes, not a stream).
            Body {
                name: "acquire",
                body: ACQUIRE,
                flags: &["allow-oom"],
            },
            Body {
                name: "release",
                body: RELEASE,
                flags: &["allow-oom"],
            },
        ],
    )
});
static ACQUIRE_FN: std::sync::LazyLock<Function> =
    std::sync::LazyLock::new(|| LIBRARY.function("acquire"));
static RELEASE_FN: std::sync::LazyLock<Function> =
    std::sync::LazyLock::new(|| LIBRARY.function("release"));

pub struct Lease {
    key: String,
    consumer: String,
    holder: String,
    ttl: Duration,
}

impl Lease {
    pub fn new(key: String, consumer: &str, ttl: Duration) -> Self {
        Self {
            key,
            consumer: consumer.to_string(),
            holder: format!("{consumer}/{:012x}", rand::random::<u64>() >> 16),
            ttl,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Take or extend the lease; `false` while another instance holds it.
    pub async fn acquire<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> redis::RedisResult<bool> {
        let got: i64 = ACQUIRE_FN
            .key(&self.key)
            .arg(&self.holder)
            .arg(&self.consumer)
            .arg(self.ttl.as_millis() as u64)
            .invoke_async(conn)
            .await?;
        Ok(got == 1)
    }

    /// Give the lease up (on shutdown), if still ours.
    pub async fn release<C: ConnectionLike + Send>(&self, conn: &mut C) -> redis::RedisResult<()> {
        let _: i64 = RELEASE_FN
            .key(&self.key)
            .arg(&self.holder)
            .invoke_async(conn)
            .await?;
        Ok(())
    }
}
