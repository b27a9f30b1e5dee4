//! The receiving protocol running: one task per shard of the stream, and, with more than
//! one shard, the membership task that shares the shards among the group's instances.
//!
//! Invariants:
//! - a panic in a shard's task ends the process (abort): the entry that caused it is then
//!   redelivered and counted, and dead-lettered if it does it again, instead of a process
//!   that serves but no longer consumes;
//! - [`Consumer::stop`] returns once every shard's task released its lease (or after
//!   [`STOP_WAIT`]), and the instance left the member set.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::config::ConsumerConfig;
use crate::inbox::Inbox;
use crate::members::{run_membership, Assignment, Membership};
use crate::metrics::ConsumerMetrics;
use crate::shard::ShardConsumer;
use crate::status::{ConsumerStatus, ShardRoles};

/// How long [`Consumer::stop`] waits for the shards' tasks to finish what they read.
pub const STOP_WAIT: Duration = Duration::from_secs(10);

/// A running consumer: every shard's task, and the membership that shares the shards out.
/// Keep it until [`Consumer::stop`]: dropped, the shards' tasks go on but no longer learn
/// which shards to take (a standby would never take over from a dead holder).
#[must_use = "keep the Consumer until stop(): dropped, standby shards never take over"]
pub struct Consumer {
    shards: Vec<JoinHandle<()>>,
    membership: Option<JoinHandle<()>>,
    /// Kept as long as the shards' tasks run (a dropped sender would wake them for ever).
    _fixed_assignment: Option<watch::Sender<Assignment>>,
}

impl Consumer {
    /// Start consuming `config`'s stream into `inbox` until `shutdown` is cancelled. What
    /// the consumers do is published on `status` (for a readiness probe: ready while
    /// active or standing by with Redis reachable).
    pub fn start<I: Inbox>(
        config: ConsumerConfig,
        inbox: Arc<I>,
        metrics: Arc<ConsumerMetrics>,
        status: watch::Sender<ConsumerStatus>,
        shutdown: &CancellationToken,
    ) -> Self {
        let config = Arc::new(config);
        let shards = config.shards;
        let roles = Arc::new(ShardRoles::new(shards, status, metrics.clone()));
        // One shard: every instance competes for the one lease. More: instances split
        // them (see `members`).
        let (assignment_tx, assignment) =
            watch::channel::<Assignment>(Arc::new(vec![shards == 1; shards as usize]));
        let (membership, fixed_assignment) = if shards > 1 {
            let task = tokio::spawn(run_membership(
                Membership {
                    client: config.redis.clone(),
                    group: config.group.clone(),
                    me: config.consumer.clone(),
                    shards,
                    ttl: config.lease_ttl,
                    inbox: inbox.clone(),
                    roles: roles.clone(),
                },
                assignment_tx,
                shutdown.clone(),
            ));
            (Some(task), None)
        } else {
            (None, Some(assignment_tx))
        };
        let shards = (0..shards)
            .map(|shard| {
                let consumer = ShardConsumer::new(
                    config.clone(),
                    shard,
                    inbox.clone(),
                    metrics.clone(),
                    roles.clone(),
                    assignment.clone(),
                );
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                    let run = tokio::spawn(async move { consumer.run(shutdown).await });
                    if let Err(e) = run.await {
                        if e.is_panic() {
                            error!(error = %e, "inbox consumer panicked; aborting the process");
                            std::process::abort();
                        }
                    }
                })
            })
            .collect();
        Self {
            shards,
            membership,
            _fixed_assignment: fixed_assignment,
        }
    }

    /// Wait for the shards' tasks (after the shutdown token was cancelled): each finishes
    /// what it read and releases its lease; then the instance leaves the member set.
    pub async fn stop(self) {
        let consumers = futures::future::join_all(self.shards);
        if tokio::time::timeout(STOP_WAIT, consumers).await.is_err() {
            warn!("inbox consumer did not stop within {STOP_WAIT:?}");
        }
        if let Some(membership) = self.membership {
            let _ = membership.await;
        }
    }
}
