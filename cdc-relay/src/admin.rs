//! The admin HTTP server: /healthz (alive), /readyz (holding the slot and Redis answering),
//! /metrics (Prometheus text format).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::status::RelayStatus;

#[derive(Clone)]
pub struct AdminState {
    pub status: watch::Receiver<RelayStatus>,
    pub metrics: Arc<Metrics>,
}

/// Bind the admin address (port 0 picks a free one; the bound address is returned).
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// Serve until `shutdown`.
pub async fn serve(listener: TcpListener, state: AdminState, shutdown: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    continue;
                }
            },
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(route(&state, &req)) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "admin connection ended");
            }
        });
    }
}

fn route(state: &AdminState, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    if !matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": format!("no route {path}")}),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut resp = json(
            StatusCode::METHOD_NOT_ALLOWED,
            serde_json::json!({"error": format!("{} is not allowed on {path}; use GET", req.method())}),
        );
        resp.headers_mut()
            .insert("allow", HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    match path {
        "/healthz" => json(StatusCode::OK, serde_json::json!({"status": "alive"})),
        "/readyz" => {
            let status = state.status.borrow().clone();
            match status.not_ready_reason() {
                None => json(
                    StatusCode::OK,
                    serde_json::json!({"status": "ready", "role": status.role}),
                ),
                Some(reason) => json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    serde_json::json!({
                        "status": "not_ready",
                        "reason": reason,
                        "role": status.role,
                        "last_error": status.last_error,
                    }),
                ),
            }
        }
        _ => {
            let mut resp = Response::new(Full::new(Bytes::from(state.metrics.encode())));
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
