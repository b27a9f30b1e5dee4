//! The outbox table as the relay sees it: which relation it is, where the mapping's columns
//! are (see `mapping`), and how one inserted row becomes one stream entry's fields.
//!
//! Columns are looked up by name in each Relation message (they are re-sent every session
//! and after DDL), so adding columns to the outbox or reordering them needs no relay change.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::mapping::{Ident, OutboxMapping};
use super::pgoutput::{Insert, Relation, Value};

/// `schema.table` of the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxTable {
    pub schema: String,
    pub table: String,
}

impl std::str::FromStr for OutboxTable {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let valid = |part: &str| {
            !part.is_empty()
                && part.len() <= 63
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                && !part.starts_with(|c: char| c.is_ascii_digit())
        };
        match s.split_once('.') {
            Some((schema, table)) if valid(schema) && valid(table) => Ok(Self {
                schema: schema.into(),
                table: table.into(),
            }),
            _ => Err(format!(
                "'{s}' is not schema.table (lowercase identifiers, e.g. consumers.outbox)"
            )),
        }
    }
}

impl std::fmt::Display for OutboxTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.table)
    }
}

/// One outbox row, as the stream entry's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    pub outbox_id: Bytes,
    pub event: Bytes,
    /// The payload exactly as stored (jsonb as Postgres printed it, bytea as its bytes).
    pub payload: Bytes,
    /// RFC 3339 in UTC (`2026-11-29T21:12:00.123456Z`); `None` when the mapping has no
    /// timestamp column.
    pub created_at: Option<Bytes>,
    /// The key: what decides the row's shard and is published as `key` (the chat id for
    /// chat messages); `None` when the column is NULL or the table has none.
    pub key: Option<Bytes>,
    /// The W3C trace context the entry carries (`traceparent`): the row's, valid, until the
    /// relay's own publish span replaces it. `None`: NULL, invalid, or no such column.
    pub traceparent: Option<Bytes>,
    /// The mapping's extra columns that were not NULL, as (field, value).
    pub extra: Vec<(Bytes, Bytes)>,
    /// The route column's value (or a message's prefix): which stream of a routed relay
    /// the entry goes to. Not a field of the entry.
    pub route: Option<Bytes>,
}

impl OutboxEvent {
    /// The entry's fields as name/value pairs, in the order the stream contract gives
    /// (`outbox_core::stream::entry::FIELDS`, then `traceparent`, `key` and the extra
    /// fields); the publishing function adds `published_at` after `created_at`'s place.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        use outbox_core::stream::entry;
        [
            Some((entry::EVENT.as_bytes(), &self.event[..])),
            Some((entry::PAYLOAD.as_bytes(), &self.payload[..])),
            Some((entry::OUTBOX_ID.as_bytes(), &self.outbox_id[..])),
            self.created_at
                .as_deref()
                .map(|v| (entry::CREATED_AT.as_bytes(), v)),
            self.traceparent
                .as_deref()
                .map(|v| (entry::TRACEPARENT.as_bytes(), v)),
            self.key.as_deref().map(|v| (entry::KEY.as_bytes(), v)),
        ]
        .into_iter()
        .flatten()
        .chain(self.extra.iter().map(|(k, v)| (&k[..], &v[..])))
    }

    /// Bytes this event adds to a stream entry (fields and names), for batch sizing.
    pub fn encoded_len(&self) -> usize {
        const FIELD_NAMES_AND_FRAMING: usize = 64;
        self.outbox_id.len()
            + self.event.len()
            + self.payload.len()
            + self.created_at.as_ref().map_or(0, Bytes::len)
            + self.traceparent.as_ref().map_or(0, Bytes::len)
            + self.key.as_ref().map_or(0, Bytes::len)
            + self
                .extra
                .iter()
                .map(|(k, v)| k.len() + v.len() + 8)
                .sum::<usize>()
            + FIELD_NAMES_AND_FRAMING
    }
}

