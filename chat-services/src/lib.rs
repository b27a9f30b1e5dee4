//! The chat services. One library, two sides (`Consumers` and `Workers`): each writes a
//! sent message and its outbox event in one transaction (and nothing else on the request
//! path), consumes the other side's stream into its inbox exactly once per message, and
//! shows each chat's feed (sent and received) live over Server-Sent Events, replayable from
//! the database.
//!
//! - `http`: the API, the page, event streams; `hub`: the live channels of this instance;
//! - `store`: every statement (outbox writes, inbox writes, feeds, the writer fence);
//! - `inbox`: this side's inbox, fed by the other side's stream through `outbox_consumer`
//!   (the receiving protocol: leases, claims, dead letters, sharing the shards);
//! - `notify`: live hints between this side's instances, and the safety nets behind them;
//! - `dead_letters`: the operator's command for entries the consumer could not record;
//! - `auth`: who is asking (bearer tokens verified against the provider's JWKS, the
//!   session cookie); `token`: tokens as a provider issues them (the local stack, tests);
//! - `retention`, `metrics`, `model`, `side`, `config`.
//!
//! Connecting, the stream's format and key names, the lease and the admin endpoints are
//! `outbox_core`'s; the services do not depend on the relay.

mod auth;
mod config;
mod dead_letters;
mod http;
mod hub;
mod inbox;
mod metrics;
mod model;
mod notify;
mod retention;
mod side;
mod stamp;
mod store;
pub mod token;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use auth::{KeySource, TokenConfig, TokenVerifier};
pub use config::{AuthArgs, AuthMode, Cli, Command, DeadLetterCommand, MigrateCli, ServiceConfig};
pub use dead_letters::{run as dead_letters, Outcome as DeadLetterOutcome};
pub use model::{parse_chat_id, parse_send_request, Message, MESSAGE_CREATED};
pub use outbox_consumer::{ConsumerRole, ConsumerStatus};
pub use side::Side;

/// The backoff between attempts to reach Postgres or Redis again: from `first` up to one
/// second, so a server that comes back after a long outage is noticed within a second of
/// it (an attempt costs one connection), not after a pause that grew through the outage.
pub(crate) fn retry_backoff(first: Duration) -> outbox_core::backoff::Backoff {
    outbox_core::backoff::Backoff::new(first, Duration::from_secs(1))
}

/// Internals the integration tests drive directly.
#[cfg(any(test, feature = "test-support"))]
pub mod test_support {
    pub use crate::store::{Received, Store, StoreError};
}

/// Why a service does not start: what to change.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(#[from] outbox_core::ConfigError),
    #[error("{flag} {addr}: cannot listen: {source}")]
    Listen {
        flag: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A chat service bound to its listen address, ready to [`Service::run`].
pub struct Service {
    config: ServiceConfig,
    listener: TcpListener,
    admin: Option<TcpListener>,
    app: Arc<http::App>,
    publisher: notify::Publisher,
    status_tx: watch::Sender<ConsumerStatus>,
    /// The public listener's certificate, with `--tls-cert-file`.
    tls: Option<Arc<http::tls::Certificate>>,
}

async fn listen(flag: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Listen { flag, addr, source })
}

