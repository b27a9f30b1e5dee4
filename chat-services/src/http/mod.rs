//! The HTTP server (hyper 1, HTTP/1.1): routing, graceful shutdown, and the shared state
//! handlers see. JSON everywhere; every error is `{"error": "..."}` naming the problem.

mod admin;
pub(crate) mod connections;
mod events;
mod members;
mod messages;
mod page;
pub(crate) mod reply;
mod request;
mod routes;
mod session;
pub(crate) mod sse;
pub(crate) mod tls;

pub(crate) use admin::ServiceProbe;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::live::hub::Hub;
use crate::metrics::Metrics;
use crate::side::Side;
use crate::store::Store;
use outbox_consumer::ConsumerStatus;
use reply::Body;
use routes::{Matched, Route};

/// What every handler can reach.
pub(crate) struct App {
    pub side: Side,
    pub store: Store,
    pub hub: Arc<Hub>,
    /// Shows committed sends on every instance of this side.
    pub announcer: crate::live::hints::Announcer,
    pub metrics: Arc<Metrics>,
    pub consumer: watch::Receiver<ConsumerStatus>,
    /// Cancelled at shutdown: open event streams end so connections can close.
    pub shutdown: CancellationToken,
    pub sse_heartbeat: Duration,
    /// Messages a stream opened behind the tip replays at most (`--sse-max-replay`).
    pub sse_max_replay: i64,
    /// Continue the `traceparent` of sends (`--trust-traceparent`).
    pub trust_traceparent: bool,
    pub limits: Limits,
    /// Who is asking (bearer tokens, the session cookie), or nobody (`--allow-anonymous`).
    pub auth: crate::access::auth::Auth,
    /// The session cookie is `Secure`.
    pub cookie_secure: bool,
    /// Served over TLS (--tls-cert-file): answers carry `Strict-Transport-Security`.
    pub tls: bool,
    /// Memberships seen lately (a request of a member costs no query for a moment).
    pub members: Arc<crate::access::members::Members>,
    /// The open event streams of identified users, held to the chat's members.
    pub streams: Arc<crate::access::streams::Streams>,
    /// Test hook (`failpoints`): history of this chat answers this much later.
    pub slow_history: Option<(i64, Duration)>,
    /// Test hook (`failpoints`): sends to this chat answer 503 while the count lasts.
    pub refuse_sends: Option<(i64, std::sync::atomic::AtomicU64)>,
}

/// What one instance holds open at most, so a flood of connections or streams costs a 503,
/// not the process.
pub(crate) struct Limits {
    pub connections: Arc<Semaphore>,
    /// Each client address's share of `connections`.
    pub addresses: Arc<connections::AddressSlots>,
    /// Each client address's failed verifications (`--failed-auth-burst`, `--failed-auth-rate`):
    /// past them, its credentials are refused unverified.
    pub failed_auth: crate::access::quota::Buckets<std::net::IpAddr>,
    pub event_streams: Arc<Semaphore>,
    /// Event streams reading the database at once (half the pool).
    pub feed_reads: Semaphore,
    /// Bytes queued for one event stream's client at most.
    pub sse_client_buffer: usize,
    /// Bytes queued for all event streams' clients together at most, and those queued now.
    pub sse_buffer_total: usize,
    pub sse_queued: Arc<std::sync::atomic::AtomicUsize>,
    pub header_read_timeout: Duration,
    /// Each user's share: sends per second, open streams.
    pub quotas: Arc<crate::access::quota::Quotas>,
    pub body_read_timeout: Duration,
    /// How long a write to a client may wait for it to read.
    pub write_timeout: Duration,
}

/// Written to a connection past `--max-connections` before closing it.
const OVER_CAPACITY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: 68\r\n\r\n{\"error\":\"too many connections to this instance; retry in a moment\"}";

/// How long a TLS handshake may take (a real client needs one or two round trips).
const TLS_HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// Connections being told they are refused at once, at most: past it one is closed without
/// an answer, so a flood of refused connections costs no more than this many small tasks.
static REFUSING: Semaphore = Semaphore::const_new(1024);

/// Write `answer` to a connection the server will not serve, then close it. The request the
/// client already sent is read and dropped first: closing with it unread would reset the
/// connection, and the client would see the reset instead of the answer. All within 1 s.
fn answer_and_close(stream: tokio::net::TcpStream, answer: &'static [u8]) {
    let Ok(permit) = REFUSING.try_acquire() else {
        return; // dropped: closed without an answer
    };
    tokio::spawn(async move {
        let _permit = permit;
        let mut stream = stream;
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            stream.write_all(answer).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 512];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        })
        .await;
    });
}

