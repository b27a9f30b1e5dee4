//! The stream contract's test vectors (`docs/contract/vectors-v1.json`, specified by
//! `docs/contract/v1.md`): what an implementation in any language must compute alike, made
//! here from this crate's own code and compared with the committed file, so neither can
//! drift from the other. `UPDATE_VECTORS=1 cargo test -p outbox-consumer contract` writes
//! the file anew (a change to it is a change of the contract: see the spec's "Versions").
//!
//! The FNV-1a hash is also checked against the published reference values, so the vectors
//! do not only agree with themselves.

use std::collections::BTreeMap;

use outbox_core::stream::entry::{self, dead_letter, EntryId};
use outbox_core::stream::{keys, shard_key, shard_of, shard_of_key};
use redis::Value;
use serde_json::{json, Value as Json};

use crate::members::{assign, weight};
use crate::shard::group::entries_of;

const PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../docs/contract/vectors-v1.json"
);

/// FNV-1a, 64 bits, written out again (the contract's hash; `shard_of` must agree).
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Keys whose shards the vectors give: ASCII, the chat's ids, Debezium's aggregate ids, an
/// empty key, multi-byte UTF-8, and a padded `char(n)` value (the padding is part of it).
const KEYS: [&str; 9] = [
    "chat-1",
    "chat-2",
    "42",
    "customer-0",
    "order-4",
    "",
    "día-ß-日本",
    "order-1         ",
    "00000000-0000-0000-0000-000000000001",
];
const SHARD_COUNTS: [u32; 6] = [1, 2, 3, 4, 16, 1024];

fn hashes() -> Json {
    let inputs: [&[u8]; 6] = [b"", b"a", b"foobar", b"chat-1", "día".as_bytes(), &[0, 255]];
    Json::Array(
        inputs
            .iter()
            .map(|i| json!({ "input_hex": hex(i), "fnv1a64": format!("{:016x}", fnv1a64(i)) }))
            .collect(),
    )
}

fn shards() -> Json {
    let mut out = Vec::new();
    for key in KEYS {
        let mut by_count = BTreeMap::new();
        for n in SHARD_COUNTS {
            by_count.insert(n.to_string(), shard_of(Some(key.as_bytes()), n));
        }
        out.push(json!({ "key": key, "key_hex": hex(key.as_bytes()), "shard_by_count": by_count }));
    }
    let mut null_key = BTreeMap::new();
    for n in SHARD_COUNTS {
        null_key.insert(n.to_string(), shard_of(None, n));
    }
    out.push(json!({ "key": null, "shard_by_count": null_key }));
    Json::Array(out)
}

fn key_names() -> Json {
    let group = "workers";
    let stream = "outbox:consumers";
    let per_shard = |base: &str, shards: u32| -> Vec<String> {
        (0..shards).map(|k| shard_key(base, k, shards)).collect()
    };
    let layouts: Vec<Json> = [1u32, 4]
        .into_iter()
        .map(|n| {
            let streams = per_shard(stream, n);
            json!({
                "stream": stream,
                "group": group,
                "shards": n,
                "streams": streams,
                "records": streams.iter().map(|s| keys::origin_key(s)).collect::<Vec<_>>(),
                "leases": per_shard(&keys::inbox_lease_base(group), n),
                "attempts": per_shard(&keys::inbox_attempts_base(group), n),
                "dead_letters": per_shard(&keys::dead_letter_base(group), n),
                "members": keys::inbox_members_key(group),
            })
        })
        .collect();
    let shard_of_keys: Vec<Json> = [
        "outbox:consumers",
        "outbox:consumers:{3}",
        "a:{b}",
        "x:{12}",
    ]
    .into_iter()
    .map(|k| json!({ "key": k, "shard": shard_of_key(k) }))
    .collect();
    json!({ "layouts": layouts, "shard_of_key": shard_of_keys })
}

