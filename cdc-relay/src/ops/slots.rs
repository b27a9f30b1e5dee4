//! The slot commands for operators: `slots` (every logical slot and its health), `check`
//! (a Nagios-style status line and exit code, for cron) and `drop-slot`.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::cli::{CheckArgs, ConnectionArgs, DropSlotArgs, SlotsArgs};
use crate::error::RelayError;
use crate::source::{self, read_slots, SlotHealth};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

async fn connect(args: &ConnectionArgs) -> Result<tokio_postgres::Client, RelayError> {
    Ok(args.database()?.connect(CONNECT_TIMEOUT).await?)
}

/// Bytes in binary units: `512 B`, `1.5 KiB`, `3.0 MiB`.
pub(super) fn human_bytes(bytes: i64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes.abs() < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[derive(Serialize)]
struct SlotJson<'a> {
    name: &'a str,
    plugin: Option<&'a str>,
    database: Option<&'a str>,
    active: bool,
    active_pid: Option<i32>,
    lag_bytes: Option<i64>,
    retained_wal_bytes: Option<i64>,
    wal_status: Option<&'a str>,
    safe_wal_size_bytes: Option<i64>,
    spill_bytes: Option<i64>,
    // Where the server has them (null before): 16+ and 17+.
    conflicting: Option<bool>,
    invalidation_reason: Option<&'a str>,
    inactive_seconds: Option<f64>,
    failover: Option<bool>,
    synced: Option<bool>,
}

/// `cdc-relay slots`: the table (or JSON) to print.
pub async fn slots(args: &SlotsArgs) -> Result<String, RelayError> {
    let client = connect(&args.connection).await?;
    let slots = read_slots(&client, None).await?;
    if args.json {
        let rows: Vec<SlotJson<'_>> = slots
            .iter()
            .map(|s| SlotJson {
                name: &s.name,
                plugin: s.plugin.as_deref(),
                database: s.database.as_deref(),
                active: s.active,
                active_pid: s.active_pid,
                lag_bytes: s.lag_bytes,
                retained_wal_bytes: s.retained_bytes,
                wal_status: s.wal_status.as_deref(),
                safe_wal_size_bytes: s.safe_wal_size,
                spill_bytes: s.spill_bytes,
                conflicting: s.conflicting,
                invalidation_reason: s.invalidation_reason.as_deref(),
                inactive_seconds: s.inactive_seconds,
                failover: s.failover,
                synced: s.synced,
            })
            .collect();
        return Ok(serde_json::to_string_pretty(&rows).expect("serializes"));
    }
    let opt = |b: Option<i64>| b.map_or_else(|| "-".to_string(), human_bytes);
    let mut out = format!(
        "{:<28} {:<9} {:<7} {:>8} {:>11} {:>13} {:<11} {:>13}  {}\n",
        "slot",
        "plugin",
        "active",
        "pid",
        "lag",
        "retained WAL",
        "wal_status",
        "safe_wal_size",
        "notes"
    );
    for s in &slots {
        out.push_str(&format!(
            "{:<28} {:<9} {:<7} {:>8} {:>11} {:>13} {:<11} {:>13}  {}\n",
            s.name,
            s.plugin.as_deref().unwrap_or("-"),
            if s.active { "yes" } else { "no" },
            s.active_pid
                .map_or_else(|| "-".to_string(), |p| p.to_string()),
            opt(s.lag_bytes),
            opt(s.retained_bytes),
            s.wal_status.as_deref().unwrap_or("-"),
            s.safe_wal_size
                .map_or_else(|| "unlimited".to_string(), human_bytes),
            notes(s),
        ));
    }
    if slots.is_empty() {
        out.push_str("(no logical replication slots in this database)\n");
    }
    Ok(out)
}

/// What newer servers say of a slot beyond the common columns, for the table: `-` if
/// nothing.
fn notes(s: &SlotHealth) -> String {
    let mut notes = Vec::new();
    if let Some(reason) = &s.invalidation_reason {
        notes.push(format!("invalidated: {reason}"));
    }
    if s.conflicting == Some(true) {
        notes.push("conflicting".to_string());
    }
    if s.failover == Some(true) {
        notes.push("failover".to_string());
    }
    if s.synced == Some(true) {
        notes.push("synced".to_string());
    }
    if let (false, Some(secs)) = (s.active, s.inactive_seconds) {
        notes.push(format!("inactive {secs:.0} s"));
    }
    if notes.is_empty() {
        "-".to_string()
    } else {
        notes.join(", ")
    }
}

