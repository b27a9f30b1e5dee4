//! What the operating system says about processes, by pid: alive, children, title, how
//! one ended. Read-only (`/proc`, signal 0): nothing here changes a process.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// A readable summary of how a process ended.
pub(crate) fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        _ => "unknown".into(),
    }
}

/// Whether a process with this pid exists (it may belong to anyone).
pub(crate) fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Pids of the live direct children of `parent`, from /proc.
pub(crate) fn children_of(parent: u32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // The command name may contain spaces; fields after ')' are fixed.
                    let rest = &stat[stat.rfind(')')? + 2..];
                    rest.split(' ').nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

/// What process `pid` says it is doing: its command line, which Postgres rewrites into a
/// title per process ("walsender ... streaming 0/1A2B3C", "checkpointer", ...).
pub(crate) fn process_title(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .replace('\0', " ")
                .trim()
                .to_string()
        })
        .unwrap_or_else(|_| "(gone)".to_string())
}
