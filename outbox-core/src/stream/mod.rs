//! The stream contract: what the relay writes and every consumer reads, in any language.
//!
//! **Streams.** A service's relay writes the Redis stream `outbox:<service>`, or, split into
//! N shards, the streams `outbox:<service>:{0}` .. `outbox:<service>:{N-1}`. A row's shard
//! is FNV-1a 64 of its `partition_key` (the chat id as UTF-8 text for chat messages) modulo
//! N ([`shard_of`]); every message of one chat is in one shard, in commit order.
//!
//! **Entries.** Each outbox row is one entry with the explicit id `<commit LSN>-<k>` (the
//! transaction's commit LSN as a decimal u64, plus the stream's id offset after a rebuild;
//! k the row's position in its transaction): ids grow in commit order, and a replay of the
//! same transaction carries the same ids, so Redis refuses it. Fields ([`entry`]):
//!
//! | field | value |
//! | --- | --- |
//! | `event` | the event type, e.g. `message.created` |
//! | `payload` | the event's JSON document (Postgres's jsonb text: parse it) |
//! | `outbox_id` | the outbox row's id, decimal (not the order: the stream id is) |
//! | `created_at` | when the row was written, RFC 3339 UTC with microseconds |
//!
//! Delivery is at least once: after a rebuild (Redis lost data, a lost slot, a failover)
//! rows may come again under new ids above the old top, so consumers deduplicate by what
//! the payload identifies (chat messages: their `id`). Consume with a consumer group per
//! receiving service, acknowledge (`XACK`) only after recording; the relay trims only what
//! every group acknowledged.
//!
//! **Other keys** (records, leases, dead letters): [`keys`] and [`record`].

pub mod entry;
pub mod keys;
pub mod record;
mod shard;

pub use entry::{EntryFields, EntryId, MissingField};
pub use shard::{
    check_recorded, recorded_count, shard_key, shard_keys, shard_of, shard_of_key, validate_layout,
    MAX_SHARDS,
};