fn entry_ids() -> Json {
    let valid: Vec<Json> = [
        "9-10",
        "0-0",
        "18446744073709551615-4294967296",
        "1764620000-1",
    ]
    .into_iter()
    .map(|t| {
        let id: EntryId = t.parse().unwrap();
        json!({ "text": t, "commit_lsn": id.commit_lsn.to_string(), "seq": id.seq.to_string() })
    })
    .collect();
    let invalid = [
        "9",
        "",
        "-",
        "a-1",
        "1-",
        "-1",
        "1-2-3",
        "18446744073709551616-0",
        " 1-2",
    ];
    for t in invalid {
        assert!(t.parse::<EntryId>().is_err(), "{t:?} parsed");
    }
    // Ascending as numbers, not as text.
    let ordered = ["9-10", "10-0", "10-2", "10-10", "100-0"];
    let parsed: Vec<EntryId> = ordered.iter().map(|t| t.parse().unwrap()).collect();
    assert!(parsed.windows(2).all(|w| w[0] < w[1]));
    json!({ "valid": valid, "invalid": invalid, "ascending": ordered })
}

/// A field value as the vectors write it: text when UTF-8, else its bytes in hex.
fn value_json(bytes: &[u8]) -> Json {
    match std::str::from_utf8(bytes) {
        Ok(text) => json!({ "text": text }),
        Err(_) => json!({ "hex": hex(bytes) }),
    }
}

fn bulk(bytes: &[u8]) -> Value {
    Value::BulkString(bytes.to_vec())
}

/// A vector entry: what it is, its id, its fields (`None`: nil, trimmed).
type EntryCase = (
    &'static str,
    &'static str,
    Option<Vec<(&'static str, &'static [u8])>>,
);

