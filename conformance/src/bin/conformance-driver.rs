//! The Rust consumer (`outbox-consumer`) as the conformance suite drives it: configured by
//! the suite's environment (`docs/contract/conformance.md`), it records every entry of the
//! stream into `<schema>.inbox` under the shard's fence in `<schema>.fence`, one
//! transaction per batch, and stops on SIGTERM. Nothing here is the suite's: any language's
//! implementation provides a program that does the same.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use outbox_consumer::fence::{classify, FenceTable};
use outbox_consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, Entry, Fence, Inbox, RecordError,
};
use outbox_core::connect::RedisTarget;
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls};
use tokio_util::sync::CancellationToken;

/// One connection (made again when it breaks) whose waits are bounded: a holder paused in
/// its transaction cannot hold the fence's row for long.
struct Table {
    config: tokio_postgres::Config,
    client: Mutex<Option<Client>>,
    fence: FenceTable,
    schema: String,
    consumer: String,
}

#[derive(Clone)]
struct Row {
    outbox_id: String,
    key: Option<String>,
    payload: String,
}

impl Table {
    async fn client(&self) -> Result<tokio::sync::MappedMutexGuard<'_, Client>, RecordError> {
        let mut slot = self.client.lock().await;
        if slot.as_ref().is_none_or(Client::is_closed) {
            let (client, connection) =
                self.config.connect(NoTls).await.map_err(|e| classify(&e))?;
            tokio::spawn(connection);
            *slot = Some(client);
        }
        Ok(tokio::sync::MutexGuard::map(slot, |c| {
            c.as_mut().expect("connected")
        }))
    }
}

impl Inbox for Table {
    type Item = Row;
    type Recorded = ();

    fn decode(&self, entry: &Entry) -> Result<Row, String> {
        let fields = entry.decode().map_err(|e| e.to_string())?;
        Ok(Row {
            outbox_id: fields.outbox_id.ok_or("no outbox_id")?.to_string(),
            key: entry.key().map(str::to_string),
            payload: fields.payload.to_string(),
        })
    }

    async fn claim_fence(&self, consumer: &str, shard: u32) -> Result<i64, RecordError> {
        let client = self.client().await?;
        self.fence
            .claim(&*client, consumer, shard)
            .await
            .map_err(|e| classify(&e))
    }

    async fn record(&self, batch: &[(Entry, Row)], fence: Fence) -> Result<(), RecordError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(|e| classify(&e))?;
        self.fence.check(&tx, fence).await?;
        let insert = format!(
            "INSERT INTO {}.inbox (outbox_id, stream_id, shard, key, consumer, payload)
             VALUES ($1, $2, $3, $4, $5, $6::text::jsonb) ON CONFLICT (outbox_id) DO NOTHING",
            self.schema
        );
        for (entry, row) in batch {
            tx.execute(
                &insert,
                &[
                    &row.outbox_id,
                    &entry.id,
                    &(fence.shard as i32),
                    &row.key,
                    &self.consumer,
                    &row.payload,
                ],
            )
            .await
            .map_err(|e| classify(&e))?;
        }
        tx.commit().await.map_err(|e| classify(&e))
    }

    fn committed(&self, _: &[(Entry, Row)], _: (), _: SystemTime) -> Result<(), String> {
        Ok(())
    }

    async fn ping(&self, deadline: Duration) -> Result<(), RecordError> {
        let ping = async {
            self.client()
                .await?
                .simple_query("SELECT 1")
                .await
                .map_err(|e| classify(&e))
        };
        match tokio::time::timeout(deadline, ping).await {
            Ok(answer) => answer.map(drop),
            Err(_) => Err(RecordError::Unavailable("no answer in time".into())),
        }
    }
}

/// `CONFORMANCE_<name>`, required.
fn env(name: &str) -> Result<String, String> {
    std::env::var(format!("CONFORMANCE_{name}"))
        .map_err(|_| format!("CONFORMANCE_{name} is not set"))
}

fn millis(name: &str) -> Result<Duration, String> {
    let ms: u64 = env(name)?
        .parse()
        .map_err(|_| format!("CONFORMANCE_{name} is not a number of milliseconds"))?;
    Ok(Duration::from_millis(ms))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    outbox_core::logging::init(outbox_core::logging::LogFormat::Text, "info");
    let schema = env("SCHEMA")?;
    let consumer = env("CONSUMER")?;
    let fence = FenceTable::new(format!("{schema}.fence"))?;
    let mut config: tokio_postgres::Config = env("POSTGRES_URL")?.parse()?;
    config.options(
        "-c lock_timeout=2s -c statement_timeout=5s -c idle_in_transaction_session_timeout=10s",
    );
    let table = Table {
        config,
        client: Mutex::new(None),
        fence,
        schema,
        consumer: consumer.clone(),
    };
    let redis = RedisTarget::Single(redis::Client::open(env("REDIS_URL")?)?);
    let mut config = ConsumerConfig::new(
        redis,
        env("STREAM")?,
        env("SHARDS")?.parse()?,
        env("GROUP")?,
        consumer,
    );
    config.lease_ttl = millis("LEASE_TTL_MS")?;
    config.claim_idle = millis("CLAIM_IDLE_MS")?;
    config.max_deliveries = env("MAX_DELIVERIES")?.parse()?;
    config.validate()?;
    let metrics = ConsumerMetrics::register(prometheus::default_registry(), "conformance")?;
    let shutdown = CancellationToken::new();
    outbox_core::shutdown::cancel_on_signal(shutdown.clone());
    let (status, _) = tokio::sync::watch::channel(Default::default());
    let consumer = Consumer::start(
        config,
        Arc::new(table),
        Arc::new(metrics),
        status,
        &shutdown,
    );
    shutdown.cancelled().await;
    consumer.stop().await;
    Ok(())
}
