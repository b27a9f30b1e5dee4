//! The consumer's metrics, registered in the application's registry under its prefix:
//! `<prefix>_<what>_<unit>[_total]` (the chat services use `chat`, so their names are
//! `chat_dead_lettered_total` and so on).

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Every metric the receiving protocol exports.
pub struct ConsumerMetrics {
    /// Stream entries moved to the dead-letter stream.
    pub dead_lettered_total: IntCounter,
    /// Oldest dead letters trimmed at the dead-letter stream's cap.
    pub dead_letters_trimmed_total: IntCounter,
    /// Entries in the dead-letter streams of the shards this instance holds.
    pub dead_letter_entries: IntGauge,
    /// Pending entries trimmed from the stream before they were recorded.
    pub entries_lost_total: IntCounter,
    /// Shards whose lease this instance holds.
    pub active_shards: IntGauge,
    /// Shards of the stream.
    pub shards: IntGauge,
    /// Recordings retried in place, by cause (`unavailable`, `database_state`, `busy`).
    pub write_retries_total: IntCounterVec,
    /// Entries recorded ahead of the reads through a backlog.
    pub recorded_ahead_total: IntCounter,
}

impl ConsumerMetrics {
    /// Register the consumer's metrics in `registry`, named `<prefix>_...`.
    pub fn register(registry: &Registry, prefix: &str) -> prometheus::Result<Self> {
        let name = |what: &str| format!("{prefix}_{what}");
        let counter = |what: &str, help: &str| -> prometheus::Result<IntCounter> {
            let metric = IntCounter::new(name(what), help)?;
            registry.register(Box::new(metric.clone()))?;
            Ok(metric)
        };
        let gauge = |what: &str, help: &str| -> prometheus::Result<IntGauge> {
            let metric = IntGauge::new(name(what), help)?;
            registry.register(Box::new(metric.clone()))?;
            Ok(metric)
        };
        let write_retries_total = IntCounterVec::new(
            Opts::new(
                name("inbox_write_retries_total"),
                "Inbox writes retried in place, by cause: unavailable (connection, shutdown, a statement or lock wait that ran out), database_state (read-only, permissions, missing table) or busy (a batch written in halves because the database was too slow for it whole); never a delivery",
            ),
            &["cause"],
        )?;
        registry.register(Box::new(write_retries_total.clone()))?;
        Ok(Self {
            dead_lettered_total: counter(
                "dead_lettered_total",
                "Stream entries moved to the dead-letter stream",
            )?,
            dead_letters_trimmed_total: counter(
                "dead_letters_trimmed_total",
                "Oldest dead letters trimmed because the stream reached --dead-letter-max-len (lost for replay)",
            )?,
            dead_letter_entries: gauge(
                "dead_letter_entries",
                "Entries in the dead-letter streams of the shards this instance consumes (summed over instances, each shard counts once)",
            )?,
            entries_lost_total: counter(
                "stream_entries_lost_total",
                "Pending entries trimmed from the stream before they were recorded",
            )?,
            active_shards: gauge(
                "inbox_consumer_active",
                "Inbox shards whose lease this instance holds (1 or 0 with one shard)",
            )?,
            shards: gauge(
                "inbox_shards",
                "Shards of the stream this side consumes (--stream-shards)",
            )?,
            write_retries_total,
            recorded_ahead_total: counter(
                "inbox_recorded_ahead_total",
                "Entries recorded ahead of the reads through a backlog: their order keys (chats) had nothing older unprocessed",
            )?,
        })
    }
}
