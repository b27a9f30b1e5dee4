//! Waiting on a condition with a deadline, the replacement for every fixed sleep in tests.

use std::future::Future;
use std::time::{Duration, Instant};

const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Poll `probe` until it returns `Ok(value)`, or panic after `timeout` with `what` was
/// expected and the last thing `probe` reported seeing (its `Err` text).
pub async fn wait_until<T, F, Fut>(timeout: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let seen = match probe().await {
            Ok(value) => return value,
            Err(seen) => seen,
        };
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}; last seen: {seen}");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// [`wait_until`] for synchronous probes.
pub fn wait_until_blocking<T>(
    timeout: Duration,
    what: &str,
    mut probe: impl FnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = match probe() {
            Ok(value) => return value,
            Err(seen) => seen,
        };
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}; last seen: {seen}");
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}
