//! This side's inbox, as the stream consumer's application (`outbox_consumer::Inbox`): each
//! message of the other side's stream recorded once in the inbox (taking its place in the
//! chat's feed, fenced per shard in the same statement), then shown on every instance.
//! The receiving protocol itself (leases, claims, attempts, dead letters, sharing the
//! shards) is `outbox_consumer`'s.
//!
//! Invariants:
//! - Shown only after the commit; streams read the feed from the database, so a crash
//!   between commit and hint hides nothing (see `notify` for the safety nets). A
//!   redelivery is shown again (its first showing may never have happened); streams that
//!   sent it skip it by position.
//! - A chat is a message's order key: the consumer may record a quiet chat's messages ahead
//!   of a backlog, never out of the chat's order.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use outbox_consumer::{Entry, Fence, RecordError};
use outbox_core::stream::entry;
use outbox_core::telemetry;
use tracing::info;

use crate::live::hints::Announcer;
use crate::live::hub::Delivery;
use crate::metrics::Metrics;
use crate::model::{self, HistoryItem, Message};
use crate::side::Side;
use crate::store::{Position, Received, Store, StoreError};

/// Test hooks (the `failpoints` feature): SIGKILL this process at a chosen point.
#[derive(Debug, Clone, Default)]
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
pub(crate) struct Failpoints {
    /// Right after the n-th recorded message was committed to the inbox, before it is
    /// acknowledged.
    pub(crate) crash_after_inbox_commit: Option<u64>,
    /// When about to record a message with this body.
    pub(crate) crash_on_body: Option<String>,
}

/// This side's inbox.
pub(crate) struct ChatInbox {
    /// The receiving side (this service).
    side: Side,
    store: Store,
    announcer: Announcer,
    metrics: Arc<Metrics>,
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    failpoints: Failpoints,
    /// Messages recorded so far (for the `failpoints` crash hook).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    recorded: AtomicU64,
}

impl ChatInbox {
    pub(crate) fn new(
        side: Side,
        store: Store,
        announcer: Announcer,
        metrics: Arc<Metrics>,
        failpoints: Failpoints,
    ) -> Self {
        Self {
            side,
            store,
            announcer,
            metrics,
            failpoints,
            recorded: AtomicU64::new(0),
        }
    }

    /// Show what an inbox commit recorded (or found recorded) on every instance, and count
    /// it. Redeliveries are shown again: the first showing may never have happened (the
    /// previous writer killed between its commit and its hint); streams that sent them
    /// skip them by position.
    fn show(
        &self,
        received: &[(Entry, Message)],
        recorded: &HashMap<uuid::Uuid, Position>,
        read_at: SystemTime,
    ) -> Result<(), String> {
        let metrics = &self.metrics;
        let committed = SystemTime::now();
        let committed_micros = committed
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let mut deliveries: HashMap<uuid::Uuid, Delivery> = HashMap::new();
        let mut shown: Vec<HistoryItem> = Vec::with_capacity(received.len());
        let mut seen = std::collections::HashSet::with_capacity(received.len());
        for (entry, message) in received {
            // Two entries of one batch with one message id: the inbox recorded one row, shown
            // once; the other is a duplicate like any redelivery.
            if !seen.insert(message.id) {
                metrics.duplicates_skipped_total.inc();
                continue;
            }
            let Some(position) = recorded.get(&message.id) else {
                // Not written and not there: only a batch refused by a newer writer's epoch
                // does that, and it ends before getting here.
                return Err(format!(
                    "message {} of entry {} has no feed position after the inbox commit",
                    message.id, entry.id
                ));
            };
            let fields = entry.fields.as_ref();
            let published = fields
                .and_then(|f| {
                    entry::EntryFields::decode(|name| f.get(name).map(String::as_str)).ok()
                })
                .and_then(|f| f.published_at());
            let given = entry.trace_context();
            let span = record_span(given.as_ref(), read_at, entry, message, position);
            deliveries.insert(
                message.id,
                Delivery {
                    recorded_at_micros: committed_micros,
                    traceparent: telemetry::passed_on(span.as_ref(), given.as_ref()),
                },
            );
            drop(span);
            if position.new {
                if let Some(published) = published {
                    metrics.published_to_recorded_seconds.observe(
                        committed
                            .duration_since(published)
                            .map_or(0.0, |d| d.as_secs_f64()),
                    );
                }
                metrics.messages_received_total.inc();
                #[cfg(feature = "failpoints")]
                if self.failpoints.crash_after_inbox_commit
                    == Some(
                        self.recorded
                            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                            + 1,
                    )
                {
                    tracing::error!(message_id = %message.id, "failpoint: crashing after the inbox commit, before XACK");
                    // SAFETY: signalling our own process.
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
            } else {
                metrics.duplicates_skipped_total.inc();
                info!(message_id = %message.id, stream_id = %entry.id, trace_id = %entry.trace_id(), pos = position.pos, "redelivery of a message already in the inbox; shown again, recorded once");
            }
            shown.push(HistoryItem {
                message: position.recorded.clone(),
                pos: position.pos,
            });
        }
        shown.sort_by_key(|item| (item.message.chat_id, item.pos));
        shown.dedup_by_key(|item| item.message.id);
        for item in &shown {
            let delivery = deliveries.remove(&item.message.id);
            self.announcer.announce(item, delivery);
        }
        let now = time::OffsetDateTime::now_utc();
        for (entry, _) in received {
            let written = entry
                .fields
                .as_ref()
                .and_then(|f| f.get(entry::CREATED_AT))
                .and_then(|t| {
                    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                        .ok()
                });
            if let Some(written) = written {
                metrics
                    .delivery_seconds
                    .observe((now - written).as_seconds_f64().max(0.0));
            }
        }
        Ok(())
    }
}

impl outbox_consumer::Inbox for ChatInbox {
    type Item = Message;
    type Recorded = HashMap<uuid::Uuid, Position>;

