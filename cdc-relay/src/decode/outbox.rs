//! The outbox table as the relay sees it: which relation it is, where its columns are, and
//! how one inserted row becomes one stream entry's fields.
//!
//! Columns are looked up by name in each Relation message (they are re-sent every session
//! and after DDL), so adding columns to the outbox or reordering them needs no relay change.

use std::collections::HashMap;

use bytes::Bytes;

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
    /// The row's jsonb, exactly as Postgres printed it.
    pub payload: Bytes,
    /// RFC 3339 in UTC (`2026-11-29T21:12:00.123456Z`).
    pub created_at: Bytes,
    /// What decides the row's shard (`partition_key`, the chat id for chat messages);
    /// `None` when the column is NULL or the table has none. Not written to the stream.
    pub partition_key: Option<Bytes>,
    /// The W3C trace context the entry carries (`traceparent`): the row's, valid, until the
    /// relay's own publish span replaces it. `None`: NULL, invalid, or no such column.
    pub traceparent: Option<Bytes>,
}

impl OutboxEvent {
    /// The entry's field values, in the order of `outbox_core::stream::entry::FIELDS`.
    /// The script adds `published_at` itself and takes an empty `traceparent` as none.
    pub fn field_values(&self) -> [&[u8]; 5] {
        [
            &self.event,
            &self.payload,
            &self.outbox_id,
            &self.created_at,
            self.traceparent.as_deref().unwrap_or_default(),
        ]
    }

    /// Bytes this event adds to a stream entry (fields and names), for batch sizing.
    pub fn encoded_len(&self) -> usize {
        const FIELD_NAMES_AND_FRAMING: usize = 64;
        self.outbox_id.len()
            + self.event.len()
            + self.payload.len()
            + self.created_at.len()
            + self.traceparent.as_ref().map_or(0, Bytes::len)
            + FIELD_NAMES_AND_FRAMING
    }
}

/// A row of the outbox that cannot become a stream entry: the table's definition or the
/// session's settings are not what the relay requires.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutboxError {
    #[error("outbox table {table} has no column '{column}' (the relay needs id, event, payload, created_at)")]
    MissingColumn { table: String, column: &'static str },
    #[error("outbox insert has {got} columns but relation {table} has {expected}")]
    ColumnCount {
        table: String,
        expected: usize,
        got: usize,
    },
    #[error("outbox insert: column '{column}' is {what}; it must be a non-null text value")]
    BadValue {
        column: &'static str,
        what: &'static str,
    },
    #[error("insert for relation id {relation_id}, which no Relation message described")]
    UnknownRelation { relation_id: u32 },
}

/// Where the relay's four fields are in the outbox relation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OutboxColumns {
    id: usize,
    event: usize,
    payload: usize,
    created_at: usize,
    partition_key: Option<usize>,
    traceparent: Option<usize>,
    count: usize,
}

#[derive(Debug, Clone)]
enum Known {
    Outbox(OutboxColumns),
    /// Another table in the publication: its rows are not ours to publish.
    Other(String),
}

/// What an insert turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Row {
    Outbox(OutboxEvent),
    /// An insert into another table of the publication, named.
    Foreign(String),
}

/// Relations seen in this replication session, by relation id.
#[derive(Debug)]
pub struct RelationCache {
    outbox: OutboxTable,
    /// A sharded stream needs every row's partition key.
    require_partition_key: bool,
    relations: HashMap<u32, Known>,
}

impl RelationCache {
    pub fn new(outbox: OutboxTable) -> Self {
        Self {
            outbox,
            require_partition_key: false,
            relations: HashMap::new(),
        }
    }

    /// A cache for a stream of `shards` shards (more than one needs `partition_key`).
    pub fn sharded(outbox: OutboxTable, shards: u32) -> Self {
        Self {
            require_partition_key: shards > 1,
            ..Self::new(outbox)
        }
    }

    /// Remember (or replace) a relation's description.
    pub fn on_relation(&mut self, relation: &Relation) -> Result<(), OutboxError> {
        let known =
            if relation.namespace == self.outbox.schema && relation.name == self.outbox.table {
                let find = |column: &'static str| {
                    relation
                        .columns
                        .iter()
                        .position(|c| c.name == column)
                        .ok_or_else(|| OutboxError::MissingColumn {
                            table: self.outbox.to_string(),
                            column,
                        })
                };
                let partition_key = if self.require_partition_key {
                    Some(find("partition_key")?)
                } else {
                    relation
                        .columns
                        .iter()
                        .position(|c| c.name == "partition_key")
                };
                let traceparent = relation
                    .columns
                    .iter()
                    .position(|c| c.name == "traceparent");
                Known::Outbox(OutboxColumns {
                    id: find("id")?,
                    event: find("event")?,
                    payload: find("payload")?,
                    created_at: find("created_at")?,
                    partition_key,
                    traceparent,
                    count: relation.columns.len(),
                })
            } else {
                Known::Other(format!("{}.{}", relation.namespace, relation.name))
            };
        self.relations.insert(relation.id, known);
        Ok(())
    }

    /// Turn an insert into the outbox event it carries.
    pub fn on_insert(&self, insert: Insert) -> Result<Row, OutboxError> {
        let columns = match self.relations.get(&insert.relation_id) {
            Some(Known::Outbox(columns)) => *columns,
            Some(Known::Other(name)) => return Ok(Row::Foreign(name.clone())),
            None => {
                return Err(OutboxError::UnknownRelation {
                    relation_id: insert.relation_id,
                })
            }
        };
        if insert.values.len() != columns.count {
            return Err(OutboxError::ColumnCount {
                table: self.outbox.to_string(),
                expected: columns.count,
                got: insert.values.len(),
            });
        }
        let mut values = insert.values;
        let partition_key = match columns.partition_key {
            Some(index) => match std::mem::replace(&mut values[index], Value::Null) {
                Value::Text(bytes) => Some(bytes),
                // NULL means "no order to keep": shard 0, like a table without the column.
                Value::Null => None,
                Value::UnchangedToast | Value::Binary(_) => {
                    return Err(OutboxError::BadValue {
                        column: "partition_key",
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
        let mut take = |index: usize, column: &'static str| match std::mem::replace(
            &mut values[index],
            Value::Null,
        ) {
            Value::Text(bytes) => Ok(bytes),
            Value::Null => Err(OutboxError::BadValue {
                column,
                what: "NULL",
            }),
            Value::UnchangedToast => Err(OutboxError::BadValue {
                column,
                what: "an unchanged TOAST value",
            }),
            Value::Binary(_) => Err(OutboxError::BadValue {
                column,
                what: "in binary format",
            }),
        };
        Ok(Row::Outbox(OutboxEvent {
            outbox_id: take(columns.id, "id")?,
            event: take(columns.event, "event")?,
            payload: take(columns.payload, "payload")?,
            created_at: rfc3339_utc(take(columns.created_at, "created_at")?),
            partition_key,
            traceparent,
        }))
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
                created_at: Bytes::from_static(b"2026-11-29T21:12:00.5Z"),
                partition_key: None,
                traceparent: None,
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
            "outbox table consumers.outbox has no column 'payload' (the relay needs id, event, payload, created_at)"
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
                    values: vec![text("1"), text("e"), bad, text("t")],
                })
                .unwrap_err();
            assert_eq!(
                err,
                OutboxError::BadValue {
                    column: "payload",
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
