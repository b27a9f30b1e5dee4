//! Decoder for the two pgoutput messages the relay acts on: Relation (`R`) and Insert (`I`),
//! logical replication protocol version 1, text or binary column values.
//!
//! `pgwire-replication` decodes Begin, Commit and logical Messages itself and hands every
//! other pgoutput message over as raw bytes; this module turns those bytes into values.
//! Every other tag is reported as [`PgOutput::Skipped`] (types, origins, updates, deletes,
//! truncates: our publication sends inserts only). Malformed bytes are always an error,
//! never a silent skip and never a panic. Column values are zero-copy slices of the input.

use bytes::Bytes;

/// A decoding failure: the bytes are not a well-formed pgoutput v1 message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty message")]
    Empty,
    #[error("{message} message truncated: needed {needed} more bytes at offset {offset}")]
    Truncated {
        message: &'static str,
        offset: usize,
        needed: usize,
    },
    #[error("{message} message: string at offset {offset} is not NUL-terminated")]
    UnterminatedString {
        message: &'static str,
        offset: usize,
    },
    #[error("{message} message: string at offset {offset} is not valid UTF-8")]
    InvalidUtf8 {
        message: &'static str,
        offset: usize,
    },
    #[error("{message} message: negative column count {count}")]
    NegativeColumnCount { message: &'static str, count: i16 },
    #[error("{message} message: negative length {length} at offset {offset}")]
    NegativeLength {
        message: &'static str,
        offset: usize,
        length: i32,
    },
    #[error("insert message: expected tuple marker 'N', found {found:#04x}")]
    UnexpectedTupleMarker { found: u8 },
    #[error("{message} message: unknown column kind {kind:#04x} at offset {offset}")]
    UnknownColumnKind {
        message: &'static str,
        offset: usize,
        kind: u8,
    },
    #[error("{message} message: {trailing} unexpected trailing bytes")]
    TrailingBytes {
        message: &'static str,
        trailing: usize,
    },
}

/// One decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgOutput {
    Relation(Relation),
    Insert(Insert),
    /// A message the relay does not act on, by tag.
    Skipped(u8),
}

/// The description of a table, sent before the first change to it in each session and
/// again after its definition changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    /// Schema name; pgoutput sends an empty string for `pg_catalog`.
    pub namespace: String,
    pub name: String,
    pub replica_identity: u8,
    pub columns: Vec<Column>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Bit 1: part of the replica identity key.
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

/// A new row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    pub relation_id: u32,
    pub values: Vec<Value>,
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Null,
    /// An unchanged TOASTed value that the server did not send (updates only).
    UnchangedToast,
    Text(Bytes),
    Binary(Bytes),
}

/// Decode one pgoutput message (the payload of an XLogData message).
pub fn decode(data: &Bytes) -> Result<PgOutput, DecodeError> {
    let tag = *data.first().ok_or(DecodeError::Empty)?;
    match tag {
        b'R' => decode_relation(data).map(PgOutput::Relation),
        b'I' => decode_insert(data).map(PgOutput::Insert),
        other => Ok(PgOutput::Skipped(other)),
    }
}

