//! A loopback TCP load balancer in front of a side's instances, as a browser meets them
//! behind a real one: each new connection goes to the next backend whose `/healthz` answered
//! its last check (every 250 ms, 200 ms to answer), so an instance that stops answering
//! (SIGSTOP: its kernel still accepts connections) gets no new ones while open ones stay.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// Forwards `127.0.0.1:<port>` to healthy backends until dropped.
pub struct Balancer {
    addr: SocketAddr,
    /// Backends taken out of rotation by the test (as an operator drains one).
    enabled: Arc<Vec<AtomicBool>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Balancer {
    /// Listen on a free loopback port; `backends`: each one's (service, health) addresses.
    pub async fn start(backends: Vec<(SocketAddr, SocketAddr)>) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let healthy: Arc<Vec<AtomicBool>> =
            Arc::new(backends.iter().map(|_| AtomicBool::new(true)).collect());
        let enabled: Arc<Vec<AtomicBool>> =
            Arc::new(backends.iter().map(|_| AtomicBool::new(true)).collect());
        let mut tasks = Vec::new();
        for (i, (_, health)) in backends.iter().enumerate() {
            let (healthy, health) = (healthy.clone(), *health);
            tasks.push(tokio::spawn(async move {
                loop {
                    let ok = matches!(
                        tokio::time::timeout(
                            Duration::from_millis(200),
                            crate::http::get(health, "/healthz")
                        )
                        .await,
                        Ok(Ok((200, _)))
                    );
                    healthy[i].store(ok, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }));
        }
        let next = Arc::new(AtomicUsize::new(0));
        let routable = enabled.clone();
        tasks.push(tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let n = backends.len();
                let start = next.fetch_add(1, Ordering::SeqCst);
                let Some(k) = (0..n).map(|j| (start + j) % n).find(|k| {
                    healthy[*k].load(Ordering::SeqCst) && routable[*k].load(Ordering::SeqCst)
                }) else {
                    continue;
                };
                let backend = backends[k].0;
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(backend).await {
                        let (mut client, mut server) = (client, server);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        }));
        Ok(Self {
            addr,
            enabled,
            tasks,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Put backend `i` in rotation or take it out (open connections stay).
    pub fn set_enabled(&self, i: usize, enabled: bool) {
        self.enabled[i].store(enabled, Ordering::SeqCst);
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