/// Serve the API, the page and event streams until `shutdown`, then let in-flight requests
/// finish (bounded). Probes and metrics are on the admin listener ([`ServiceProbe`]).
pub(crate) async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: CancellationToken,
) {
    let graceful = GracefulShutdown::new();
    let mut acceptor = outbox_core::admin::Acceptor::new(listener);
    while let Some(stream) = acceptor
        .accept(&shutdown, || app.metrics.accept_errors_total.inc())
        .await
    {
        let _ = stream.set_nodelay(true);
        // An address's share is taken before a place of the instance's: one address cannot
        // hold more of them than its share.
        let peer = stream.peer_addr().map(|a| a.ip()).ok();
        let Some(address) = peer.and_then(|ip| app.limits.addresses.take(ip)) else {
            app.metrics.connections_over_address_share_total.inc();
            if tls.is_none() {
                answer_and_close(stream, connections::OVER_SHARE);
            }
            continue;
        };
        let Ok(permit) = app.limits.connections.clone().try_acquire_owned() else {
            app.metrics.connections_refused_total.inc();
            // A TLS client would read a plaintext answer as a protocol error: it is closed.
            if tls.is_some() {
                continue;
            }
            answer_and_close(stream, OVER_CAPACITY);
            continue;
        };
        // A peer that vanished (a phone that changed networks) holds its stream, its
        // user's stream place and a connection until TCP gives up, by default ~15 minutes:
        // what it was sent and never acknowledged, or keepalive probes it never answers
        // (from 15 s idle), close the connection after the write deadline.
        let socket = socket2::SockRef::from(&stream);
        let _ = socket.set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(15))
                .with_interval(Duration::from_secs(5))
                .with_retries(3),
        );
        let _ = socket.set_tcp_user_timeout(Some(app.limits.write_timeout));
        // A client that stops reading an answer holds its buffers and its connection: past
        // the write deadline the connection is closed (an event stream resumes with
        // Last-Event-ID, missing nothing).
        let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
        stream.set_write_timeout(Some(app.limits.write_timeout));
        let stream = Box::pin(stream);
        let (app, watcher, tls) = (app.clone(), graceful.watcher(), tls.clone());
        let client = peer.and_then(|ip| app.limits.addresses.client(ip));
        tokio::spawn(async move {
            match tls {
                None => serve_connection(stream, app, client, watcher).await,
                Some(tls) => {
                    // A stranger's handshake holds a place: it gets the header deadline at
                    // most, and never more than TLS_HANDSHAKE_LIMIT.
                    let handshake = tls.accept(stream);
                    let deadline = app.limits.header_read_timeout.min(TLS_HANDSHAKE_LIMIT);
                    match tokio::time::timeout(deadline, handshake).await {
                        Ok(Ok(stream)) => serve_connection(stream, app, client, watcher).await,
                        Ok(Err(e)) => debug!(error = %e, "TLS handshake failed"),
                        Err(_) => debug!("TLS handshake timed out"),
                    }
                }
            }
            drop(permit);
            drop(address);
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(10)) => warn!("connections still open 10 s after shutdown; closing"),
    }
}

