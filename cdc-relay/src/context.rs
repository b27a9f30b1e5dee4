//! State the relay's tasks share (configuration, metrics, the status /readyz reports, this
//! process's identity in Redis locks), kept apart from the supervisor so that the session,
//! pipeline, rebuild and monitor modules depend on it and not on each other.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use tokio::sync::watch;

use crate::config::RelayConfig;
use crate::metrics::Metrics;
use crate::sink::layout::Layout;
use crate::status::{RelayStatus, Role};

/// State shared by the relay's tasks.
pub(crate) struct Context {
    pub config: RelayConfig,
    pub metrics: Arc<Metrics>,
    status: watch::Sender<RelayStatus>,
    admin_addr: OnceLock<SocketAddr>,
    /// Identifies this process in Redis locks.
    instance_id: String,
    /// The streams of the current (or last) session: its routes and shards.
    layout: std::sync::Mutex<Layout>,
    this: std::sync::Weak<Context>,
}

pub(crate) type SharedContext = Arc<Context>;

impl Context {
    pub(crate) fn new(config: RelayConfig) -> SharedContext {
        let metrics = Arc::new(Metrics::new(&config.postgres.slot, &config.stream));
        let layout = Layout::new(&config.stream, config.stream_shards, []);
        Arc::new_cyclic(|this| Context {
            layout: std::sync::Mutex::new(layout),
            metrics,
            status: watch::Sender::new(RelayStatus::default()),
            admin_addr: OnceLock::new(),
            // Stable across restarts (the pod's name): a restarted relay recognises a rebuild
            // lock its previous process left, instead of waiting out its TTL.
            instance_id: config.instance_id.clone(),
            this: this.clone(),
            config,
        })
    }

    /// The streams of the current session (before the first, the fallback route's alone).
    pub(crate) fn layout(&self) -> Layout {
        self.layout.lock().unwrap().clone()
    }

    pub(crate) fn set_layout(&self, layout: Layout) {
        *self.layout.lock().unwrap() = layout;
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<RelayStatus> {
        self.status.subscribe()
    }

    pub(crate) fn role(&self) -> Role {
        self.status.borrow().role
    }

    pub(crate) fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr.get().copied()
    }

    pub(crate) fn set_admin_addr(&self, addr: SocketAddr) {
        let _ = self.admin_addr.set(addr);
    }

    pub(crate) fn shared(&self) -> SharedContext {
        self.this.upgrade().expect("context alive while in use")
    }

    pub(crate) fn set_role(&self, role: Role) {
        self.metrics.set_role(role);
        self.status
            .send_if_modified(|s| std::mem::replace(&mut s.role, role) != role);
    }

    pub(crate) fn set_redis_reachable(&self, reachable: bool) {
        self.status.send_if_modified(|s| {
            std::mem::replace(&mut s.redis_reachable, reachable) != reachable
        });
    }

    pub(crate) fn set_postgres_reachable(&self, reachable: bool) {
        self.status.send_if_modified(|s| {
            std::mem::replace(&mut s.postgres_reachable, reachable) != reachable
        });
    }

    pub(crate) fn status_snapshot(&self) -> RelayStatus {
        self.status.borrow().clone()
    }

    pub(crate) fn instance_id(&self) -> &str {
        &self.instance_id
    }

    pub(crate) fn set_slot_lost(&self, lost: bool) {
        self.metrics.slot_lost.set(i64::from(lost));
        self.status
            .send_if_modified(|s| std::mem::replace(&mut s.slot_lost, lost) != lost);
    }

    pub(crate) fn set_behind_shards(&self, behind: Vec<u32>) {
        self.status.send_if_modified(|s| {
            std::mem::replace(&mut s.behind_shards, behind.clone()) != behind
        });
    }

    pub(crate) fn set_last_error(&self, error: Option<String>) {
        self.status
            .send_if_modified(|s| std::mem::replace(&mut s.last_error, error.clone()) != error);
    }
}