/// Nagios plugin status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CheckStatus {
    Ok = 0,
    Warning = 1,
    Critical = 2,
    Unknown = 3,
}

impl CheckStatus {
    fn label(self) -> &'static str {
        match self {
            CheckStatus::Ok => "OK",
            CheckStatus::Warning => "WARNING",
            CheckStatus::Critical => "CRITICAL",
            CheckStatus::Unknown => "UNKNOWN",
        }
    }
}

/// `cdc-relay check`: the status and its one line.
pub async fn check(args: &CheckArgs) -> (CheckStatus, String) {
    let name = match args.connection.slot() {
        Ok(name) => name,
        Err(e) => return (CheckStatus::Unknown, format!("CDC-RELAY UNKNOWN - {e}")),
    };
    let client = match connect(&args.connection).await {
        Ok(client) => client,
        Err(e) => return (CheckStatus::Unknown, format!("CDC-RELAY UNKNOWN - {e}")),
    };
    let slot = match read_slots(&client, Some(name)).await {
        Ok(slots) => slots.into_iter().next(),
        Err(e) => {
            return (
                CheckStatus::Unknown,
                format!("CDC-RELAY UNKNOWN - {}", RelayError::from(e)),
            )
        }
    };
    let Some(slot) = slot else {
        return (
            CheckStatus::Critical,
            format!("CDC-RELAY CRITICAL - slot {} does not exist", name),
        );
    };
    // Postgres 17+ knows since when the slot is inactive; older servers need our state file.
    let (inactive_for, untracked) = match (slot.active, slot.inactive_seconds) {
        (false, Some(secs)) => (Some(Duration::from_secs_f64(secs.max(0.0))), None),
        _ => match track_inactivity(&args.state_dir, name, slot.active) {
            Ok(inactive_for) => (inactive_for, None),
            Err(why) => (None, Some(why)),
        },
    };
    let mut verdict = evaluate(args, &slot, inactive_for);
    if let Some(why) = untracked {
        // An inactive slot whose inactivity cannot be timed is not OK: say why, and what to
        // change (a read-only root filesystem in a pod, typically). CRITICAL for another
        // reason stays CRITICAL: it is already the page.
        if verdict.status != CheckStatus::Critical {
            verdict.status = CheckStatus::Unknown;
        }
        verdict.detail.push_str(&format!(
            "; inactive for an unknown time: {why} (point --state-dir / CDC_CHECK_STATE_DIR at a writable directory)"
        ));
    }
    (verdict.status, verdict.line())
}

/// A judged slot reading: its status, what the line says, and the performance data.
pub(crate) struct Verdict {
    pub(crate) status: CheckStatus,
    pub(crate) detail: String,
    perf: String,
}

impl Verdict {
    /// The check's one line, as monitoring plugins print it.
    pub(crate) fn line(&self) -> String {
        format!(
            "CDC-RELAY {} - {} | {}",
            self.status.label(),
            self.detail,
            self.perf
        )
    }
}

