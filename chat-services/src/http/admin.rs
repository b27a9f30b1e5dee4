//! The service's admin endpoints (served by `outbox_core::admin`, off the public port):
//! ready while Postgres answers (sends need nothing else); Redis and the inbox consumer are
//! reported, but a Redis outage does not stop sends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::admin::{Probe, Readiness};

use super::App;

/// What the admin endpoints report.
pub(crate) struct ServiceProbe {
    app: Arc<App>,
    /// When Postgres last answered a ping, or failed to: probes within a second of it take
    /// that answer, and only one ping is in flight, so a flood of `/readyz` costs the pool
    /// one connection a second at most.
    postgres: tokio::sync::Mutex<Option<(Instant, bool)>>,
}

/// How long a ping's answer stands for the next probes.
const PING_KEPT: Duration = Duration::from_secs(1);

impl ServiceProbe {
    pub(crate) fn new(app: Arc<App>) -> Self {
        Self {
            app,
            postgres: tokio::sync::Mutex::new(None),
        }
    }

    async fn postgres_up(&self) -> bool {
        let mut last = self.postgres.lock().await;
        if let Some((at, up)) = *last {
            if at.elapsed() < PING_KEPT {
                return up;
            }
        }
        let up = self.app.store.ping(Duration::from_secs(2)).await.is_ok();
        *last = Some((Instant::now(), up));
        up
    }
}

impl Probe for ServiceProbe {
    async fn readiness(&self) -> Readiness {
        let app = &self.app;
        let consumer = app.consumer.borrow().clone();
        let postgres = self.postgres_up().await;
        let redis = if consumer.redis_reachable {
            "up"
        } else {
            "down"
        };
        if !app.auth.has_keys() {
            // Every request would be refused: not ready until the provider's keys are in.
            return Readiness {
                ready: false,
                body: serde_json::json!({"status": "not_ready", "reason": "no_token_keys", "redis": redis, "consumer": consumer.role}),
            };
        }
        match postgres {
            true => Readiness {
                ready: true,
                body: serde_json::json!({"status": "ready", "postgres": "up", "redis": redis, "consumer": consumer.role, "shards": consumer.shards, "last_error": consumer.last_error}),
            },
            false => Readiness {
                ready: false,
                body: serde_json::json!({"status": "not_ready", "reason": "postgres_unavailable", "postgres": "down", "redis": redis, "consumer": consumer.role}),
            },
        }
    }

    fn metrics(&self) -> String {
        let app = &self.app;
        app.metrics.live_chats.set(app.hub.chats() as i64);
        if let Some(verifier) = app.auth.verifier() {
            app.metrics.jwks_keys.set(verifier.key_count() as i64);
        }
        app.metrics
            .client_addresses
            .set(app.limits.addresses.addresses() as i64);
        app.metrics.sse_queued_bytes.set(
            app.limits
                .sse_queued
                .load(std::sync::atomic::Ordering::SeqCst)
                .try_into()
                .unwrap_or(i64::MAX),
        );
        app.metrics.encode()
    }

    fn accept_failed(&self) {
        self.app.metrics.accept_errors_total.inc();
    }
}
