//! Writing to the outbox as the services would (transactions of rows), WAL noise outside
//! the publication, and a shard that refuses every write ([`StuckShard`]).

use testkit::RedisServer;

/// Insert `rows` outbox rows in one transaction; payload marks writer, txn and row.
pub(crate) async fn insert_txn(
    client: &mut tokio_postgres::Client,
    writer: u32,
    txn: u32,
    rows: u32,
    commit: bool,
) -> Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    for row in 0..rows {
        let payload =
            serde_json::json!({"writer": writer, "txn": txn, "row": row, "committed": commit});
        tx.execute(
            "INSERT INTO consumers.outbox (event, payload) VALUES ('test.event', $1::text::jsonb)",
            &[&payload.to_string()],
        )
        .await?;
    }
    if commit {
        tx.commit().await
    } else {
        tx.rollback().await
    }
}

/// Bytes of WAL written into a table outside the publication.
pub(crate) async fn write_noise(db: &tokio_postgres::Client, megabytes: usize) {
    db.batch_execute("CREATE TABLE IF NOT EXISTS public.noise (pad text)")
        .await
        .unwrap();
    for _ in 0..megabytes {
        db.batch_execute(
            "INSERT INTO public.noise SELECT repeat('x', 1000) FROM generate_series(1, 1000)",
        )
        .await
        .unwrap();
    }
}

/// A shard that refuses every write: its record is swapped for a string (the publish script
/// fails with WRONGTYPE, which the relay retries as it would a node that refuses writes),
/// its stream left as it is. [`StuckShard::release`] puts the record back as it was.
pub(crate) struct StuckShard {
    conn: redis::aio::MultiplexedConnection,
    key: String,
    dump: Vec<u8>,
}

impl StuckShard {
    pub(crate) async fn start(redis: &RedisServer, shard_stream: &str) -> Self {
        let mut conn = redis.connect().await.unwrap();
        let key = format!("{shard_stream}:origin");
        let dump: Vec<u8> = redis::cmd("DUMP")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let () = redis::cmd("SET")
            .arg(&key)
            .arg("refusing writes")
            .query_async(&mut conn)
            .await
            .unwrap();
        Self { conn, key, dump }
    }

    pub(crate) async fn release(mut self) {
        let () = redis::cmd("RESTORE")
            .arg(&self.key)
            .arg(0)
            .arg(&self.dump)
            .arg("REPLACE")
            .query_async(&mut self.conn)
            .await
            .unwrap();
    }
}