/// Judge a slot reading; `inactive_for` is how long it has been seen inactive.
pub(crate) fn evaluate(
    args: &CheckArgs,
    slot: &SlotHealth,
    inactive_for: Option<Duration>,
) -> Verdict {
    let warn_lag = args.warn_lag_bytes.unwrap_or(args.max_lag_bytes / 2);
    let warn_inactive = args
        .warn_inactive_seconds
        .unwrap_or(args.max_inactive_seconds / 2);
    let lag = slot.lag_bytes.unwrap_or(0).max(0) as u64;
    let mut status = CheckStatus::Ok;
    let mut problems = Vec::new();
    let mut raise = |to: CheckStatus, why: String| {
        status = status.max(to);
        problems.push(why);
    };
    match (slot.wal_status.as_deref(), &slot.invalidation_reason) {
        // 17+ says why (wal_status says lost for any reason since 16; both are read).
        (_, Some(reason)) => raise(
            CheckStatus::Critical,
            format!(
                "wal_status {} (the slot was invalidated: {reason})",
                slot.wal_status.as_deref().unwrap_or("-")
            ),
        ),
        (Some("lost"), None) => raise(
            CheckStatus::Critical,
            "wal_status lost (the slot was invalidated)".into(),
        ),
        (Some("unreserved"), None) => raise(
            CheckStatus::Critical,
            "wal_status unreserved (WAL it needs is about to be removed)".into(),
        ),
        _ => {}
    }
    if slot.conflicting == Some(true) {
        raise(
            CheckStatus::Critical,
            match &slot.invalidation_reason {
                Some(reason) => format!("conflicting with recovery ({reason}); it cannot be used"),
                None => "conflicting with recovery; it cannot be used".to_string(),
            },
        );
    }
    if lag > args.max_lag_bytes {
        raise(
            CheckStatus::Critical,
            format!(
                "lag {} over {}",
                human_bytes(lag as i64),
                human_bytes(args.max_lag_bytes as i64)
            ),
        );
    } else if lag > warn_lag {
        raise(
            CheckStatus::Warning,
            format!(
                "lag {} over {}",
                human_bytes(lag as i64),
                human_bytes(warn_lag as i64)
            ),
        );
    }
    if let Some(inactive) = inactive_for {
        let secs = inactive.as_secs();
        if secs > args.max_inactive_seconds {
            raise(
                CheckStatus::Critical,
                format!(
                    "inactive for {secs} s (limit {} s)",
                    args.max_inactive_seconds
                ),
            );
        } else if secs > warn_inactive {
            raise(
                CheckStatus::Warning,
                format!("inactive for {secs} s (warning at {warn_inactive} s)"),
            );
        }
    }
    let activity = match (slot.active, slot.active_pid, inactive_for) {
        (true, Some(pid), _) => format!("active (pid {pid})"),
        (true, None, _) => "active".to_string(),
        (false, _, Some(d)) => format!("inactive for {} s", d.as_secs()),
        (false, _, None) => "inactive".to_string(),
    };
    let summary = format!(
        "slot {} {activity}, lag {}, retained WAL {}, wal_status {}",
        slot.name,
        human_bytes(lag as i64),
        human_bytes(slot.retained_bytes.unwrap_or(0)),
        slot.wal_status.as_deref().unwrap_or("-"),
    );
    let detail = if problems.is_empty() {
        summary
    } else {
        format!("{}; {summary}", problems.join("; "))
    };
    let perf = format!(
        "lag_bytes={lag};{warn_lag};{} retained_bytes={}",
        args.max_lag_bytes,
        slot.retained_bytes.unwrap_or(0)
    );
    Verdict {
        status,
        detail,
        perf,
    }
}

/// Remember since when the slot is inactive in `state_dir`; `None` while active. An error
/// says why the state cannot be kept (the directory unwritable, say).
fn track_inactivity(
    state_dir: &Path,
    slot: &str,
    active: bool,
) -> Result<Option<Duration>, String> {
    let file = state_dir.join(format!("cdc-relay-check.{slot}.inactive-since"));
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    if active {
        // Nothing to remember: a file that cannot be removed only makes the next inactive
        // spell look older, which errs towards alerting.
        let _ = std::fs::remove_file(&file);
        return Ok(None);
    }
    let since = match std::fs::read_to_string(&file) {
        Ok(text) => text.trim().parse::<u64>().ok(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("cannot read {}: {e}", file.display())),
    };
    let since = match since {
        Some(since) => since,
        None => {
            std::fs::write(&file, now.to_string())
                .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
            now
        }
    };
    Ok(Some(Duration::from_secs(now.saturating_sub(since))))
}

/// `cdc-relay drop-slot`.
pub async fn drop_slot(args: &DropSlotArgs) -> Result<String, RelayError> {
    let name = args.connection.slot()?;
    let client = connect(&args.connection).await?;
    let slot = read_slots(&client, Some(name)).await?.into_iter().next();
    let Some(slot) = slot else {
        return Err(RelayError::Config(format!(
            "replication slot {} does not exist",
            name
        )));
    };
    if slot.active {
        return Err(RelayError::Config(format!(
            "replication slot {} is active{}: stop the relay using it first",
            name,
            slot.active_pid
                .map(|p| format!(" (walsender pid {p})"))
                .unwrap_or_default()
        )));
    }
    if !args.yes {
        return Err(RelayError::Config(format!(
            "dropping replication slot {} loses its position: what it had not delivered is then only in the outbox table; pass --yes to drop it",
            name
        )));
    }
    source::drop_slot(&client, name).await?;
    Ok(format!("dropped replication slot {}", name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_like_humans_write_them() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert_eq!(human_bytes(5 << 30), "5.0 GiB");
    }
}
