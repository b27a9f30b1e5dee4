//! A small HTTP/1.1 client for tests: plain requests, Server-Sent Events, and helpers for
//! probing admin endpoints of processes under test.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("response is not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

async fn send(
    addr: SocketAddr,
    request: Request<Full<Bytes>>,
) -> anyhow::Result<Response<Incoming>> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender.send_request(request).await?)
}

/// `method path` with `headers` and `body`; the whole response within 30 s.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<Reply> {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let request = builder.body(Full::new(body.into()))?;
    let exchange = async {
        let response = send(addr, request).await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::Ok(Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .context("HTTP request timed out")?
}

/// One kept-alive HTTP/1.1 connection, for sending many requests like a browser does.
pub struct Connection {
    addr: SocketAddr,
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl Connection {
    pub async fn open(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect {addr}"))?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self { addr, sender })
    }

    /// `POST path` with a JSON body on this connection.
    pub async fn post_json(
        &mut self,
        path: &str,
        body: &serde_json::Value,
    ) -> anyhow::Result<Reply> {
        self.post_json_with(path, body, &[]).await
    }

    /// [`Connection::post_json`] with these request headers too (credentials).
    pub async fn post_json_with(
        &mut self,
        path: &str,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Reply> {
        self.sender.ready().await?;
        let mut request = Request::builder()
            .method("POST")
            .uri(path)
            .header("host", self.addr.to_string())
            .header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(Bytes::from(body.to_string())))?;
        let response = self.sender.send_request(request).await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }
}

/// `GET path`: the status code and the body.
pub async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let reply = request(addr, "GET", path, &[], Bytes::new()).await?;
    Ok((reply.status, reply.body))
}

/// `POST path` with a JSON body.
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> anyhow::Result<Reply> {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    request(addr, "POST", path, &all, body.to_string()).await
}

/// One Server-Sent Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: String,
    pub data: String,
}

