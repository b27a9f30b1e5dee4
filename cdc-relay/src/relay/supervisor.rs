//! The relay's lifecycle around replication sessions: connect to Redis (retrying, and
//! saying so), take the slot or stand by while another relay holds it, reconnect with
//! backoff after transient errors, stop on permanent ones.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use outbox_core::backoff::{jitter, Backoff};

use super::session;
use crate::config::RelayConfig;
use crate::context::{Context, SharedContext};
use crate::error::RelayError;
use crate::metrics::Metrics;
use crate::ops::{admin, monitor, streams};
use crate::recovery::take_over;
use crate::sink::Publisher;
use crate::status::{RelayStatus, Role};

/// A relay: cheap to clone; [`Relay::run`] drives it, the other methods observe it.
#[derive(Clone)]
pub struct Relay {
    ctx: SharedContext,
}

impl Relay {
    pub fn new(config: RelayConfig) -> Self {
        Self {
            ctx: Context::new(config),
        }
    }

    pub fn status(&self) -> watch::Receiver<RelayStatus> {
        self.ctx.subscribe()
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.ctx.metrics.clone()
    }

    /// The admin server's bound address, once listening.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.ctx.admin_addr()
    }

    /// Run until `shutdown` is cancelled (then `Ok` after the final acknowledgement) or a
    /// permanent error.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), RelayError> {
        let ctx = &self.ctx;
        let admin_stop = shutdown.child_token();
        if let Some(addr) = ctx.config.admin_addr {
            let (listener, local) = admin::bind(addr).await.map_err(|e| {
                RelayError::Config(format!("--admin-addr {addr}: cannot listen: {e}"))
            })?;
            ctx.set_admin_addr(local);
            info!(addr = %local, "admin server listening");
            let probe = admin::RelayProbe {
                status: self.status(),
                metrics: self.metrics(),
            };
            tokio::spawn(admin::serve(listener, probe, admin_stop.clone()));
        }
        tokio::spawn(monitor::run(ctx.clone(), admin_stop.clone()));
        tokio::spawn(streams::watch(ctx.clone(), admin_stop.clone()));
        let result = self.supervise(&shutdown).await;
        match &result {
            Ok(()) => ctx.set_role(Role::Stopping),
            Err(e) => {
                ctx.set_role(Role::Failed);
                ctx.set_last_error(Some(e.to_string()));
                error!(error = %e, "relay stopped");
            }
        }
        admin_stop.cancel();
        result
    }

    async fn supervise(&self, shutdown: &CancellationToken) -> Result<(), RelayError> {
        let ctx = &self.ctx;
        let cfg = &ctx.config;
        let Some(publisher) = self.connect_redis(shutdown).await? else {
            return Ok(());
        };
        let mut backoff = Backoff::new(Duration::from_millis(200), cfg.reconnect_max_backoff);
        loop {
            let result = self.session(publisher.clone(), shutdown).await;
            let delay = match result {
                Ok(()) => return Ok(()),
                Err(RelayError::SlotBusy { slot, holder }) => {
                    if ctx.role() != Role::Standby {
                        let holder_pid =
                            holder.map_or_else(|| "unknown".to_string(), |p| p.to_string());
                        info!(%slot, %holder_pid, "slot is held by another relay; standing by");
                    }
                    ctx.set_role(Role::Standby);
                    // Watch the slot on one connection (a query per --standby-retry), and try
                    // the whole takeover only once it is free: a standby costs Postgres next
                    // to nothing, and takes over within about one retry of the holder's exit.
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = self.wait_while_held() => {}
                    }
                    Duration::ZERO
                }
                Err(RelayError::NewRoute { route, at }) => {
                    // Registered before the next session, which loads it; nothing of its
                    // transaction was acknowledged.
                    match crate::recovery::register_route(ctx, &publisher, &route, at).await {
                        Ok(()) => {
                            info!(%route, "a row names a new route; starting a session with its stream");
                            backoff.reset();
                            Duration::ZERO
                        }
                        Err(e) => {
                            let delay = backoff.next_delay();
                            warn!(%route, error = %e, retry_in = ?delay, "could not register a new route");
                            delay
                        }
                    }
                }
                Err(e) if e.is_transient() => {
                    if ctx.role() == Role::Streaming {
                        backoff.reset();
                    }
                    ctx.metrics.reconnects_total.inc();
                    ctx.set_role(Role::Reconnecting);
                    ctx.set_last_error(Some(e.to_string()));
                    if !e.is_redis()
                        && matches!(e, RelayError::Postgres(_) | RelayError::ConnectTimeout(_))
                    {
                        ctx.set_postgres_reachable(false);
                    }
                    let delay = backoff.next_delay();
                    warn!(error = %e, retry_in = ?delay, "replication session ended; reconnecting");
                    delay
                }
                Err(e) => return Err(e),
            };
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Until the slot looks free (no walsender holds it), or the connection to look at it
    /// fails (then the full takeover finds out why).
    async fn wait_while_held(&self) {
        let cfg = &self.ctx.config;
        let Ok(sql) = cfg.postgres.endpoint.connect(cfg.connect_timeout).await else {
            tokio::time::sleep(jitter(cfg.standby_retry * 2)).await;
            return;
        };
        loop {
            let held = tokio::time::timeout(
                cfg.connect_timeout,
                sql.query_opt(
                    "SELECT active_pid IS NOT NULL FROM pg_replication_slots WHERE slot_name = $1",
                    &[&cfg.postgres.slot],
                ),
            )
            .await;
            match held {
                Ok(Ok(Some(row))) if row.get::<_, bool>(0) => {
                    tokio::time::sleep(jitter(cfg.standby_retry * 2)).await;
                }
                _ => return,
            }
        }
    }

    /// One replication session: take the slot over, then stream until shutdown or an error.
    async fn session(
        &self,
        publisher: Publisher,
        shutdown: &CancellationToken,
    ) -> Result<(), RelayError> {
        let started = match take_over(&self.ctx, publisher, shutdown).await {
            Err(RelayError::ShuttingDown) => return Ok(()),
            started => started?,
        };
        session::stream(&self.ctx, started, shutdown).await
    }

    /// Connect to Redis, retrying transient failures until it answers or shutdown (`None`).
    async fn connect_redis(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<Option<Publisher>, RelayError> {
        let ctx = &self.ctx;
        let cfg = &ctx.config;
        let mut backoff = Backoff::new(Duration::from_millis(200), cfg.reconnect_max_backoff);
        loop {
            let attempt = async {
                Publisher::connect(
                    &cfg.redis,
                    &cfg.stream,
                    cfg.stream_shards,
                    cfg.stream_max_len,
                    cfg.redis_timeout,
                )
                .await
                .map(|p| p.with_wait_replicas(cfg.redis_wait_replicas))
            };
            let result = tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                result = attempt => result,
            };
            match result {
                Ok(publisher) => {
                    ctx.set_redis_reachable(true);
                    return Ok(Some(publisher));
                }
                Err(e) if e.is_transient() => {
                    ctx.set_redis_reachable(false);
                    ctx.set_last_error(Some(e.to_string()));
                    let delay = backoff.next_delay();
                    warn!(error = %e, retry_in = ?delay, "redis unreachable; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Run a relay with `config` until `shutdown`.
pub async fn run(config: RelayConfig, shutdown: CancellationToken) -> Result<(), RelayError> {
    Relay::new(config).run(shutdown).await
}
