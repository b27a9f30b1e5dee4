//! The per-process scratch directory under which every server and log of this test process
//! lives, pruned of directories left by test processes that died without cleaning up.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

static ROOT: OnceLock<PathBuf> = OnceLock::new();
static COUNTER: AtomicU64 = AtomicU64::new(0);

fn base() -> PathBuf {
    std::env::temp_dir().join("outbox-testkit")
}

/// This process's scratch directory, created on first use (world-readable, so a Postgres
/// running as the `postgres` user can reach its data directory inside it).
pub(crate) fn scratch_root() -> &'static Path {
    ROOT.get_or_init(|| {
        let base = base();
        std::fs::create_dir_all(&base).expect("create testkit base directory");
        let _ = std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o1777));
        prune_stale(&base);
        let root = base.join(std::process::id().to_string());
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create testkit scratch directory");
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))
            .expect("chmod scratch directory");
        // SAFETY: registering a plain extern "C" function.
        unsafe {
            libc::atexit(remove_at_exit);
        }
        root
    })
}

/// A new, empty directory inside this process's scratch directory.
pub fn scratch_dir(prefix: &str) -> PathBuf {
    let dir = scratch_root().join(unique_name(prefix));
    std::fs::create_dir_all(&dir).expect("create scratch directory");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
        .expect("chmod scratch directory");
    dir
}

/// A name unique within this test process and across concurrent ones: `<prefix>_<pid>_<n>`,
/// usable as a database, slot or stream name (lowercase, digits, underscores).
pub fn unique_name(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}_{}_{n}", std::process::id())
}

/// Remove the scratch directories of test processes that are no longer alive.
fn prune_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if pid as u32 == std::process::id() || crate::pids::pid_alive(pid) {
            continue;
        }
        let _ = std::fs::remove_dir_all(entry.path());
    }
}

extern "C" fn remove_at_exit() {
    remove_scratch_root();
}

/// Remove this process's scratch directory at exit, unless `TESTKIT_KEEP_SCRATCH` is set
/// (to read a failed test's process logs; the next test run prunes it).
fn remove_scratch_root() {
    if std::env::var_os("TESTKIT_KEEP_SCRATCH").is_some() {
        return;
    }
    if let Some(root) = ROOT.get() {
        let _ = std::fs::remove_dir_all(root);
    }
}
