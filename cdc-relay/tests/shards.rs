//! A stream split into shards, on real servers with the relay binary: every row lands in
//! the shard its partition key hashes to, each shard in commit order with the ids a single
//! stream would have; a shard that lost its data is caught up from the outbox without
//! duplicating the others; a shard that refused every write falls behind (the slot moves on)
//! and gets its rows once it accepts again; a relay configured with another shard count is
//! refused.

use std::collections::HashSet;
use std::time::Duration;

use crate::support::{read_stream, tail, Entry, Fixture, RelayProcess};
use outbox_core::stream::shard_key;
use testkit::{shared_postgres, wait_until, RedisServer};

const SHARDS: u32 = 8;

/// Insert one transaction of rows for `chats` (one row each, in order). Like the chat
/// services (a send locks its chat's feed counter before writing its outbox row), it locks
/// its chats first (in one order, so writers never deadlock): rows of one chat are written
/// one transaction after another, so their outbox ids follow their commit order, which is
/// what a catch-up from the outbox table keeps.
async fn insert_chat_txn(
    client: &mut tokio_postgres::Client,
    writer: u32,
    txn: u32,
    chats: &[i64],
) -> Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let mut locks: Vec<i64> = chats.to_vec();
    locks.sort_unstable();
    locks.dedup();
    tx.execute(
        "SELECT pg_advisory_xact_lock(c) FROM unnest($1::bigint[]) c",
        &[&locks],
    )
    .await?;
    for (row, chat) in chats.iter().enumerate() {
        let payload =
            serde_json::json!({"chat_id": chat, "writer": writer, "txn": txn, "row": row});
        tx.execute(
            "INSERT INTO consumers.outbox (event, payload, partition_key) VALUES ('test.event', $1::text::jsonb, $2)",
            &[&payload.to_string(), &chat.to_string()],
        )
        .await?;
    }
    tx.commit().await
}

async fn shard_entries(fx: &Fixture<'_>) -> Vec<Vec<Entry>> {
    let mut all = Vec::new();
    for k in 0..SHARDS {
        all.push(
            read_stream(fx.redis, &shard_key(&fx.stream, k, SHARDS))
                .await
                .unwrap(),
        );
    }
    all
}