/// A connected Server-Sent Events stream; events are parsed as they arrive. Heartbeat
/// events (`event: heartbeat`, which say the stream is alive and carry no message) are
/// counted, not returned, as a page's message listener never sees them.
pub struct SseClient {
    events: mpsc::UnboundedReceiver<SseEvent>,
    heartbeats: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl SseClient {
    /// Connect to `path`, sending `Last-Event-ID` when given; fails unless the answer is a
    /// 200 event stream.
    pub async fn connect(
        addr: SocketAddr,
        path: &str,
        last_event_id: Option<&str>,
    ) -> anyhow::Result<Self> {
        match last_event_id {
            Some(id) => Self::connect_with(addr, path, &[("last-event-id", id)]).await,
            None => Self::connect_with(addr, path, &[]).await,
        }
    }

    /// [`SseClient::connect`] with these request headers (credentials, `Last-Event-ID`).
    pub async fn connect_with(
        addr: SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let mut builder = Request::builder()
            .uri(path)
            .header("host", addr.to_string())
            .header("accept", "text/event-stream");
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let response = tokio::time::timeout(
            Duration::from_secs(10),
            send(addr, builder.body(Full::new(Bytes::new()))?),
        )
        .await
        .context("SSE connect timed out")??;
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        if status != 200 || !content_type.starts_with("text/event-stream") {
            let body = response.into_body().collect().await?.to_bytes();
            bail!(
                "SSE connect got {status} {content_type}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        let (tx, events) = mpsc::unbounded_channel();
        let heartbeats = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let beats = heartbeats.clone();
        let mut body = response.into_body();
        let task = tokio::spawn(async move {
            let mut buffer = String::new();
            while let Some(Ok(frame)) = body.frame().await {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                buffer.push_str(&String::from_utf8_lossy(&data));
                while let Some(end) = buffer.find("\n\n") {
                    let block: String = buffer.drain(..end + 2).collect();
                    if let Some(event) = parse_event(&block) {
                        if event.event == "heartbeat" {
                            beats.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        } else if tx.send(event).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Ok(Self {
            events,
            heartbeats,
            task,
        })
    }

    /// How many heartbeat events arrived so far.
    pub fn heartbeats(&self) -> usize {
        self.heartbeats.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The next event, or `None` if none arrived within `timeout` or the stream ended.
    pub async fn next(&mut self, timeout: Duration) -> Option<SseEvent> {
        tokio::time::timeout(timeout, self.events.recv())
            .await
            .ok()
            .flatten()
    }

    /// Whether the server closed the stream (all events received so far stay readable).
    pub fn is_closed(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for SseClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An event from one block of lines; comments and `retry:` lines alone make no event.
fn parse_event(block: &str) -> Option<SseEvent> {
    let mut id = None;
    let mut event = None;
    let mut data: Vec<&str> = Vec::new();
    for line in block.lines() {
        if line.starts_with(':') || line.is_empty() {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "id" => id = Some(value.to_string()),
            "event" => event = Some(value.to_string()),
            "data" => data.push(value),
            _ => {}
        }
    }
    if data.is_empty() {
        return None;
    }
    Some(SseEvent {
        id,
        event: event.unwrap_or_else(|| "message".into()),
        data: data.join("\n"),
    })
}

/// A port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range
/// (32768 and up on Linux). Processes the tests restart (a killed service, a Redis node)
/// listen on the same port again; a port of the ephemeral range may meanwhile be the
/// source port of some outgoing connection, and the restart then fails with "Address
/// already in use" (seen in the cluster soak). No outgoing connection takes one of these.
/// Each process walks the range from its own starting point, so two test processes
/// rarely probe the same port, and never hands out one port twice.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_000;
    const COUNT: u32 = 22_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    if NEXT.load(Ordering::Relaxed) == u32::MAX {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let start = (std::process::id().wrapping_mul(7_919) ^ nanos) % COUNT;
        let _ = NEXT.compare_exchange(u32::MAX, start, Ordering::Relaxed, Ordering::Relaxed);
    }
    for _ in 0..COUNT {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % COUNT) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!(
        "no free port on 127.0.0.1 between {FIRST} and {}",
        FIRST + COUNT
    )
}

/// Every sample of Prometheus text output by series, with the constant labels every
/// series of a process carries (`slot`, `stream`, `side`) left out:
/// `name` or `name{label="value",...}`.
pub fn metric_samples(text: &str) -> std::collections::HashMap<String, f64> {
    const CONSTANT: [&str; 3] = ["slot", "stream", "side"];
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value: f64 = value.trim().parse().ok()?;
            let key = match series.split_once('{') {
                None => series.to_string(),
                Some((name, labels)) => {
                    let kept: Vec<&str> = labels
                        .trim_end_matches('}')
                        .split(',')
                        .filter(|pair| {
                            let label = pair.split('=').next().unwrap_or_default();
                            !pair.is_empty() && !CONSTANT.contains(&label)
                        })
                        .collect();
                    if kept.is_empty() {
                        name.to_string()
                    } else {
                        format!("{name}{{{}}}", kept.join(","))
                    }
                }
            };
            Some((key, value))
        })
        .collect()
}

/// Lint Prometheus text output with `promtool check metrics`; `Err` carries its complaints.
pub fn promtool_check_metrics(text: &str) -> Result<(), String> {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("promtool (deploy/install-deps.sh installs it): {e}"))?;
    child
        .stdin
        .take()
        .expect("stdin piped")
        .write_all(text.as_bytes())
        .map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The value of a metric (without labels other than the constant ones).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    metric_samples(text).get(name).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_labels_are_left_out_of_series_keys() {
        let text =
            "# HELP x y\nx{slot=\"s\",stream=\"t\"} 3\ny{side=\"w\",status=\"lost\"} 1\nz 2\n";
        let m = metric_samples(text);
        assert_eq!(m["x"], 3.0);
        assert_eq!(m["y{status=\"lost\"}"], 1.0);
        assert_eq!(metric_value(text, "z"), Some(2.0));
    }

    #[test]
    fn sse_blocks_parse() {
        assert_eq!(
            parse_event("id: 7\nevent: message\ndata: {\"a\":1}\n\n"),
            Some(SseEvent {
                id: Some("7".into()),
                event: "message".into(),
                data: "{\"a\":1}".into()
            })
        );
        assert_eq!(parse_event(": heartbeat\n\n"), None);
        assert_eq!(parse_event("retry: 1000\n\n"), None);
    }
}
