//! Every metric the relay exports, defined once. Names follow Prometheus conventions:
//! `cdc_relay_<what>_<unit>[_total]`; slot health is `cdc_relay_slot_*`.

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::status::Role;

/// `wal_status` values of `pg_replication_slots` (PG 15).
pub(crate) const WAL_STATUSES: [&str; 4] = ["reserved", "extended", "unreserved", "lost"];

pub struct Metrics {
    registry: Registry,
    // Publishing.
    pub events_published_total: IntCounter,
    pub duplicates_rejected_total: IntCounter,
    pub foreign_inserts_skipped_total: IntCounter,
    pub messages_published_total: IntCounter,
    pub messages_skipped_total: IntCounter,
    pub transactions_total: IntCounter,
    pub publish_batches_total: IntCounter,
    pub publish_batch_duration_seconds: Histogram,
    pub publish_batch_entries: Histogram,
    pub commit_to_published_seconds: Histogram,
    pub acknowledged_lsn: IntGauge,
    pub redis_errors_total: IntCounter,
    pub reconnects_total: IntCounter,
    pub state: IntGaugeVec,
    // Recovery.
    pub rebuilds_total: IntCounterVec,
    pub republished_events_total: IntCounter,
    pub shard_behind: IntGaugeVec,
    pub shard_behind_seconds: GaugeVec,
    pub shards_fell_behind_total: IntCounterVec,
    pub catch_ups_total: IntCounterVec,
    pub catch_up_waiting_for_consumers: IntGauge,
    pub catch_up_waiting_for_commits: IntGauge,
    pub catch_up_past_retention_total: IntCounter,
    pub lane_held_bytes: IntGauge,
    pub replication_silent_total: IntCounter,
    pub messages_pauses_total: IntCounter,
    pub confirmations_overdue_total: IntCounter,
    // Slot health, read from pg_replication_slots / pg_stat_replication_slots.
    pub slot_lag_bytes: IntGauge,
    pub slot_retained_wal_bytes: IntGauge,
    pub slot_safe_wal_size_bytes: Gauge,
    pub slot_conflicting: Gauge,
    pub slot_failover: Gauge,
    pub slot_synced: Gauge,
    pub slot_inactive_seconds: Gauge,
    pub standby_up: IntGaugeVec,
    pub standby_slot_ready: IntGaugeVec,
    pub standby_slot_behind_bytes: GaugeVec,
    pub standby_slot_sync_skipped: IntGaugeVec,
    pub slot_wal_status: IntGaugeVec,
    pub slot_active: IntGauge,
    pub slot_held: IntGauge,
    pub slot_exists: IntGauge,
    pub slot_lost: IntGauge,
    pub slot_spilled_bytes_total: IntCounter,
    pub slot_spilled_transactions_total: IntCounter,
    pub slot_memory_exceeded_total: IntCounter,
    pub postgres_up: IntGauge,
    // The stream as its consumers see it, read from Redis (XLEN, XINFO, XPENDING) every
    // --slot-metrics-interval by the relay holding the slot.
    pub stream_length_entries: IntGaugeVec,
    pub stream_group_lag_entries: GaugeVec,
    pub stream_group_pending_entries: IntGaugeVec,
    pub stream_group_oldest_pending_idle_seconds: GaugeVec,
    pub stream_group_consumers: IntGaugeVec,
    pub stream_up: IntGauge,
}

struct Builder<'a>(&'a Registry);

impl Builder<'_> {
    fn register<M: prometheus::core::Collector + Clone + 'static>(&self, metric: M) -> M {
        self.0
            .register(Box::new(metric.clone()))
            .expect("unique metric");
        metric
    }
    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::new(name, help).expect("valid metric"))
    }
    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::new(name, help).expect("valid metric"))
    }
    fn histogram(&self, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
        self.register(
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .expect("valid metric"),
        )
    }
}

