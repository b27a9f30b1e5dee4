//! An OTLP/HTTP trace receiver on loopback: takes `POST /v1/traces` (protobuf), keeps the
//! spans, answers as a collector does. Tests point binaries' `--otlp-endpoint` at it and
//! read back which spans arrived, under which trace and parent.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;
use tokio::net::TcpListener;

/// One received span, ids in lowercase hex (the parent empty for a root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// The OTLP span kind (1 internal, 2 server, 3 client, 4 producer, 5 consumer).
    pub kind: i32,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    /// Linked contexts: (trace id, span id).
    pub links: Vec<(String, String)>,
}

/// The receiver; stops when dropped.
pub struct OtlpReceiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let kept = kept.clone();
                        async move { Ok::<_, std::convert::Infallible>(receive(req, &kept).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(conn), service)
                        .await;
                });
            }
        });
        Ok(Self { addr, spans, task })
    }

    /// The value for `--otlp-endpoint` / `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap().clone()
    }

    /// Wait until `done` holds for the spans received, and return them; panics naming
    /// `what` and the spans seen at the deadline.
    pub async fn wait_for(
        &self,
        within: Duration,
        what: &str,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        crate::wait_until(within, what, || async {
            let spans = self.spans();
            if done(&spans) {
                Ok(spans)
            } else {
                Err(format!("{spans:#?}"))
            }
        })
        .await
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn receive(req: Request<Incoming>, kept: &Mutex<Vec<ReceivedSpan>>) -> Response<Full<Bytes>> {
    let answer = |status: StatusCode, body: Vec<u8>| {
        let mut resp = Response::new(Full::new(Bytes::from(body)));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/x-protobuf"),
        );
        resp
    };
    if req.uri().path() != "/v1/traces" {
        return answer(StatusCode::NOT_FOUND, Vec::new());
    }
    let Ok(body) = req.into_body().collect().await else {
        return answer(StatusCode::BAD_REQUEST, Vec::new());
    };
    let Ok(request) = ExportTraceServiceRequest::decode(body.to_bytes()) else {
        return answer(StatusCode::BAD_REQUEST, Vec::new());
    };
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let mut received = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                received.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    kind: span.kind,
                    start_unix_nanos: span.start_time_unix_nano,
                    end_unix_nanos: span.end_time_unix_nano,
                    links: span
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                });
            }
        }
    }
    kept.lock().unwrap().extend(received);
    answer(
        StatusCode::OK,
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}