/// Wait until every shard holds exactly what committed (the shard's rows, once, in order).
async fn assert_shards_hold_exactly_what_committed(fx: &Fixture<'_>, relay: &RelayProcess) {
    let expected = crate::support::expected_by_shard(&fx.witness().await, SHARDS);
    assert!(
        expected.iter().filter(|s| !s.is_empty()).count() >= SHARDS as usize - 1,
        "the chats spread over the shards: {:?}",
        expected.iter().map(Vec::len).collect::<Vec<_>>()
    );
    wait_until(
        Duration::from_secs(60),
        "every shard holds its rows",
        || async {
            let actual = shard_entries(fx).await;
            let behind: Vec<(usize, usize, usize)> = (0..SHARDS as usize)
                .filter(|k| actual[*k].len() < expected[*k].len())
                .map(|k| (k, actual[k].len(), expected[k].len()))
                .collect();
            if behind.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "(shard, has, needs): {behind:?}; log: {}",
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    let actual = shard_entries(fx).await;
    for k in 0..SHARDS as usize {
        let ids = |entries: &[Entry]| {
            entries
                .iter()
                .map(|e| (e.id.clone(), e.outbox_id.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            ids(&actual[k]),
            ids(&expected[k]),
            "shard {k}: stream vs committed (id, outbox id)"
        );
        assert_eq!(actual[k], expected[k], "shard {k}: entries' fields");
    }
}

/// Four writers, `txns` transactions each of 1 to 4 rows over 40 chats.
async fn write_concurrently(fx: &Fixture<'_>, round: u32, txns: u32) {
    let mut writers = Vec::new();
    for w in 0..4u32 {
        let mut client = fx.writer().await;
        writers.push(tokio::spawn(async move {
            for t in 0..txns {
                let n = 1 + ((w + t) % 4) as usize;
                let chats: Vec<i64> = (0..n)
                    .map(|r| 1 + i64::from((round * 7919 + w * 131 + t * 17 + r as u32 * 3) % 40))
                    .collect();
                insert_chat_txn(&mut client, w, t, &chats).await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_chat_lands_in_its_shard_in_commit_order() {
    // GIVEN a stream of 8 shards and a relay streaming it
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &redis, SHARDS).await;
    let relay = fx.spawn_relay("relay", &[]);
    relay.wait_streaming().await;

    // WHEN four writers commit transactions spanning several chats (so shards) at once
    write_concurrently(&fx, 0, 60).await;

    // THEN each shard holds exactly its chats' rows, in commit order, with single-stream ids
    assert_shards_hold_exactly_what_committed(&fx, &relay).await;
    // AND every shard's record names the shard count
    let mut conn = redis.connect().await.unwrap();
    for k in 0..SHARDS {
        let shards: Option<String> = redis::cmd("HGET")
            .arg(format!("{}:origin", shard_key(&fx.stream, k, SHARDS)))
            .arg("shards")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(shards.as_deref(), Some("8"), "shard {k}'s record");
    }
    // AND a graceful stop leaves the slot past the last commit, though most batches
    // acknowledged only in the shards they wrote
    relay.stop();
    let last_end = fx.witness().await.last().unwrap().end_lsn;
    let confirmed = fx.confirmed_flush_lsn().await;
    assert!(
        confirmed >= last_end,
        "slot confirmed {confirmed:X}, last commit ends at {last_end:X}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_refusing_every_write_falls_behind_and_gets_all_its_rows_once_it_accepts_again() {
    // GIVEN a relay on 8 shards that lets a shard fall behind after 1 s
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &redis, SHARDS).await;
    let relay = fx.spawn_relay("relay", &["--shard-detach-after", "1s"]);
    relay.wait_streaming().await;
    write_concurrently(&fx, 0, 5).await;
    assert_shards_hold_exactly_what_committed(&fx, &relay).await;

    // WHEN shard 3 refuses every write (its record replaced by a string: every call there
    // fails at once) while writers commit rows for every shard
    let stuck = crate::support::StuckShard::start(&redis, &shard_key(&fx.stream, 3, SHARDS)).await;
    write_concurrently(&fx, 1, 40).await;

    // THEN it falls behind, the slot moves past its rows, and the other shards get theirs
    crate::support::wait_metric(
        &relay,
        "cdc_relay_shard_behind{shard=\"3\"}",
        "shard 3 behind",
        |v| v == 1.0,
    )
    .await;
    let last_end = fx.witness().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(30),
        "the slot past the last commit",
        || async {
            let confirmed = fx.confirmed_flush_lsn().await;
            if confirmed >= last_end {
                Ok(())
            } else {
                Err(format!("confirmed {confirmed:X} < {last_end:X}"))
            }
        },
    )
    .await;

    // ... and once it accepts again, it gets every one of its rows, once, each chat in order
    stuck.release().await;
    write_concurrently(&fx, 2, 5).await;
    crate::support::wait_metric(
        &relay,
        "cdc_relay_shard_behind{shard=\"3\"}",
        "shard 3 live again",
        |v| v == 0.0,
    )
    .await;
    assert_shards_hold_exactly_after_rebuild(&fx, &relay, None, &[3]).await;
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_lost_its_data_is_rebuilt_without_duplicating_the_others() {
    // GIVEN 8 shards holding what four writers committed
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &redis, SHARDS).await;
    let relay = fx.spawn_relay("relay-1", &[]);
    relay.wait_streaming().await;
    write_concurrently(&fx, 0, 30).await;
    assert_shards_hold_exactly_what_committed(&fx, &relay).await;
    relay.stop();
    let mut conn = redis.connect().await.unwrap();

    // WHEN shard 3 loses its entries but keeps its record (a stale node), and the relay
    // starts again while writers go on
    let () = redis::cmd("DEL")
        .arg(shard_key(&fx.stream, 3, SHARDS))
        .query_async(&mut conn)
        .await
        .unwrap();
    let relay = fx.spawn_relay("relay-2", &[]);
    relay.wait_streaming().await;
    write_concurrently(&fx, 1, 10).await;

    // THEN shard 3 gets its rows back, and no shard holds anything twice
    assert_shards_hold_exactly_after_rebuild(&fx, &relay, Some("lost_redis_data"), &[3]).await;
    relay.stop();

    // WHEN shard 5 loses everything, its record too
    let () = redis::cmd("DEL")
        .arg(shard_key(&fx.stream, 5, SHARDS))
        .arg(format!("{}:origin", shard_key(&fx.stream, 5, SHARDS)))
        .query_async(&mut conn)
        .await
        .unwrap();
    let relay = fx.spawn_relay("relay-3", &[]);
    relay.wait_streaming().await;
    write_concurrently(&fx, 2, 10).await;

    // THEN the same
    assert_shards_hold_exactly_after_rebuild(&fx, &relay, Some("no_record"), &[3, 5]).await;
    relay.stop();
}

/// After rebuilds of the shards `rebuilt`: the other shards hold exactly what committed
/// (nothing was republished into them); each rebuilt one holds each of its rows once
/// (republished ones above its old top, in outbox order, so their ids are not commit LSNs).
async fn assert_shards_hold_exactly_after_rebuild(
    fx: &Fixture<'_>,
    relay: &RelayProcess,
    reason: Option<&str>,
    rebuilt: &[usize],
) {
    if let Some(reason) = reason {
        crate::support::wait_rebuild_counted(relay, reason).await;
    }
    let expected = crate::support::expected_by_shard(&fx.witness().await, SHARDS);
    wait_until(
        Duration::from_secs(60),
        "every shard holds its rows",
        || async {
            let actual = shard_entries(fx).await;
            let missing: Vec<(usize, usize)> = (0..SHARDS as usize)
                .map(|k| {
                    let have: HashSet<&str> =
                        actual[k].iter().map(|e| e.outbox_id.as_str()).collect();
                    (
                        k,
                        expected[k]
                            .iter()
                            .filter(|e| !have.contains(e.outbox_id.as_str()))
                            .count(),
                    )
                })
                .filter(|(_, n)| *n > 0)
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "(shard, missing rows): {missing:?}; log: {}",
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    let actual = shard_entries(fx).await;
    for k in 0..SHARDS as usize {
        if !rebuilt.contains(&k) {
            assert_eq!(actual[k], expected[k], "shard {k} (not rebuilt)");
            continue;
        }
        crate::support::assert_caught_up(&actual[k], &expected[k], &format!("shard {k}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_with_another_shard_count_is_refused_with_what_to_change() {
    // GIVEN a stream set up with 8 shards
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::sharded(shared_postgres(), &redis, SHARDS).await;
    for other in ["4", "1"] {
        // WHEN a relay says another count
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
            .arg("run")
            .args(fx.flags(&["--stream-shards", other, "--admin-addr", ""]))
            .output()
            .unwrap();
        // THEN it stops at once, saying what the stream has and which flag to change
        crate::support::assert_refused(&output, &["set up with 8 shard(s)", "--stream-shards"]);
    }
    // AND nothing was written under the other layout
    let mut conn = redis.connect().await.unwrap();
    let plain: bool = redis::cmd("EXISTS")
        .arg(format!("{}:origin", fx.stream))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!plain, "a record of the plain stream appeared");
}

fn reshard(fx: &Fixture<'_>, shards: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
        .arg("reshard")
        .args(fx.flags(&["--stream-shards", shards, "--admin-addr", ""]))
        .output()
        .unwrap()
}

/// Read `count` new entries of `stream` as group `g` and acknowledge them.
async fn consume(redis: &RedisServer, stream: &str, count: usize) -> usize {
    let mut conn = redis.connect().await.unwrap();
    let _: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg("g")
        .arg("0")
        .query_async(&mut conn)
        .await;
    let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("c")
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    let ids: Vec<String> = reply
        .keys
        .iter()
        .flat_map(|k| k.ids.iter().map(|e| e.id.clone()))
        .collect();
    if !ids.is_empty() {
        let _: i64 = redis::cmd("XACK")
            .arg(stream)
            .arg("g")
            .arg(&ids)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    ids.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_stream_is_resized_and_streams_on_without_republishing() {
    // GIVEN a plain stream (one shard) a consumer group has read part of, and its relay
    // stopped while writers go on (their rows wait in the slot)
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let relay = fx.spawn_relay("relay-1", &[]);
    relay.wait_streaming().await;
    write_concurrently(&fx, 0, 10).await;
    let published = crate::support::outbox_ids(&fx).await;
    crate::support::wait_published(&fx, &published, &relay).await;
    assert_eq!(consume(&redis, &fx.stream, 5).await, 5);
    relay.stop();
    write_concurrently(&fx, 1, 10).await;

    // WHEN the operator resizes to 8 before the group read everything: refused, saying why
    crate::support::assert_refused(
        &reshard(&fx, "8"),
        &["group g has not finished", "reshard again"],
    );

    // AND after the group drained the stream: done
    consume(&redis, &fx.stream, 10_000).await;
    let output = reshard(&fx, "8");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains("resized from 1 to 8"));

    // THEN a relay still configured with one shard is refused
    let old = std::process::Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
        .arg("run")
        .args(fx.flags(&["--admin-addr", ""]))
        .output()
        .unwrap();
    crate::support::assert_refused(&old, &["set up with 8 shard(s)", "--stream-shards"]);

    // AND the relay with 8 streams on from the slot: the rows committed while it was
    // stopped, and every later one, land in their shards in commit order, nothing
    // republished and nothing in the old stream twice
    let relay = fx.spawn_relay("relay-2", &["--stream-shards", "8"]);
    relay.wait_streaming().await;
    write_concurrently(&fx, 2, 10).await;
    let old_stream: HashSet<String> = read_stream(&redis, &fx.stream)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.outbox_id)
        .collect();
    assert_eq!(old_stream.len(), published.len(), "old stream untouched");
    let expected: Vec<Vec<Entry>> = crate::support::expected_by_shard(&fx.witness().await, SHARDS)
        .into_iter()
        .map(|shard| {
            shard
                .into_iter()
                .filter(|e| !old_stream.contains(&e.outbox_id))
                .collect()
        })
        .collect();
    let want: usize = expected.iter().map(Vec::len).sum();
    wait_until(
        Duration::from_secs(60),
        "the new rows in the shards",
        || async {
            let have: usize = shard_entries(&fx).await.iter().map(Vec::len).sum();
            if have >= want {
                Ok(())
            } else {
                Err(format!(
                    "{have} of {want}; log: {}",
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
    assert_eq!(shard_entries(&fx).await, expected);
    let rebuilds: f64 = crate::support::metrics(&relay)
        .await
        .iter()
        .filter(|(k, _)| k.starts_with("cdc_relay_rebuilds_total"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(rebuilds, 0.0, "nothing rebuilt");
    relay.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_resized_twice_streams_on_with_the_last_count() {
    // GIVEN a plain stream resized to 4 shards, streaming there
    let redis = RedisServer::start().unwrap();
    let fx = Fixture::new(shared_postgres(), &redis).await;
    let relay = fx.spawn_relay("relay-1", &[]);
    relay.wait_streaming().await;
    write_concurrently(&fx, 0, 5).await;
    crate::support::wait_published(&fx, &crate::support::outbox_ids(&fx).await, &relay).await;
    relay.stop();
    consume(&redis, &fx.stream, 10_000).await;
    assert!(reshard(&fx, "4").status.success());
    let relay = fx.spawn_relay("relay-2", &["--stream-shards", "4"]);
    relay.wait_streaming().await;
    write_concurrently(&fx, 1, 5).await;
    let want = crate::support::outbox_ids(&fx).await.len();
    wait_until(Duration::from_secs(60), "rows in the 4 shards", || async {
        let mut have = read_stream(&redis, &fx.stream).await.unwrap().len();
        for key in outbox_core::stream::shard_keys(&fx.stream, 4) {
            have += read_stream(&redis, &key).await.unwrap().len();
        }
        if have >= want {
            Ok(())
        } else {
            Err(format!("{have} of {want}"))
        }
    })
    .await;
    relay.stop();

    // WHEN it is drained and resized again, to 8
    for key in outbox_core::stream::shard_keys(&fx.stream, 4) {
        consume(&redis, &key, 10_000).await;
    }
    let output = reshard(&fx, "8");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    // THEN a relay with 8 streams, and one still saying 4 is refused
    let relay = fx.spawn_relay("relay-3", &["--stream-shards", "8"]);
    relay.wait_streaming().await;
    relay.stop();
    let old = std::process::Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
        .arg("run")
        .args(fx.flags(&["--stream-shards", "4", "--admin-addr", ""]))
        .output()
        .unwrap();
    crate::support::assert_refused(&old, &["set up with 8 shard(s)"]);
}