impl Metrics {
    /// Metrics labelled with the relay's slot and stream (a standby relay exports the same
    /// slot's health, so alerts aggregate `by (slot)`).
    pub fn new(slot: &str, stream: &str) -> Self {
        let labels = [
            ("slot".to_string(), slot.to_string()),
            ("stream".to_string(), stream.to_string()),
        ]
        .into_iter()
        .collect();
        let registry = Registry::new_custom(None, Some(labels)).expect("valid labels");
        let b = Builder(&registry);
        let latency = vec![
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0,
        ];
        let metrics = Self {
            events_published_total: b.counter("cdc_relay_events_published_total", "Outbox events written to the stream"),
            duplicates_rejected_total: b.counter("cdc_relay_duplicates_rejected_total", "Re-sent outbox events the stream already held (not written again)"),
            messages_published_total: b.counter("cdc_relay_messages_published_total", "Transactional logical decoding messages (pg_logical_emit_message) of the --message-prefixes sealed into batches as entries"),
            messages_skipped_total: b.counter("cdc_relay_messages_skipped_total", "Non-transactional logical decoding messages of the --message-prefixes, not published (no transaction gives them a place in commit order)"),
            foreign_inserts_skipped_total: b.counter("cdc_relay_foreign_inserts_skipped_total", "Inserts into publication tables other than the outbox, not published"),
            transactions_total: b.counter("cdc_relay_transactions_total", "Transactions received from the slot"),
            publish_batches_total: b.counter("cdc_relay_publish_batches_total", "Batches confirmed by Redis"),
            publish_batch_duration_seconds: b.histogram("cdc_relay_publish_batch_duration_seconds", "Time of one successful batch call to Redis", latency.clone()),
            publish_batch_entries: b.histogram("cdc_relay_publish_batch_entries", "Entries per published batch", prometheus::exponential_buckets(1.0, 4.0, 8).expect("valid buckets")),
            commit_to_published_seconds: b.histogram("cdc_relay_commit_to_published_seconds", "From a transaction's commit timestamp to Redis confirming its entries", latency),
            acknowledged_lsn: b.gauge("cdc_relay_acknowledged_lsn", "Last LSN this relay acknowledged to its slot (as a 64-bit integer)"),
            redis_errors_total: b.counter("cdc_relay_redis_errors_total", "Failed Redis calls (each retried)"),
            reconnects_total: b.counter("cdc_relay_reconnects_total", "Replication sessions restarted after a transient error"),
            state: b.register(IntGaugeVec::new(Opts::new("cdc_relay_state", "1 for the relay's current state, 0 for the others"), &["state"]).expect("valid metric")),
            rebuilds_total: b.register(IntCounterVec::new(Opts::new("cdc_relay_rebuilds_total", "Sessions that started with shards behind the slot or made the slot anew, by reason (the shards are caught up from the outbox table)"), &["reason"]).expect("valid metric")),
            republished_events_total: b.counter("cdc_relay_republished_events_total", "Outbox rows published from the outbox table by catch-ups"),
            shard_behind: b.register(IntGaugeVec::new(Opts::new("cdc_relay_shard_behind", "1 while the shard is behind: the slot does not wait for it, and its rows wait in the outbox table for a catch-up"), &["shard"]).expect("valid metric")),
            shard_behind_seconds: b.register(GaugeVec::new(Opts::new("cdc_relay_shard_behind_seconds", "How long ago the snapshot a behind shard is caught up from was taken (0 when live): compare with --outbox-retention"), &["shard"]).expect("valid metric")),
            shards_fell_behind_total: b.register(IntCounterVec::new(Opts::new("cdc_relay_shards_fell_behind_total", "Shards that fell behind, by reason (failing: could not confirm for --shard-detach-after; full: --stream-max-len unread entries; memory: --lane-max-bytes; lost: lost entries or its record)"), &["reason"]).expect("valid metric")),
            catch_ups_total: b.register(IntCounterVec::new(Opts::new("cdc_relay_catch_ups_total", "Catch-ups of a shard from the outbox table started, by what they compare (since: from the shard's watermark; everything: every retained row)"), &["mode"]).expect("valid metric")),
            catch_up_waiting_for_consumers: b.gauge("cdc_relay_catch_up_waiting_for_consumers", "1 while a catch-up waits for the consumer groups to read before it publishes more (nothing unread is ever trimmed)"),
            catch_up_waiting_for_commits: b.gauge("cdc_relay_catch_up_waiting_for_commits", "1 while a catch-up's hand-over waits for transactions the slot sent (and a behind shard dropped) to become visible to snapshots: commits waiting for a synchronous standby"),
            catch_up_past_retention_total: b.counter("cdc_relay_catch_up_past_retention_total", "Catch-ups of a shard that fell behind longer ago than --outbox-retention: rows it never got may have been deleted"),
            lane_held_bytes: b.gauge("cdc_relay_lane_held_bytes", "Bytes of entries the lanes hold (queued, in flight, captured)"),
            replication_silent_total: b.counter("cdc_relay_replication_silent_total", "Replication sessions ended because the server was silent for --replication-timeout"),
            messages_pauses_total: b.counter("cdc_relay_messages_pauses_total", "Times reading waited because a shard behind kept --lane-max-bytes of logical messages (no table holds them)"),
            confirmations_overdue_total: b.counter("cdc_relay_confirmations_overdue_total", "Replication sessions ended because the server asked for a confirmation of everything it sent (a fast shutdown waits for it) that could not be given within --shutdown-grace"),
            slot_lag_bytes: b.gauge("cdc_relay_slot_lag_bytes", "WAL between the server's current position and the slot's confirmed_flush_lsn"),
            slot_retained_wal_bytes: b.gauge("cdc_relay_slot_retained_wal_bytes", "WAL the slot keeps on disk: current position minus restart_lsn"),
            slot_safe_wal_size_bytes: b.register(Gauge::new("cdc_relay_slot_safe_wal_size_bytes", "WAL that can still be written before the slot is lost (NaN without max_slot_wal_keep_size)").expect("valid metric")),
            slot_conflicting: b.register(Gauge::new("cdc_relay_slot_conflicting", "1 while the slot conflicts with recovery and cannot be used (NaN before Postgres 17)").expect("valid metric")),
            slot_failover: b.register(Gauge::new("cdc_relay_slot_failover", "1 when the slot is a failover slot, synced to standbys (NaN before Postgres 17)").expect("valid metric")),
            slot_synced: b.register(Gauge::new("cdc_relay_slot_synced", "1 when the slot was synced from a primary (on a standby; NaN before Postgres 17)").expect("valid metric")),
            slot_inactive_seconds: b.register(Gauge::new("cdc_relay_slot_inactive_seconds", "Seconds since the slot became inactive, by the server's clock (0 while active; NaN before Postgres 17)").expect("valid metric")),
            standby_up: b.register(IntGaugeVec::new(Opts::new("cdc_relay_standby_up", "1 when the last query of the standby (--standby-url) succeeded"), &["standby"]).expect("valid metric")),
            standby_slot_ready: b.register(IntGaugeVec::new(Opts::new("cdc_relay_standby_slot_ready", "1 when the standby (--standby-url) holds a synced, non-temporary, valid copy of the failover slot, so its promotion keeps the slot"), &["standby"]).expect("valid metric")),
            standby_slot_behind_bytes: b.register(GaugeVec::new(Opts::new("cdc_relay_standby_slot_behind_bytes", "The slot's confirmed_flush_lsn on the primary minus its synced copy's on the standby (NaN without a copy)"), &["standby"]).expect("valid metric")),
            standby_slot_sync_skipped: b.register(IntGaugeVec::new(Opts::new("cdc_relay_standby_slot_sync_skipped", "1, labelled with the reason, while the standby's slot sync skips the failover slot (Postgres 19+: slotsync_skip_reason); absent otherwise"), &["standby", "reason"]).expect("valid metric")),
            slot_wal_status: b.register(IntGaugeVec::new(Opts::new("cdc_relay_slot_wal_status", "1 for the slot's current wal_status, 0 for the others"), &["status"]).expect("valid metric")),
            slot_active: b.gauge("cdc_relay_slot_active", "1 while some walsender holds the slot"),
            slot_held: b.gauge("cdc_relay_slot_held", "1 while this relay holds the slot"),
            slot_exists: b.gauge("cdc_relay_slot_exists", "1 while the slot exists"),
            slot_lost: b.gauge("cdc_relay_slot_lost", "1 while the slot is lost and not yet recreated"),
            slot_spilled_bytes_total: b.counter("cdc_relay_slot_spilled_bytes_total", "Bytes of decoded transactions spilled to disk (pg_stat_replication_slots.spill_bytes)"),
            slot_spilled_transactions_total: b.counter("cdc_relay_slot_spilled_transactions_total", "Transactions spilled to disk (pg_stat_replication_slots.spill_txns)"),
            slot_memory_exceeded_total: b.counter("cdc_relay_slot_memory_exceeded_total", "Times decoding the slot used more than logical_decoding_work_mem (Postgres 19+: pg_stat_replication_slots.mem_exceeded_count; stays 0 before)"),
            postgres_up: b.gauge("cdc_relay_postgres_up", "1 when the last slot health query succeeded"),
            stream_length_entries: b.register(IntGaugeVec::new(Opts::new("cdc_relay_stream_length_entries", "Entries in each shard of the stream (XLEN)"), &["shard"]).expect("valid metric")),
            stream_group_lag_entries: b.register(GaugeVec::new(Opts::new("cdc_relay_stream_group_lag_entries", "Entries of the shard not yet delivered to the consumer group (XINFO GROUPS lag; NaN when Redis cannot tell)"), &["shard", "group"]).expect("valid metric")),
            stream_group_pending_entries: b.register(IntGaugeVec::new(Opts::new("cdc_relay_stream_group_pending_entries", "Entries delivered to the group's consumers and not yet acknowledged"), &["shard", "group"]).expect("valid metric")),
            stream_group_oldest_pending_idle_seconds: b.register(GaugeVec::new(Opts::new("cdc_relay_stream_group_oldest_pending_idle_seconds", "Time since the group's oldest unacknowledged entry was last delivered (XPENDING idle; 0 with none pending)"), &["shard", "group"]).expect("valid metric")),
            stream_group_consumers: b.register(IntGaugeVec::new(Opts::new("cdc_relay_stream_group_consumers", "Consumers the group knows on the shard"), &["shard", "group"]).expect("valid metric")),
            stream_up: b.gauge("cdc_relay_stream_up", "1 when this relay holds the slot and its last read of the stream's consumer groups succeeded"),
            registry,
        };
        metrics.set_role(Role::Starting);
        for status in WAL_STATUSES {
            metrics.slot_wal_status.with_label_values(&[status]).set(0);
        }
        metrics.slot_safe_wal_size_bytes.set(f64::NAN);
        for unknown in [
            &metrics.slot_conflicting,
            &metrics.slot_failover,
            &metrics.slot_synced,
            &metrics.slot_inactive_seconds,
        ] {
            unknown.set(f64::NAN);
        }
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

    /// Set the one-hot wal_status gauge (`None`: no slot).
    pub fn set_wal_status(&self, current: Option<&str>) {
        for status in WAL_STATUSES {
            self.slot_wal_status
                .with_label_values(&[status])
                .set(i64::from(Some(status) == current));
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
}
