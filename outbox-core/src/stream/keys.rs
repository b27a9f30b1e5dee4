//! Every Redis key and channel name of the system, in one place. `base` names are what the
//! operator configures (`--stream`, `--dead-letter-stream`); per-shard keys derive from them
//! with [`shard_key`](super::shard_key), so all keys of one shard share the `{k}` hash tag
//! and live on one Redis Cluster node.
//!
//! | key | type | written by | what |
//! | --- | --- | --- | --- |
//! | `outbox:<service>` (shard k: `outbox:<service>:{k}`) | stream | the service's relay | the outbox events |
//! | `<stream>:origin` | hash | relay `setup` and rebuilds | the stream's record (see `record`) |
//! | `<stream>:rebuilding` | string | a rebuilding relay | the rebuild lock (a lease) |
//! | `inbox-lease:<consumer group>` (+ shard) | string | the consuming service | one active consumer per shard (a lease) |
//! | `inbox-attempts:<consumer group>` (+ shard) | hash | the consuming service | which run is processing which entry |
//! | `inbox-members:<consumer group>` | sorted set | the consuming service | live instances sharing the shards |
//! | `deadletter:<consumer group>` (+ shard) | stream | the consuming service | entries it could not record, with the reason |
//! | `<dead-letter stream>:audit` | stream | `chat-service dead-letters` | who replayed or dropped what |
//! | `budget:<consumer group>:<kind>:<user>` | string | the service | one user's budget of sends, reads, stream opens or sign-ins (a token bucket as one timestamp, expiring when full) |
//! | `feed:<consumer group>` | pub/sub channel | the service | live hints between its instances |
//! | `inbox:<consumer group>` | pub/sub channel | the service | hints of versions before feed positions (rolling deploys only) |

/// The outbox stream a service's relay writes (the base of its shard keys).
pub fn outbox_stream(service: &str) -> String {
    format!("outbox:{service}")
}

/// The stream's record (a hash), beside the stream or shard it describes.
pub fn origin_key(stream: &str) -> String {
    format!("{stream}:origin")
}

/// The lock a relay holds while it rebuilds the stream (other relays stand by).
pub fn rebuild_lock_key(stream: &str) -> String {
    format!("{stream}:rebuilding")
}

/// The base of the consumer lease keys of `group` (one key per shard).
pub fn inbox_lease_base(group: &str) -> String {
    format!("inbox-lease:{group}")
}

/// The base of the attempt-record keys of `group` (one hash per shard).
pub fn inbox_attempts_base(group: &str) -> String {
    format!("inbox-attempts:{group}")
}

/// The sorted set of `group`'s live instances.
pub fn inbox_members_key(group: &str) -> String {
    format!("inbox-members:{group}")
}

/// The default base of `group`'s dead-letter streams (one per shard).
pub fn dead_letter_base(group: &str) -> String {
    format!("deadletter:{group}")
}

/// The audit log beside a dead-letter stream.
pub fn dead_letter_audit_key(dead_letter_stream: &str) -> String {
    format!("{dead_letter_stream}:audit")
}

/// One user's budget of `kind` (`send`, `history`, `stream_open`, `sign_in`) on the side
/// whose consumer group is `group`: shared by its instances.
pub fn budget_key(group: &str, kind: &str, user: &str) -> String {
    format!("budget:{group}:{kind}:{user}")
}

/// The pub/sub channel of `group`'s live hints.
pub fn feed_channel(group: &str) -> String {
    format!("feed:{group}")
}

/// The pub/sub channel of `group`'s hints as versions before feed positions sent them
/// (side-wide inbox positions): read and written only to tell those versions "re-read"
/// during a rolling deploy.
pub fn legacy_hint_channel(group: &str) -> String {
    format!("inbox:{group}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::shard_key;

    #[test]
    fn names_are_what_deployments_have_today() {
        assert_eq!(outbox_stream("consumers"), "outbox:consumers");
        assert_eq!(
            origin_key(&shard_key("outbox:consumers", 3, 8)),
            "outbox:consumers:{3}:origin"
        );
        assert_eq!(
            rebuild_lock_key("outbox:consumers"),
            "outbox:consumers:rebuilding"
        );
        assert_eq!(
            shard_key(&inbox_lease_base("workers"), 2, 4),
            "inbox-lease:workers:{2}"
        );
        assert_eq!(inbox_attempts_base("workers"), "inbox-attempts:workers");
        assert_eq!(inbox_members_key("workers"), "inbox-members:workers");
        assert_eq!(dead_letter_base("workers"), "deadletter:workers");
        assert_eq!(
            dead_letter_audit_key("deadletter:workers"),
            "deadletter:workers:audit"
        );
        assert_eq!(feed_channel("workers"), "feed:workers");
        assert_eq!(legacy_hint_channel("workers"), "inbox:workers");
    }
}
