//! A throwaway certificate authority for TLS tests: a CA and server certificates for the
//! names a test chooses, written as PEM files readable by the servers it starts.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

use crate::scratch::scratch_dir;

pub struct TestCa {
    dir: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A server certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct ServerCert {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    pub fn new() -> anyhow::Result<Self> {
        let dir = scratch_dir("ca");
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "outbox test CA");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        std::fs::write(dir.join("ca.pem"), issuer.pem())?;
        Ok(Self { dir, issuer })
    }

    /// The CA certificate, PEM.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A certificate for `names` (DNS names or IP addresses), signed by this CA.
    pub fn issue(&self, file_stem: &str, names: &[&str]) -> anyhow::Result<ServerCert> {
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("server"),
        );
        let cert = params.signed_by(&key, &self.issuer)?;
        let files = ServerCert {
            cert: self.dir.join(format!("{file_stem}.pem")),
            key: self.dir.join(format!("{file_stem}.key")),
        };
        std::fs::write(&files.cert, cert.pem())?;
        write_private(&files.key, &key.serialize_pem())?;
        Ok(files)
    }
}

/// A key file only its owner can read (Postgres refuses anything looser).
fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, contents)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(())
}
