//! The stream contract: what the relay writes and every consumer reads, in any language.
//!
//! **Streams.** A service's relay writes the Redis stream `outbox:<service>`, or, split into
//! N shards, the streams `outbox:<service>:{0}` .. `outbox:<service>:{N-1}`. A row's shard
//! is FNV-1a 64 of its key (the outbox mapping's key column as UTF-8 text: the chat id for
//! chat messages, `aggregateid` in Debezium's layout) modulo N ([`shard_of`]); every entry of
//! one key is in one shard, in commit order.
//!
//! **Entries.** Each outbox row is one entry with the explicit id `<commit LSN>-<k>` (the
//! transaction's commit LSN as a decimal u64, plus the stream's id offset after a rebuild;
//! k the row's position in its transaction): ids grow in commit order, and a replay of the
//! same transaction carries the same ids, so Redis refuses it. Fields ([`entry`]):
//!
//! | field | value |
//! | --- | --- |
//! | `event` | the event type, e.g. `message.created` |
//! | `payload` | the payload as stored (jsonb as Postgres prints it: parse it; bytea as its bytes; empty for NULL) |
//! | `outbox_id` | the outbox row's id as Postgres prints it (not the order: the stream id is) |
//! | `created_at` | when the row was written, RFC 3339 UTC with microseconds (only with a timestamp column) |
//! | `traceparent` | W3C trace context of the relay's publish span (only when the row had one) |
//! | `key` | the row's key, which picked its shard (only when the row had one) |
//! | `published_at` | when Redis stored the entry, Unix microseconds (absent from relays before it) |
//!
//! The outbox mapping's extra columns come as fields of their own before `published_at`.
//!
//! Delivery is at least once: after a rebuild (Redis lost data, a lost slot, a failover)
//! rows may come again under new ids above the old top, so consumers deduplicate by what
//! the payload identifies (chat messages: their `id`). Consume with a consumer group per
//! receiving service, acknowledge (`XACK`) only after recording; the relay trims only what
//! every group acknowledged.
//!
//! **Other keys** (records, leases, dead letters): [`keys`] and [`record`].

//!
//! Every field and key is named once, here; the tables above and in docs/deployment.md ("The
//! stream contract") are held to these constants by this module's tests.

pub mod entry;
pub mod keys;
pub mod record;
mod shard;

pub use entry::{EntryFields, EntryId, MissingField};
pub use shard::{
    check_recorded, recorded_count, shard_key, shard_keys, shard_of, shard_of_key, validate_layout,
    MAX_SHARDS,
};

#[cfg(test)]
mod tests {
    //! The written contract (this module's docs, `keys`' table, docs/deployment.md) names
    //! every field and key the code defines, in the code's order where order matters.

    use super::{entry, keys, record};

    const MODULE_DOCS: &str = include_str!("mod.rs");
    const KEYS_DOCS: &str = include_str!("keys.rs");
    const DEPLOYMENT: &str = include_str!("../../../docs/deployment.md");

    /// The part of docs/deployment.md under "The stream contract".
    fn deployment_contract() -> &'static str {
        let start = DEPLOYMENT
            .find("## The stream contract")
            .expect("docs/deployment.md has a section 'The stream contract'");
        let rest = &DEPLOYMENT[start + 3..];
        &rest[..rest.find("\n## ").unwrap_or(rest.len())]
    }

    /// Every entry field, in the order the relay writes them.
    fn entry_fields() -> Vec<&'static str> {
        entry::FIELDS.to_vec()
    }

    /// Where each name's table row starts in `text` (`| `name` |`), in order of `names`.
    fn rows_in_order(text: &str, names: &[&str], what: &str) {
        let mut last = 0;
        for name in names {
            let row = format!("| `{name}` |");
            let at = text
                .find(&row)
                .unwrap_or_else(|| panic!("{what}: no table row for `{name}`"));
            assert!(at >= last, "{what}: `{name}` is out of the code's order");
            last = at;
        }
    }

    #[test]
    fn entry_field_tables_list_every_field_in_order() {
        rows_in_order(MODULE_DOCS, &entry_fields(), "outbox_core::stream docs");
        rows_in_order(deployment_contract(), &entry_fields(), "docs/deployment.md");
    }

    #[test]
    fn the_record_and_dead_letter_fields_are_all_documented() {
        let docs = deployment_contract();
        for field in record::fields::ALL
            .iter()
            .chain(entry::dead_letter::ALL.iter())
        {
            assert!(
                docs.contains(&format!("`{field}`")),
                "docs/deployment.md's stream contract does not name `{field}`"
            );
        }
        assert!(docs.contains(&format!("`{}`", entry::dead_letter::entry_field("<field>"))));
    }

    /// Every key and channel name, as a table writes it: `service` names the outbox,
    /// `group` the consumer group, `dead_letters` a dead-letter stream.
    fn key_names(service: &str, group: &str, dead_letters: &str) -> [String; 10] {
        [
            keys::outbox_stream(service),
            keys::origin_key("<stream>"),
            keys::rebuild_lock_key("<stream>"),
            keys::inbox_lease_base(group),
            keys::inbox_attempts_base(group),
            keys::inbox_members_key(group),
            keys::dead_letter_base(group),
            keys::dead_letter_audit_key(dead_letters),
            keys::feed_channel(group),
            keys::legacy_hint_channel(group),
        ]
    }

    #[test]
    fn every_key_is_in_both_key_tables() {
        for key in key_names("<service>", "<consumer group>", "<dead-letter stream>") {
            assert!(
                KEYS_DOCS.contains(&format!("| `{key}`")),
                "keys' table has no row for `{key}`"
            );
        }
        let docs = deployment_contract();
        for key in key_names("<side>", "<side>", &keys::dead_letter_base("<side>")) {
            assert!(
                docs.contains(&format!("`{key}`")),
                "docs/deployment.md's stream contract does not name `{key}`"
            );
        }
    }
}