/// A row of the outbox that cannot become a stream entry: the table's definition or the
/// session's settings are not what the relay requires.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutboxError {
    #[error("outbox table {table} has no column '{column}' (the mapping's {role}; see --outbox-preset and the --outbox-*-column flags)")]
    MissingColumn {
        table: String,
        column: String,
        role: &'static str,
    },
    #[error("outbox insert has {got} columns but relation {table} has {expected}")]
    ColumnCount {
        table: String,
        expected: usize,
        got: usize,
    },
    #[error("outbox insert: column '{column}' is {what}; it must be a non-null text value")]
    BadValue { column: String, what: &'static str },
    #[error("insert for relation id {relation_id}, which no Relation message described")]
    UnknownRelation { relation_id: u32 },
}

/// The type oid of bytea: a payload of this type is published as its bytes.
pub(crate) const BYTEA_OID: u32 = 17;

/// Where the mapping's columns are in the outbox relation.
#[derive(Debug, Clone)]
struct OutboxColumns {
    id: usize,
    event: usize,
    payload: usize,
    payload_bytea: bool,
    created_at: Option<usize>,
    key: Option<usize>,
    traceparent: Option<usize>,
    /// (position, field name) of each extra column.
    extra: Vec<(usize, Bytes)>,
    /// The route column, when routed.
    route: Option<usize>,
    count: usize,
}

#[derive(Debug, Clone)]
enum Known {
    Outbox(Arc<OutboxColumns>),
    /// Another table in the publication: its rows are not ours to publish.
    Other(String),
}

/// What an insert turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
// One per insert, matched at once: boxing the large variant would cost an allocation per row.
#[allow(clippy::large_enum_variant)]
pub enum Row {
    Outbox(OutboxEvent),
    /// An insert into another table of the publication, named.
    Foreign(String),
}

/// Relations seen in this replication session, by relation id.
#[derive(Debug)]
pub struct RelationCache {
    mapping: Arc<OutboxMapping>,
    /// A sharded stream needs every row's key column.
    require_key: bool,
    relations: HashMap<u32, Known>,
}

impl RelationCache {
    /// A cache for the chat's table layout (`OutboxMapping::chat`).
    pub fn new(outbox: OutboxTable) -> Self {
        Self::mapped(Arc::new(OutboxMapping::chat(outbox)), 1)
    }

    /// A cache for a stream of `shards` shards (more than one needs the key column).
    pub fn mapped(mapping: Arc<OutboxMapping>, shards: u32) -> Self {
        Self {
            mapping,
            require_key: shards > 1,
            relations: HashMap::new(),
        }
    }

