//! A chat service's settings, validated (the command line, `cli`, makes them): one group per part of
//! the service, so each part is handed its own settings and none reads the whole.
//!
//! Invariant: a `ServiceConfig` exists only validated; what is loaded from files (the TLS
//! certificate, the identity provider's keys) is loaded once, here, and shared.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use outbox_consumer::ConsumerConfig;
use outbox_core::connect::{PgEndpoint, RedisTarget};

use crate::side::Side;

/// Everything a service needs, validated.
#[derive(Clone)]
pub struct ServiceConfig {
    pub side: Side,
    pub postgres: PgEndpoint,
    pub redis: RedisTarget,
    /// Postgres connections in the pool.
    pub db_pool_size: usize,
    pub listen: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    /// TLS on --listen: the certificate chain and key, loaded once at start (and watched for
    /// renewal while serving).
    pub(crate) certificate: Option<Arc<crate::http::tls::Certificate>>,
    /// The token verifier, its key set read; `None`: anonymous (`--allow-anonymous`, or an
    /// operator's command, which serves nobody).
    pub(crate) verifier: Option<Arc<crate::access::auth::Verifier>>,
    pub cookie_secure: bool,
    pub http: HttpSettings,
    pub live: LiveSettings,
    /// The receiving protocol: the other side's stream into this side's inbox.
    pub inbox: ConsumerConfig,
    pub(crate) retention: Retention,
    pub(crate) failpoints: Failpoints,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URLs may carry passwords: leave them out.
        f.debug_struct("ServiceConfig")
            .field("side", &self.side)
            .field("listen", &self.listen)
            .field("consumer_name", &self.inbox.consumer)
            .field("inbound_stream", &self.inbox.stream)
            .finish_non_exhaustive()
    }
}

/// What the public listener holds clients to.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    /// Open connections at most.
    pub max_connections: usize,
    /// Open connections one client address may hold, and the addresses exempt (proxies).
    pub max_connections_per_address: usize,
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Failed verifications one address may make at once, and per second after.
    pub failed_auth_burst: u32,
    pub failed_auth_rate: f64,
    /// Each user's budgets, in the order of `budgets::Kind` (sends, history pages, stream
    /// opens, sign-ins): a rate per second and the burst they may spend at once.
    pub(crate) budgets: [crate::access::budgets::Budget; 4],
    /// Requests one user may have in flight on one instance.
    pub max_requests_per_user: usize,
    pub body_read_timeout: Duration,
    pub write_timeout: Duration,
    pub header_read_timeout: Duration,
    /// Continue the `traceparent` a send carries.
    pub trust_traceparent: bool,
}

/// Live delivery: event streams and the feed check.
#[derive(Debug, Clone)]
pub struct LiveSettings {
    pub sse_heartbeat: Duration,
    /// Bytes queued for all event-stream clients together at most, and for one.
    pub sse_buffer_total: usize,
    pub sse_client_buffer: usize,
    /// Open event streams at most, on the instance and per user.
    pub max_event_streams: usize,
    pub max_event_streams_per_user: usize,
    /// Messages a stream opened behind the tip replays at most.
    pub sse_max_replay: i64,
    /// How often the newest position of every streamed chat is compared with what was sent.
    pub feed_check_interval: Duration,
}

/// How long rows are kept (`operations::retention`).
#[derive(Debug, Clone)]
pub(crate) struct Retention {
    /// Outbox rows older than this are deleted.
    pub outbox: Duration,
    /// Messages older than this are deleted, when set.
    pub messages: Option<Duration>,
    /// How often retention runs.
    pub every: Duration,
}

/// Test hooks (the `failpoints` feature; all off without it).
#[derive(Debug, Clone, Default)]
pub(crate) struct Failpoints {
    pub inbox: crate::inbox::Failpoints,
    /// History of this chat answers this much later.
    pub slow_history: Option<(i64, Duration)>,
    /// The first sends to this chat answer 503.
    pub refuse_sends: Option<(i64, u64)>,
}

impl ServiceConfig {
    /// What the HTTP server holds clients to.
    /// `budgets_local` is set while users' budgets are counted by this instance alone.
    pub(crate) fn http_limits(&self, budgets_local: prometheus::IntGauge) -> crate::http::Limits {
        use tokio::sync::Semaphore;
        let (http, live) = (&self.http, &self.live);
        crate::http::Limits {
            connections: Arc::new(Semaphore::new(http.max_connections)),
            addresses: Arc::new(crate::http::connections::AddressSlots::new(
                http.max_connections_per_address,
                http.trusted_proxies.iter().copied(),
            )),
            event_streams: Arc::new(Semaphore::new(live.max_event_streams)),
            failed_auth: crate::access::quota::Buckets::new(
                http.failed_auth_rate,
                f64::from(http.failed_auth_burst),
            ),
            feed_reads: Semaphore::new((self.db_pool_size / 2).max(1)),
            sse_client_buffer: live.sse_client_buffer,
            sse_buffer_total: live.sse_buffer_total,
            sse_queued: Arc::default(),
            header_read_timeout: http.header_read_timeout,
            quotas: Arc::new(crate::access::quota::Quotas::new(
                crate::access::budgets::Budgets::shared(
                    self.side,
                    http.budgets,
                    self.redis.clone(),
                    budgets_local,
                ),
                live.max_event_streams_per_user,
                http.max_requests_per_user,
            )),
            body_read_timeout: http.body_read_timeout,
            write_timeout: http.write_timeout,
        }
    }
}
