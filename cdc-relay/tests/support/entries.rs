//! Stream entries as the tests compare them: reading a stream or shard, what the witness
//! slot says it must hold, and the comparisons (same entries, caught up, published).

use std::collections::HashMap;
use std::time::Duration;

use cdc_relay::decode::{self as pgoutput, OutboxEvent, PgOutput, RelationCache, Row};
use redis::streams::StreamRangeReply;
use testkit::{wait_until, RedisServer, TestDb};

use super::{tail, Fixture, RelayProcess, OUTBOX, PUBLICATION};

/// A stream entry as the tests compare it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub id: String,
    pub outbox_id: String,
    pub event: String,
    pub payload: serde_json::Value,
    pub created_at: String,
}

pub(crate) async fn read_stream(redis: &RedisServer, stream: &str) -> anyhow::Result<Vec<Entry>> {
    let mut conn = redis.connect().await?;
    let mut entries = Vec::new();
    let mut start = "-".to_string();
    loop {
        let reply: StreamRangeReply = redis::cmd("XRANGE")
            .arg(stream)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(2_000)
            .query_async(&mut conn)
            .await?;
        let n = reply.ids.len();
        for item in reply.ids {
            let field = |name: &str| -> String {
                item.map
                    .get(name)
                    .map(|v| redis::from_redis_value_ref::<String>(v).unwrap_or_default())
                    .unwrap_or_default()
            };
            entries.push(Entry {
                id: item.id.clone(),
                outbox_id: field("outbox_id"),
                event: field("event"),
                payload: serde_json::from_str(&field("payload")).unwrap_or(serde_json::Value::Null),
                created_at: field("created_at"),
            });
            start = format!("({}", item.id);
        }
        if n < 2_000 {
            return Ok(entries);
        }
    }
}

pub(crate) fn parse_lsn(text: &str) -> u64 {
    let (hi, lo) = text.split_once('/').expect("LSN hi/lo");
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

/// One committed transaction as the witness slot saw it.
#[derive(Debug, Clone)]
pub(crate) struct WitnessTxn {
    pub commit_lsn: u64,
    pub end_lsn: u64,
    pub events: Vec<OutboxEvent>,
}

pub(crate) async fn read_witness(db: &TestDb, slot: &str) -> Vec<WitnessTxn> {
    let client = db.connect().await.unwrap();
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                 'proto_version', '1', 'publication_names', $2)",
            &[&slot, &PUBLICATION],
        )
        .await
        .expect("peek witness slot");
    let mut relations = RelationCache::new(OUTBOX.parse().unwrap());
    let mut txns = Vec::new();
    let mut open: Option<WitnessTxn> = None;
    for row in rows {
        let data: Vec<u8> = row.get(0);
        let be64 = |at: usize| u64::from_be_bytes(data[at..at + 8].try_into().unwrap());
        match data[0] {
            b'B' => {
                open = Some(WitnessTxn {
                    commit_lsn: be64(1),
                    end_lsn: 0,
                    events: Vec::new(),
                })
            }
            b'C' => {
                let mut txn = open.take().expect("commit after begin");
                assert_eq!(txn.commit_lsn, be64(2), "commit lsn = begin final_lsn");
                txn.end_lsn = be64(10);
                txns.push(txn);
            }
            _ => match pgoutput::decode(&bytes::Bytes::from(data)).expect("witness decodes") {
                PgOutput::Relation(rel) => relations.on_relation(&rel).unwrap(),
                PgOutput::Insert(ins) => {
                    if let Row::Outbox(event) = relations.on_insert(ins).unwrap() {
                        open.as_mut().expect("insert inside txn").events.push(event);
                    }
                }
                PgOutput::Skipped(_) => {}
            },
        }
    }
    txns
}

pub(crate) fn expected_from(txns: &[WitnessTxn]) -> Vec<Entry> {
    let text = |b: &bytes::Bytes| String::from_utf8(b.to_vec()).unwrap();
    txns.iter()
        .flat_map(|txn| {
            txn.events.iter().enumerate().map(move |(k, e)| Entry {
                id: format!("{}-{k}", txn.commit_lsn),
                outbox_id: text(&e.outbox_id),
                event: text(&e.event),
                payload: serde_json::from_slice(&e.payload).unwrap(),
                created_at: e.created_at.as_ref().map(text).unwrap_or_default(),
            })
        })
        .collect()
}

