//! Every metric the relay exports, defined once. Names follow Prometheus conventions:
//! `cdc_relay_<what>_<unit>[_total]`.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

use crate::status::Role;

pub struct Metrics {
    registry: Registry,
    pub events_published_total: IntCounter,
    pub duplicates_rejected_total: IntCounter,
    pub foreign_inserts_skipped_total: IntCounter,
    pub transactions_total: IntCounter,
    pub publish_batches_total: IntCounter,
    pub publish_batch_duration_seconds: Histogram,
    pub publish_batch_entries: Histogram,
    pub commit_to_published_seconds: Histogram,
    pub acknowledged_lsn: IntGauge,
    pub redis_errors_total: IntCounter,
    pub reconnects_total: IntCounter,
    pub state: IntGaugeVec,
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    registry
        .register(Box::new(c.clone()))
        .expect("unique metric");
    c
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
        .expect("valid metric");
    registry
        .register(Box::new(h.clone()))
        .expect("unique metric");
    h
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let latency_buckets = vec![
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0,
        ];
        let acknowledged_lsn = IntGauge::new(
            "cdc_relay_acknowledged_lsn",
            "Last LSN acknowledged to the replication slot (as a 64-bit integer)",
        )
        .expect("valid metric");
        r.register(Box::new(acknowledged_lsn.clone()))
            .expect("unique metric");
        let state = IntGaugeVec::new(
            Opts::new(
                "cdc_relay_state",
                "1 for the relay's current state, 0 for the others",
            ),
            &["state"],
        )
        .expect("valid metric");
        r.register(Box::new(state.clone())).expect("unique metric");
        let metrics = Self {
            events_published_total: counter(
                &r,
                "cdc_relay_events_published_total",
                "Outbox events written to the stream",
            ),
            duplicates_rejected_total: counter(
                &r,
                "cdc_relay_duplicates_rejected_total",
                "Re-sent outbox events the stream already held (not written again)",
            ),
            foreign_inserts_skipped_total: counter(
                &r,
                "cdc_relay_foreign_inserts_skipped_total",
                "Inserts into publication tables other than the outbox, not published",
            ),
            transactions_total: counter(
                &r,
                "cdc_relay_transactions_total",
                "Transactions received from the slot",
            ),
            publish_batches_total: counter(
                &r,
                "cdc_relay_publish_batches_total",
                "Batches confirmed by Redis",
            ),
            publish_batch_duration_seconds: histogram(
                &r,
                "cdc_relay_publish_batch_duration_seconds",
                "Time of one successful batch call to Redis",
                latency_buckets.clone(),
            ),
            publish_batch_entries: histogram(
                &r,
                "cdc_relay_publish_batch_entries",
                "Entries per published batch",
                prometheus::exponential_buckets(1.0, 4.0, 8).expect("valid buckets"),
            ),
            commit_to_published_seconds: histogram(
                &r,
                "cdc_relay_commit_to_published_seconds",
                "From a transaction's commit timestamp to Redis confirming its entries",
                latency_buckets,
            ),
            acknowledged_lsn,
            redis_errors_total: counter(
                &r,
                "cdc_relay_redis_errors_total",
                "Failed Redis calls (each retried)",
            ),
            reconnects_total: counter(
                &r,
                "cdc_relay_reconnects_total",
                "Replication sessions restarted after a transient error",
            ),
            state,
            registry: r,
        };
        metrics.set_role(Role::Starting);
        metrics
    }

    /// Set the one-hot state gauge.
    pub fn set_role(&self, role: Role) {
        for r in Role::ALL {
            self.state
                .with_label_values(&[r.as_str()])
                .set(i64::from(r == role));
        }
    }

    /// The registry in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("metrics are UTF-8")
    }

    /// The registry, to add collectors beside these metrics.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
