//! A loopback TCP proxy in front of a Unix socket (a test Postgres) that can cut a
//! connection at the worst moment: right after the server answered a request the client
//! sent, before the client sees the answer ("the connection died after COMMIT"); or cut
//! every connection and refuse new ones until restored (a network partition of one
//! client). [`Proxy::retarget`] points new connections at another socket: a DNS name
//! switched to a promoted standby. [`Proxy::black_hole`] keeps every open connection open
//! and forwards nothing more on it, while new ones pass: a middlebox that lost its state, or
//! a server host gone behind an address that moved.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};

/// Forwards `127.0.0.1:<port>` to a Unix socket until dropped.
pub struct Proxy {
    addr: SocketAddr,
    armed: Arc<Mutex<Option<Vec<u8>>>>,
    /// Where new connections go.
    target: Arc<Mutex<PathBuf>>,
    /// While true, every connection is cut and new ones are closed at once.
    severed: tokio::sync::watch::Sender<bool>,
    hold: Arc<Hold>,
    /// Connections numbered below this forward nothing (see [`Proxy::black_hole`]).
    black_holed_below: Arc<AtomicU64>,
    next_connection: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listen on a free loopback port, forwarding each connection to `socket`.
    pub async fn to_unix(socket: PathBuf) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let armed: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
        let target = Arc::new(Mutex::new(socket));
        let (severed, _) = tokio::sync::watch::channel(false);
        let hold = Arc::new(Hold::default());
        let black_holed_below = Arc::new(AtomicU64::new(0));
        let next_connection = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn({
            let armed = armed.clone();
            let hold = hold.clone();
            let target = target.clone();
            let severed = severed.clone();
            let black_holed_below = black_holed_below.clone();
            let next_connection = next_connection.clone();
            async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    if *severed.borrow() {
                        continue;
                    }
                    let socket = target.lock().unwrap().clone();
                    let Ok(unix) = UnixStream::connect(&socket).await else {
                        continue;
                    };
                    let mut cut = severed.subscribe();
                    let void = Void {
                        id: next_connection.fetch_add(1, Ordering::SeqCst),
                        below: black_holed_below.clone(),
                    };
                    let connection = forward(tcp, unix, armed.clone(), hold.clone(), void);
                    tokio::spawn(async move {
                        tokio::select! {
                            _ = connection => {}
                            _ = cut.wait_for(|s| *s) => {}
                        }
                    });
                }
            }
        });
        Ok(Self {
            addr,
            armed,
            target,
            severed,
            hold,
            black_holed_below,
            next_connection,
            task,
        })
    }

    /// Cut every connection and refuse new ones until [`Proxy::restore`].
    pub fn sever(&self) {
        self.severed.send_replace(true);
    }

    pub fn restore(&self) {
        self.severed.send_replace(false);
    }

    /// Every connection open now stays open and forwards nothing more, either way (what
    /// arrives is read and dropped, so neither end's writes fail); new connections pass.
    pub fn black_hole(&self) {
        self.black_holed_below.store(
            self.next_connection.load(Ordering::SeqCst),
            Ordering::SeqCst,
        );
    }

    /// New connections go to `socket` from now on; open ones stay where they are (as with a
    /// DNS switch, they end with the server they reached).
    pub fn retarget(&self, socket: PathBuf) {
        *self.target.lock().unwrap() = socket;
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next connection whose client sends bytes containing `pattern` is cut as soon
    /// as the server answers: the answer is dropped and both sides are closed. Once.
    pub fn cut_reply_after(&self, pattern: &[u8]) {
        *self.armed.lock().unwrap() = Some(pattern.to_vec());
    }

    /// Whether the armed cut happened.
    pub fn cut_done(&self) -> bool {
        self.armed.lock().unwrap().is_none()
    }

    /// The next client bytes containing `pattern` (and everything after them on that
    /// connection) are held, not forwarded, until [`Proxy::release`]: a request that left
    /// the client and reaches the server only much later (a partition that heals). Once.
    pub fn hold_when(&self, pattern: &[u8]) {
        let mut state = self.hold.state.lock().unwrap();
        state.pattern = Some(pattern.to_vec());
        state.holding = false;
    }

    /// Whether a connection is holding bytes now.
    pub fn holding(&self) -> bool {
        self.hold.state.lock().unwrap().holding
    }

    /// Forward what is held.
    pub fn release(&self) {
        self.hold.state.lock().unwrap().holding = false;
        self.hold.released.notify_waiters();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What [`Proxy::hold_when`] armed, and the wake-up of the connection holding it.
#[derive(Default)]
struct Hold {
    state: Mutex<HoldState>,
    released: tokio::sync::Notify,
}

#[derive(Default)]
struct HoldState {
    pattern: Option<Vec<u8>>,
    holding: bool,
}

/// Whether a connection was black-holed.
#[derive(Clone)]
struct Void {
    id: u64,
    below: Arc<AtomicU64>,
}

impl Void {
    fn swallows(&self) -> bool {
        self.id < self.below.load(Ordering::SeqCst)
    }
}

async fn forward(
    tcp: tokio::net::TcpStream,
    unix: UnixStream,
    armed: Arc<Mutex<Option<Vec<u8>>>>,
    hold: Arc<Hold>,
    void: Void,
) {
    let (mut client_read, mut client_write) = tcp.into_split();
    let (mut server_read, mut server_write) = unix.into_split();
    // Set when this connection's client sent the armed pattern.
    let marked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let upstream = {
        let (armed, marked, void) = (armed.clone(), marked.clone(), void.clone());
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_read.read(&mut buf).await {
                    // A black hole does not pass a close on either: the other end never hears.
                    Ok(0) | Err(_) if void.swallows() => std::future::pending().await,
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if let Some(pattern) = armed.lock().unwrap().as_ref() {
                    if buf[..n].windows(pattern.len()).any(|w| w == &pattern[..]) {
                        marked.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                }
                let released = {
                    let mut state = hold.state.lock().unwrap();
                    let matched = state
                        .pattern
                        .as_ref()
                        .is_some_and(|p| buf[..n].windows(p.len()).any(|w| w == &p[..]));
                    if matched {
                        state.pattern = None;
                        state.holding = true;
                        // Registered before the lock is let go: a release cannot be missed.
                        let mut released = Box::pin(hold.released.notified());
                        released.as_mut().enable();
                        Some(released)
                    } else {
                        None
                    }
                };
                if let Some(released) = released {
                    released.await;
                }
                if void.swallows() {
                    continue;
                }
                if server_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) if void.swallows() => std::future::pending().await,
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if marked.load(std::sync::atomic::Ordering::SeqCst) {
                // The server answered what the client sent: drop the answer, close both.
                *armed.lock().unwrap() = None;
                return;
            }
            if void.swallows() {
                continue;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    // Whichever side ends first ends the connection (dropping both halves closes it).
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
    }
}