    /// Remember (or replace) a relation's description.
    pub fn on_relation(&mut self, relation: &Relation) -> Result<(), OutboxError> {
        let m = &self.mapping;
        let known = if relation.namespace == m.table.schema && relation.name == m.table.table {
            let position = |column: &Ident| {
                relation
                    .columns
                    .iter()
                    .position(|c| c.name == column.as_str())
            };
            let find = |column: &Ident, role: &'static str| {
                position(column).ok_or_else(|| OutboxError::MissingColumn {
                    table: m.table.to_string(),
                    column: column.to_string(),
                    role,
                })
            };
            let key = if self.require_key {
                Some(find(&m.key, "key (a sharded stream needs it)")?)
            } else {
                position(&m.key)
            };
            let payload = find(&m.payload, "payload")?;
            let mut extra = Vec::with_capacity(m.extra.len());
            for field in &m.extra {
                extra.push((
                    find(&field.column, "extra field")?,
                    Bytes::from(field.field.clone()),
                ));
            }
            Known::Outbox(Arc::new(OutboxColumns {
                id: find(&m.id, "id")?,
                event: find(&m.event_type, "type")?,
                payload,
                payload_bytea: relation.columns[payload].type_oid == BYTEA_OID,
                created_at: match &m.timestamp {
                    Some(t) => Some(find(t, "timestamp")?),
                    None => None,
                },
                key,
                traceparent: m.traceparent.as_ref().and_then(position),
                route: match &m.route {
                    Some(r) => Some(find(r, "route")?),
                    None => None,
                },
                extra,
                count: relation.columns.len(),
            }))
        } else {
            Known::Other(format!("{}.{}", relation.namespace, relation.name))
        };
        self.relations.insert(relation.id, known);
        Ok(())
    }

    /// Turn an insert into the outbox event it carries.
    pub fn on_insert(&self, insert: Insert) -> Result<Row, OutboxError> {
        let columns = match self.relations.get(&insert.relation_id) {
            Some(Known::Outbox(columns)) => Arc::clone(columns),
            Some(Known::Other(name)) => return Ok(Row::Foreign(name.clone())),
            None => {
                return Err(OutboxError::UnknownRelation {
                    relation_id: insert.relation_id,
                })
            }
        };
        let m = &self.mapping;
        if insert.values.len() != columns.count {
            return Err(OutboxError::ColumnCount {
                table: m.table.to_string(),
                expected: columns.count,
                got: insert.values.len(),
            });
        }
        let mut values = insert.values;
        // Read, not taken: the route column may be published as an extra field too.
        let route = columns.route.and_then(|index| match &values[index] {
            Value::Text(bytes) => Some(bytes.clone()),
            _ => None,
        });
        let key = match columns.key {
            Some(index) => match std::mem::replace(&mut values[index], Value::Null) {
                Value::Text(bytes) => Some(bytes),
                // NULL means "no order to keep": shard 0, like a table without the column.
                Value::Null => None,
                Value::UnchangedToast | Value::Binary(_) => {
                    return Err(OutboxError::BadValue {
                        column: m.key.to_string(),
                        what: "not a text value",
                    })
                }
            },
            None => None,
        };
        // Trace context is a courtesy: one that is not valid is dropped, never an error
        // (a client may send anything in its header).
        let traceparent = columns.traceparent.and_then(|index| {
            match std::mem::replace(&mut values[index], Value::Null) {
                // Written again as the relay reads it: only the canonical 55 bytes go on,
                // whatever a writer other than the service put in the column.
                Value::Text(bytes) => std::str::from_utf8(&bytes)
                    .ok()
                    .and_then(outbox_core::telemetry::parse)
                    .map(|context| Bytes::from(outbox_core::telemetry::format(&context))),
                _ => None,
            }
        });
        let mut take = |index: usize, column: &Ident, null_ok: bool| match std::mem::replace(
            &mut values[index],
            Value::Null,
        ) {
            Value::Text(bytes) => Ok(Some(bytes)),
            Value::Null if null_ok => Ok(None),
            Value::Null => Err(OutboxError::BadValue {
                column: column.to_string(),
                what: "NULL",
            }),
            Value::UnchangedToast => Err(OutboxError::BadValue {
                column: column.to_string(),
                what: "an unchanged TOAST value",
            }),
            Value::Binary(_) => Err(OutboxError::BadValue {
                column: column.to_string(),
                what: "in binary format",
            }),
        };
        let required = |v: Option<Bytes>| v.unwrap_or_default();
        let outbox_id = required(take(columns.id, &m.id, false)?);
        let event = required(take(columns.event, &m.event_type, false)?);
        // A NULL payload (Debezium's delete marker) is published as an empty one: a stream
        // has no compaction that a tombstone could drive.
        let payload = take(columns.payload, &m.payload, true)?
            .map(|text| stored_payload(text, columns.payload_bytea))
            .unwrap_or_default();
        let created_at = match (columns.created_at, &m.timestamp) {
            (Some(index), Some(column)) => Some(rfc3339_utc(required(take(index, column, false)?))),
            _ => None,
        };
        let mut extra = Vec::with_capacity(columns.extra.len());
        for ((index, field), mapped) in columns.extra.iter().zip(&m.extra) {
            if let Some(value) = take(*index, &mapped.column, true)? {
                extra.push((field.clone(), value));
            }
        }
        Ok(Row::Outbox(OutboxEvent {
            outbox_id,
            event,
            payload,
            created_at,
            key,
            traceparent,
            extra,
            route,
        }))
    }
}

