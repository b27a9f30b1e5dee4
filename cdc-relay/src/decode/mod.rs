//! Decoding, without I/O: the walsender's pgoutput messages into relations and inserts
//! (`pgoutput`), and inserts into the outbox into the fields of stream entries
//! (`outbox`, by the columns `mapping` names). Malformed bytes are an error, never a silent skip; tested on bytes.

mod mapping;
mod outbox;
mod pgoutput;

pub use mapping::{ExtraField, Ident, OutboxMapping, Overrides, Preset, Recovery, RESERVED_FIELDS};
pub(crate) use outbox::{rfc3339_utc, stored_payload, BYTEA_OID};
pub use outbox::{OutboxError, OutboxEvent, OutboxTable, RelationCache, Row};
pub use pgoutput::{decode, encode, Column, DecodeError, Insert, PgOutput, Relation, Value};
