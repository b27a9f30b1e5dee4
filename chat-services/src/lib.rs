//! The chat services. One library, two sides (`Consumers` and `Workers`): each writes a
//! sent message and its outbox event in one transaction (and nothing else on the request
//! path), consumes the other side's stream into its inbox exactly once per message, and
//! shows each chat's feed (sent and received) live over Server-Sent Events, replayable from
//! the database.

pub mod config;
pub mod dead_letters;
pub mod http;
pub mod hub;
pub mod inbox;
pub mod lease;
pub mod metrics;
pub mod model;
pub mod notify;
pub mod retention;
pub mod side;
pub mod store;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

pub use config::{Cli, ServiceConfig};
pub use side::Side;

/// A chat service bound to its listen address, ready to [`Service::run`].
pub struct Service {
    config: ServiceConfig,
    listener: TcpListener,
    admin: Option<TcpListener>,
    app: Arc<http::App>,
    publisher: notify::Publisher,
    status_tx: watch::Sender<inbox::ConsumerStatus>,
}

impl Service {
    /// Bind the HTTP listener (port 0 picks a free one) and build the state.
    pub async fn bind(config: ServiceConfig, shutdown: CancellationToken) -> Result<Self, String> {
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(|e| format!("--listen {}: cannot listen: {e}", config.listen))?;
        let admin = match config.admin_addr {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|e| format!("--admin-addr {addr}: cannot listen: {e}"))?,
            ),
            None => None,
        };
        let (status_tx, status_rx) = watch::channel(inbox::ConsumerStatus::default());
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
            limits: http::Limits::new(&config),
        });
        Ok(Self {
            config,
            listener,
            admin,
            app,
            publisher,
            status_tx,
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

    pub fn consumer_status(&self) -> watch::Receiver<inbox::ConsumerStatus> {
        self.status_tx.subscribe()
    }

    /// Serve HTTP and consume the inbox until the shutdown token given to `bind`.
    pub async fn run(self) {
        let cfg = &self.config;
        let shutdown = self.app.shutdown.clone();
        info!(side = %cfg.side, addr = %self.local_addr(), consumer = %cfg.consumer_name, "chat service listening");
        let shards = cfg.stream_shards;
        let roles = Arc::new(inbox::ShardRoles::new(
            shards,
            self.status_tx,
            self.app.metrics.clone(),
        ));
        // One shard: every instance competes for the one lease, as before shards existed.
        // More: instances split them (see `inbox::shards`).
        let (assignment_tx, assignment) =
            watch::channel::<inbox::Assignment>(Arc::new(vec![shards == 1; shards as usize]));
        // The sender lives as long as the consumers (a dropped one would wake them for ever).
        let (membership, _fixed_assignment) = if shards > 1 {
            let task = tokio::spawn(inbox::shards::run_membership(
                inbox::shards::Membership {
                    client: cfg.redis.clone(),
                    side: cfg.side,
                    me: cfg.consumer_name.clone(),
                    shards,
                    ttl: cfg.lease_ttl,
                    store: self.app.store.clone(),
                    roles: roles.clone(),
                },
                assignment_tx,
                shutdown.clone(),
            ));
            (Some(task), None)
        } else {
            (None, Some(assignment_tx))
        };
        let mut consumers = Vec::with_capacity(shards as usize);
        for shard in 0..shards {
            let key = |base: &str| cdc_relay::shard::shard_key(base, shard, shards);
            let inbox = inbox::Inbox::new(
                inbox::InboxConfig {
                    side: cfg.side,
                    stream: key(&cfg.inbound_stream),
                    shard,
                    shards,
                    lease_key: key(&format!("inbox-lease:{}", cfg.side)),
                    attempts_key: key(&format!("inbox-attempts:{}", cfg.side)),
                    group: cfg.side.as_str().to_string(),
                    consumer: cfg.consumer_name.clone(),
                    dead_letter_stream: key(&cfg.dead_letter_stream),
                    legacy_dead_letter_stream: (shards > 1
                        && shard == 0
                        && !cfg.redis.is_cluster())
                    .then(|| cfg.dead_letter_stream.clone()),
                    dead_letter_max_len: cfg.dead_letter_max_len,
                    claim_idle: cfg.claim_idle,
                    max_deliveries: cfg.max_deliveries,
                    lease_ttl: cfg.lease_ttl,
                    crash_after_inbox_commit: cfg.crash_after_inbox_commit,
                    crash_on_body: cfg.crash_on_body.clone(),
                },
                cfg.redis.clone(),
                self.app.store.clone(),
                self.app.announcer.clone(),
                self.app.metrics.clone(),
                roles.clone(),
                assignment.clone(),
            );
            let shutdown = shutdown.clone();
            consumers.push(tokio::spawn(async move {
                // A panic in the consumer is a crash: end the process, so the entry that
                // caused it is redelivered and counted (and dead-lettered if it does it
                // again), instead of a process that serves but no longer consumes.
                let run = tokio::spawn(async move { inbox.run(shutdown).await });
                if let Err(e) = run.await {
                    if e.is_panic() {
                        error!(error = %e, "inbox consumer panicked; aborting the process");
                        std::process::abort();
                    }
                }
            }));
        }
        let consumer = futures::future::join_all(consumers);
        let follower = tokio::spawn(notify::follow(
            cfg.redis.clone(),
            cfg.side,
            self.app.hub.clone(),
            shutdown.clone(),
        ));
        let publisher = tokio::spawn(self.publisher.run(shutdown.clone()));
        let tips = tokio::spawn(notify::watch_tips(
            self.app.store.clone(),
            self.app.hub.clone(),
            cfg.feed_check_interval,
            shutdown.clone(),
        ));
        let retention = tokio::spawn(retention::run(
            self.app.store.clone(),
            self.app.metrics.clone(),
            cfg.outbox_retention,
            cfg.outbox_retention_interval,
            shutdown.clone(),
        ));
        let admin = self.admin.map(|listener| {
            info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "admin listener (healthz, readyz, metrics)");
            tokio::spawn(http::serve(
                listener,
                self.app.clone(),
                shutdown.clone(),
                http::Surface::Admin,
            ))
        });
        http::serve(
            self.listener,
            self.app.clone(),
            shutdown,
            http::Surface::Public,
        )
        .await;
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        let _ = retention.await;
        if tokio::time::timeout(Duration::from_secs(10), consumer)
            .await
            .is_err()
        {
            warn!("inbox consumer did not stop within 10 s");
        }
        if let Some(membership) = membership {
            let _ = membership.await;
        }
        let _ = follower.await;
        let _ = publisher.await;
        let _ = tips.await;
        info!("stopped");
    }
}
