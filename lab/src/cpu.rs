//! Where the CPU goes: user + system time of every process in a run, grouped the way the
//! performance questions are asked (each relay and service by name, Postgres backends,
//! walsenders and background processes, Redis, and the load generator itself), read from
//! /proc before and after a step so each step reports its own cost per message.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::report::cpu_seconds;

/// CPU seconds by group at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot(BTreeMap<String, f64>);

/// One group's CPU over a step.
#[derive(Debug, Clone, Serialize)]
pub struct GroupCpu {
    pub group: String,
    pub seconds: f64,
    pub per_1000_messages: f64,
}

/// The processes to account for.
pub struct Sampler {
    /// Processes known by name (relays, services).
    pub named: Vec<(String, u32)>,
    /// The postmaster: its children are classified by their process title.
    pub postmaster: Option<u32>,
    pub redis: Vec<u32>,
}

/// User and system time of the reaped children of `pid` (what exited backends used).
fn children_cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split(' ').collect();
    // cutime and cstime follow utime and stime.
    [13, 14]
        .iter()
        .filter_map(|i| fields.get(*i)?.parse::<f64>().ok())
        .sum::<f64>()
        / 100.0
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(1)?.parse().ok()
}

/// The group of a Postgres child by its process title (`postgres: walsender ...`,
/// `postgres: checkpointer`, `postgres: <user> <db> <host> <state>`).
pub fn postgres_group(title: &str) -> &'static str {
    let rest = title.strip_prefix("postgres: ").unwrap_or(title);
    let first = rest.split_whitespace().next().unwrap_or_default();
    const BACKGROUND: &[&str] = &[
        "checkpointer",
        "background",
        "walwriter",
        "autovacuum",
        "logical",
        "archiver",
        "stats",
        "startup",
        "walreceiver",
        "io",
        "walsummarizer",
    ];
    if first == "walsender" {
        "postgres walsenders"
    } else if BACKGROUND.contains(&first) {
        "postgres background"
    } else {
        "postgres backends"
    }
}

impl Sampler {
    pub fn snapshot(&self) -> Snapshot {
        let mut groups: BTreeMap<String, f64> = BTreeMap::new();
        for (name, pid) in &self.named {
            *groups.entry(name.clone()).or_default() += cpu_seconds(*pid);
        }
        for pid in &self.redis {
            *groups.entry("redis".into()).or_default() += cpu_seconds(*pid);
        }
        *groups
            .entry("load generator (chat-lab)".into())
            .or_default() += cpu_seconds(std::process::id());
        if let Some(postmaster) = self.postmaster {
            *groups.entry("postgres background".into()).or_default() +=
                cpu_seconds(postmaster) + children_cpu_seconds(postmaster);
            for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                let Some(pid) = entry
                    .file_name()
                    .to_str()
                    .and_then(|s| s.parse::<u32>().ok())
                else {
                    continue;
                };
                if parent_of(pid) != Some(postmaster) {
                    continue;
                }
                let title = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                    .unwrap_or_default()
                    .replace('\0', " ");
                *groups
                    .entry(postgres_group(title.trim()).to_string())
                    .or_default() += cpu_seconds(pid);
            }
        }
        Snapshot(groups)
    }
}

impl Snapshot {
    /// What each group used since `before`, per 1,000 of `messages` too, largest first.
    pub fn since(&self, before: &Snapshot, messages: usize) -> Vec<GroupCpu> {
        let mut groups: Vec<GroupCpu> = self
            .0
            .iter()
            .map(|(group, now)| {
                // A backend that exited meanwhile moves its time to the postmaster's
                // children; a group never goes below zero.
                let seconds = (now - before.0.get(group).copied().unwrap_or(0.0)).max(0.0);
                GroupCpu {
                    group: group.clone(),
                    seconds,
                    per_1000_messages: seconds * 1000.0 / messages.max(1) as f64,
                }
            })
            .collect();
        groups.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        groups
    }
}

/// Print `groups` with a total line.
pub fn print(title: &str, groups: &[GroupCpu]) {
    println!("{title}");
    for g in groups {
        println!(
            "  {:<28} {:>8.2} s {:>9.3} s per 1,000 messages",
            g.group, g.seconds, g.per_1000_messages
        );
    }
    let total: f64 = groups.iter().map(|g| g.seconds).sum();
    let per: f64 = groups.iter().map(|g| g.per_1000_messages).sum();
    println!(
        "  {:<28} {:>8.2} s {:>9.3} s per 1,000 messages",
        "total", total, per
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_children_are_grouped_by_their_title() {
        assert_eq!(
            postgres_group("postgres: walsender consumers_relay [local] START_REPLICATION"),
            "postgres walsenders"
        );
        assert_eq!(
            postgres_group("postgres: checkpointer"),
            "postgres background"
        );
        assert_eq!(
            postgres_group("postgres: background writer"),
            "postgres background"
        );
        assert_eq!(
            postgres_group("postgres: consumers lab_1 [local] idle"),
            "postgres backends"
        );
    }
}
