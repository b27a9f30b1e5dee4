//! Retention: the service that owns the outbox deletes rows older than the retention, in
//! small batches. The relay never needs them (it reads the WAL); they are kept so a relay
//! whose slot or Redis lost data can republish from the table, so the retention bounds how
//! long an outage can be recovered from. With `--message-retention`, sent and received
//! messages older than it go the same way (storage no longer only grows).

use std::sync::Arc;
use std::time::Duration;

use crate::config::Retention;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::store::Store;

/// Rows deleted per statement: short transactions, no long locks on the outbox.
const BATCH: i64 = 1000;

pub(crate) async fn run(
    store: Store,
    metrics: Arc<Metrics>,
    retention: Retention,
    shutdown: CancellationToken,
) {
    let every = retention.every;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let mut deleted = 0;
        loop {
            match store.delete_old_outbox(retention.outbox, BATCH).await {
                Ok(n) => {
                    deleted += n;
                    metrics.outbox_deleted_total.inc_by(n);
                    if n < BATCH as u64 || shutdown.is_cancelled() {
                        break;
                    }
                }
                Err(e) => {
                    warn!(error = %e, "outbox retention pass failed; next pass retries");
                    break;
                }
            }
        }
        if deleted > 0 {
            info!(deleted, retention = ?retention.outbox, "deleted old outbox rows");
        }
        if let Some(older_than) = retention.messages {
            for sent in [true, false] {
                delete_messages(&store, &metrics, sent, older_than, &shutdown).await;
            }
        }
    }
}

/// One pass over sent (`sent`) or received messages, in batches.
async fn delete_messages(
    store: &Store,
    metrics: &Metrics,
    sent: bool,
    older_than: Duration,
    shutdown: &CancellationToken,
) {
    let what = if sent { "sent" } else { "received" };
    let mut deleted = 0;
    loop {
        match store.delete_old_messages(sent, older_than, BATCH).await {
            Ok(n) => {
                deleted += n;
                metrics
                    .messages_deleted_total
                    .with_label_values(&[what])
                    .inc_by(n);
                if n < BATCH as u64 || shutdown.is_cancelled() {
                    break;
                }
            }
            Err(e) => {
                warn!(error = %e, what, "message retention pass failed; next pass retries");
                break;
            }
        }
    }
    if deleted > 0 {
        info!(deleted, what, retention = ?older_than, "deleted old messages");
    }
}
