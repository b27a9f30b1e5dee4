//! The conformance suite's short variant, run by `cargo test` against both implementations:
//! the Rust consumer (`outbox-consumer`, through `conformance-driver`) and the TypeScript one
//! (`packages/outbox-consumer`, built by `deploy/install-deps.sh`, through its
//! `dist/src/driver.js`). Another implementation joins with a module like theirs below (a
//! function that says how to start its driver).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use conformance::{cases, node, Driver, Outcome};

mod example;

/// The `cdc-relay` binary of this build (built now if stale: it is another package's).
fn relay() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .args(["build", "--quiet", "-p", "cdc-relay", "--bin", "cdc-relay"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("cargo build");
            assert!(status.success(), "building cdc-relay failed");
            PathBuf::from(env!("CARGO_BIN_EXE_conformance-driver"))
                .parent()
                .expect("a directory")
                .join("cdc-relay")
        })
        .clone()
}

fn rust() -> Driver {
    Driver {
        name: "rust".into(),
        program: env!("CARGO_BIN_EXE_conformance-driver").into(),
        args: Vec::new(),
    }
}

fn typescript() -> Driver {
    conformance::typescript_driver().unwrap()
}

fn report(driver: &str, case: &str, outcome: anyhow::Result<Outcome>) {
    match outcome {
        Ok(o) => eprintln!(
            "conformance {driver} {case}: pass ({} recorded, {} dead-lettered, commit to recorded p50 {:?} p99 {:?}{})",
            o.recorded,
            o.dead_lettered,
            o.latency_p50,
            o.latency_p99,
            if o.throughput > 0.0 {
                format!(", {:.0} rows/s", o.throughput)
            } else {
                String::new()
            }
        ),
        Err(e) => panic!("conformance {driver} {case}: FAIL: {e:#}"),
    }
}

/// One test per (implementation, case).
macro_rules! cases {
    ($($case:ident),*) => {
        mod rust_consumer {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let d = rust();
                report(&d.name.clone(), stringify!($case), cases::$case(d, &relay()).await);
            })*
        }
        mod typescript_consumer {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let d = typescript();
                report(&d.name.clone(), stringify!($case), cases::$case(d, &relay()).await);
            })*
        }
    };
}

cases!(
    sigkill_and_poison,
    frozen_in_commit,
    sigstop_past_the_lease,
    redis_restart,
    three_instances_rolling_restart,
    database_outage_across_a_restart,
    steady,
    burst
);

/// The TypeScript package's own tests (the contract's vectors, computed by it) pass.
#[test]
fn the_typescript_package_tests_pass() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packages/outbox-consumer");
    let node = node();
    let mut path = std::env::var_os("PATH").unwrap_or_default();
    if let Some(bin) = node.parent().filter(|b| !b.as_os_str().is_empty()) {
        path = std::env::join_paths(
            std::iter::once(bin.to_path_buf()).chain(std::env::split_paths(&path)),
        )
        .expect("PATH");
    }
    let out = Command::new("npm")
        .args(["test", "--silent"])
        .env("PATH", path)
        .current_dir(&dir)
        .output()
        .expect("npm (deploy/install-deps.sh installs it)");
    assert!(
        out.status.success(),
        "npm test failed in {}:\n{}{}",
        dir.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
