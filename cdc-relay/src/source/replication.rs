//! The replication connection: its settings, from the same endpoint (TLS, credentials) as
//! every SQL connection, and what its errors mean for the relay, mapped in one place.

use std::time::Duration;

use outbox_core::connect::{PgEndpoint, SslMode};
use pgwire_replication::{
    PgWireError, ReplicationConfig, SslMode as ReplicationSslMode, TlsConfig,
};

use crate::config::PostgresConfig;
use crate::error::{sqlstate, sqlstates, RelayError};

/// Session settings the relay pins: pgoutput prints column values with the walsender's
/// own DateStyle and TimeZone, and the stream must not depend on the server's defaults; and
/// the walsender's timeout (`--replication-timeout`), which is also the deadline of the
/// connection here. The server pings a client it has not heard from for half of it, and this
/// client speaks unasked only every whole `timeout` (its idle wakeup), so a live server is
/// never silent for longer than about half of it: the session ends once it has been silent for
/// the whole of it (a vanished host, a proxy that keeps the socket open but forwards nothing).
/// The server in turn drops a relay it has not heard from for that long (a frozen process),
/// which frees the slot for a standby.
fn session_options(timeout: Duration) -> String {
    format!(
        "-c DateStyle=ISO -c TimeZone=UTC -c wal_sender_timeout={}ms",
        timeout.as_millis()
    )
}

/// The replication connection's settings for `slot` and `publication`; `timeout`: see
/// [`session_options`].
pub(crate) fn replication_config(
    endpoint: &PgEndpoint,
    slot: &str,
    publication: &str,
    status_interval: Duration,
    timeout: Duration,
) -> ReplicationConfig {
    let ca = endpoint.ca_file().map(Into::into);
    let tls = match endpoint.effective_ssl() {
        SslMode::Disable => TlsConfig::disabled(),
        SslMode::Prefer => TlsConfig {
            mode: ReplicationSslMode::Prefer,
            ..TlsConfig::default()
        },
        SslMode::Require => TlsConfig::require(),
        SslMode::VerifyCa => TlsConfig::verify_ca(ca),
        SslMode::VerifyFull => TlsConfig::verify_full(ca),
    };
    ReplicationConfig::new(
        endpoint.host_name(),
        endpoint.user(),
        endpoint.password(),
        endpoint.dbname(),
        slot,
        publication,
    )
    .with_port(endpoint.port())
    .with_tls(tls)
    .with_options(session_options(timeout))
    .with_application_name("cdc-relay")
    .with_status_interval(status_interval)
    .with_wakeup_interval(timeout)
}

/// Where on a replication session an error came from: the same SQLSTATE means a missing
/// slot at START_REPLICATION and a missing publication at the first decoded change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReplicationPhase {
    Start,
    Streaming,
}

/// The one mapping of a replication-session error to what it means for the relay.
pub(crate) fn replication_error(
    e: PgWireError,
    phase: ReplicationPhase,
    cfg: &PostgresConfig,
    recover: bool,
    holder: Option<u32>,
) -> RelayError {
    if let PgWireError::MessageTooLarge {
        payload_bytes,
        limit_bytes,
    } = e
    {
        return RelayError::Config(format!(
            "a change of {payload_bytes} bytes (one outbox row) is larger than --max-row-bytes ({limit_bytes}): raise --max-row-bytes (and the container's memory: 64 such rows may be buffered)"
        ));
    }
    match (sqlstate(&e), phase) {
        (Some(sqlstates::OBJECT_IN_USE), _) => RelayError::SlotBusy {
            slot: cfg.slot.clone(),
            holder,
        },
        (Some(sqlstates::UNDEFINED_OBJECT), ReplicationPhase::Start) => RelayError::SlotMissing {
            slot: cfg.slot.clone(),
        },
        (Some(sqlstates::UNDEFINED_OBJECT), ReplicationPhase::Streaming) => {
            RelayError::PublicationMissing {
                publication: cfg.publication.clone(),
            }
        }
        // "cannot read from logical replication slot": invalidated.
        (Some(sqlstates::OBJECT_NOT_IN_PREREQUISITE_STATE), _) => RelayError::SlotLost {
            slot: cfg.slot.clone(),
            recover,
        },
        _ => RelayError::Replication(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_file_reaches_the_replication_connection() {
        let dir = std::env::temp_dir().join(format!("pg-secret-repl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "s3cret-from-file\n").unwrap();
        let e = PgEndpoint::parse("postgres://relay:in-url@db/chat")
            .unwrap()
            .with_password_file(Some(&file))
            .unwrap();
        let rc = replication_config(
            &e,
            "s",
            "p",
            Duration::from_secs(1),
            Duration::from_secs(10),
        );
        assert_eq!(rc.password, "s3cret-from-file");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
