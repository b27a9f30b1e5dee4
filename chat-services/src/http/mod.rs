//! The HTTP server (hyper 1, HTTP/1.1): routing, graceful shutdown, and the shared state
//! handlers see. JSON everywhere; every error is `{"error": "..."}` naming the problem.

mod api;
pub(crate) mod reply;
pub mod sse;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::hub::Hub;
use crate::inbox::ConsumerStatus;
use crate::metrics::Metrics;
use crate::side::Side;
use crate::store::Store;
use reply::Body;

/// What every handler can reach.
pub struct App {
    pub side: Side,
    pub store: Store,
    pub hub: Arc<Hub>,
    pub metrics: Arc<Metrics>,
    pub consumer: watch::Receiver<ConsumerStatus>,
    /// Cancelled at shutdown: open event streams end so connections can close.
    pub shutdown: CancellationToken,
    pub sse_heartbeat: Duration,
}

/// Serve until `shutdown`, then let in-flight requests finish (bounded).
pub async fn serve(listener: TcpListener, app: Arc<App>, shutdown: CancellationToken) {
    let graceful = GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let service = hyper::service::service_fn(move |req| {
            let app = app.clone();
            async move { Ok::<_, Infallible>(route(app, req).await) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                debug!(error = %e, "connection ended with an error");
            }
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(10)) => warn!("connections still open 10 s after shutdown; closing"),
    }
}

async fn route(app: Arc<App>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let method = req.method().clone();
    let get_only = |handler: Response<Body>| {
        if method == Method::GET {
            handler
        } else {
            reply::method_not_allowed(&method, &path, "GET")
        }
    };
    match segments.as_slice() {
        [""] => get_only(api::page(&app)),
        ["healthz"] => get_only(reply::json(
            StatusCode::OK,
            &serde_json::json!({"status": "alive"}),
        )),
        ["readyz"] if method == Method::GET => api::readyz(&app).await,
        ["metrics"] => get_only(api::metrics(&app)),
        ["chats", chat_id, "messages"] => match method {
            Method::GET => api::history(&app, chat_id, req.uri().query()).await,
            Method::POST => api::send(&app, chat_id, req).await,
            _ => reply::method_not_allowed(&method, &path, "GET, POST"),
        },
        ["chats", chat_id, "events"] if method == Method::GET => {
            api::events(app.clone(), chat_id, &req)
        }
        ["readyz"] | ["chats", _, "events"] => reply::method_not_allowed(&method, &path, "GET"),
        _ => reply::error(StatusCode::NOT_FOUND, format!("no route {path}")),
    }
}
