//! The relay's admin endpoints (served by `outbox_core::admin`): /healthz (alive), /readyz
//! (holding the slot and Redis answering, else the reason and the last error), /metrics.

use std::net::SocketAddr;
use std::sync::Arc;

use outbox_core::admin::{self, Probe, Readiness};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::status::RelayStatus;

/// What the admin endpoints report.
pub(crate) struct RelayProbe {
    pub(crate) status: watch::Receiver<RelayStatus>,
    pub(crate) metrics: Arc<Metrics>,
}

impl Probe for RelayProbe {
    async fn readiness(&self) -> Readiness {
        let status = self.status.borrow().clone();
        match status.not_ready_reason() {
            None => Readiness {
                ready: true,
                body: serde_json::json!({"status": "ready", "role": status.role}),
            },
            Some(reason) => Readiness {
                ready: false,
                body: serde_json::json!({
                    "status": "not_ready",
                    "reason": reason,
                    "role": status.role,
                    "last_error": status.last_error,
                }),
            },
        }
    }

    fn metrics(&self) -> String {
        self.metrics.encode()
    }
}

/// Bind the admin address (port 0 picks a free one; the bound address is returned).
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// Serve until `shutdown`.
pub(crate) async fn serve(listener: TcpListener, probe: RelayProbe, shutdown: CancellationToken) {
    admin::serve(listener, Arc::new(probe), shutdown).await;
}
