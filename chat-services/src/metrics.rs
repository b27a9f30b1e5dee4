//! Every metric a chat service exports, defined once: `chat_<what>_<unit>[_total]`.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

pub(crate) struct Metrics {
    registry: Registry,
    /// The receiving protocol's (`outbox_consumer`), named `chat_...` like the rest.
    pub consumer: std::sync::Arc<outbox_consumer::ConsumerMetrics>,
    pub messages_sent_total: IntCounter,
    pub messages_received_total: IntCounter,
    pub duplicates_skipped_total: IntCounter,
    pub sse_clients: IntGauge,
    pub sse_gaps_filled_total: IntCounter,
    pub sse_slow_clients_dropped_total: IntCounter,
    pub live_hints_unpublished_total: IntCounter,
    pub delivery_seconds: Histogram,
    pub published_to_recorded_seconds: Histogram,
    pub recorded_to_pushed_seconds: Histogram,
    pub http_request_duration_seconds: HistogramVec,
    pub outbox_deleted_total: IntCounter,
    pub accept_errors_total: IntCounter,
    pub connections_refused_total: IntCounter,
    pub connections_over_address_share_total: IntCounter,
    pub event_streams_refused_total: IntCounter,
    pub live_chats: IntGauge,
    pub sse_queued_bytes: IntGauge,
    pub client_addresses: IntGauge,
    pub jwks_keys: IntGauge,
    pub requests_refused_total: IntCounterVec,
    pub event_streams_revoked_total: IntCounter,
    pub membership_checks_failed_total: IntCounter,
    pub messages_deleted_total: IntCounterVec,
    pub jwks_fetch_failures_total: IntCounter,
    pub database_breaker_trips_total: IntCounter,
    pub budgets_local: IntGauge,
}

impl Metrics {
    /// Metrics labelled with the service's side.
    /// Without identities (`--allow-anonymous`) there is no key set: its gauge is not
    /// exported, so its alert (no usable key) cannot fire on such an instance.
    pub(crate) fn anonymous(self) -> Self {
        let _ = self.registry.unregister(Box::new(self.jwks_keys.clone()));
        self
    }

