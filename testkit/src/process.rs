//! Child processes owned by the test process: spawned with a parent-death SIGKILL, signalled
//! by pid (never by name), reaped, and killed at exit.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that spawned the child exits, not the process.
//! Test harnesses run each test on its own short-lived thread, so every child is spawned
//! from one long-lived spawner thread that lives as long as the process.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// The signals tests send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Term,
    Int,
    Kill,
    Quit,
    Stop,
    Cont,
}

impl Signal {
    fn raw(self) -> libc::c_int {
        match self {
            Signal::Term => libc::SIGTERM,
            Signal::Int => libc::SIGINT,
            Signal::Kill => libc::SIGKILL,
            Signal::Quit => libc::SIGQUIT,
            Signal::Stop => libc::SIGSTOP,
            Signal::Cont => libc::SIGCONT,
        }
    }
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Pids of live children, killed by the exit hook.
static LIVE: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("testkit-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
                // The channel lives in a static, so this thread never ends: children
                // keep their parent thread until the process exits.
            })
            .expect("start testkit spawner thread");
        Mutex::new(tx)
    })
}

/// A child process this test process started. Dropping it kills it (SIGKILL) and reaps it.
pub struct ChildProcess {
    name: String,
    pid: i32,
    child: Mutex<Child>,
    log_path: PathBuf,
    status: Mutex<Option<ExitStatus>>,
}

impl ChildProcess {
    /// Spawn `command` with stdout and stderr appended to `log_path`.
    pub fn spawn(name: &str, mut command: Command, log_path: &Path) -> anyhow::Result<Self> {
        crate::scratch::scratch_root();
        install_exit_cleanup();
        let log = File::options()
            .create(true)
            .append(true)
            .open(log_path)
            .with_context(|| format!("open log {}", log_path.display()))?;
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl and signal are async-signal-safe and touch no memory of the parent.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // A test run in the background of a non-interactive shell (`cargo test &`,
                // nohup) inherits SIGINT and SIGQUIT ignored, and so would every process
                // it starts: a shell cannot even trap a signal ignored at entry. The signals
                // the tests send must do what they do in a terminal.
                for signal in [libc::SIGINT, libc::SIGQUIT, libc::SIGTERM, libc::SIGHUP] {
                    libc::signal(signal, libc::SIG_DFL);
                }
                Ok(())
            });
        }
        let (reply_tx, reply_rx) = mpsc::channel();
        spawner()
            .lock()
            .unwrap()
            .send((command, reply_tx))
            .expect("spawner thread alive");
        let child = reply_rx
            .recv()
            .expect("spawner replies")
            .with_context(|| format!("spawn {name}"))?;
        let pid = child.id() as i32;
        LIVE.lock().unwrap().insert(pid);
        Ok(Self {
            name: name.to_string(),
            pid,
            child: Mutex::new(child),
            log_path: log_path.to_path_buf(),
            status: Mutex::new(None),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the process wrote to stdout and stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Send `signal` to this process (by pid), unless it has already exited.
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        if self.try_status().is_some() {
            return Ok(());
        }
        // SAFETY: plain syscall on a pid we own and have not reaped yet.
        if unsafe { libc::kill(self.pid, signal.raw()) } != 0 {
            let err = std::io::Error::last_os_error();
            bail!("kill -{:?} {} ({}): {err}", signal, self.pid, self.name);
        }
        Ok(())
    }

    /// The exit status, if the process has exited (reaps it).
    pub fn try_status(&self) -> Option<ExitStatus> {
        let mut status = self.status.lock().unwrap();
        if status.is_none() {
            if let Ok(Some(s)) = self.child.lock().unwrap().try_wait() {
                LIVE.lock().unwrap().remove(&self.pid);
                *status = Some(s);
            }
        }
        *status
    }

    pub fn is_running(&self) -> bool {
        self.try_status().is_none()
    }

    /// Wait up to `timeout` for the process to exit.
    pub fn wait_exit(&self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status() {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} (pid {}) still running after {timeout:?}",
                    self.name,
                    self.pid
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&self) -> anyhow::Result<ExitStatus> {
        self.signal(Signal::Kill)?;
        self.wait_exit(Duration::from_secs(30))
    }

    /// Send `signal` and wait up to `timeout` for the exit.
    pub fn stop_with(&self, signal: Signal, timeout: Duration) -> anyhow::Result<ExitStatus> {
        self.signal(signal)?;
        self.wait_exit(timeout)
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if self.try_status().is_none() {
            let _ = self.kill();
        }
    }
}

extern "C" fn kill_children_at_exit() {
    let pids: Vec<i32> = LIVE
        .lock()
        .map(|l| l.iter().copied().collect())
        .unwrap_or_default();
    for pid in &pids {
        // SAFETY: our own unreaped children.
        unsafe {
            libc::kill(*pid, libc::SIGKILL);
        }
    }
    for pid in &pids {
        let mut status = 0;
        // SAFETY: reaping our own children.
        unsafe {
            libc::waitpid(*pid, &mut status, 0);
        }
    }
}

/// Kill this process's children at exit. Registered after the scratch directory's own
/// clean-up (`spawn` makes the directory first), so it runs before it: `atexit` runs the
/// last registered first, and a server is gone before its directory is removed.
fn install_exit_cleanup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registering a plain extern "C" function.
        unsafe {
            libc::atexit(kill_children_at_exit);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ignored-signal bits of `SigIgn:` in a process's /proc status.
    fn ignored_mask(status: &str) -> u64 {
        let hex = status
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .expect("a SigIgn line")
            .trim();
        u64::from_str_radix(hex, 16).unwrap()
    }

    /// Run as `cargo test &` or under nohup, the test process ignores SIGINT (and SIGHUP):
    /// the processes it starts must not, or the SIGINT a test sends does nothing (issue 25
    /// item 8: the README run-command test failed after 120 s with the stack still up).
    #[test]
    fn children_do_not_inherit_ignored_signals() {
        // SAFETY: plain dispositions of this test process, restored below; no handler runs.
        let (int, hup) = unsafe {
            (
                libc::signal(libc::SIGINT, libc::SIG_IGN),
                libc::signal(libc::SIGHUP, libc::SIG_IGN),
            )
        };
        let own = ignored_mask(&std::fs::read_to_string("/proc/self/status").unwrap());
        let dir = crate::scratch_dir("dispositions");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "exec cat /proc/self/status"]);
        let child = ChildProcess::spawn("dispositions", cmd, &dir.join("status.log")).unwrap();
        let exited = child.wait_exit(Duration::from_secs(10));
        // SAFETY: as above.
        unsafe {
            libc::signal(libc::SIGINT, int);
            libc::signal(libc::SIGHUP, hup);
        }
        assert!(exited.unwrap().success());
        let bit = |signal: libc::c_int| 1u64 << (signal - 1);
        assert_ne!(own & bit(libc::SIGINT), 0, "the test itself ignores SIGINT");
        let child_mask = ignored_mask(&child.log());
        for (name, signal) in [("SIGINT", libc::SIGINT), ("SIGHUP", libc::SIGHUP)] {
            assert_eq!(child_mask & bit(signal), 0, "the child ignores {name}");
        }
    }
}