/// What each shard must hold: every committed row in the shard of its partition key, in
/// commit order, with the id `<commit_lsn>-<position in its transaction>`.
pub(crate) fn expected_by_shard(txns: &[WitnessTxn], count: u32) -> Vec<Vec<Entry>> {
    let mut shards = vec![Vec::new(); count as usize];
    let text = |b: &bytes::Bytes| String::from_utf8(b.to_vec()).unwrap();
    for txn in txns {
        for (k, e) in txn.events.iter().enumerate() {
            let shard = outbox_core::stream::shard_of(e.key.as_deref(), count);
            shards[shard as usize].push(Entry {
                id: format!("{}-{k}", txn.commit_lsn),
                outbox_id: text(&e.outbox_id),
                event: text(&e.event),
                payload: serde_json::from_slice(&e.payload).unwrap(),
                created_at: e.created_at.as_ref().map(text).unwrap_or_default(),
            });
        }
    }
    shards
}

/// Compare two entry lists and describe the first difference.
pub(crate) fn assert_same_entries(actual: &[Entry], expected: &[Entry]) {
    if actual == expected {
        return;
    }
    let first_diff = actual
        .iter()
        .zip(expected)
        .position(|(a, e)| a != e)
        .unwrap_or(actual.len().min(expected.len()));
    let actual_ids: HashMap<&str, usize> =
        actual
            .iter()
            .map(|e| e.outbox_id.as_str())
            .fold(HashMap::new(), |mut m, id| {
                *m.entry(id).or_default() += 1;
                m
            });
    let duplicated = actual_ids.values().filter(|n| **n > 1).count();
    let missing = expected
        .iter()
        .filter(|e| !actual_ids.contains_key(e.outbox_id.as_str()))
        .count();
    panic!(
        "stream differs from what committed: {} entries vs {} expected; {missing} missing, {duplicated} duplicated; first difference at #{first_diff}: {:?} vs {:?}",
        actual.len(),
        expected.len(),
        actual.get(first_diff),
        expected.get(first_diff)
    );
}

/// A stream (or shard) that was caught up from the outbox table holds each committed row of
/// `expected` exactly once, and nothing else, and each chat's (or, without chats, each
/// writer's) rows in commit order; its ids need not be commit LSNs.
pub(crate) fn assert_caught_up(actual: &[Entry], expected: &[Entry], what: &str) {
    let got: Vec<&str> = actual.iter().map(|e| e.outbox_id.as_str()).collect();
    let unique: std::collections::HashSet<&str> = got.iter().copied().collect();
    assert_eq!(unique.len(), got.len(), "{what}: a row twice");
    let want: std::collections::HashSet<&str> =
        expected.iter().map(|e| e.outbox_id.as_str()).collect();
    let missing = want.difference(&unique).count();
    let extra = unique.difference(&want).count();
    assert!(
        missing == 0 && extra == 0,
        "{what}: {missing} rows missing, {extra} rows that never committed"
    );
    let key = |e: &Entry| {
        e.payload
            .get("chat_id")
            .or_else(|| e.payload.get("writer"))
            .map(|v| v.to_string())
            .unwrap_or_default()
    };
    let order = |entries: &[Entry]| {
        let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
        for e in entries {
            by_key.entry(key(e)).or_default().push(e.outbox_id.clone());
        }
        by_key
    };
    let (got, want) = (order(actual), order(expected));
    for (k, ids) in &want {
        assert_eq!(got.get(k), Some(ids), "{what}: order of {k}'s rows");
    }
}

/// Outbox ids in the stream, with how many times each appears.
pub(crate) async fn stream_ids(fx: &Fixture<'_>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for e in fx.stream_entries().await {
        *counts.entry(e.outbox_id).or_default() += 1;
    }
    counts
}

/// Wait until every one of `outbox_ids` has an entry in the stream.
pub(crate) async fn wait_published(fx: &Fixture<'_>, outbox_ids: &[String], relay: &RelayProcess) {
    wait_until(
        Duration::from_secs(30),
        "every outbox row in the stream",
        || async {
            let ids = stream_ids(fx).await;
            let missing = outbox_ids
                .iter()
                .filter(|id| !ids.contains_key(*id))
                .count();
            if missing == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{missing} of {} missing; log: {}",
                    outbox_ids.len(),
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
}

pub(crate) async fn outbox_ids(fx: &Fixture<'_>) -> Vec<String> {
    let db = fx.db.connect().await.unwrap();
    db.query("SELECT id::text FROM consumers.outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// A stream id as a comparable pair.
pub(crate) fn parse_stream_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').expect("a stream id");
    (ms.parse().unwrap(), seq.parse().unwrap())
}
