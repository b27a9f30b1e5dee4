//! The experiments' clients: a sender that retries like a careful client (one
//! Idempotency-Key per message), and a watcher that keeps an SSE stream open like a browser,
//! reconnecting with `Last-Event-ID` (through any instance of the side, as behind a load
//! balancer), and records everything it was shown and when.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use testkit::http::SseClient;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What a steady sender sends: its n-th message (from 1) goes to chat `chat(n)` with body
/// `body(n)`, through `addrs[n % addrs.len()]`, each retried for `give_up`.
pub struct Traffic<C, B> {
    pub addrs: Vec<SocketAddr>,
    /// Messages a second.
    pub rate: f64,
    pub chat: C,
    pub body: B,
    pub give_up: Duration,
}

/// Send `traffic` at its steady rate until `stop`, then wait for every answer: how many
/// were answered, and how many failed.
pub async fn send_steadily<C, B>(traffic: Traffic<C, B>, stop: CancellationToken) -> (usize, usize)
where
    C: Fn(i64) -> i64,
    B: Fn(i64) -> String,
{
    let mut pending = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / traffic.rate));
    let mut n = 0i64;
    while !stop.is_cancelled() {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        n += 1;
        let (chat, body) = ((traffic.chat)(n), (traffic.body)(n));
        let addr = traffic.addrs[n as usize % traffic.addrs.len()];
        let give_up = traffic.give_up;
        pending.push(tokio::spawn(async move {
            send(addr, chat, &body, give_up).await
        }));
    }
    let mut ok = 0;
    let mut failed = 0;
    for p in pending {
        match p.await {
            Ok(Ok(_)) => ok += 1,
            _ => failed += 1,
        }
    }
    (ok, failed)
}

/// Send one message, retrying connection failures and 503s until `give_up` has passed.
/// Returns the message as answered, or the last error.
pub async fn send(
    addr: SocketAddr,
    chat_id: i64,
    body: &str,
    give_up: Duration,
) -> Result<serde_json::Value, String> {
    let key = uuid::Uuid::new_v4().to_string();
    let deadline = tokio::time::Instant::now() + give_up;
    loop {
        let attempt = testkit::http::post_json(
            addr,
            &format!("/chats/{chat_id}/messages"),
            &serde_json::json!({ "body": body }),
            &[("idempotency-key", &key)],
        )
        .await;
        let last_error = match attempt {
            Ok(reply) if reply.status == 201 => return Ok(reply.json()),
            Ok(reply) if reply.status < 500 => {
                return Err(format!("{}: {}", reply.status, reply.body))
            }
            Ok(reply) => format!("{}: {}", reply.status, reply.body),
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(last_error);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One shown message.
#[derive(Debug, Clone)]
pub struct Shown {
    pub seq: i64,
    pub message: serde_json::Value,
    /// When the event reached the tab (wall clock, comparable with `created_at`).
    pub at: SystemTime,
}

/// An SSE client of one chat that reconnects forever (like EventSource) until stopped.
pub struct Watcher {
    shown: Arc<Mutex<Vec<Shown>>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Watcher {
    /// Watch `chat_id` on `addr` from the beginning (`after=p0`).
    pub fn start(addr: SocketAddr, chat_id: i64) -> Self {
        Self::start_any(vec![addr], chat_id)
    }

    /// Watch `chat_id` through `addrs`: the first one, then, whenever a connection fails or
    /// ends, the next (what a load balancer in front of a side's instances does for a tab).
    pub fn start_any(addrs: Vec<SocketAddr>, chat_id: i64) -> Self {
        assert!(!addrs.is_empty(), "a watcher needs an address");
        let shown = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let task = {
            let (shown, stop) = (shown.clone(), stop.clone());
            tokio::spawn(async move {
                let mut last: Option<String> = None;
                let mut next = 0;
                while !stop.is_cancelled() {
                    let addr = addrs[next % addrs.len()];
                    next += 1;
                    let path = format!("/chats/{chat_id}/events?after=p0");
                    let client = tokio::select! {
                        _ = stop.cancelled() => return,
                        c = SseClient::connect(addr, &path, last.as_deref()) => c,
                    };
                    let Ok(mut client) = client else {
                        if next % addrs.len() == 0 {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        continue;
                    };
                    // Stay on the instance that answered until it goes.
                    next -= 1;
                    loop {
                        let event = tokio::select! {
                            _ = stop.cancelled() => return,
                            e = client.next(Duration::from_millis(500)) => e,
                        };
                        match event {
                            // Only messages are shown (a `skipped` event leaves its
                            // messages missing, which the checks then report).
                            Some(event) if event.event != "message" => {}
                            Some(event) => {
                                let Ok(message) =
                                    serde_json::from_str::<serde_json::Value>(&event.data)
                                else {
                                    continue;
                                };
                                let seq = event
                                    .id
                                    .as_deref()
                                    .and_then(|id| id.strip_prefix('p')?.parse().ok())
                                    .unwrap_or(0);
                                last = event.id.clone();
                                shown.lock().unwrap().push(Shown {
                                    seq,
                                    message,
                                    at: SystemTime::now(),
                                });
                            }
                            None if client.is_closed() => break,
                            None => {}
                        }
                    }
                    // It went: the next instance. The browser's EventSource waits the
                    // `retry:` time (1 s) before reconnecting; a shorter pause keeps the
                    // experiments quick.
                    next += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        Self { shown, stop, task }
    }

    /// Everything shown so far, in order.
    pub fn shown(&self) -> Vec<Shown> {
        self.shown.lock().unwrap().clone()
    }

    pub async fn stop(self) -> Vec<Shown> {
        self.stop.cancel();
        let _ = self.task.await;
        self.shown.lock().unwrap().clone()
    }
}