/// HTTP/1.1 on one connection, plain or TLS, until it ends or the server shuts down.
/// `client` is the address its failures are counted under (`None`: a trusted proxy).
async fn serve_connection<IO>(
    io: IO,
    app: Arc<App>,
    client: Option<std::net::IpAddr>,
    watcher: hyper_util::server::graceful::Watcher,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let header_read_timeout = app.limits.header_read_timeout;
    let service = hyper::service::service_fn(move |req| {
        let app = app.clone();
        async move { Ok::<_, Infallible>(route(app, req, client).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        // A head that never ends is cut here (431), not at hyper's ~400 KB default.
        .max_buf_size(connections::HEAD_LIMIT)
        .serve_connection(TokioIo::new(io), service);
    if let Err(e) = watcher.watch(conn).await {
        debug!(error = %e, "connection ended with an error");
    }
}

/// Every answer says its content type is the one to use and that no other site's page may
/// learn where it came from.
async fn route(
    app: Arc<App>,
    req: Request<Incoming>,
    client: Option<std::net::IpAddr>,
) -> Response<Body> {
    let started = std::time::Instant::now();
    // The path is matched once: its route is the label and what is dispatched.
    let path = req.uri().path().to_string();
    let matched = Route::of(&path);
    let label = Route::label(matched.map(|m| m.route));
    let method = req.method().clone();
    let metrics = app.metrics.clone();
    // An address whose credentials keep failing has its next ones refused unverified; a
    // credential verified lately is not a guess, and passes (a user behind the same address
    // as an attacker keeps working).
    // Only routes that verify a credential are gated: the page, its files, /healthz and
    // signing out verify nothing, and stay open to a limited address.
    let verifies = matched.is_some_and(|m| m.route.verifies(&method));
    let judged = client.filter(|_| verifies && app.auth.carries_unknown_credential(req.headers()));
    let refused = judged.and_then(|ip| app.limits.failed_auth.check(&ip).err());
    let mut resp = match refused {
        Some(wait) => request::too_many(
            &app,
            "auth_failures",
            wait,
            "too many requests with bad credentials from your address; retry later".into(),
        ),
        None => {
            let resp = dispatch(app.clone(), req, &path, matched).await;
            if let Some(ip) = judged.filter(|_| request::InvalidCredentials::marks(&resp)) {
                let _ = app.limits.failed_auth.take(&ip);
            }
            resp
        }
    };
    metrics
        .http_request_duration_seconds
        .with_label_values(&[label, method_label(&method), resp.status().as_str()])
        .observe(started.elapsed().as_secs_f64());
    let headers = resp.headers_mut();
    headers.insert(
        "x-content-type-options",
        hyper::header::HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        "referrer-policy",
        hyper::header::HeaderValue::from_static("no-referrer"),
    );
    // Every answer but the page's own files is someone's (their chats, messages, session):
    // no shared cache or browser history keeps it.
    headers
        .entry(hyper::header::CACHE_CONTROL)
        .or_insert(hyper::header::HeaderValue::from_static("no-store"));
    if app.tls {
        // Once seen over HTTPS, a browser never tries this host over plain HTTP for a
        // year (no includeSubDomains: sibling hosts are not ours to decide).
        headers.insert(
            hyper::header::STRICT_TRANSPORT_SECURITY,
            hyper::header::HeaderValue::from_static("max-age=31536000"),
        );
    }
    resp
}

/// A method as a bounded label (anything unusual is `other`).
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

async fn dispatch(
    app: Arc<App>,
    req: Request<Incoming>,
    path: &str,
    matched: Option<Matched<'_>>,
) -> Response<Body> {
    let method = req.method().clone();
    let Some(Matched { route, id, user }) = matched else {
        return reply::error(StatusCode::NOT_FOUND, format!("no route {path}"));
    };
    match (route, &method) {
        (Route::Page, &Method::GET) => page::page(&app),
        (Route::PageJs, &Method::GET) => page::page_file("page.js"),
        (Route::PageCss, &Method::GET) => page::page_file("page.css"),
        (Route::Healthz, &Method::GET) => {
            reply::json(StatusCode::OK, &serde_json::json!({"status": "alive"}))
        }
        (Route::AdminOnly, _) => reply::error(
            StatusCode::NOT_FOUND,
            format!("{path} is served on the admin listener (--admin-addr)"),
        ),
        (Route::Session, &Method::GET) => session::session(&app, &req),
        (Route::Session, &Method::POST) => session::sign_in(&app, &req).await,
        (Route::Session, &Method::DELETE) => session::sign_out(&app),
        (Route::Messages, &Method::GET) => messages::history(&app, id, &req).await,
        (Route::Messages, &Method::POST) => messages::send(&app, id, req).await,
        (Route::Events, &Method::GET) => events::events(app.clone(), id, &req).await,
        (Route::Members, &Method::GET) => members::members(&app, id, &req).await,
        (Route::Member, &Method::PUT) => members::set_member(&app, id, user, true, &req).await,
        (Route::Member, &Method::DELETE) => members::set_member(&app, id, user, false, &req).await,
        (route, _) => reply::method_not_allowed(&method, path, route.allowed()),
    }
}