/// A payload as stored: a bytea column's text form (`\x` and hex, as Postgres prints it
/// under the default `bytea_output`) becomes its bytes; any other type is its text.
pub(crate) fn stored_payload(text: Bytes, bytea: bool) -> Bytes {
    if !bytea {
        return text;
    }
    match text.strip_prefix(b"\\x") {
        Some(hex) if hex.len() % 2 == 0 => {
            let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
            let decoded: Option<Vec<u8>> = hex
                .chunks_exact(2)
                .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
                .collect();
            decoded.map(Bytes::from).unwrap_or(text)
        }
        _ => text,
    }
}

/// Postgres prints timestamptz as `2026-11-29 21:12:00.123456+00` under the relay's pinned
/// `DateStyle=ISO` and `TimeZone=UTC`; make that RFC 3339 (`T` separator, `Z`). Anything
/// else (`infinity`, a year past 9999) passes through unchanged rather than being guessed at.
pub(crate) fn rfc3339_utc(text: Bytes) -> Bytes {
    let t = &text[..];
    let canonical = t.len() >= 22
        && t[4] == b'-'
        && t[7] == b'-'
        && t[10] == b' '
        && t[13] == b':'
        && t[16] == b':'
        && t.ends_with(b"+00")
        && t[..t.len() - 3]
            .iter()
            .enumerate()
            .all(|(i, b)| matches!(i, 4 | 7 | 10 | 13 | 16 | 19) || b.is_ascii_digit());
    if !canonical {
        return text;
    }
    let mut out = Vec::with_capacity(t.len() - 2);
    out.extend_from_slice(&t[..10]);
    out.push(b'T');
    out.extend_from_slice(&t[11..t.len() - 3]);
    out.push(b'Z');
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Column;

    fn relation(id: u32, namespace: &str, name: &str, columns: &[&str]) -> Relation {
        Relation {
            id,
            namespace: namespace.into(),
            name: name.into(),
            replica_identity: b'd',
            columns: columns
                .iter()
                .map(|c| Column {
                    flags: 0,
                    name: (*c).into(),
                    type_oid: 25,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    fn text(s: &str) -> Value {
        Value::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    fn cache() -> RelationCache {
        RelationCache::new("consumers.outbox".parse().unwrap())
    }

    #[test]
    fn columns_are_found_by_name_in_any_order() {
        let mut cache = cache();
        cache
            .on_relation(&relation(
                5,
                "consumers",
                "outbox",
                &["created_at", "extra", "payload", "id", "event"],
            ))
            .unwrap();
        let row = cache
            .on_insert(Insert {
                relation_id: 5,
                values: vec![
                    text("2026-11-29 21:12:00.5+00"),
                    Value::Null,
                    text("{\"a\": 1}"),
                    text("17"),
                    text("message.created"),
                ],
            })
            .unwrap();
        assert_eq!(
            row,
            Row::Outbox(OutboxEvent {
                outbox_id: Bytes::from_static(b"17"),
                event: Bytes::from_static(b"message.created"),
                payload: Bytes::from_static(b"{\"a\": 1}"),
                created_at: Some(Bytes::from_static(b"2026-11-29T21:12:00.5Z")),
                key: None,
                traceparent: None,
                extra: Vec::new(),
                route: None,
            })
        );
    }

    #[test]
    fn a_valid_traceparent_is_carried_and_any_other_dropped() {
        let mut cache = cache();
        cache
            .on_relation(&relation(
                5,
                "consumers",
                "outbox",
                &["id", "event", "payload", "created_at", "traceparent"],
            ))
            .unwrap();
        let traced = |value: Value| match cache.on_insert(Insert {
            relation_id: 5,
            values: vec![text("1"), text("e"), text("{}"), text("x"), value],
        }) {
            Ok(Row::Outbox(event)) => event.traceparent,
            other => panic!("{other:?}"),
        };
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(traced(text(tp)), Some(Bytes::from(tp)));
        assert_eq!(traced(text("00-not-a-trace-01")), None);
        assert_eq!(traced(text("")), None);
        assert_eq!(traced(Value::Null), None);
    }

    #[test]
    fn a_redefined_relation_replaces_the_old_one() {
        let mut cache = cache();
        cache
            .on_relation(&relation(
                5,
                "consumers",
                "outbox",
                &["id", "event", "payload", "created_at"],
            ))
            .unwrap();
        cache
            .on_relation(&relation(
                5,
                "consumers",
                "outbox",
                &["id", "event", "payload", "created_at", "trace"],
            ))
            .unwrap();
        let row = cache.on_insert(Insert {
            relation_id: 5,
            values: vec![text("1"), text("e"), text("{}"), text("x"), text("t")],
        });
        assert!(matches!(row, Ok(Row::Outbox(_))));
    }

    #[test]
    fn missing_column_is_an_error_naming_it() {
        let mut cache = cache();
        let err = cache
            .on_relation(&relation(
                5,
                "consumers",
                "outbox",
                &["id", "event", "created_at"],
            ))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "outbox table consumers.outbox has no column 'payload' (the mapping's payload; see --outbox-preset and the --outbox-*-column flags)"
        );
    }

    #[test]
    fn other_tables_are_foreign_and_unknown_relations_are_errors() {
        let mut cache = cache();
        cache
            .on_relation(&relation(9, "workers", "outbox", &["id"]))
            .unwrap();
        assert_eq!(
            cache.on_insert(Insert {
                relation_id: 9,
                values: vec![text("1")]
            }),
            Ok(Row::Foreign("workers.outbox".into()))
        );
        assert_eq!(
            cache.on_insert(Insert {
                relation_id: 10,
                values: vec![]
            }),
            Err(OutboxError::UnknownRelation { relation_id: 10 })
        );
    }

    #[test]
    fn null_toast_and_binary_values_are_errors() {
        let mut cache = cache();
        cache
            .on_relation(&relation(
                5,
                "consumers",
                "outbox",
                &["id", "event", "payload", "created_at"],
            ))
            .unwrap();
        for (bad, what) in [
            (Value::Null, "NULL"),
            (Value::UnchangedToast, "an unchanged TOAST value"),
            (Value::Binary(Bytes::from_static(b"{}")), "in binary format"),
        ] {
            let err = cache
                .on_insert(Insert {
                    relation_id: 5,
                    values: vec![text("1"), bad, text("{}"), text("t")],
                })
                .unwrap_err();
            assert_eq!(
                err,
                OutboxError::BadValue {
                    column: "event".into(),
                    what
                }
            );
        }
        let err = cache
            .on_insert(Insert {
                relation_id: 5,
                values: vec![text("1")],
            })
            .unwrap_err();
        assert!(matches!(
            err,
            OutboxError::ColumnCount {
                expected: 4,
                got: 1,
                ..
            }
        ));
    }

    /// Debezium's documented table, with the two columns a catch-up needs.
    fn debezium(extra: &str) -> RelationCache {
        let table: OutboxTable = "public.outbox".parse().unwrap();
        let mapping = OutboxMapping::build(
            crate::decode::Preset::Debezium,
            table,
            &crate::decode::Overrides {
                extra: Some(extra.into()),
                ..Default::default()
            },
            false,
        )
        .unwrap();
        let mut cache = RelationCache::mapped(Arc::new(mapping), 4);
        let mut rel = relation(
            7,
            "public",
            "outbox",
            &[
                "id",
                "aggregatetype",
                "aggregateid",
                "type",
                "payload",
                "seq",
                "tx",
            ],
        );
        rel.columns[4].type_oid = BYTEA_OID;
        cache.on_relation(&rel).unwrap();
        cache
    }

    #[test]
    fn a_debezium_row_publishes_its_key_extra_fields_and_bytes_as_stored() {
        let cache = debezium("aggregatetype:header:aggregate_type");
        let row = cache
            .on_insert(Insert {
                relation_id: 7,
                values: vec![
                    text("0b4e7c1e-7a4d-4f9e-9a57-0d1c5e3f2a10"),
                    text("order"),
                    text("o-17"),
                    text("OrderCreated"),
                    text("\\x00ff7b7d"),
                    text("3"),
                    text("812"),
                ],
            })
            .unwrap();
        let Row::Outbox(event) = row else {
            panic!("{row:?}")
        };
        assert_eq!(event.payload, Bytes::from_static(b"\x00\xff{}"));
        assert_eq!(event.key.as_deref(), Some(&b"o-17"[..]));
        assert_eq!(event.created_at, None);
        let fields: Vec<(&[u8], &[u8])> = event.fields().collect();
        assert_eq!(
            fields,
            [
                (&b"event"[..], &b"OrderCreated"[..]),
                (b"payload", b"\x00\xff{}"),
                (b"outbox_id", b"0b4e7c1e-7a4d-4f9e-9a57-0d1c5e3f2a10"),
                (b"key", b"o-17"),
                (b"aggregate_type", b"order"),
            ]
        );
    }

    #[test]
    fn a_null_payload_is_published_empty_and_a_null_extra_left_out() {
        let cache = debezium("aggregatetype");
        let row = cache
            .on_insert(Insert {
                relation_id: 7,
                values: vec![
                    text("id-1"),
                    Value::Null,
                    text("o-17"),
                    text("OrderDeleted"),
                    Value::Null,
                    text("4"),
                    text("813"),
                ],
            })
            .unwrap();
        let Row::Outbox(event) = row else {
            panic!("{row:?}")
        };
        assert!(event.payload.is_empty());
        assert!(event.extra.is_empty());
    }

    #[test]
    fn a_sharded_stream_refuses_a_table_without_the_key_naming_the_flag() {
        let table: OutboxTable = "public.outbox".parse().unwrap();
        let mapping = OutboxMapping::build(
            crate::decode::Preset::Debezium,
            table,
            &Default::default(),
            false,
        )
        .unwrap();
        let mut cache = RelationCache::mapped(Arc::new(mapping), 4);
        let err = cache
            .on_relation(&relation(
                7,
                "public",
                "outbox",
                &["id", "type", "payload", "seq", "tx"],
            ))
            .unwrap_err();
        assert!(
            err.to_string().contains("no column 'aggregateid'")
                && err.to_string().contains("--outbox-"),
            "{err}"
        );
    }

    #[test]
    fn bytea_text_becomes_bytes_and_anything_else_stays_text() {
        let b = |s: &'static [u8], bytea| stored_payload(Bytes::from_static(s), bytea);
        assert_eq!(b(b"\\x414243", true), "ABC");
        assert_eq!(b(b"\\x414", true), "\\x414", "odd length: left as printed");
        assert_eq!(b(b"\\x41zz", true), "\\x41zz");
        assert_eq!(b(b"\\x414243", false), "\\x414243");
        assert_eq!(b(b"", true), "");
    }

    #[test]
    fn timestamps_become_rfc3339() {
        let t = |s: &'static str| rfc3339_utc(Bytes::from_static(s.as_bytes()));
        assert_eq!(
            t("2026-11-29 21:12:00.123456+00"),
            "2026-11-29T21:12:00.123456Z"
        );
        assert_eq!(t("2026-11-29 21:12:00+00"), "2026-11-29T21:12:00Z");
        assert_eq!(t("infinity"), "infinity");
        assert_eq!(t("2026-11-29 21:12:00+03"), "2026-11-29 21:12:00+03");
    }

    #[test]
    fn outbox_table_names_are_validated() {
        assert!("consumers.outbox".parse::<OutboxTable>().is_ok());
        for bad in [
            "outbox",
            "a.b.c",
            "Consumers.outbox",
            ".outbox",
            "consumers.",
            "x;drop.y",
        ] {
            assert!(bad.parse::<OutboxTable>().is_err(), "{bad} accepted");
        }
    }
}
