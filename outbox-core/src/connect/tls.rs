//! TLS for Postgres connections, with libpq's `sslmode` meanings: `prefer` and `require`
//! encrypt without verifying, `verify-ca` checks the chain against the CA file (or the
//! well-known roots), `verify-full` also checks that the certificate names the host.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use crate::error::ConfigError;

/// `sslmode` as libpq defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl std::str::FromStr for SslMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "disable" => Ok(SslMode::Disable),
            "prefer" | "allow" => Ok(SslMode::Prefer),
            "require" => Ok(SslMode::Require),
            "verify-ca" => Ok(SslMode::VerifyCa),
            "verify-full" => Ok(SslMode::VerifyFull),
            other => Err(format!(
                "sslmode '{other}' is not one of disable, prefer, require, verify-ca, verify-full"
            )),
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// CA certificates from a PEM file, or the well-known roots.
pub fn root_store(ca_file: Option<&Path>) -> Result<RootCertStore, ConfigError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        Some(path) => {
            let pem = std::fs::read(path)
                .map_err(|e| ConfigError(format!("CA file {}: {e}", path.display())))?;
            let mut found = 0;
            for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
                let cert =
                    cert.map_err(|e| ConfigError(format!("CA file {}: {e}", path.display())))?;
                roots
                    .add(cert)
                    .map_err(|e| ConfigError(format!("CA file {}: {e}", path.display())))?;
                found += 1;
            }
            if found == 0 {
                return Err(ConfigError(format!(
                    "CA file {} holds no PEM certificate",
                    path.display()
                )));
            }
        }
    }
    Ok(roots)
}

/// The rustls client configuration for `mode` (not `Disable`).
pub fn client_config(mode: SslMode, ca_file: Option<&Path>) -> Result<ClientConfig, ConfigError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError(format!("TLS: {e}")))?;
    let verifier: Arc<dyn ServerCertVerifier> = match mode {
        SslMode::Disable | SslMode::Prefer | SslMode::Require => Arc::new(Unverified(provider)),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let webpki = WebPkiServerVerifier::builder_with_provider(
                Arc::new(root_store(ca_file)?),
                provider,
            )
            .build()
            .map_err(|e| ConfigError(format!("TLS: {e}")))?;
            if mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        }
    };
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

/// `prefer`/`require`: encrypted, the server not authenticated (libpq's meaning).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted CA; the host name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmodes_parse_like_libpq() {
        assert_eq!("verify-full".parse::<SslMode>(), Ok(SslMode::VerifyFull));
        assert_eq!("allow".parse::<SslMode>(), Ok(SslMode::Prefer));
        assert!("verify".parse::<SslMode>().is_err());
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        let dir = std::env::temp_dir().join(format!("tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate").unwrap();
        let err = client_config(SslMode::VerifyFull, Some(&empty)).unwrap_err();
        assert!(
            err.to_string().contains("holds no PEM certificate"),
            "{err}"
        );
        let missing = client_config(SslMode::VerifyCa, Some(&dir.join("missing.pem"))).unwrap_err();
        assert!(missing.to_string().contains("missing.pem"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
