//! An outbox stream's entries recorded once each into a table of one's own (`inbox.received`,
//! fenced by `inbox.fence`; both made if missing): all an application writes to consume a
//! `cdc-relay` stream with `outbox-consumer`. Outbox ids identify entries (a relay's rebuild
//! may send one again under a new stream id).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::Parser;
use outbox_consumer::fence::{classify, FenceTable};
use outbox_consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, Entry, Fence, Inbox, RecordError,
};
use outbox_core::connect::RedisTarget;
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Args {
    #[arg(long, env = "POSTGRES_URL")]
    postgres_url: String,
    #[arg(long, env = "REDIS_URL")]
    redis_url: String,
    #[arg(long, default_value = "outbox:orders")]
    stream: String,
    #[arg(long, default_value_t = 1)]
    shards: u32,
    #[arg(long, default_value = "billing")]
    group: String,
    #[arg(long)]
    consumer: String,
}

const SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS inbox;
    CREATE TABLE IF NOT EXISTS inbox.received (
      outbox_id bigint PRIMARY KEY, seq bigserial, shard integer NOT NULL,
      event text NOT NULL, payload jsonb NOT NULL);";

/// The table, through one connection (made again when it breaks) whose waits are bounded:
/// a previous holder paused mid-transaction cannot hold the fence's row for long.
struct Table {
    config: tokio_postgres::Config,
    client: Mutex<Option<Client>>,
    fence: FenceTable,
}

#[derive(Clone)]
struct Row {
    outbox_id: i64,
    event: String,
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
        let outbox_id = fields.outbox_id.and_then(|id| id.parse().ok());
        Ok(Row {
            outbox_id: outbox_id.ok_or("no readable outbox_id")?,
            event: fields.event.to_string(),
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
        for (_, row) in batch {
            tx.execute(
                "INSERT INTO inbox.received (outbox_id, shard, event, payload)
                 VALUES ($1, $2, $3, $4::text::jsonb) ON CONFLICT (outbox_id) DO NOTHING",
                &[
                    &row.outbox_id,
                    &(fence.shard as i32),
                    &row.event,
                    &row.payload,
                ],
            )
            .await
            .map_err(|e| classify(&e))?;
        }
        tx.commit().await.map_err(|e| classify(&e))
    }

    fn committed(&self, _: &[(Entry, Row)], _: (), _: SystemTime) -> Result<(), String> {
        Ok(()) // nothing to show: a service would push to its clients here
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    outbox_core::logging::init(outbox_core::logging::LogFormat::Text, "info");
    let args = Args::parse();
    let fence = FenceTable::new("inbox.fence")?;
    let mut config: tokio_postgres::Config = args.postgres_url.parse()?;
    config.options(
        "-c lock_timeout=2s -c statement_timeout=5s -c idle_in_transaction_session_timeout=10s",
    );
    let table = Table {
        config,
        client: Mutex::new(None),
        fence,
    };
    let client = table.client().await.map_err(|e| e.to_string())?;
    client.batch_execute(SCHEMA).await?;
    client.batch_execute(&table.fence.migration()).await?;
    drop(client);
    let redis = RedisTarget::Single(redis::Client::open(args.redis_url)?);
    let config = ConsumerConfig::new(redis, args.stream, args.shards, args.group, args.consumer);
    config.validate()?;
    let metrics = ConsumerMetrics::register(prometheus::default_registry(), "table_inbox")?;
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