    fn decode(&self, entry: &Entry) -> Result<Message, String> {
        model::parse_entry(|name| entry.field(name), self.side.other()).map_err(|e| e.to_string())
    }

    fn order_key(&self, entry: &Entry) -> Option<i64> {
        chat_of(entry)
    }

    async fn claim_fence(&self, consumer: &str, shard: u32) -> Result<i64, RecordError> {
        self.store
            .claim_inbox_writer(consumer, shard)
            .await
            .map_err(record_error)
    }

    async fn record(
        &self,
        batch: &[(Entry, Message)],
        fence: Fence,
    ) -> Result<Self::Recorded, RecordError> {
        #[cfg(feature = "failpoints")]
        if let Some(body) = &self.failpoints.crash_on_body {
            if batch.iter().any(|(_, m)| &m.body == body) {
                tracing::error!("failpoint: crashing on a received message before recording it");
                // SAFETY: signalling our own process.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
        }
        let received: Vec<Received> = batch
            .iter()
            .map(|(e, m)| Received {
                stream_id: e.id.clone(),
                message: m.clone(),
            })
            .collect();
        self.store
            .record_inbox(&received, fence.shard, fence.epoch)
            .await
            .map_err(record_error)
    }

    fn committed(
        &self,
        batch: &[(Entry, Message)],
        recorded: Self::Recorded,
        read_at: SystemTime,
    ) -> Result<(), String> {
        self.show(batch, &recorded, read_at)
    }

    async fn holds(&self, items: &[&Message]) -> Result<Vec<bool>, RecordError> {
        let ids: Vec<uuid::Uuid> = items.iter().map(|m| m.id).collect();
        let held = self.store.inbox_holds(&ids).await.map_err(record_error)?;
        Ok(ids.iter().map(|id| held.contains(id)).collect())
    }

    async fn ping(&self, deadline: Duration) -> Result<(), RecordError> {
        self.store.ping(deadline).await.map_err(record_error)
    }

    fn answering_again(&self) -> impl std::future::Future<Output = ()> + Send + '_ {
        self.store.answering_again()
    }

    fn took_shard(&self, _shard: u32) {
        // Whatever a previous holder recorded and never announced is shown now.
        self.announcer.resync();
    }
}

/// What a store failure means to the consumer (see `RecordError`).
fn record_error(e: StoreError) -> RecordError {
    match e {
        StoreError::Fenced { ours, current } => RecordError::Fenced { ours, current },
        // The dead letter's reason, as before the consumer was a crate of its own.
        StoreError::RowRefused(_) => RecordError::Refused(format!("postgres refused it: {e}")),
        StoreError::Busy(_) => RecordError::Busy(e.to_string()),
        StoreError::Unavailable(_) => RecordError::Unavailable(e.to_string()),
        other => RecordError::State(other.to_string()),
    }
}

/// The chat an entry's message is in, read without the rest of it (held-back entries
/// need no more).
fn chat_of(entry: &Entry) -> Option<i64> {
    #[derive(serde::Deserialize)]
    struct ChatOf {
        chat_id: i64,
    }
    let fields = entry.decode().ok()?;
    if fields.event != model::MESSAGE_CREATED {
        return None;
    }
    serde_json::from_str::<ChatOf>(fields.payload)
        .ok()
        .map(|c| c.chat_id)
}

/// The inbox write's span of one message: a child of the relay's publish span (the
/// entry's context), from the batch being read to its commit (ended when dropped).
fn record_span(
    parent: Option<&telemetry::SpanContext>,
    read_at: SystemTime,
    entry: &Entry,
    message: &Message,
    position: &Position,
) -> Option<telemetry::Span> {
    use telemetry::{Attribute, Kind};
    telemetry::start(
        "inbox record",
        Kind::Consumer,
        Some(parent?),
        Some(read_at),
        vec![
            Attribute::new("messaging.system", "redis"),
            Attribute::new("messaging.operation.type", "process"),
            Attribute::new("messaging.message.id", entry.id.clone()),
            Attribute::new("chat.message.id", message.id.to_string()),
            Attribute::new("chat.id", message.chat_id),
            Attribute::new("chat.inbox.duplicate", !position.new),
        ],
    )
}
