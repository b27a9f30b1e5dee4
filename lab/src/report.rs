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
    /// How fast this box wakes a sleeping thread: round trips over a Unix socket pair, each
    /// after a pause long enough for the cores to go idle (`None`: could not be measured).
    /// Every hop of a message wakes a process, so a virtual machine whose idle cores wake
    /// slowly (host contention) shows it in every end-to-end figure: compare this before
    /// comparing runs of two machines.
    pub wakeup_round_trip: Option<crate::stats::Summary>,
}

/// The cores this process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
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
        cpus: cpus(),
        cpu_model,
        kernel: output("uname", &["-r"]),
        postgres: output("/usr/lib/postgresql/15/bin/postgres", &["--version"]),
        redis: output("redis-server", &["--version"]),
        wakeup_round_trip: wakeup_round_trip(),
    }
}

impl Machine {
    /// One line for a report's header.
    pub fn describe(&self) -> String {
        let model = if self.cpu_model.is_empty() {
            String::new()
        } else {
            format!(" ({})", self.cpu_model)
        };
        let wakeup = self.wakeup_round_trip.as_ref().map_or_else(
            || "not measured".to_string(),
            |w| format!("p50 {:.0} µs, p99 {:.0} µs", w.p50_ms * 1e3, w.p99_ms * 1e3),
        );
        format!(
            "{} cores{model}; a sleeping thread's wake-up round trip {wakeup}",
            self.cpus
        )
    }
}

/// 1,000 round trips between two threads over a Unix socket pair, 1 ms apart (see
/// [`Machine::wakeup_round_trip`]). The pause is well past KVM's halt polling (200 µs by
/// default), so a virtual core is really asleep when the byte arrives.
pub fn wakeup_round_trip() -> Option<crate::stats::Summary> {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let measure = || -> std::io::Result<Vec<f64>> {
        let (mut near, mut far) = UnixStream::pair()?;
        let echo = std::thread::Builder::new()
            .name("wakeup-echo".into())
            .spawn(move || {
                let mut byte = [0u8; 1];
                while far.read_exact(&mut byte).is_ok() && far.write_all(&byte).is_ok() {}
            })?;
        let mut samples = Vec::with_capacity(1_000);
        let mut byte = [0u8; 1];
        for _ in 0..1_000 {
            std::thread::sleep(std::time::Duration::from_millis(1));
            let started = std::time::Instant::now();
            near.write_all(&byte)?;
            near.read_exact(&mut byte)?;
            samples.push(started.elapsed().as_secs_f64() * 1e3);
        }
        drop(near);
        let _ = echo.join();
        Ok(samples)
    };
    measure()
        .ok()
        .map(|samples| crate::stats::summarize("wake-up round trip", samples))
}

/// Write `value` as pretty JSON to `target/lab/<name>.json`; returns the path.
pub fn write_json(name: &str, value: &impl Serialize) -> anyhow::Result<PathBuf> {
    let dir = lab_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(value)?)?;
    Ok(path)
}

/// A private key made by `openssl genpkey <args>` into `dir/<name>.pem`, as PEM.
pub fn openssl_key(dir: &std::path::Path, name: &str, args: &[&str]) -> anyhow::Result<Vec<u8>> {
    let path = dir.join(format!("{name}.pem"));
    let out = std::process::Command::new("openssl")
        .arg("genpkey")
        .args(args)
        .arg("-out")
        .arg(&path)
        .output()
        .map_err(|e| anyhow::anyhow!("openssl (deploy/install-deps.sh installs it): {e}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "openssl genpkey {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(std::fs::read(path)?)
}
