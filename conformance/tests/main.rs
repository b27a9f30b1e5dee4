//! The conformance suite's short variant, run by `cargo test` against the Rust consumer
//! (`outbox-consumer`, through `conformance-driver`); `CONFORMANCE_DRIVER="<command>"` runs
//! it against another implementation (`CONFORMANCE_DRIVER_NAME` names it in failures).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use conformance::{cases, Driver, Outcome};

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

fn driver() -> Driver {
    match std::env::var("CONFORMANCE_DRIVER") {
        Ok(command) => Driver::from_command(
            &std::env::var("CONFORMANCE_DRIVER_NAME").unwrap_or_else(|_| "custom".into()),
            &command,
        )
        .expect("CONFORMANCE_DRIVER"),
        Err(_) => Driver {
            name: "rust".into(),
            program: env!("CARGO_BIN_EXE_conformance-driver").into(),
            args: Vec::new(),
        },
    }
}

fn report(case: &str, outcome: anyhow::Result<Outcome>) {
    match outcome {
        Ok(o) => eprintln!(
            "conformance {} {case}: pass ({} recorded, {} dead-lettered, commit to recorded p50 {:?} p99 {:?})",
            driver().name,
            o.recorded,
            o.dead_lettered,
            o.latency_p50,
            o.latency_p99
        ),
        Err(e) => panic!("conformance {} {case}: FAIL: {e:#}", driver().name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_poison() {
    report(
        "sigkill_and_poison",
        cases::sigkill_and_poison(driver(), &relay()).await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_past_the_lease() {
    report(
        "sigstop_past_the_lease",
        cases::sigstop_past_the_lease(driver(), &relay()).await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_in_commit() {
    report(
        "frozen_in_commit",
        cases::frozen_in_commit(driver(), &relay()).await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart() {
    report(
        "redis_restart",
        cases::redis_restart(driver(), &relay()).await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_rolling_restart() {
    report(
        "three_instances_rolling_restart",
        cases::three_instances_rolling_restart(driver(), &relay()).await,
    );
}
