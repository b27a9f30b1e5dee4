//! What a consumer is told: where the stream is, how it is split, who consumes it; and the
//! keys of one shard, every one derived from those names through `outbox_core::stream`.
//!
//! Invariant: a configuration that cannot work is refused by [`ConsumerConfig::validate`]
//! before anything connects, saying what to change.

use std::time::Duration;

use outbox_core::connect::RedisTarget;
use outbox_core::stream::{keys, shard_key, validate_layout};
use outbox_core::ConfigError;

/// Everything the receiving protocol needs to know.
#[derive(Clone)]
pub struct ConsumerConfig {
    /// The Redis (or Redis Cluster) holding the stream.
    pub redis: RedisTarget,
    /// The stream's base name (`outbox:<service>`): with `shards` > 1 the consumer reads
    /// `<stream>:{0}` .. `<stream>:{N-1}`.
    pub stream: String,
    /// The shard count the relay writes (the stream's records must agree, when checked).
    pub shards: u32,
    /// The consumer group: the receiving service's name. Lease, attempt-record and member
    /// keys derive from it (`outbox_core::stream::keys`).
    pub group: String,
    /// This instance's consumer name, stable across its restarts and unique among live
    /// instances (its pending entries are its own: a restart finishes them first).
    pub consumer: String,
    /// The dead-letter stream's base name (`deadletter:<group>` by default), split like the
    /// stream.
    pub dead_letter_stream: String,
    /// Dead letters kept at most per shard (the oldest are trimmed beyond it, and counted).
    pub dead_letter_max_len: u64,
    /// Pending entries idle this long are claimed (from a consumer that died).
    pub claim_idle: Duration,
    /// Times an entry's processing may end with its consumer process (a crash) before it
    /// is dead-lettered; restarts and handovers never count. An entry whose processing
    /// ended a process while it was processed alone (after one crash, suspects are) is
    /// dead-lettered at once: it is what ended it.
    pub max_deliveries: u64,
    /// The shard lease's TTL: how soon a dead holder's shards are taken over.
    pub lease_ttl: Duration,
    /// Whether the relay's records describe this stream (its `shards` is checked against
    /// them on every session); false for a stream some other writer fills.
    pub check_layout: bool,
    /// Shard 0 also counts the unsharded dead-letter stream in its gauge (dead letters
    /// from before the stream was split; not on a Redis Cluster, where it has no node of
    /// shard 0's).
    pub count_unsharded_dead_letters: bool,
}

impl std::fmt::Debug for ConsumerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerConfig")
            .field("cluster", &self.redis.is_cluster())
            .field("stream", &self.stream)
            .field("shards", &self.shards)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .finish_non_exhaustive()
    }
}

impl ConsumerConfig {
    /// A configuration with defaults: dead letters in `deadletter:<group>` (10,000 kept),
    /// claims after 30 s idle, 5 deliveries, a 10 s lease, the layout checked.
    pub fn new(
        redis: RedisTarget,
        stream: impl Into<String>,
        shards: u32,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> Self {
        let group = group.into();
        Self {
            redis,
            stream: stream.into(),
            shards,
            dead_letter_stream: keys::dead_letter_base(&group),
            group,
            consumer: consumer.into(),
            dead_letter_max_len: 10_000,
            claim_idle: Duration::from_secs(30),
            max_deliveries: 5,
            lease_ttl: Duration::from_secs(10),
            check_layout: true,
            count_unsharded_dead_letters: false,
        }
    }

    /// Refuse what cannot work, saying what to change.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_layout(
            "--stream-shards",
            self.shards,
            self.redis.is_cluster(),
            &[
                ("the stream", &self.stream),
                ("the dead-letter stream", &self.dead_letter_stream),
            ],
        )?;
        let invalid = |what: String| Err(ConfigError(what));
        if self.group.is_empty() || self.consumer.is_empty() {
            return invalid("the consumer group and the consumer name must not be empty".into());
        }
        if self.max_deliveries == 0 {
            return invalid("max deliveries must be at least 1".into());
        }
        if self.dead_letter_max_len == 0 {
            return invalid("the dead-letter stream must keep at least one entry".into());
        }
        if self.lease_ttl < Duration::from_millis(300) {
            return invalid(format!(
                "a lease TTL of {:?} is too short to renew in time: use at least 300ms",
                self.lease_ttl
            ));
        }
        Ok(())
    }

    /// The keys of `shard`.
    pub(crate) fn shard(&self, shard: u32) -> ShardKeys {
        let key = |base: &str| shard_key(base, shard, self.shards);
        ShardKeys {
            shard,
            stream: key(&self.stream),
            lease: key(&keys::inbox_lease_base(&self.group)),
            attempts: key(&keys::inbox_attempts_base(&self.group)),
            dead_letters: key(&self.dead_letter_stream),
            unsharded_dead_letters: (self.count_unsharded_dead_letters
                && self.shards > 1
                && shard == 0
                && !self.redis.is_cluster())
            .then(|| self.dead_letter_stream.clone()),
        }
    }
}

/// One shard's keys.
#[derive(Debug, Clone)]
pub(crate) struct ShardKeys {
    pub(crate) shard: u32,
    pub(crate) stream: String,
    /// One active consumer per shard (a lease).
    pub(crate) lease: String,
    /// Which run is processing which entry (see `shard::group`).
    pub(crate) attempts: String,
    pub(crate) dead_letters: String,
    /// Also counted in the dead-letter gauge (see
    /// [`ConsumerConfig::count_unsharded_dead_letters`]).
    pub(crate) unsharded_dead_letters: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(shards: u32) -> ConsumerConfig {
        let redis = RedisTarget::Single(redis::Client::open("redis://127.0.0.1/").unwrap());
        ConsumerConfig::new(redis, "outbox:orders", shards, "billing", "billing-1")
    }

    #[test]
    fn every_key_of_a_shard_derives_from_the_names() {
        let keys = config(4).shard(2);
        assert_eq!(keys.stream, "outbox:orders:{2}");
        assert_eq!(keys.lease, "inbox-lease:billing:{2}");
        assert_eq!(keys.attempts, "inbox-attempts:billing:{2}");
        assert_eq!(keys.dead_letters, "deadletter:billing:{2}");
        assert_eq!(keys.unsharded_dead_letters, None);
        let one = config(1).shard(0);
        assert_eq!(
            (one.stream.as_str(), one.lease.as_str()),
            ("outbox:orders", "inbox-lease:billing")
        );
        let mut legacy = config(4);
        legacy.count_unsharded_dead_letters = true;
        assert_eq!(
            legacy.shard(0).unsharded_dead_letters.as_deref(),
            Some("deadletter:billing")
        );
        assert_eq!(legacy.shard(1).unsharded_dead_letters, None);
    }

    #[test]
    fn what_cannot_work_is_refused_saying_what_to_change() {
        assert!(config(4).validate().is_ok());
        let mut c = config(4);
        c.max_deliveries = 0;
        assert!(c.validate().unwrap_err().to_string().contains("at least 1"));
        let mut c = config(4);
        c.lease_ttl = Duration::from_millis(10);
        assert!(c.validate().unwrap_err().to_string().contains("300ms"));
        assert!(config(0).validate().is_err());
    }
}