/// Entries as XRANGE returns them, and what a consumer makes of each.
fn entries() -> Json {
    let cases: Vec<EntryCase> = vec![
        (
            "the chat's entry, every field",
            "1764620000-0",
            Some(vec![
                ("event", b"message.created"),
                ("payload", br#"{"id": "7f0c", "body": "hi"}"#),
                ("outbox_id", b"12"),
                ("created_at", b"2026-11-29T21:12:00.123456Z"),
                (
                    "traceparent",
                    b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                ),
                ("key", b"chat-1"),
                ("published_at", b"1764620000123456"),
            ]),
        ),
        (
            "Debezium's, with an extra field and no timestamp",
            "22-1",
            Some(vec![
                ("event", b"OrderCreated"),
                ("payload", br#"{"n": 1}"#),
                ("outbox_id", b"00000000-0000-0000-0000-000000000001"),
                ("key", b"order-4"),
                ("aggregate_type", b"order"),
                ("published_at", b"1764620000123456"),
            ]),
        ),
        (
            "the least an entry has",
            "5-0",
            Some(vec![("event", b"e"), ("payload", b"")]),
        ),
        (
            "a bytea payload: not UTF-8, handed over as bytes",
            "10-0",
            Some(vec![
                ("event", b"blob.stored"),
                ("payload", &[0x00, 0xff, 0xfe]),
                ("key", b"k-1"),
            ]),
        ),
        (
            "no event: undecodable (dead-lettered)",
            "11-0",
            Some(vec![("payload", b"{}")]),
        ),
        (
            "no payload: undecodable (dead-lettered)",
            "12-0",
            Some(vec![("event", b"e")]),
        ),
        (
            "fields nil: trimmed before it was acknowledged (counted lost, acknowledged)",
            "13-0",
            None,
        ),
    ];
    let reply = Value::Array(
        cases
            .iter()
            .map(|(_, id, fields)| {
                Value::Array(vec![
                    bulk(id.as_bytes()),
                    match fields {
                        None => Value::Nil,
                        Some(fields) => Value::Array(
                            fields
                                .iter()
                                .flat_map(|(k, v)| [bulk(k.as_bytes()), bulk(v)])
                                .collect(),
                        ),
                    },
                ])
            })
            .collect(),
    );
    let parsed = entries_of(reply).unwrap();
    cases
        .iter()
        .zip(&parsed)
        .map(|((name, id, fields), entry)| {
            let given = fields.as_ref().map(|fields| {
                fields
                    .iter()
                    .map(|(k, v)| json!([k, value_json(v)]))
                    .collect::<Vec<_>>()
            });
            let expect = match (&entry.fields, entry.decode()) {
                (None, _) => json!({ "trimmed": true }),
                (Some(_), Err(missing)) => json!({ "missing": missing.0 }),
                (Some(_), Ok(f)) => json!({
                    "event": f.event,
                    "payload": value_json(entry.field_bytes(entry::PAYLOAD).unwrap_or_default()),
                    "outbox_id": f.outbox_id,
                    "created_at": f.created_at,
                    "traceparent": f.traceparent,
                    "key": entry.key(),
                    "published_at_micros": f.published_at,
                }),
            };
            // A bytea payload decodes as missing text: the bytes are still the entry's.
            let expect = if entry.binary.contains_key(entry::PAYLOAD) {
                json!({
                    "missing": "payload",
                    "payload_bytes_hex": hex(&entry.binary[entry::PAYLOAD]),
                })
            } else {
                expect
            };
            json!({ "case": name, "id": id, "fields": given, "expect": expect })
        })
        .collect()
}

fn assignments() -> Json {
    let cases: [(u32, &[&str]); 7] = [
        (4, &[]),
        (4, &["solo"]),
        (8, &["a", "b"]),
        (8, &["a", "b", "c"]),
        (16, &["workers-0", "workers-1", "workers-2"]),
        (3, &["a", "b", "c", "d", "e"]),
        (16, &["workers-0", "workers-1", "workers-2", "workers-3"]),
    ];
    let out: Vec<Json> = cases
        .iter()
        .map(|(shards, members)| {
            let members: Vec<String> = members.iter().map(|m| m.to_string()).collect();
            let mut owners = BTreeMap::new();
            for m in &members {
                let mine = assign(*shards, &members, m);
                let ks: Vec<u32> = (0..*shards).filter(|k| mine[*k as usize]).collect();
                owners.insert(m.clone(), ks);
            }
            // An instance not in the set wants nothing (unless the set is empty: everything).
            let outsider = assign(*shards, &members, "not-a-member");
            let outsider: Vec<u32> = (0..*shards).filter(|k| outsider[*k as usize]).collect();
            json!({ "shards": shards, "members": members, "wanted": owners, "not_a_member": outsider })
        })
        .collect();
    let weights: Vec<Json> = [("a", 0u32), ("a", 1), ("b", 0), ("workers-2", 15)]
        .into_iter()
        .map(
            |(m, k)| json!({ "member": m, "shard": k, "weight": format!("{:016x}", weight(m, k)) }),
        )
        .collect();
    json!({ "cases": out, "weights": weights })
}

fn libraries() -> Json {
    Json::Array(
        crate::functions::libraries()
            .iter()
            .map(|l| json!({ "name": l.name(), "code": l.code() }))
            .collect(),
    )
}

fn vectors() -> Json {
    json!({
        "contract": 1,
        "fnv1a64": hashes(),
        "shard_of": shards(),
        "keys": key_names(),
        "entry_ids": entry_ids(),
        "entries": entries(),
        "assign": assignments(),
        "dead_letter_fields": dead_letter::ALL,
        "dead_letter_entry_prefix": dead_letter::ENTRY_PREFIX,
        "libraries": libraries(),
    })
}

#[test]
fn fnv1a64_is_the_reference_hash() {
    // From the FNV reference test suite (Noll's `test_fnv.c`, FNV-1a 64).
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    for key in KEYS {
        for n in SHARD_COUNTS {
            assert_eq!(
                u64::from(shard_of(Some(key.as_bytes()), n)),
                fnv1a64(key.as_bytes()) % u64::from(n),
                "{key:?} over {n}"
            );
        }
    }
}

#[test]
fn the_committed_vectors_are_what_this_crate_computes() {
    let made = serde_json::to_string_pretty(&vectors()).unwrap() + "\n";
    if std::env::var_os("UPDATE_VECTORS").is_some() {
        std::fs::create_dir_all(std::path::Path::new(PATH).parent().unwrap()).unwrap();
        std::fs::write(PATH, &made).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(PATH)
        .unwrap_or_else(|e| panic!("{PATH}: {e} (UPDATE_VECTORS=1 writes it)"));
    assert!(
        committed == made,
        "docs/contract/vectors-v1.json differs from what this crate computes: a change of the \
         contract must be deliberate (see docs/contract/v1.md, \"Versions\"); UPDATE_VECTORS=1 \
         writes it anew"
    );
}
