//! The receiving end of an outbox stream written by `cdc-relay` (the contract:
//! `outbox_core::stream`): every entry recorded once by the application, in order per key,
//! through consumer crashes, pauses, deploys and Redis restarts.
//!
//! The application implements [`Inbox`]: decode an entry, record a batch of them in one
//! transaction that first checks the shard's [`Fence`] (with Postgres: [`fence::FenceTable`]),
//! and act after the commit. [`Consumer::start`] does the rest:
//! - one active consumer per shard (a Redis lease), fenced where the writes land, so a
//!   paused holder that wakes after losing the lease writes nothing;
//! - the shards shared fairly among the group's live instances (a heartbeat set; an
//!   instance that cannot reach its database while another can gives its shards up);
//! - on taking a shard, every pending entry claimed and finished in id order before new
//!   ones; entries of a consumer that died claimed after `claim_idle`;
//! - `XACK` only after the application's commit; a redelivered entry is handed over again
//!   (the application's inbox absorbs it);
//! - an entry that cannot be decoded, that the database refuses for its own data, or whose
//!   processing ended with its consumer process `max_deliveries` times (counted by attempt
//!   records, so restarts and handovers never count) is dead-lettered with the reason,
//!   atomically with its `XACK`, and never blocks the entries after it;
//! - through a backlog, entries whose order key has nothing older unprocessed are recorded
//!   ahead of the reads ([`Inbox::order_key`]), so a quiet key is not held behind a burst;
//! - readiness ([`ConsumerStatus`]) and metrics ([`ConsumerMetrics`]).
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::{Duration, SystemTime};
//!
//! use outbox_consumer::fence::{classify, FenceTable};
//! use outbox_consumer::{Consumer, ConsumerConfig, ConsumerMetrics, Entry, Fence, Inbox, RecordError};
//!
//! struct Orders {
//!     db: tokio::sync::Mutex<tokio_postgres::Client>,
//!     fence: FenceTable,
//! }
//!
//! impl Inbox for Orders {
//!     type Item = (i64, String); // (outbox id, payload)
//!     type Recorded = ();
//!
//!     fn decode(&self, entry: &Entry) -> Result<Self::Item, String> {
//!         let fields = entry.decode().map_err(|e| e.to_string())?;
//!         let id = fields.outbox_id.and_then(|id| id.parse().ok()).ok_or("no outbox_id")?;
//!         Ok((id, fields.payload.to_string()))
//!     }
//!
//!     async fn claim_fence(&self, consumer: &str, shard: u32) -> Result<i64, RecordError> {
//!         let db = self.db.lock().await;
//!         self.fence.claim(&*db, consumer, shard).await.map_err(|e| classify(&e))
//!     }
//!
//!     async fn record(&self, batch: &[(Entry, Self::Item)], fence: Fence) -> Result<(), RecordError> {
//!         let mut db = self.db.lock().await;
//!         let tx = db.transaction().await.map_err(|e| classify(&e))?;
//!         self.fence.check(&tx, fence).await?;
//!         for (_, (id, payload)) in batch {
//!             tx.execute(
//!                 "INSERT INTO orders_inbox (outbox_id, payload) VALUES ($1, $2::text::jsonb)
//!                  ON CONFLICT (outbox_id) DO NOTHING",
//!                 &[id, payload],
//!             )
//!             .await
//!             .map_err(|e| classify(&e))?;
//!         }
//!         tx.commit().await.map_err(|e| classify(&e))
//!     }
//!
//!     fn committed(&self, _: &[(Entry, Self::Item)], _: (), _: SystemTime) -> Result<(), String> {
//!         Ok(())
//!     }
//!
//!     async fn ping(&self, deadline: Duration) -> Result<(), RecordError> {
//!         let ping = async {
//!             let db = self.db.lock().await;
//!             db.simple_query("SELECT 1").await.map(drop).map_err(|e| classify(&e))
//!         };
//!         tokio::time::timeout(deadline, ping)
//!             .await
//!             .unwrap_or_else(|_| Err(RecordError::Unavailable("no answer in time".into())))
//!     }
//! }
//!
//! # async fn run(orders: Orders, redis: outbox_core::connect::RedisTarget) {
//! let config = ConsumerConfig::new(redis, "outbox:orders", 4, "billing", "billing-1");
//! config.validate().expect("a configuration that works");
//! let metrics = ConsumerMetrics::register(prometheus::default_registry(), "billing").unwrap();
//! let (status, _ready) = tokio::sync::watch::channel(Default::default());
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! let consumer = Consumer::start(config, Arc::new(orders), Arc::new(metrics), status, &shutdown);
//! // ... on SIGTERM:
//! shutdown.cancel();
//! consumer.stop().await;
//! # }
//! ```
//!
//! The keys it uses (leases, attempt records, members, dead letters) derive from the stream
//! and group names: `outbox_core::stream::keys`.

mod config;
mod consumer;
#[cfg(test)]
mod contract;
pub mod fence;
pub mod functions;
mod inbox;
mod members;
mod metrics;
mod shard;
mod status;

pub use config::ConsumerConfig;
pub use consumer::{Consumer, STOP_WAIT};
pub use inbox::{Entry, Fence, Inbox, RecordError};
pub use metrics::ConsumerMetrics;
pub use status::{ConsumerRole, ConsumerStatus};
