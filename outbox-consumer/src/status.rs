//! What an instance's consumers are doing, summed up in one status for readiness probes
//! and tests: active while it holds any shard, with the shards it holds, whether Redis
//! answers and the last error; and the dead-letter gauge over the shards it holds.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::metrics::ConsumerMetrics;

/// What a consumer is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConsumerRole {
    Starting,
    /// Another instance holds the lease.
    Standby,
    Active,
    Stopped,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConsumerStatus {
    /// Active while this instance holds any shard's lease.
    pub role: ConsumerRole,
    /// The shards whose lease this instance holds.
    pub shards: Vec<u32>,
    pub redis_reachable: bool,
    pub last_error: Option<String>,
}

impl Default for ConsumerStatus {
    fn default() -> Self {
        Self {
            role: ConsumerRole::Starting,
            shards: Vec::new(),
            redis_reachable: false,
            last_error: None,
        }
    }
}

/// The roles of an instance's shard consumers, summed up in one status: active while it
/// holds any shard.
pub(crate) struct ShardRoles {
    roles: Mutex<Vec<ConsumerRole>>,
    /// Entries in each held shard's dead-letter stream (0 for shards not held: their
    /// holder reports them).
    dead_letters: Mutex<Vec<i64>>,
    status: watch::Sender<ConsumerStatus>,
    metrics: Arc<ConsumerMetrics>,
    /// The stream's records refused this instance's shard count (a configuration error).
    layout_refused: std::sync::atomic::AtomicBool,
}

impl ShardRoles {
    pub(crate) fn new(
        shards: u32,
        status: watch::Sender<ConsumerStatus>,
        metrics: Arc<ConsumerMetrics>,
    ) -> Self {
        metrics.shards.set(i64::from(shards));
        Self {
            roles: Mutex::new(vec![ConsumerRole::Starting; shards as usize]),
            dead_letters: Mutex::new(vec![0; shards as usize]),
            status,
            metrics,
            layout_refused: Default::default(),
        }
    }

    pub(crate) fn set_layout_refused(&self, refused: bool) {
        self.layout_refused
            .store(refused, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn layout_refused(&self) -> bool {
        self.layout_refused
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(crate) fn set(&self, shard: u32, role: ConsumerRole) {
        let (summary, held) = {
            let mut roles = self.roles.lock().unwrap();
            roles[shard as usize] = role;
            let held: Vec<u32> = (0..roles.len() as u32)
                .filter(|k| roles[*k as usize] == ConsumerRole::Active)
                .collect();
            let summary = if !held.is_empty() {
                ConsumerRole::Active
            } else if roles.iter().all(|r| *r == ConsumerRole::Stopped) {
                ConsumerRole::Stopped
            } else if roles.contains(&ConsumerRole::Starting) {
                ConsumerRole::Starting
            } else {
                ConsumerRole::Standby
            };
            (summary, held)
        };
        self.metrics.active_shards.set(held.len() as i64);
        if role != ConsumerRole::Active {
            self.set_dead_letters(shard, 0);
        }
        self.status.send_if_modified(|s| {
            let changed = s.role != summary || s.shards != held;
            s.role = summary;
            s.shards = held;
            changed
        });
    }

    /// The length of a held shard's dead-letter stream; the gauge sums the held shards', so
    /// summed over instances each shard counts once.
    pub(crate) fn set_dead_letters(&self, shard: u32, entries: i64) {
        let total = {
            let mut counts = self.dead_letters.lock().unwrap();
            counts[shard as usize] = entries;
            counts.iter().sum()
        };
        self.metrics.dead_letter_entries.set(total);
    }

    /// This shard's role.
    pub(crate) fn get(&self, shard: u32) -> ConsumerRole {
        self.roles.lock().unwrap()[shard as usize]
    }

    pub(crate) fn status(&self) -> &watch::Sender<ConsumerStatus> {
        &self.status
    }
}
