//! Sharing a sharded stream's shards among this side's instances, and one status for all of
//! an instance's shard consumers.
//!
//! Each instance heartbeats into a sorted set of members (scored by Redis's clock, so hosts'
//! clocks do not matter) and reads the live ones back: members sorted by name, shard k is
//! wanted by member `k mod m`. Everyone computes the same split from the same view; while
//! views differ (a member joined or died moments ago) the per-shard lease decides, and an
//! instance gives a shard up as soon as its view says another live member wants it. A dead
//! member drops out of the view within the lease TTL, when its leases have expired too.
//! Ownership is only ever the lease's (fenced per shard in Postgres); the split only says
//! who tries.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionManager;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{ConsumerRole, ConsumerStatus};
use crate::metrics::Metrics;
use crate::side::Side;

/// Which shards this instance should try to hold (index: shard).
pub type Assignment = Arc<Vec<bool>>;

/// Heartbeat (join) or leave, then the live members. KEYS[1]: the members' sorted set;
/// ARGV: member, liveness window (ms), '1' to heartbeat or '0' to leave.
static MEMBERS: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], now, ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - 10 * window))
return redis.call('ZRANGEBYSCORE', KEYS[1], now - window, '+inf')
"#,
    )
});

/// The key of `side`'s member set.
pub fn members_key(side: Side) -> String {
    format!("inbox-members:{side}")
}

/// The shards `me` wants among `members` (any order): shard k goes to the k mod m-th
/// member by name.
pub fn assign(shards: u32, members: &[String], me: &str) -> Vec<bool> {
    let mut sorted: Vec<&str> = members.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let Some(index) = sorted.iter().position(|m| *m == me) else {
        return vec![false; shards as usize];
    };
    (0..shards as usize)
        .map(|k| k % sorted.len() == index)
        .collect()
}

/// Keep this instance in the member set and `assignment` up to date until `shutdown`, then
/// leave, so the others take its shards at once.
pub async fn run_membership(
    client: redis::Client,
    side: Side,
    me: String,
    shards: u32,
    ttl: Duration,
    assignment: watch::Sender<Assignment>,
    shutdown: CancellationToken,
) {
    let key = members_key(side);
    let window = ttl.as_millis() as u64;
    let mut conn: Option<ConnectionManager> = None;
    let mut last_members: Vec<String> = Vec::new();
    loop {
        if conn.is_none() {
            conn = ConnectionManager::new(client.clone()).await.ok();
        }
        if let Some(c) = conn.as_mut() {
            let beat: Result<Vec<String>, _> = MEMBERS
                .key(&key)
                .arg(&me)
                .arg(window)
                .arg("1")
                .invoke_async(c)
                .await;
            match beat {
                Ok(mut members) => {
                    members.sort_unstable();
                    if members != last_members {
                        let mine = assign(shards, &members, &me);
                        let held: Vec<usize> = (0..mine.len()).filter(|k| mine[*k]).collect();
                        info!(members = ?members, shards = ?held, "inbox members changed; shards wanted by this instance");
                        assignment.send_replace(Arc::new(mine));
                        last_members = members;
                    }
                }
                // Keep the last view: the leases still decide, and a member that cannot
                // reach Redis cannot consume anyway.
                Err(e) => warn!(error = %e, "inbox membership heartbeat failed; retrying"),
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(ttl / 3) => {}
        }
    }
    if let Some(c) = conn.as_mut() {
        let left: Result<Vec<String>, _> = MEMBERS
            .key(&key)
            .arg(&me)
            .arg(window)
            .arg("0")
            .invoke_async(c)
            .await;
        if let Err(e) = left {
            warn!(error = %e, "could not leave the inbox member set; the others notice within the lease TTL");
        }
    }
}

/// The roles of an instance's shard consumers, summed up in one status: active while it
/// holds any shard.
pub struct ShardRoles {
    roles: Mutex<Vec<ConsumerRole>>,
    status: watch::Sender<ConsumerStatus>,
    metrics: Arc<Metrics>,
}

impl ShardRoles {
    pub fn new(shards: u32, status: watch::Sender<ConsumerStatus>, metrics: Arc<Metrics>) -> Self {
        Self {
            roles: Mutex::new(vec![ConsumerRole::Starting; shards as usize]),
            status,
            metrics,
        }
    }

    pub fn set(&self, shard: u32, role: ConsumerRole) {
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
        self.metrics.consumer_active.set(held.len() as i64);
        self.status.send_if_modified(|s| {
            let changed = s.role != summary || s.shards != held;
            s.role = summary;
            s.shards = held;
            changed
        });
    }

    /// This shard's role.
    pub fn get(&self, shard: u32) -> ConsumerRole {
        self.roles.lock().unwrap()[shard as usize]
    }

    pub fn status(&self) -> &watch::Sender<ConsumerStatus> {
        &self.status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_evenly_by_name_and_a_stranger_gets_none() {
        let members: Vec<String> = ["c", "a", "b"].iter().map(|s| s.to_string()).collect();
        let counts: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|me| assign(8, &members, me).iter().filter(|x| **x).count())
            .collect();
        assert_eq!(counts, [3, 3, 2]);
        // Every shard wanted by exactly one member.
        for k in 0..8 {
            let wanting = ["a", "b", "c"]
                .iter()
                .filter(|me| assign(8, &members, me)[k])
                .count();
            assert_eq!(wanting, 1, "shard {k}");
        }
        assert!(!assign(8, &members, "d").iter().any(|x| *x));
        assert!(assign(1, &["a".to_string()], "a")[0]);
    }
}
