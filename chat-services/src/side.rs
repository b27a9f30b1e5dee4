//! The two sides of the chat. A service is one side: it owns the schema of that name,
//! writes its own outbox (relayed to `outbox:<side>`) and consumes the other side's stream.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    Consumers,
    Workers,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Consumers => "consumers",
            Side::Workers => "workers",
        }
    }

    pub fn other(self) -> Side {
        match self {
            Side::Consumers => Side::Workers,
            Side::Workers => Side::Consumers,
        }
    }

    /// The Postgres schema (and the service's role) of this side.
    pub fn schema(self) -> &'static str {
        self.as_str()
    }

    /// The stream this side's relay writes.
    pub fn outbox_stream(self) -> String {
        outbox_core::stream::keys::outbox_stream(self.as_str())
    }
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
