//! The relay under test, in-process ([`RunningRelay`]) or as a real process
//! ([`RelayProcess`], for signals), and what a test waits for in its metrics and status.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use cdc_relay::{Relay, RelayError};
use testkit::{wait_until, ChildProcess};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub(crate) struct RunningRelay {
    pub relay: Relay,
    pub shutdown: CancellationToken,
    pub(super) task: Option<JoinHandle<Result<(), RelayError>>>,
}

impl RunningRelay {
    /// Cancel and wait for the relay to finish its graceful shutdown.
    pub(crate) async fn stop(mut self) -> Result<(), RelayError> {
        self.shutdown.cancel();
        self.task
            .take()
            .unwrap()
            .await
            .expect("relay task panicked")
    }

    pub(crate) fn metric(&self, name: &str) -> f64 {
        testkit::http::metric_value(&self.relay.metrics().encode(), name).unwrap_or(0.0)
    }
}

impl Drop for RunningRelay {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub(crate) struct RelayProcess {
    pub child: ChildProcess,
    pub admin: SocketAddr,
}

impl RelayProcess {
    /// A metric from the process's /metrics (`None` while not answering).
    pub(crate) async fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = testkit::http::get(self.admin, "/metrics").await.ok()?;
        testkit::http::metric_value(&body, name)
    }

    /// /readyz status code and body (`None` while not answering).
    pub(crate) async fn readyz(&self) -> Option<(u16, String)> {
        testkit::http::get(self.admin, "/readyz").await.ok()
    }

    /// SIGTERM, and wait (10 s at most) for the graceful exit.
    pub(crate) fn stop(&self) -> std::process::ExitStatus {
        self.child
            .stop_with(testkit::Signal::Term, Duration::from_secs(10))
            .unwrap()
    }

    pub(crate) async fn wait_streaming(&self) {
        testkit::wait_until(
            Duration::from_secs(30),
            "relay ready (streaming)",
            || async {
                match self.readyz().await {
                    Some((200, _)) => Ok(()),
                    other => Err(format!(
                        "readyz {other:?}; log: {}",
                        tail(&self.child.log())
                    )),
                }
            },
        )
        .await
    }
}

/// The process failed, and the last line of its stderr is one `cdc-relay: ...` line
/// containing each of `expected`.
pub(crate) fn assert_refused(output: &std::process::Output, expected: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "exit {:?}; stderr: {stderr}",
        output.status
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("cdc-relay: "), "last line: {last:?}");
    for word in expected {
        assert!(last.contains(word), "{last:?} does not say {word:?}");
    }
}

pub(crate) fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Every sample of the relay's /metrics, by series (`name{labels}`).
pub(crate) async fn metrics(relay: &RelayProcess) -> HashMap<String, f64> {
    let Ok((_, body)) = testkit::http::get(relay.admin, "/metrics").await else {
        return HashMap::new();
    };
    testkit::http::metric_samples(&body)
}

pub(crate) async fn wait_metric(
    relay: &RelayProcess,
    series: &str,
    what: &str,
    ok: impl Fn(f64) -> bool,
) {
    wait_until(Duration::from_secs(30), what, || async {
        match metrics(relay).await.get(series) {
            Some(v) if ok(*v) => Ok(()),
            other => Err(format!("{series} = {other:?}")),
        }
    })
    .await
}

/// Wait until the relay counted a rebuild for `reason`: the counters move after the last
/// entry is in the stream, so a test that saw the stream complete must still wait for them.
pub(crate) async fn wait_rebuild_counted(relay: &RelayProcess, reason: &str) {
    let series = format!("cdc_relay_rebuilds_total{{reason=\"{reason}\"}}");
    wait_metric(relay, &series, "the rebuild counted", |v| v >= 1.0).await
}

/// Wait until the relay caught a shard up from the outbox table comparing `mode` (`since`
/// or `everything`), and no shard is behind any more.
pub(crate) async fn wait_caught_up(relay: &RelayProcess, mode: &str) {
    let series = format!("cdc_relay_catch_ups_total{{mode=\"{mode}\"}}");
    wait_until(Duration::from_secs(30), "a catch-up counted", || async {
        match metrics(relay).await.get(&series) {
            Some(v) if *v >= 1.0 => Ok(()),
            other => Err(format!(
                "{series} = {other:?}; log: {}",
                tail(&relay.child.log())
            )),
        }
    })
    .await;
    wait_until(Duration::from_secs(30), "no shard behind", || async {
        let m = metrics(relay).await;
        let behind: Vec<&String> = m
            .iter()
            .filter(|(k, v)| k.starts_with("cdc_relay_shard_behind{") && **v != 0.0)
            .map(|(k, _)| k)
            .collect();
        if behind.is_empty() {
            Ok(())
        } else {
            Err(format!("{behind:?}; log: {}", tail(&relay.child.log())))
        }
    })
    .await;
}
