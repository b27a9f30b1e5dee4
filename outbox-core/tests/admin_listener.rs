//! The admin listener under a flood from one address: the others' probes still answer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::admin::{Probe, Readiness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Ready;

impl Probe for Ready {
    async fn readiness(&self) -> Readiness {
        Readiness {
            ready: true,
            body: serde_json::json!({"status": "ready"}),
        }
    }

    fn metrics(&self) -> String {
        String::new()
    }
}

/// A connection to `to` from the loopback address `from` (any of 127.0.0.0/8).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

/// The status line of `GET path` from `from`, or what went wrong.
async fn get_from(from: [u8; 4], to: SocketAddr, path: &str) -> Result<String, String> {
    let mut conn = connect_from(from, to).await;
    let request = format!("GET {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n");
    conn.write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut answer))
        .await
        .map_err(|_| "no answer within 5 s".to_string())?
        .map_err(|e| e.to_string())?;
    let answer = String::from_utf8_lossy(&answer).to_string();
    answer
        .lines()
        .next()
        .filter(|line| !line.is_empty())
        .map(str::to_string)
        .ok_or_else(|| "closed without an answer".to_string())
}

/// One address holding every connection it can (idle, as a stuck scraper or a neighbour
/// flooding the port would) takes a quarter of the listener: a probe from another address
/// is answered, and the flooding address's next connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_the_places_the_probes_need() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(outbox_core::admin::serve(
        listener,
        Arc::new(Ready),
        shutdown.clone(),
    ));
    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(connect_from([127, 0, 0, 1], addr).await);
    }
    // Every held connection accepted (or refused) before the probe: the last one's fate
    // is known once a request on it is answered or refused.
    let over = get_from([127, 0, 0, 1], addr, "/healthz").await;
    assert!(over.is_err(), "the flooding address was served: {over:?}");
    let probe = get_from([127, 0, 0, 2], addr, "/readyz").await;
    assert_eq!(probe.as_deref(), Ok("HTTP/1.1 200 OK"), "{probe:?}");
    drop(held);
    shutdown.cancel();
    server.await.unwrap();
}
