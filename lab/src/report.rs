//! Where results go: `target/lab/<name>.json`, plus what machine they came from.

use std::path::PathBuf;

use serde::Serialize;

/// The workspace's `target/lab` directory.
pub fn lab_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("lab")
}

/// The directory holding this executable, where the other workspace binaries are built.
pub fn bin_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.to_path_buf()))
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A sibling binary of this workspace, or an error saying how to build it.
pub fn workspace_binary(name: &str) -> anyhow::Result<PathBuf> {
    let path = bin_dir().join(name);
    anyhow::ensure!(
        path.exists(),
        "{} not found: build the workspace first (cargo build --release --workspace)",
        path.display()
    );
    Ok(path)
}

#[derive(Debug, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub postgres: String,
    pub redis: String,
}

pub fn machine() -> Machine {
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let output = |cmd: &str, args: &[&str]| {
        std::process::Command::new(cmd)
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    Machine {
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        cpu_model,
        kernel: output("uname", &["-r"]),
        postgres: output("/usr/lib/postgresql/15/bin/postgres", &["--version"]),
        redis: output("redis-server", &["--version"]),
    }
}

/// Write `value` as pretty JSON to `target/lab/<name>.json`; returns the path.
pub fn write_json(name: &str, value: &impl Serialize) -> anyhow::Result<PathBuf> {
    let dir = lab_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(value)?)?;
    Ok(path)
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
