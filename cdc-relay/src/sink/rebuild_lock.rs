//! The rebuild lock: while one relay rebuilds a stream, the others stand by. A lease in
//! Redis (`<stream>:rebuilding`), extended in the background. Its holder releases it with
//! [`RebuildLock::release`] (awaited) at the end of the scope that took it; dropping the
//! guard otherwise (a cancelled future, a panic) releases it in the background.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::connect::RedisConn;
use outbox_core::lease::Lease;
use outbox_core::stream::keys::rebuild_lock_key;
use tokio::task::JoinHandle;
use tracing::warn;

use crate::error::RelayError;

/// The rebuild lock while held: extended in the background every third of its TTL, and
/// marked lost when an extension is refused or none succeeded for a whole TTL. Every
/// destructive step of a rebuild checks it first.
pub(crate) struct RebuildLock {
    conn: RedisConn,
    lease: Arc<Lease>,
    stream: String,
    lost: Arc<AtomicBool>,
    heartbeat: JoinHandle<()>,
    /// Released already (by [`RebuildLock::release`]): nothing left for `Drop`.
    released: bool,
}

impl RebuildLock {
    /// Take the lock for `holder` (`None` while another relay holds it).
    pub(crate) async fn acquire(
        conn: RedisConn,
        stream: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Self>, RelayError> {
        let lease = Arc::new(Lease::new(rebuild_lock_key(stream), holder, ttl));
        if !lease.acquire(&mut conn.clone()).await? {
            return Ok(None);
        }
        let lost = Arc::new(AtomicBool::new(false));
        let heartbeat = tokio::spawn({
            let (mut conn, lease, lost) = (conn.clone(), lease.clone(), lost.clone());
            async move {
                let mut last_ok = tokio::time::Instant::now();
                loop {
                    tokio::time::sleep(ttl / 3).await;
                    match lease.acquire(&mut conn).await {
                        Ok(true) => last_ok = tokio::time::Instant::now(),
                        Ok(false) => break,
                        Err(e) if last_ok.elapsed() < ttl => {
                            warn!(error = %e, "could not extend the rebuild lock; retrying")
                        }
                        Err(_) => break,
                    }
                }
                lost.store(true, Ordering::SeqCst);
            }
        });
        Ok(Some(Self {
            conn,
            lease,
            stream: stream.to_string(),
            lost,
            heartbeat,
            released: false,
        }))
    }

    /// Err when the lock was lost: stop before doing anything more.
    pub(crate) fn check(&self) -> Result<(), RelayError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(RelayError::RebuildLockLost {
                stream: self.stream.clone(),
            });
        }
        Ok(())
    }

    /// Extend now and confirm the lock is still ours (before an irreversible step): it then
    /// stays ours for at least a whole TTL.
    pub(crate) async fn confirm(&mut self) -> Result<(), RelayError> {
        self.check()?;
        if !self.lease.acquire(&mut self.conn).await? {
            self.lost.store(true, Ordering::SeqCst);
            return self.check();
        }
        Ok(())
    }
}

impl RebuildLock {
    /// Stop extending and delete the lock if still ours, and wait until Redis did: where the
    /// caller goes on at once (a command about to exit, a relay about to stream). Every
    /// other way out releases it on drop.
    pub(crate) async fn release(mut self) {
        self.heartbeat.abort();
        self.released = true;
        if let Err(e) = self.lease.release(&mut self.conn).await {
            warn!(error = %e, "could not release the rebuild lock; it expires by itself");
        }
    }
}

impl Drop for RebuildLock {
    /// Stop extending, and delete the lock if still ours, in the background, so a holder
    /// that was cancelled does not make the next one wait for the TTL. Where the process
    /// ends first (or outside a runtime) the lock expires by itself.
    fn drop(&mut self) {
        self.heartbeat.abort();
        if self.released {
            return;
        }
        let (lease, mut conn) = (self.lease.clone(), self.conn.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = lease.release(&mut conn).await {
                    warn!(error = %e, "could not release the rebuild lock; it expires by itself");
                }
            });
        }
    }
}
