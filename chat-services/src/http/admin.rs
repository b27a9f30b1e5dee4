//! The service's admin endpoints (served by `outbox_core::admin`, off the public port):
//! ready while Postgres answers (sends need nothing else); Redis and the inbox consumer are
//! reported, but a Redis outage does not stop sends.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::admin::{Probe, Readiness};

use super::App;

/// What the admin endpoints report.
pub(crate) struct ServiceProbe(pub Arc<App>);

impl Probe for ServiceProbe {
    async fn readiness(&self) -> Readiness {
        let app = &self.0;
        let consumer = app.consumer.borrow().clone();
        let postgres = app.store.ping(Duration::from_secs(2)).await;
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
            Ok(()) => Readiness {
                ready: true,
                body: serde_json::json!({"status": "ready", "postgres": "up", "redis": redis, "consumer": consumer.role, "shards": consumer.shards, "last_error": consumer.last_error}),
            },
            _ => Readiness {
                ready: false,
                body: serde_json::json!({"status": "not_ready", "reason": "postgres_unavailable", "postgres": "down", "redis": redis, "consumer": consumer.role}),
            },
        }
    }

    fn metrics(&self) -> String {
        let app = &self.0;
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
        self.0.metrics.accept_errors_total.inc();
    }
}
