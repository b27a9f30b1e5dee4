//! The relay in-process against real Postgres and Redis: what reaches the stream, in which
//! order, and what the slot is acknowledged at.

use std::time::Duration;

use crate::support::{assert_same_entries, insert_txn, Fixture};
use testkit::{shared_postgres, shared_redis, wait_until, PgServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_inserts_arrive_exactly_once_in_commit_order() {
    // GIVEN a relay streaming the consumers outbox
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let relay = fx.start_relay(&[]).await;

    // WHEN 4 concurrent writers commit transactions of 0..=4 inserts and roll some back
    let mut writers = Vec::new();
    for writer in 0..4u32 {
        let mut client = fx.writer().await;
        writers.push(tokio::spawn(async move {
            let (mut committed, mut rolled_back) = (0u32, 0u32);
            for txn in 0..60u32 {
                let rows = (txn * 7 + writer) % 5;
                let commit = (txn + writer) % 6 != 0;
                insert_txn(&mut client, writer, txn, rows, commit)
                    .await
                    .unwrap();
                if commit {
                    committed += rows;
                } else {
                    rolled_back += rows;
                }
            }
            (committed, rolled_back)
        }));
    }
    let (mut committed, mut rolled_back) = (0, 0);
    for w in writers {
        let (c, r) = w.await.unwrap();
        committed += c;
        rolled_back += r;
    }
    assert!(
        rolled_back > 0 && committed > 300,
        "the workload has both kinds"
    );

    // THEN the stream holds exactly the committed inserts, in commit order, with ids
    //  <commit_lsn>-<position> and the rows' fields
    let expected = fx.expected_entries().await;
    assert_eq!(
        expected.len() as u32,
        committed,
        "witness saw every committed insert"
    );
    fx.wait_stream_len(expected.len(), Duration::from_secs(30))
        .await;
    let actual = fx.stream_entries().await;
    assert_same_entries(&actual, &expected);
    assert!(
        actual.iter().all(|e| e.payload["committed"] == true),
        "no rolled-back row"
    );
    // created_at is the row's own timestamp, in RFC 3339.
    let client = fx.db.connect().await.unwrap();
    for e in actual.iter().step_by(37) {
        let same: bool = client
            .query_one(
                "SELECT created_at = $2::text::timestamptz FROM consumers.outbox WHERE id = $1::text::bigint",
                &[&e.outbox_id, &e.created_at],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            same && e.created_at.ends_with('Z') && e.created_at.contains('T'),
            "{e:?}"
        );
        assert_eq!(e.event, "test.event");
    }
    assert_eq!(
        relay.metric("cdc_relay_events_published_total") as usize,
        expected.len()
    );
    assert_eq!(relay.metric("cdc_relay_duplicates_rejected_total"), 0.0);
    relay.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_acknowledges_everything_published() {
    // GIVEN a relay that published 200 transactions
    let fx = Fixture::new(shared_postgres(), shared_redis()).await;
    let relay = fx.start_relay(&["--status-interval", "1s"]).await;
    let mut client = fx.writer().await;
    for txn in 0..200 {
        insert_txn(&mut client, 0, txn, 1, true).await.unwrap();
    }
    fx.wait_stream_len(200, Duration::from_secs(30)).await;
    // WHEN it is shut down (the status interval is long, so only the shutdown path can
    // have sent the final acknowledgement in time)
    relay.stop().await.unwrap();
    // THEN the slot is acknowledged at least at the last transaction's end_lsn
    let witness = fx.witness().await;
    let last_end = witness.last().unwrap().end_lsn;
    let confirmed = fx.confirmed_flush_lsn().await;
    assert!(
        confirmed >= last_end,
        "confirmed {confirmed:X} < last end_lsn {last_end:X}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_does_not_pin_wal_while_other_tables_are_busy() {
    // GIVEN a relay on an idle outbox, on a server of its own (WAL positions are cluster-wide)
    let pg = PgServer::start().unwrap();
    let fx = Fixture::new(&pg, shared_redis()).await;
    let relay = fx.start_relay(&[]).await;
    let mut status = relay.relay.status();
    status
        .wait_for(|s| s.role == cdc_relay::Role::Streaming)
        .await
        .unwrap();

    // WHEN another table takes thousands of writes (tens of MB of WAL)
    let client = fx.db.connect().await.unwrap();
    client
        .batch_execute("CREATE TABLE public.noise (id bigserial, pad text)")
        .await
        .unwrap();
    let start: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    for _ in 0..200 {
        client
            .batch_execute("INSERT INTO public.noise (pad) SELECT repeat('x', 500) FROM generate_series(1, 200)")
            .await
            .unwrap();
    }
    let written: i64 = client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::bigint",
            &[&start],
        )
        .await
        .unwrap()
        .get(0);
    assert!(written > 16 << 20, "only {written} bytes of WAL written");

    // THEN the slot follows: its lag drops under 1 MB
    wait_until(Duration::from_secs(20), "slot lag under 1 MB", || async {
        let lag: i64 = client
            .query_one(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
                   FROM pg_replication_slots WHERE slot_name = $1",
                &[&fx.slot],
            )
            .await
            .unwrap()
            .get(0);
        if lag < 1 << 20 {
            Ok(())
        } else {
            Err(format!("lag {lag} bytes"))
        }
    })
    .await;
    assert_eq!(fx.stream_len().await, 0);
    relay.stop().await.unwrap();
}
