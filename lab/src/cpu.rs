//! Where the CPU goes: user + system time of every process in a run, grouped the way the
//! performance questions are asked (each relay and service by name, Postgres backends,
//! walsenders and background processes, Redis, and the load generator itself: the lab
//! process, its SSE readers and this sampling included), read from /proc per process before
//! and after a step so each step reports its own cost per message.

use std::collections::BTreeMap;

use serde::Serialize;

/// CPU seconds of every process accounted for at one moment, with its group; and what the
/// postmaster's exited children used in all.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    processes: BTreeMap<u32, (String, f64)>,
    reaped: f64,
}

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
        let mut processes = BTreeMap::new();
        for (name, pid) in &self.named {
            processes.insert(*pid, (name.clone(), cpu_seconds(*pid)));
        }
        for pid in &self.redis {
            processes.insert(*pid, ("redis".to_string(), cpu_seconds(*pid)));
        }
        let me = std::process::id();
        processes.insert(
            me,
            ("load generator (chat-lab)".to_string(), cpu_seconds(me)),
        );
        let mut reaped = 0.0;
        if let Some(postmaster) = self.postmaster {
            processes.insert(
                postmaster,
                ("postgres background".to_string(), cpu_seconds(postmaster)),
            );
            // What exited backends used lands in the postmaster's cutime and cstime.
            reaped = proc_stat(postmaster).map_or(0.0, |f| stat_seconds(&f, &[13, 14]));
            for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                let Some(pid) = entry
                    .file_name()
                    .to_str()
                    .and_then(|s| s.parse::<u32>().ok())
                else {
                    continue;
                };
                let Some(stat) = proc_stat(pid) else {
                    continue;
                };
                if stat.get(1).and_then(|p| p.parse::<u32>().ok()) != Some(postmaster) {
                    continue;
                }
                let title = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                    .unwrap_or_default()
                    .replace('\0', " ");
                processes.insert(
                    pid,
                    (
                        postgres_group(title.trim()).to_string(),
                        stat_seconds(&stat, &[11, 12]),
                    ),
                );
            }
        }
        Snapshot { processes, reaped }
    }
}

impl Snapshot {
    /// What each group used since `before`, per 1,000 of `messages` too, largest first.
    /// Each process counts what it used since `before` (all of it if it started since); a
    /// Postgres child that exited meanwhile counts in its last known group, with what the
    /// postmaster's reaped children grew by beyond what the exited ones had used before.
    pub fn since(&self, before: &Snapshot, messages: usize) -> Vec<GroupCpu> {
        let mut groups: BTreeMap<String, f64> = BTreeMap::new();
        for (pid, (group, now)) in &self.processes {
            let then = before.processes.get(pid).map_or(0.0, |(_, t)| *t);
            *groups.entry(group.clone()).or_default() += (now - then).max(0.0);
        }
        let exited: Vec<&(String, f64)> = before
            .processes
            .iter()
            .filter(|(pid, _)| !self.processes.contains_key(pid))
            .map(|(_, p)| p)
            .collect();
        let used_before: f64 = exited.iter().map(|(_, t)| t).sum();
        let used_since = (self.reaped - before.reaped - used_before).max(0.0);
        if used_since > 0.0 {
            // Exited children of one kind (the usual case: backends of a pool) get it all.
            let group = match exited.first() {
                Some((g, _)) if exited.iter().all(|(other, _)| other == g) => g.clone(),
                Some(_) => "postgres (exited during the step)".to_string(),
                None => "postgres background".to_string(),
            };
            *groups.entry(group).or_default() += used_since;
        }
        let mut groups: Vec<GroupCpu> = groups
            .into_iter()
            .map(|(group, seconds)| GroupCpu {
                group,
                seconds,
                per_1000_messages: seconds * 1000.0 / messages.max(1) as f64,
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

/// The fields of `/proc/<pid>/stat` after the command name (state is field 0, the parent
/// pid field 1, utime and stime fields 11 and 12, cutime and cstime 13 and 14); `None` when
/// the process is gone.
pub fn proc_stat(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    Some(rest.split(' ').map(str::to_string).collect())
}

/// Seconds of the clock-tick fields `at` of a `proc_stat` reading (Linux reports them in
/// USER_HZ, 100 per second).
pub fn stat_seconds(fields: &[String], at: &[usize]) -> f64 {
    at.iter()
        .filter_map(|i| fields.get(*i)?.parse::<f64>().ok())
        .sum::<f64>()
        / 100.0
}

/// User plus system CPU time of a process so far, from /proc (0 when gone).
pub fn cpu_seconds(pid: u32) -> f64 {
    proc_stat(pid).map_or(0.0, |fields| stat_seconds(&fields, &[11, 12]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(processes: &[(u32, &str, f64)], reaped: f64) -> Snapshot {
        Snapshot {
            processes: processes
                .iter()
                .map(|(pid, g, t)| (*pid, (g.to_string(), *t)))
                .collect(),
            reaped,
        }
    }

    #[test]
    fn a_backend_exiting_mid_step_counts_in_its_group_once() {
        let before = snapshot(
            &[
                (1, "postgres background", 1.0),
                (2, "postgres backends", 3.0),
                (3, "postgres backends", 5.0),
            ],
            10.0,
        );
        // Backend 3 used 0.5 more and exited: the reaped time grew by all of its 5.5.
        let after = snapshot(
            &[
                (1, "postgres background", 1.0),
                (2, "postgres backends", 4.0),
                (4, "postgres backends", 0.25),
            ],
            15.5,
        );
        let groups = after.since(&before, 1000);
        let backends = groups
            .iter()
            .find(|g| g.group == "postgres backends")
            .unwrap();
        assert!((backends.seconds - 1.75).abs() < 1e-9, "{groups:?}");
        let background = groups
            .iter()
            .find(|g| g.group == "postgres background")
            .unwrap();
        assert_eq!(background.seconds, 0.0);
    }

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
