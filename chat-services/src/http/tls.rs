//! Optional TLS on the public listener: a certificate chain and its key from PEM files
//! (`--tls-cert-file`, `--tls-key-file`), read again when either file changes (looked at
//! every few seconds), so a renewed certificate is served to new connections without a
//! restart. A pair that does not load (half-written, a key of another certificate) keeps
//! the previous one and says why.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::stamp::Stamp;
use outbox_core::ConfigError;

/// How often the files are looked at.
const LOOK_EVERY: Duration = Duration::from_secs(2);

/// The certificate served now, and where it comes from.
pub(crate) struct Certificate {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files as last read well; `None` after a failed read, so the next look reads them
    /// again whatever they say.
    seen: Mutex<Option<(Option<Stamp>, Option<Stamp>)>>,
}

impl std::fmt::Debug for Certificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Certificate")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("not poisoned").clone())
    }
}

fn stamps(cert: &Path, key: &Path) -> (Option<Stamp>, Option<Stamp>) {
    (Stamp::of(cert), Stamp::of(key))
}

fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let open = |path: &Path| {
        std::fs::File::open(path)
            .map(BufReader::new)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    let chain = rustls_pemfile::certs(&mut open(cert)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{} holds no PEM certificate", cert.display()));
    }
    let private = rustls_pemfile::private_key(&mut open(key)?)
        .map_err(|e| format!("{}: {e}", key.display()))?
        .ok_or_else(|| format!("{} holds no PEM private key", key.display()))?;
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, private, &provider).map_err(|e| {
        format!(
            "{} and {} do not make a certificate to serve: {e}",
            cert.display(),
            key.display()
        )
    })
}

impl Certificate {
    /// Load the pair, or say what to change.
    pub(crate) fn load(cert: PathBuf, key: PathBuf) -> Result<Arc<Self>, ConfigError> {
        // Stamped before the read: a change during it is seen at the next look.
        let seen = stamps(&cert, &key);
        let current = load(&cert, &key)
            .map_err(|e| ConfigError(format!("--tls-cert-file/--tls-key-file: {e}")))?;
        Ok(Arc::new(Self {
            seen: Mutex::new(Some(seen)),
            cert,
            key,
            current: RwLock::new(Arc::new(current)),
        }))
    }

    /// The acceptor for the public listener (HTTP/1.1 only, as the server speaks).
    pub(crate) fn acceptor(self: &Arc<Self>) -> tokio_rustls::TlsAcceptor {
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("the provider supports the default versions")
        .with_no_client_auth()
        .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    }

    /// Read the files again whenever either changes, until `shutdown`.
    pub(crate) async fn watch(self: Arc<Self>, shutdown: CancellationToken) {
        let mut every = tokio::time::interval(LOOK_EVERY);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every.tick() => {}
            }
            let now = stamps(&self.cert, &self.key);
            {
                let mut seen = self.seen.lock().expect("not poisoned");
                if *seen == Some(now) {
                    continue;
                }
                *seen = Some(now);
            }
            match load(&self.cert, &self.key) {
                Ok(pair) => {
                    *self.current.write().expect("not poisoned") = Arc::new(pair);
                    info!(cert = %self.cert.display(), "TLS certificate read again; new connections get it");
                }
                Err(e) => {
                    *self.seen.lock().expect("not poisoned") = None;
                    warn!(error = %e, "TLS certificate not read again; still serving the previous one");
                }
            }
        }
    }
}
