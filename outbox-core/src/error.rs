//! Errors of configuring and connecting, and their classification, shared by every binary:
//! a configuration a human must change is permanent and says what to change; a broken or
//! refused connection is transient. Messages never carry a password or a full URL.

use redis::{ErrorKind, RedisError, ServerErrorKind};

/// A configuration a human must change; the message says what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ConfigError {
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// Configuring or connecting failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),

    #[error("postgres: {}", describe_postgres(.0))]
    Postgres(#[from] tokio_postgres::Error),
}

impl Error {
    /// Whether trying again later can succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Config(_) => false,
            Error::Postgres(e) => postgres_is_transient(e),
        }
    }
}

/// Broad classes of SQLSTATE that mean "try again later": connection exceptions (08),
/// insufficient resources (53), operator intervention such as a shutdown (57), system
/// errors (58) and transaction rollbacks (40).
pub fn sqlstate_is_transient(code: &str) -> bool {
    matches!(&code[..code.len().min(2)], "08" | "53" | "57" | "58" | "40")
}

/// Whether a Postgres error may go away by itself: a transient SQLSTATE, or no SQLSTATE
/// at all (the connection broke or could not be made), unless a certificate was refused.
pub fn postgres_is_transient(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        Some(code) => sqlstate_is_transient(code.code()),
        None => !is_certificate_error(e),
    }
}

/// Whether a Redis error may go away by itself. Permanent only where a human must change
/// something: a refused certificate, failed authentication, a missing ACL permission, a
/// client configuration or keys of one script on two cluster slots. Everything else (the
/// connection, a timeout, a server loading, failing over, out of memory under
/// `noeviction`, a blocked command ended by the server with `UNBLOCKED` when its master
/// turned replica, a cluster restarting, a reply of a shape not expected) is retried, and
/// shows in readiness and metrics meanwhile.
pub fn redis_is_transient(e: &RedisError) -> bool {
    if is_certificate_error(e) {
        return false;
    }
    match e.kind() {
        ErrorKind::AuthenticationFailed
        | ErrorKind::InvalidClientConfig
        | ErrorKind::RESP3NotSupported
        | ErrorKind::Server(ServerErrorKind::NoPerm | ServerErrorKind::CrossSlot) => false,
        ErrorKind::Extension => !matches!(e.code(), Some("NOPERM" | "WRONGPASS" | "NOAUTH")),
        _ => true,
    }
}

/// Whether `e` (or what caused it) is a TLS certificate the client refused: a configuration
/// problem, not worth retrying.
pub fn is_certificate_error(e: &(dyn std::error::Error + 'static)) -> bool {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = current {
        if let Some(rustls::Error::InvalidCertificate(_)) = err.downcast_ref::<rustls::Error>() {
            return true;
        }
        // redis-rs keeps its cause in an `Arc`, whose `source()` skips the inner error, and
        // `io::Error::source()` skips the error it wraps: look inside both.
        if let Some(shared) = err.downcast_ref::<Shared>() {
            let inner: &(dyn std::error::Error + 'static) = &**shared;
            if is_certificate_error(inner) {
                return true;
            }
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                if let Some(rustls::Error::InvalidCertificate(_)) =
                    inner.downcast_ref::<rustls::Error>()
                {
                    return true;
                }
            }
        }
        current = err.source();
    }
    false
}

/// tokio-postgres' Display for server errors is only "db error"; show the server's message.
/// Other errors (TLS, I/O) keep their cause in `source()`, which says what actually failed.
pub fn describe_postgres(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None if is_certificate_error(e) => format!(
            "{}; the server's certificate was refused: give the CA that signed it (--database-ca-file or sslrootcert), connect by the name the certificate carries, or use sslmode=verify-ca to check the chain only",
            with_causes(e)
        ),
        None => {
            let text = with_causes(e);
            // tokio-postgres has no error kind for this; the text is only used for the hint.
            if text.contains("server does not support TLS") {
                format!("{text}; enable ssl on the server, or put sslmode=disable in the URL to connect without TLS (the default is verify-full)")
            } else {
                text
            }
        }
    }
}

/// A Redis error with its causes, and what to do about a refused certificate.
pub fn describe_redis(e: &RedisError) -> String {
    if is_certificate_error(e) {
        format!(
            "{}; Redis's certificate was refused: give the CA that signed it (--redis-ca-file) and connect by the name the certificate carries",
            with_causes(e)
        )
    } else {
        with_causes(e)
    }
}

/// An error's message followed by each cause that adds something.
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let part = cause.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_errors_are_classified_by_kind_and_code() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(redis_is_transient(&io));
        let oom = redis::make_extension_error("OOM".into(), Some("command not allowed".into()));
        assert!(redis_is_transient(&oom));
        let no_node = RedisError::from((
            redis::ErrorKind::ClusterConnectionNotFound,
            "No connections found",
        ));
        assert!(redis_is_transient(&no_node));
        let perm = redis::make_extension_error("NOPERM".into(), None);
        assert!(!redis_is_transient(&perm));
        let auth = redis::make_extension_error("WRONGPASS".into(), None);
        assert!(!redis_is_transient(&auth));
        // A WAIT (or a blocking read) the server ended because its node turned replica.
        let unblocked = redis::make_extension_error(
            "UNBLOCKED".into(),
            Some("force unblock from blocking operation".into()),
        );
        assert!(redis_is_transient(&unblocked));
    }

    #[test]
    fn sqlstates_are_classified_by_class() {
        assert!(sqlstate_is_transient("57P01"));
        assert!(sqlstate_is_transient("08006"));
        assert!(!sqlstate_is_transient("28P01"));
        assert!(!sqlstate_is_transient("42704"));
    }
}
