//! Outbox retention: the service that owns the outbox deletes rows older than the retention,
//! in small batches. The relay never needs them (it reads the WAL); they are kept so a relay
//! whose slot or Redis lost data can republish from the table, so the retention bounds how
//! long an outage can be recovered from.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::store::Store;

/// Rows deleted per statement: short transactions, no long locks on the outbox.
const BATCH: i64 = 1000;

pub(crate) async fn run(
    store: Store,
    metrics: Arc<Metrics>,
    retention: Duration,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let mut deleted = 0;
        loop {
            match store.delete_old_outbox(retention, BATCH).await {
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
            info!(deleted, retention = ?retention, "deleted old outbox rows");
        }
    }
}
