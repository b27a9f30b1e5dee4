//! One stream entry: its id and its fields, encoded by the relay and decoded by every
//! consumer, and the dead-letter entries a consumer writes for entries it cannot record.

use std::fmt;

/// The contract's fields, in the order the relay writes them. [`EVENT`], [`PAYLOAD`],
/// [`OUTBOX_ID`] and [`PUBLISHED_AT`] are in every entry (entries written by relays before
/// `published_at` lack it); [`CREATED_AT`] when the outbox mapping has a timestamp column,
/// [`TRACEPARENT`] and [`KEY`] when the row has them. The mapping's extra fields come
/// before `published_at`, which is last.
pub const FIELDS: [&str; 7] = [
    EVENT,
    PAYLOAD,
    OUTBOX_ID,
    CREATED_AT,
    TRACEPARENT,
    KEY,
    PUBLISHED_AT,
];
/// The event type (`outbox.event`), e.g. `message.created`.
pub const EVENT: &str = "event";
/// The event's payload exactly as the outbox stored it: the chat's JSON document (jsonb as
/// Postgres prints it: keys reordered, so parse it, never compare it as text), a bytea
/// column's bytes; empty when the column was NULL.
pub const PAYLOAD: &str = "payload";
/// The outbox row's id as Postgres prints it (the chat's decimal, Debezium's uuid). Not
/// the order: the stream id is.
pub const OUTBOX_ID: &str = "outbox_id";
/// When the outbox row was written, RFC 3339 in UTC (`2026-11-29T21:12:00.123456Z`);
/// absent when the outbox mapping has no timestamp column.
pub const CREATED_AT: &str = "created_at";
/// When Redis stored the entry (its clock, in the publishing call), Unix microseconds in
/// decimal. A rebuild's republished entries carry the rebuild's time.
pub const PUBLISHED_AT: &str = "published_at";
/// W3C trace context (`00-<trace id>-<span id>-<flags>`) of the relay's publish span, or
/// the outbox row's own when the relay exports no spans; absent when the row had none.
pub const TRACEPARENT: &str = "traceparent";
/// The row's key (the mapping's key column: `partition_key` in the chat, `aggregateid` in
/// Debezium's layout): what picked the entry's shard, so the unit whose order is kept.
/// Absent when the row had none (NULL, or a table without the column).
pub const KEY: &str = "key";

/// A stream entry id `<final_lsn>-<k>`: the transaction's commit LSN (plus the stream's id
/// offset after a rebuild) and the insert's position inside it. Ids grow strictly in commit
/// order and are the same when Postgres re-sends a transaction, which makes publishing
/// idempotent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EntryId {
    pub commit_lsn: u64,
    pub seq: u64,
}

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.commit_lsn, self.seq)
    }
}

/// Text that is not `<u64>-<u64>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not a stream id")]
pub struct BadEntryId(pub String);

impl std::str::FromStr for EntryId {
    type Err = BadEntryId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadEntryId(s.to_string());
        let (lsn, seq) = s.split_once('-').ok_or_else(bad)?;
        Ok(Self {
            commit_lsn: lsn.parse().map_err(|_| bad())?,
            seq: seq.parse().map_err(|_| bad())?,
        })
    }
}

/// A field an entry must have is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("entry has no '{0}' field")]
pub struct MissingField(pub &'static str);

/// An entry's fields as a consumer reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryFields<'a> {
    pub event: &'a str,
    pub payload: &'a str,
    pub outbox_id: Option<&'a str>,
    pub created_at: Option<&'a str>,
    pub published_at: Option<&'a str>,
    pub traceparent: Option<&'a str>,
}

impl<'a> EntryFields<'a> {
    /// Decode from a field lookup (`event` and `payload` are required).
    pub fn decode(field: impl Fn(&str) -> Option<&'a str>) -> Result<Self, MissingField> {
        Ok(Self {
            event: field(EVENT).ok_or(MissingField(EVENT))?,
            payload: field(PAYLOAD).ok_or(MissingField(PAYLOAD))?,
            outbox_id: field(OUTBOX_ID),
            created_at: field(CREATED_AT),
            published_at: field(PUBLISHED_AT),
            traceparent: field(TRACEPARENT),
        })
    }

    /// When Redis stored the entry, if it says (and says it readably).
    pub fn published_at(&self) -> Option<std::time::SystemTime> {
        let micros: u64 = self.published_at?.parse().ok()?;
        std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_micros(micros))
    }
}

/// The fields of a dead-letter entry (in `deadletter:<service>`, see `keys`): where the
/// entry came from, why it could not be recorded, and the entry's own fields prefixed with
/// [`dead_letter::ENTRY_PREFIX`].
pub mod dead_letter {
    /// The stream (shard) the entry was read from.
    pub const STREAM: &str = "stream";
    /// The entry's id in that stream.
    pub const ID: &str = "id";
    /// Why it was dead-lettered.
    pub const REASON: &str = "reason";
    /// How often the consumer group had delivered it.
    pub const DELIVERIES: &str = "deliveries";
    /// Prefix of the original entry's fields (`entry.event`, `entry.payload`, ...).
    pub const ENTRY_PREFIX: &str = "entry.";
    /// Every field a dead letter has besides the entry's own.
    pub const ALL: [&str; 4] = [STREAM, ID, REASON, DELIVERIES];

    /// The dead-letter field that carries the original entry's `field`.
    pub fn entry_field(field: &str) -> String {
        format!("{ENTRY_PREFIX}{field}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn ids_order_by_commit_then_position_and_round_trip() {
        let a = EntryId {
            commit_lsn: 9,
            seq: 10,
        };
        let b = EntryId {
            commit_lsn: 10,
            seq: 0,
        };
        assert!(a < b);
        assert_eq!(a.to_string(), "9-10");
        assert_eq!("9-10".parse::<EntryId>(), Ok(a));
        assert_eq!(
            "9".parse::<EntryId>().unwrap_err().to_string(),
            "'9' is not a stream id"
        );
    }

    #[test]
    fn fields_decode_and_say_what_is_missing() {
        let map: HashMap<String, String> = [("event", "e"), ("payload", "{}"), ("created_at", "t")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let fields = EntryFields::decode(|k| map.get(k).map(String::as_str)).unwrap();
        assert_eq!((fields.event, fields.payload), ("e", "{}"));
        assert_eq!((fields.outbox_id, fields.created_at), (None, Some("t")));
        assert_eq!((fields.published_at(), fields.traceparent), (None, None));
        let published = EntryFields {
            published_at: Some("1764620000123456"),
            ..fields
        };
        assert_eq!(
            published.published_at(),
            Some(std::time::UNIX_EPOCH + std::time::Duration::from_micros(1_764_620_000_123_456))
        );
        let none = EntryFields::decode(|_| None).unwrap_err();
        assert_eq!(none, MissingField("event"));
        assert_eq!(dead_letter::entry_field(PAYLOAD), "entry.payload");
    }
}