impl Service {
    /// Bind the HTTP listener (port 0 picks a free one) and build the state.
    pub async fn bind(
        config: ServiceConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, StartError> {
        let tls = match &config.tls {
            Some((cert, key)) => Some(http::tls::Certificate::load(cert.clone(), key.clone())?),
            None => None,
        };
        let listener = listen("--listen", config.listen).await?;
        let admin = match config.admin_addr {
            Some(addr) => Some(listen("--admin-addr", addr).await?),
            None => None,
        };
        let (status_tx, status_rx) = watch::channel(ConsumerStatus::default());
        let hub = hub::Hub::new();
        let metrics = Arc::new(metrics::Metrics::new(config.side));
        let (announcer, publisher) = notify::Announcer::new(
            hub.clone(),
            config.redis.clone(),
            config.side,
            metrics.clone(),
        );
        let app = Arc::new(http::App {
            side: config.side,
            store: store::Store::new(&config.postgres, config.side, config.db_pool_size)?,
            hub,
            announcer,
            metrics,
            consumer: status_rx,
            shutdown,
            sse_heartbeat: config.sse_heartbeat,
            trust_traceparent: config.trust_traceparent,
            limits: http::Limits::new(&config),
            auth: match &config.auth {
                config::AuthMode::Anonymous => {
                    warn!("running with --allow-anonymous: nobody is identified, anyone who reaches --listen may read and post in every chat");
                    auth::Auth::Anonymous
                }
                config::AuthMode::Tokens(tokens) => {
                    auth::Auth::Tokens(Arc::new(auth::Verifier::load(tokens.clone())?))
                }
            },
            cookie_secure: config.cookie_secure,
            streams: Arc::default(),
            slow_history: config.slow_history,
            refuse_sends: config
                .refuse_sends
                .map(|(chat, n)| (chat, std::sync::atomic::AtomicU64::new(n))),
        });
        Ok(Self {
            config,
            listener,
            admin,
            app,
            publisher,
            status_tx,
            tls,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    /// The admin listener's address (/healthz, /readyz, /metrics), if enabled.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn consumer_status(&self) -> watch::Receiver<ConsumerStatus> {
        self.status_tx.subscribe()
    }

    /// Serve HTTP and consume the inbox until the shutdown token given to `bind`; then stop
    /// in order: listeners, the consumers (they release their leases), the rest.
    pub async fn run(self) {
        let shutdown = self.app.shutdown.clone();
        let cfg = &self.config;
        info!(side = %cfg.side, addr = %self.local_addr(), consumer = %cfg.consumer_name, "chat service listening");
        let consumer = start_consumer(cfg, &self.app, self.status_tx, &shutdown);
        let background = Background::start(cfg, &self.app, self.publisher, &shutdown);
        let admin = self.admin.map(|listener| {
            info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "admin listener (healthz, readyz, metrics)");
            tokio::spawn(outbox_core::admin::serve(
                listener,
                Arc::new(http::ServiceProbe(self.app.clone())),
                shutdown.clone(),
            ))
        });
        if let Some(verifier) = self.app.auth.remote() {
            tokio::spawn(verifier.fetch(
                self.app.metrics.jwks_fetch_failures_total.clone(),
                shutdown.clone(),
            ));
        }
        let tls = self.tls.map(|certificate| {
            tokio::spawn(certificate.clone().watch(shutdown.clone()));
            certificate.acceptor()
        });
        http::serve(self.listener, self.app.clone(), tls, shutdown).await;
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        let Background {
            follower,
            publisher,
            tips,
            retention,
            streams,
        } = background;
        let _ = retention.await;
        consumer.stop().await;
        for task in [follower, publisher, tips, streams] {
            let _ = task.await;
        }
        info!("stopped");
    }
}

/// The inbox consumer: the receiving protocol (`outbox_consumer`) with this side's inbox.
fn start_consumer(
    cfg: &ServiceConfig,
    app: &Arc<http::App>,
    status_tx: watch::Sender<ConsumerStatus>,
    shutdown: &CancellationToken,
) -> outbox_consumer::Consumer {
    let inbox = inbox::ChatInbox::new(
        cfg.side,
        app.store.clone(),
        app.announcer.clone(),
        app.metrics.clone(),
        inbox::Failpoints {
            crash_after_inbox_commit: cfg.crash_after_inbox_commit,
            crash_on_body: cfg.crash_on_body.clone(),
        },
    );
    outbox_consumer::Consumer::start(
        inbox::consumer_config(cfg),
        Arc::new(inbox),
        app.metrics.consumer.clone(),
        status_tx,
        shutdown,
    )
}

/// The tasks beside the consumers: live hints (in and out), the feed check, retention.
struct Background {
    follower: JoinHandle<()>,
    publisher: JoinHandle<()>,
    tips: JoinHandle<()>,
    retention: JoinHandle<()>,
    /// Ends the event streams of users who left their chat.
    streams: JoinHandle<()>,
}

impl Background {
    fn start(
        cfg: &ServiceConfig,
        app: &Arc<http::App>,
        publisher: notify::Publisher,
        shutdown: &CancellationToken,
    ) -> Self {
        Self {
            follower: tokio::spawn(notify::follow(
                cfg.redis.clone(),
                cfg.side,
                app.hub.clone(),
                shutdown.clone(),
            )),
            publisher: tokio::spawn(publisher.run(shutdown.clone())),
            tips: tokio::spawn(notify::watch_tips(
                app.store.clone(),
                app.hub.clone(),
                cfg.feed_check_interval,
                shutdown.clone(),
            )),
            retention: tokio::spawn(retention::run(
                app.store.clone(),
                app.metrics.clone(),
                retention::Retention {
                    outbox: cfg.outbox_retention,
                    messages: cfg.message_retention,
                    every: cfg.outbox_retention_interval,
                },
                shutdown.clone(),
            )),
            streams: tokio::spawn(app.streams.clone().run(
                app.store.clone(),
                app.metrics.clone(),
                shutdown.clone(),
            )),
        }
    }
}
