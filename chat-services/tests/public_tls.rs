//! TLS on the public listener: served with the configured certificate, plaintext refused,
//! a renewed certificate picked up without a restart, and the session cookie for HTTPS only.

use std::sync::Arc;
use std::time::Duration;

use crate::support::{bearer, Idp, Stack};
use bytes::Bytes;
use chat_services::Side;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use testkit::tls::TestCa;
use testkit::{shared_postgres, wait_until};
use tokio::net::TcpStream;

/// One request over TLS verified against `ca`: (status, headers, body, the server's
/// certificate as DER).
async fn https(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, hyper::HeaderMap, String, Vec<u8>)> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca)?;
    for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
        roots.add(cert?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await?;
    let served = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = sender
        .send_request(request.body(Full::new(Bytes::new()))?)
        .await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((
        status,
        headers,
        String::from_utf8_lossy(&body).into_owned(),
        served,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_listener_serves_tls_and_picks_up_a_renewed_certificate() {
    let stack = Stack::start(shared_postgres()).await;
    let ca = TestCa::new().unwrap();
    let first = ca.issue("public", &["localhost"]).unwrap();
    let idp = Idp::new();
    let mut flags = idp.flags();
    flags.extend([
        "--tls-cert-file".to_string(),
        first.cert.display().to_string(),
        "--tls-key-file".into(),
        first.key.display().to_string(),
    ]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;

    let (status, _, body, served) = https(svc.addr, &ca.ca_file(), "GET", "/healthz", &[])
        .await
        .unwrap();
    assert_eq!((status, body.contains("alive")), (200, true), "{body}");
    // Plaintext HTTP gets no answer.
    let plain = testkit::http::get(svc.addr, "/healthz").await;
    assert!(plain.is_err(), "{plain:?}");

    // Over TLS the page's session cookie is for HTTPS only, and host-bound.
    let (name, value) = bearer(&idp.token("alice"));
    let (status, headers, body, _) = https(
        svc.addr,
        &ca.ca_file(),
        "POST",
        "/session",
        &[(name, &value)],
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let cookie = headers.get("set-cookie").unwrap().to_str().unwrap();
    assert!(
        cookie.starts_with("__Host-chat_session_consumers=") && cookie.contains("; Secure"),
        "{cookie}"
    );
    // Browsers are told to keep to HTTPS, and to keep private answers nowhere.
    let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_string());
    assert_eq!(
        header("strict-transport-security").as_deref(),
        Some("max-age=31536000")
    );
    assert_eq!(header("cache-control").as_deref(), Some("no-store"));

    // Renewed in place (same files): new connections get the new certificate.
    let renewed = ca.issue("public", &["localhost"]).unwrap();
    assert_eq!(renewed.cert, first.cert);
    wait_until(
        Duration::from_secs(15),
        "the renewed certificate served",
        || async {
            match https(svc.addr, &ca.ca_file(), "GET", "/healthz", &[]).await {
                Ok((200, _, _, now)) if now != served => Ok(()),
                other => Err(format!("{:?}", other.map(|(s, ..)| s))),
            }
        },
    )
    .await;

    // A refused pair at start says which files and why.
    let mut argv = vec!["chat-service".to_string()];
    argv.extend(stack.service_args(
        Side::Consumers,
        &[
            "--tls-cert-file",
            &first.cert.display().to_string(),
            "--tls-key-file",
            &idp.jwks.display().to_string(),
        ],
    ));
    let refused = <chat_services::Cli as clap::Parser>::try_parse_from(argv)
        .unwrap()
        .validate()
        .expect_err("a JWKS is no key")
        .to_string();
    assert!(refused.contains("no PEM private key"), "{refused}");
    svc.stop().await;
}
