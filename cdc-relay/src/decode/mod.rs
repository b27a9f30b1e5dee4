//! Decoding, without I/O: the walsender's pgoutput messages into relations and inserts
//! (`pgoutput`), and inserts into the outbox into the fields of stream entries
//! (`outbox`). Malformed bytes are an error, never a silent skip; tested on bytes.

mod outbox;
mod pgoutput;

pub(crate) use outbox::rfc3339_utc;
pub use outbox::{OutboxError, OutboxEvent, OutboxTable, RelationCache, Row};
pub use pgoutput::{decode, encode, Column, DecodeError, Insert, PgOutput, Relation, Value};
