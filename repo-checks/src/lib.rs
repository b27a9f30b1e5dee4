//! The repository's own checks, dev only: the deploy files, the docs and the README are held
//! to the binaries they describe (tests/). Nothing here ships; the library is the little the
//! checks share: where the repository is and where its binaries were built.
//!
//! Invariant: the checks run the workspace's binaries as built now, never stale ones, and
//! build them with the same features as the lab does (its dependency turns on chat-services'
//! `failpoints`), so one build serves both and neither relinks the other's.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo-checks sits in the repository's root")
        .to_path_buf()
}

/// The file at `path` (relative to the repository), or a panic naming it.
pub fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The directory holding the workspace's binaries (`cdc-relay`, `chat-service`, `migrate`,
/// `chat-token`, `healthcheck`), built now if they are stale (once per test run).
///
/// It is the directory of the test executable's profile (`target/debug`). Cargo runs one
/// test binary at a time, so relinking here cannot pull a binary from under another suite.
pub fn binaries() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--quiet", "--bins"])
            .args(["-p", "cdc-relay", "-p", "chat-services", "-p", "lab"])
            .current_dir(repo())
            .status()
            .expect("cargo build");
        assert!(status.success(), "cargo build of the binaries failed");
        // target/debug/deps/main-<hash> → target/debug
        let exe = std::env::current_exe().expect("the test executable");
        let dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/deps")
            .to_path_buf();
        for binary in [
            "cdc-relay",
            "chat-service",
            "migrate",
            "chat-token",
            "healthcheck",
        ] {
            assert!(
                dir.join(binary).exists(),
                "{binary} is missing from {}",
                dir.display()
            );
        }
        dir
    })
}

/// The path of one of the workspace's binaries (see [`binaries`]).
pub fn binary(name: &str) -> PathBuf {
    binaries().join(name)
}