fn decode_relation(data: &Bytes) -> Result<Relation, DecodeError> {
    const MSG: &str = "relation";
    let mut r = Reader::new(data, MSG);
    r.skip(1)?; // tag
    let id = r.u32()?;
    let namespace = r.string()?;
    let name = r.string()?;
    let replica_identity = r.u8()?;
    let count = r.i16()?;
    if count < 0 {
        return Err(DecodeError::NegativeColumnCount {
            message: MSG,
            count,
        });
    }
    let mut columns = Vec::with_capacity(count as usize);
    for _ in 0..count {
        columns.push(Column {
            flags: r.u8()?,
            name: r.string()?,
            type_oid: r.u32()?,
            type_modifier: r.i32()?,
        });
    }
    r.finish()?;
    Ok(Relation {
        id,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn decode_insert(data: &Bytes) -> Result<Insert, DecodeError> {
    const MSG: &str = "insert";
    let mut r = Reader::new(data, MSG);
    r.skip(1)?; // tag
    let relation_id = r.u32()?;
    let marker = r.u8()?;
    if marker != b'N' {
        return Err(DecodeError::UnexpectedTupleMarker { found: marker });
    }
    let values = r.tuple()?;
    r.finish()?;
    Ok(Insert {
        relation_id,
        values,
    })
}

/// A bounds-checked cursor over one message.
struct Reader<'a> {
    data: &'a Bytes,
    offset: usize,
    message: &'static str,
}

impl<'a> Reader<'a> {
    fn new(data: &'a Bytes, message: &'static str) -> Self {
        Self {
            data,
            offset: 0,
            message,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let available = self.data.len() - self.offset;
        if available < n {
            return Err(DecodeError::Truncated {
                message: self.message,
                offset: self.offset,
                needed: n - available,
            });
        }
        let bytes = &self.data[self.offset..self.offset + n];
        self.offset += n;
        Ok(bytes)
    }

    fn skip(&mut self, n: usize) -> Result<(), DecodeError> {
        self.take(n).map(|_| ())
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn i16(&mut self) -> Result<i16, DecodeError> {
        Ok(i16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let start = self.offset;
        let rest = &self.data[start..];
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::UnterminatedString {
                message: self.message,
                offset: start,
            })?;
        let s = std::str::from_utf8(&rest[..len]).map_err(|_| DecodeError::InvalidUtf8 {
            message: self.message,
            offset: start,
        })?;
        self.offset += len + 1;
        Ok(s.to_owned())
    }

    /// TupleData: Int16 column count, then per column a kind byte and, for text and binary
    /// values, an Int32 length and the bytes.
    fn tuple(&mut self) -> Result<Vec<Value>, DecodeError> {
        let count = self.i16()?;
        if count < 0 {
            return Err(DecodeError::NegativeColumnCount {
                message: self.message,
                count,
            });
        }
        let mut values = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let kind_offset = self.offset;
            let kind = self.u8()?;
            let value = match kind {
                b'n' => Value::Null,
                b'u' => Value::UnchangedToast,
                b't' | b'b' => {
                    let length_offset = self.offset;
                    let length = self.i32()?;
                    if length < 0 {
                        return Err(DecodeError::NegativeLength {
                            message: self.message,
                            offset: length_offset,
                            length,
                        });
                    }
                    let start = self.offset;
                    self.skip(length as usize)?;
                    let bytes = self.data.slice(start..self.offset);
                    if kind == b't' {
                        Value::Text(bytes)
                    } else {
                        Value::Binary(bytes)
                    }
                }
                other => {
                    return Err(DecodeError::UnknownColumnKind {
                        message: self.message,
                        offset: kind_offset,
                        kind: other,
                    })
                }
            };
            values.push(value);
        }
        Ok(values)
    }

    fn finish(&self) -> Result<(), DecodeError> {
        let trailing = self.data.len() - self.offset;
        if trailing != 0 {
            return Err(DecodeError::TrailingBytes {
                message: self.message,
                trailing,
            });
        }
        Ok(())
    }
}

/// Encoders for the same messages, the inverse of [`decode`]: used by the decoder's tests
/// and property tests, and by anyone who needs well-formed pgoutput bytes.
pub mod encode {
    use super::{Relation, Value};
    use bytes::{BufMut, Bytes, BytesMut};

    pub fn relation(rel: &Relation) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(b'R');
        b.put_u32(rel.id);
        put_string(&mut b, &rel.namespace);
        put_string(&mut b, &rel.name);
        b.put_u8(rel.replica_identity);
        b.put_i16(rel.columns.len() as i16);
        for c in &rel.columns {
            b.put_u8(c.flags);
            put_string(&mut b, &c.name);
            b.put_u32(c.type_oid);
            b.put_i32(c.type_modifier);
        }
        b.freeze()
    }

    pub fn insert(relation_id: u32, values: &[Value]) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(b'I');
        b.put_u32(relation_id);
        b.put_u8(b'N');
        b.put_i16(values.len() as i16);
        for v in values {
            match v {
                Value::Null => b.put_u8(b'n'),
                Value::UnchangedToast => b.put_u8(b'u'),
                Value::Text(t) => {
                    b.put_u8(b't');
                    b.put_i32(t.len() as i32);
                    b.put_slice(t);
                }
                Value::Binary(t) => {
                    b.put_u8(b'b');
                    b.put_i32(t.len() as i32);
                    b.put_slice(t);
                }
            }
        }
        b.freeze()
    }

    fn put_string(b: &mut BytesMut, s: &str) {
        b.put_slice(s.as_bytes());
        b.put_u8(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outbox_relation() -> Relation {
        let col = |name: &str, oid: u32, flags: u8| Column {
            flags,
            name: name.into(),
            type_oid: oid,
            type_modifier: -1,
        };
        Relation {
            id: 16_401,
            namespace: "consumers".into(),
            name: "outbox".into(),
            replica_identity: b'd',
            columns: vec![
                col("id", 20, 1),
                col("event", 25, 0),
                col("payload", 3802, 0),
                col("created_at", 1184, 0),
            ],
        }
    }

    fn text(s: &str) -> Value {
        Value::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn relation_round_trips() {
        let rel = outbox_relation();
        assert_eq!(decode(&encode::relation(&rel)), Ok(PgOutput::Relation(rel)));
    }

    #[test]
    fn insert_with_text_null_binary_and_unchanged_toast() {
        let values = vec![
            text("42"),
            Value::Null,
            Value::Binary(Bytes::from_static(&[0, 1, 2])),
            Value::UnchangedToast,
            text(""),
        ];
        let decoded = decode(&encode::insert(7, &values)).unwrap();
        assert_eq!(
            decoded,
            PgOutput::Insert(Insert {
                relation_id: 7,
                values
            })
        );
    }

    #[test]
    fn hand_built_outbox_insert_decodes() {
        // The wire layout written out byte by byte, independent of the encoder.
        let mut raw = vec![b'I', 0, 0, 0x40, 0x11, b'N', 0, 4];
        for v in [
            "1",
            "message.created",
            "{\"a\": 1}",
            "2026-11-29 21:12:00.123456+00",
        ] {
            raw.push(b't');
            raw.extend_from_slice(&(v.len() as i32).to_be_bytes());
            raw.extend_from_slice(v.as_bytes());
        }
        let PgOutput::Insert(insert) = decode(&Bytes::from(raw)).unwrap() else {
            panic!("not an insert");
        };
        assert_eq!(insert.relation_id, 0x4011);
        assert_eq!(insert.values[2], text("{\"a\": 1}"));
    }

    #[test]
    fn unknown_and_unhandled_tags_are_skipped() {
        for tag in [b'Y', b'O', b'U', b'D', b'T', b'Z', 0xff] {
            assert_eq!(
                decode(&Bytes::from(vec![tag, 1, 2, 3])),
                Ok(PgOutput::Skipped(tag))
            );
        }
    }

    #[test]
    fn empty_message_is_an_error() {
        assert_eq!(decode(&Bytes::new()), Err(DecodeError::Empty));
    }

    #[test]
    fn every_truncation_of_valid_messages_is_an_error() {
        let rel = encode::relation(&outbox_relation());
        let ins = encode::insert(1, &[text("1"), Value::Null, text("x")]);
        for msg in [rel, ins] {
            for len in 1..msg.len() {
                let cut = msg.slice(..len);
                assert!(decode(&cut).is_err(), "prefix of {len} bytes decoded");
            }
        }
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        let mut raw = encode::insert(1, &[text("1")]).to_vec();
        raw.push(0);
        assert_eq!(
            decode(&Bytes::from(raw)),
            Err(DecodeError::TrailingBytes {
                message: "insert",
                trailing: 1
            })
        );
    }

    #[test]
    fn malformed_tuples_are_errors() {
        // Wrong tuple marker.
        let raw = Bytes::from(vec![b'I', 0, 0, 0, 1, b'K', 0, 0]);
        assert_eq!(
            decode(&raw),
            Err(DecodeError::UnexpectedTupleMarker { found: b'K' })
        );
        // Unknown column kind.
        let raw = Bytes::from(vec![b'I', 0, 0, 0, 1, b'N', 0, 1, b'x']);
        assert!(matches!(
            decode(&raw),
            Err(DecodeError::UnknownColumnKind { kind: b'x', .. })
        ));
        // Negative column count.
        let raw = Bytes::from(vec![b'I', 0, 0, 0, 1, b'N', 0xff, 0xff]);
        assert!(matches!(
            decode(&raw),
            Err(DecodeError::NegativeColumnCount { count: -1, .. })
        ));
        // Negative value length.
        let raw = Bytes::from(vec![
            b'I', 0, 0, 0, 1, b'N', 0, 1, b't', 0xff, 0xff, 0xff, 0xfe,
        ]);
        assert!(matches!(
            decode(&raw),
            Err(DecodeError::NegativeLength { length: -2, .. })
        ));
        // Length beyond the end.
        let raw = Bytes::from(vec![b'I', 0, 0, 0, 1, b'N', 0, 1, b't', 0, 0, 0, 9, b'a']);
        assert!(matches!(decode(&raw), Err(DecodeError::Truncated { .. })));
    }

    #[test]
    fn malformed_relation_strings_are_errors() {
        // Namespace without terminator.
        let raw = Bytes::from(vec![b'R', 0, 0, 0, 1, b'a', b'b']);
        assert!(matches!(
            decode(&raw),
            Err(DecodeError::UnterminatedString { .. })
        ));
        // Invalid UTF-8 in a name.
        let raw = Bytes::from(vec![b'R', 0, 0, 0, 1, 0xc3, 0x28, 0]);
        assert!(matches!(decode(&raw), Err(DecodeError::InvalidUtf8 { .. })));
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        fn value() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                Just(Value::UnchangedToast),
                proptest::collection::vec(any::<u8>(), 0..64)
                    .prop_map(|v| Value::Text(Bytes::from(v))),
                proptest::collection::vec(any::<u8>(), 0..64)
                    .prop_map(|v| Value::Binary(Bytes::from(v))),
            ]
        }

        fn name() -> impl Strategy<Value = String> {
            "[^\u{0}]{0,24}"
        }

        fn relation() -> impl Strategy<Value = Relation> {
            (
                any::<u32>(),
                name(),
                name(),
                any::<u8>(),
                proptest::collection::vec((any::<u8>(), name(), any::<u32>(), any::<i32>()), 0..12),
            )
                .prop_map(|(id, namespace, name, replica_identity, cols)| Relation {
                    id,
                    namespace,
                    name,
                    replica_identity,
                    columns: cols
                        .into_iter()
                        .map(|(flags, name, type_oid, type_modifier)| Column {
                            flags,
                            name,
                            type_oid,
                            type_modifier,
                        })
                        .collect(),
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2_000))]

            /// Arbitrary bytes never panic the decoder.
            #[test]
            fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
                let _ = decode(&Bytes::from(data));
            }

            /// Arbitrary bytes after a tag the decoder acts on never panic either.
            #[test]
            fn arbitrary_bodies_never_panic(
                tag in prop_oneof![Just(b'R'), Just(b'I')],
                body in proptest::collection::vec(any::<u8>(), 0..256),
            ) {
                let mut data = vec![tag];
                data.extend(body);
                let _ = decode(&Bytes::from(data));
            }

            #[test]
            fn relations_round_trip(rel in relation()) {
                prop_assert_eq!(decode(&encode::relation(&rel)), Ok(PgOutput::Relation(rel)));
            }

            #[test]
            fn inserts_round_trip(id in any::<u32>(), values in proptest::collection::vec(value(), 0..16)) {
                let decoded = decode(&encode::insert(id, &values));
                prop_assert_eq!(decoded, Ok(PgOutput::Insert(Insert { relation_id: id, values })));
            }

            /// A valid message with one byte flipped decodes to something or fails cleanly.
            #[test]
            fn mutated_messages_never_panic(
                values in proptest::collection::vec(value(), 0..8),
                position in any::<prop::sample::Index>(),
                byte in any::<u8>(),
            ) {
                let mut raw = encode::insert(1, &values).to_vec();
                let i = position.index(raw.len());
                raw[i] = byte;
                let _ = decode(&Bytes::from(raw));
            }
        }
    }
}
