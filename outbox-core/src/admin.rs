//! The admin HTTP listener both binaries serve, kept off any public port: `/healthz` (the
//! process is alive), `/readyz` (whatever the binary counts as ready, with the reason when
//! not) and `/metrics` (Prometheus text format). GET and HEAD only; every other answer is
//! JSON `{"error": ...}` naming the problem.
//!
//! Bounded like a public listener: a connection cap, and a smaller one per client address
//! (a scraper gone wrong, or a neighbour, cannot take the places the kubelet's probes need,
//! which would read as a dead process and restart it), a deadline on reading a request's
//! headers (which also closes idle keep-alive connections), and an accept loop that pauses
//! on errors (running out of file descriptors) instead of spinning on them.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Connections the admin listener holds open at most (probes and a scraper need a few).
const MAX_CONNECTIONS: usize = 64;
/// Connections one client address holds open at most: a quarter of the listener's.
const MAX_CONNECTIONS_PER_ADDRESS: usize = MAX_CONNECTIONS / 4;
/// How long a connection may take to send its request headers, or stay idle.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest pause after failed accepts.
const MAX_ACCEPT_PAUSE: Duration = Duration::from_secs(1);

/// Accepts connections until shutdown, pausing after a failed accept (running out of file
/// descriptors, above all) instead of spinning on the same error; every listener of both
/// binaries accepts through it.
pub struct Acceptor {
    listener: TcpListener,
    pause: Duration,
}

impl Acceptor {
    pub fn new(listener: TcpListener) -> Self {
        Self {
            listener,
            pause: Duration::ZERO,
        }
    }

    /// The next connection, or `None` once `shutdown` is cancelled. `failed` is told of
    /// each failed accept (for a metric).
    pub async fn accept(
        &mut self,
        shutdown: &CancellationToken,
        failed: impl Fn(),
    ) -> Option<tokio::net::TcpStream> {
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return None,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        self.pause = Duration::ZERO;
                        return Some(stream);
                    }
                    Err(e) => {
                        self.pause = (self.pause * 2).clamp(Duration::from_millis(10), MAX_ACCEPT_PAUSE);
                        failed();
                        tracing::warn!(error = %e, pause = ?self.pause, "accept failed; pausing");
                        tokio::select! {
                            _ = shutdown.cancelled() => return None,
                            _ = tokio::time::sleep(self.pause) => {}
                        }
                    }
                },
            }
        }
    }
}

/// What `/readyz` answers.
#[derive(Debug, Clone, PartialEq)]
pub struct Readiness {
    pub ready: bool,
    /// The JSON body (status, reason, whatever helps an operator).
    pub body: serde_json::Value,
}

/// What a binary reports on its admin listener.
pub trait Probe: Send + Sync + 'static {
    /// `/readyz`.
    fn readiness(&self) -> impl Future<Output = Readiness> + Send;
    /// `/metrics`, in the Prometheus text format.
    fn metrics(&self) -> String;
    /// An accept failed (counted by binaries that export it).
    fn accept_failed(&self) {}
}

/// Open connections by client address.
#[derive(Default)]
struct AddressShares(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One connection's place in its address's share, given back when dropped.
struct AddressShare {
    shares: Arc<AddressShares>,
    address: std::net::IpAddr,
}

impl AddressShares {
    fn take(self: Arc<Self>, address: std::net::IpAddr) -> Option<AddressShare> {
        let mut open = self.0.lock().expect("not poisoned");
        let count = open.entry(address).or_insert(0);
        if *count >= MAX_CONNECTIONS_PER_ADDRESS {
            return None;
        }
        *count += 1;
        drop(open);
        Some(AddressShare {
            shares: self,
            address,
        })
    }
}

impl Drop for AddressShare {
    fn drop(&mut self) {
        let mut open = self.shares.0.lock().expect("not poisoned");
        if let Some(count) = open.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.address);
            }
        }
    }
}

/// Serve `probe` on `listener` until `shutdown`, then let open requests finish (bounded).
pub async fn serve<P: Probe>(listener: TcpListener, probe: Arc<P>, shutdown: CancellationToken) {
    let graceful = GracefulShutdown::new();
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let addresses = Arc::new(AddressShares::default());
    let mut acceptor = Acceptor::new(listener);
    while let Some(stream) = acceptor.accept(&shutdown, || probe.accept_failed()).await {
        // Over either cap the connection is closed at once; probes retry.
        let Ok(peer) = stream.peer_addr() else {
            continue;
        };
        let Some(share) = addresses.clone().take(peer.ip()) else {
            continue;
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            continue;
        };
        let probe = probe.clone();
        let service = hyper::service::service_fn(move |req| {
            let probe = probe.clone();
            async move { Ok::<_, Infallible>(route(&*probe, &req).await) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "admin connection ended");
            }
            drop((permit, share));
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(5)) => {}
    }
}

async fn route<P: Probe>(probe: &P, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    if !matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": format!("no route {path} on the admin listener (healthz, readyz, metrics)")}),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut resp = json(
            StatusCode::METHOD_NOT_ALLOWED,
            serde_json::json!({"error": format!("{} is not allowed on {path}; allowed: GET, HEAD", req.method())}),
        );
        resp.headers_mut()
            .insert("allow", HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    match path {
        "/healthz" => json(StatusCode::OK, serde_json::json!({"status": "alive"})),
        "/readyz" => {
            let readiness = probe.readiness().await;
            let status = if readiness.ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            json(status, readiness.body)
        }
        _ => {
            let mut resp = Response::new(Full::new(Bytes::from(probe.metrics())));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            resp
        }
    }
}

fn json(status: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}