    pub(crate) fn new(side: crate::side::Side) -> Self {
        let labels = [("side".to_string(), side.as_str().to_string())]
            .into_iter()
            .collect();
        let registry = Registry::new_custom(None, Some(labels)).expect("valid labels");
        let counter = |name: &str, help: &str| {
            registered(
                &registry,
                IntCounter::new(name, help).expect("valid metric"),
            )
        };
        let gauge = |name: &str, help: &str| {
            registered(&registry, IntGauge::new(name, help).expect("valid metric"))
        };
        let counters = |name: &str, help: &str, labels: &[&str]| {
            registered(
                &registry,
                IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let delivery_seconds = registered(
            &registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "chat_delivery_seconds",
                    "From the sender's outbox write (its created_at) to the message being shown here",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0,
                ]),
            )
            .expect("valid metric"),
        );
        let stage = |name: &str, help: &str| {
            registered(
                &registry,
                Histogram::with_opts(HistogramOpts::new(name, help).buckets(vec![
                    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.5, 1.0, 5.0, 30.0,
                ]))
                .expect("valid metric"),
            )
        };
        let published_to_recorded_seconds = stage(
            "chat_published_to_recorded_seconds",
            "From Redis storing a received entry (its published_at) to its first inbox commit here",
        );
        let recorded_to_pushed_seconds = stage(
            "chat_recorded_to_pushed_seconds",
            "From a received message's inbox commit to its live push to one event stream (each stream counts; catch-ups from the database do not)",
        );
        let http_request_duration_seconds = registered(
            &registry,
            HistogramVec::new(
                HistogramOpts::new(
                    "chat_http_request_duration_seconds",
                    "Public HTTP requests, from their head read to the answer's head (an event stream's: until it opened), by route, method and status",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0,
                ]),
                &["route", "method", "status"],
            )
            .expect("valid metric"),
        );
        let requests_refused_total = counters(
            "chat_requests_refused_total",
            "Requests refused for who sent them, by reason: no_credentials, invalid_token, duplicate_cookie (the session cookie sent twice), not_member (answered as a missing chat), not_admin, auth_failures (an address whose credentials kept failing), send_rate, history_rate, stream_open_rate, sign_in_rate (a user past a budget), requests_per_user (a user with --max-requests-per-user in flight), streams_per_user",
            &["reason"],
        );
        let messages_deleted_total = counters(
            "chat_messages_deleted_total",
            "Messages deleted by --message-retention, sent or received",
            &["what"],
        );
        Self {
            budgets_local: gauge(
                "chat_budgets_local",
                "1 while users' budgets (sends, history, stream opens, sign-ins) are counted by this instance alone because Redis does not answer: each instance then allows a user the whole budget",
            ),
            database_breaker_trips_total: counter(
                "chat_database_breaker_trips_total",
                "Times Postgres left an operation or a new connection unanswered past its deadline (frozen, cut off): until it answers again, one operation at a time tries it and the others are answered 503 at once. A busy pool never counts",
            ),
            jwks_fetch_failures_total: counter(
                "chat_jwks_fetch_failures_total",
                "Fetches of --jwks-url that failed (the keys there are were kept)",
            ),
            messages_deleted_total,
            requests_refused_total,
            membership_checks_failed_total: counter(
                "chat_membership_checks_failed_total",
                "Checks of the open event streams against chat members that the database did not answer",
            ),
            event_streams_revoked_total: counter(
                "chat_event_streams_revoked_total",
                "Event streams ended because their user left the chat or their token expired",
            ),
            accept_errors_total: counter(
                "chat_accept_errors_total",
                "Failed accepts (such as too many open files), each followed by a pause",
            ),
            connections_refused_total: counter(
                "chat_connections_refused_total",
                "Connections answered 503 and closed because --max-connections were open",
            ),
            connections_over_address_share_total: counter(
                "chat_connections_over_address_share_total",
                "Connections answered 429 and closed because their client address held --max-connections-per-address",
            ),
            event_streams_refused_total: counter(
                "chat_event_streams_refused_total",
                "Event streams refused with 503 because --max-event-streams were open",
            ),
            live_chats: gauge(
                "chat_live_chats",
                "Chats with at least one open event stream on this instance",
            ),
            jwks_keys: gauge(
                "chat_jwks_keys",
                "Usable signing keys in the identity provider's key set now; 0 refuses every token",
            ),
            client_addresses: gauge(
                "chat_client_addresses",
                "Client addresses (an IPv6 client: its /64) holding a connection now",
            ),
            sse_queued_bytes: gauge(
                "chat_sse_queued_bytes",
                "Bytes queued for all event-stream clients of the instance, not yet taken by their connections (at most --sse-buffer-total beside one frame per client)",
            ),
            delivery_seconds,
            published_to_recorded_seconds,
            recorded_to_pushed_seconds,
            http_request_duration_seconds,
            messages_sent_total: counter(
                "chat_messages_sent_total",
                "Messages written with their outbox event",
            ),
            messages_received_total: counter(
                "chat_messages_received_total",
                "Messages recorded in the inbox",
            ),
            duplicates_skipped_total: counter(
                "chat_duplicates_skipped_total",
                "Redeliveries of messages already in the inbox",
            ),
            sse_clients: gauge("chat_sse_clients", "Connected Server-Sent Events clients"),
            live_hints_unpublished_total: counter(
                "chat_live_hints_unpublished_total",
                "Live hints that did not reach the other instances (Redis refused or the queue was full); each owes them a resync, sent once Redis takes it",
            ),
            sse_slow_clients_dropped_total: counter(
                "chat_sse_slow_clients_dropped_total",
                "Event streams ended because their client fell --sse-client-buffer bytes or two heartbeats behind (it resumes with Last-Event-ID)",
            ),
            sse_gaps_filled_total: counter(
                "chat_sse_gaps_filled_total",
                "Event streams that saw a later position than the next one (a hint late or lost) and read the gap from the database",
            ),
            outbox_deleted_total: counter(
                "chat_outbox_deleted_total",
                "Outbox rows deleted by retention",
            ),
            consumer: std::sync::Arc::new(
                outbox_consumer::ConsumerMetrics::register(&registry, "chat")
                    .expect("unique metric names"),
            ),
            registry,
        }
    }

    pub(crate) fn encode(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("metrics are UTF-8")
    }
}

/// `metric`, registered in `registry` (each name once).
fn registered<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: M,
) -> M {
    registry
        .register(Box::new(metric.clone()))
        .expect("unique metric");
    metric
}
