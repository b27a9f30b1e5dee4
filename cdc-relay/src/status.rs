//! What the relay is doing right now, for /readyz, metrics and tests.

use serde::Serialize;

/// The relay's role in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Connecting for the first time.
    Starting,
    /// Another relay holds the slot; retrying to take it over.
    Standby,
    /// Holding the slot and publishing.
    Streaming,
    /// Lost the session to a transient error; reconnecting with backoff.
    Reconnecting,
    /// Shutting down.
    Stopping,
    /// Stopped on a permanent error.
    Failed,
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::Starting,
        Role::Standby,
        Role::Streaming,
        Role::Reconnecting,
        Role::Stopping,
        Role::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Starting => "starting",
            Role::Standby => "standby",
            Role::Streaming => "streaming",
            Role::Reconnecting => "reconnecting",
            Role::Stopping => "stopping",
            Role::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RelayStatus {
    pub role: Role,
    pub redis_reachable: bool,
    pub postgres_reachable: bool,
    /// The slot was found invalidated (and not yet recreated).
    pub slot_lost: bool,
    /// Shards that fell behind: the slot does not wait for them, and they are caught up from
    /// the outbox table once they accept writes (and their groups have read).
    pub behind_shards: Vec<u32>,
    /// The last error, for operators (never contains credentials).
    pub last_error: Option<String>,
}

impl Default for RelayStatus {
    fn default() -> Self {
        Self {
            role: Role::Starting,
            redis_reachable: false,
            postgres_reachable: false,
            slot_lost: false,
            behind_shards: Vec::new(),
            last_error: None,
        }
    }
}

impl RelayStatus {
    /// `None` when ready (holding the slot, Redis answering), else the reason.
    pub fn not_ready_reason(&self) -> Option<&'static str> {
        if self.slot_lost {
            Some("slot_lost")
        } else if self.role == Role::Standby {
            Some("standby")
        } else if !self.redis_reachable {
            Some("redis_unavailable")
        } else if !self.postgres_reachable {
            Some("postgres_unavailable")
        } else if self.role != Role::Streaming {
            Some(self.role.as_str())
        } else {
            None
        }
    }
}
