//! The runtime of one service: bind its listeners and build its state
//! ([`Service::bind`]), then serve HTTP, consume the other side's stream and run the
//! background tasks until shutdown, stopping them in order ([`Service::run`]).

use std::net::SocketAddr;
use std::sync::Arc;

use outbox_consumer::ConsumerStatus;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::access::auth;
use crate::config::ServiceConfig;
use crate::http;
use crate::inbox;
use crate::live;
use crate::live::{hints, tips};
use crate::metrics;
use crate::operations::retention;
use crate::store;

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
    publisher: hints::Publisher,
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
        let tls = config.certificate.clone();
        let listener = listen("--listen", config.listen).await?;
        let admin = match config.admin_addr {
            Some(addr) => Some(listen("--admin-addr", addr).await?),
            None => None,
        };
        let (status_tx, status_rx) = watch::channel(ConsumerStatus::default());
        let hub = live::hub::Hub::new();
        let metrics = match config.verifier {
            Some(_) => metrics::Metrics::new(config.side),
            None => metrics::Metrics::new(config.side).anonymous(),
        };
        let metrics = Arc::new(metrics);
        let (announcer, publisher) = hints::Announcer::new(
            hub.clone(),
            config.redis.clone(),
            config.side,
            metrics.clone(),
        );
        let limits = config.http_limits(metrics.budgets_local.clone());
        let auth = match &config.verifier {
            None => {
                warn!("running with --allow-anonymous: nobody is identified, anyone who reaches --listen may read and post in every chat");
                auth::Auth::Anonymous
            }
            Some(verifier) => auth::Auth::Tokens(verifier.clone()),
        };
        if auth.session_key_generated() {
            warn!("no --session-key-file: page sessions are signed with a key of this process only, so a page signed in here is signed out by a restart and unknown to the side's other instances; give every instance the same key file (CHAT_SESSION_KEY_FILE)");
        }
        if !config.cookie_secure && !auth.is_anonymous() {
            warn!("--cookie-secure=false: the session cookie is sent over plain HTTP and may be set by a sibling subdomain; for local development only");
        }
        if auth.admin_trusts_any_client() {
            warn!("--jwt-admin-audience is set without --jwt-admin-clients: a token of any client granted the admin audience is an admin's; name the backend's client (CHAT_JWT_ADMIN_CLIENTS) if the identity provider lets clients ask for any audience");
        }
        let store = store::Store::new(&config.postgres, config.side, config.db_pool_size)?;
        store.count_breaker_trips(metrics.database_breaker_trips_total.clone());
        let app = Arc::new(http::App {
            side: config.side,
            store,
            hub,
            announcer,
            metrics,
            consumer: status_rx,
            shutdown,
            sse_heartbeat: config.live.sse_heartbeat,
            sse_max_replay: config.live.sse_max_replay,
            trust_traceparent: config.http.trust_traceparent,
            limits,
            auth,
            cookie_secure: config.cookie_secure,
            tls: config.certificate.is_some(),
            members: Arc::default(),
            streams: Arc::default(),
            slow_history: config.failpoints.slow_history,
            refuse_sends: config
                .failpoints
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
        info!(side = %cfg.side, addr = %self.local_addr(), consumer = %cfg.inbox.consumer, "chat service listening");
        let consumer = start_consumer(cfg, &self.app, self.status_tx, &shutdown);
        let background = Background::start(cfg, &self.app, self.publisher, &shutdown);
        let admin = self.admin.map(|listener| {
            info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "admin listener (healthz, readyz, metrics)");
            tokio::spawn(outbox_core::admin::serve(
                listener,
                Arc::new(http::ServiceProbe::new(self.app.clone())),
                shutdown.clone(),
            ))
        });
        // The key set is kept current (fetched, or its file watched) whether or not
        // requests arrive: a withdrawn key ends the streams it signed.
        if let Some(verifier) = self.app.auth.verifier() {
            tokio::spawn(verifier.clone().fetch(
                self.app.metrics.jwks_fetch_failures_total.clone(),
                shutdown.clone(),
            ));
            tokio::spawn(verifier.watch_file(shutdown.clone()));
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
        cfg.failpoints.inbox.clone(),
    );
    outbox_consumer::Consumer::start(
        cfg.inbox.clone(),
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
        publisher: hints::Publisher,
        shutdown: &CancellationToken,
    ) -> Self {
        Self {
            follower: tokio::spawn(hints::follow(
                cfg.redis.clone(),
                cfg.side,
                app.hub.clone(),
                app.store.clone(),
                shutdown.clone(),
            )),
            publisher: tokio::spawn(publisher.run(shutdown.clone())),
            tips: tokio::spawn(tips::watch_tips(
                app.store.clone(),
                app.hub.clone(),
                cfg.live.feed_check_interval,
                shutdown.clone(),
            )),
            retention: tokio::spawn(retention::run(
                app.store.clone(),
                app.metrics.clone(),
                cfg.retention.clone(),
                shutdown.clone(),
            )),
            streams: tokio::spawn(app.streams.clone().run(
                app.store.clone(),
                app.members.clone(),
                app.metrics.clone(),
                shutdown.clone(),
            )),
        }
    }
}
