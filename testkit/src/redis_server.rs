//! A throwaway redis-server on a Unix socket with the production durability settings
//! (`appendonly yes`, `appendfsync always`, `noeviction`), restartable on its AOF.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::process::{describe_exit, ChildProcess, Signal};
use crate::scratch::scratch_dir;

/// One redis-server process over one data directory.
pub struct RedisServer {
    dir: PathBuf,
    socket: PathBuf,
    process: Mutex<Option<ChildProcess>>,
    starts: Mutex<u32>,
}

impl RedisServer {
    pub fn start() -> anyhow::Result<Self> {
        let dir = scratch_dir("redis");
        let server = Self {
            socket: dir.join("redis.sock"),
            dir,
            process: Mutex::new(None),
            starts: Mutex::new(0),
        };
        server.start_again()?;
        Ok(server)
    }

    /// `redis+unix://` URL of the server.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket.display())
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn pid(&self) -> Option<u32> {
        self.process
            .lock()
            .unwrap()
            .as_ref()
            .filter(|p| p.is_running())
            .map(|p| p.pid())
    }

    /// A multiplexed async connection (fails fast while the server is down). Replies may
    /// be large (tests read whole streams), so the response timeout is generous.
    pub async fn connect(&self) -> anyhow::Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(self.url())?;
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(60)))
            .set_connection_timeout(Some(Duration::from_secs(5)));
        Ok(client
            .get_multiplexed_async_connection_with_config(&config)
            .await?)
    }

    /// Start on the existing data directory (replaying the AOF) and wait for PONG.
    pub fn start_again(&self) -> anyhow::Result<()> {
        let mut process = self.process.lock().unwrap();
        if process.as_ref().is_some_and(|p| p.is_running()) {
            bail!("redis is already running");
        }
        let n = {
            let mut starts = self.starts.lock().unwrap();
            *starts += 1;
            *starts
        };
        let _ = std::fs::remove_file(&self.socket);
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", "0", "--unixsocket"])
            .arg(&self.socket)
            .args(["--unixsocketperm", "700", "--dir"])
            .arg(&self.dir)
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--maxmemory-policy",
                "noeviction",
                "--daemonize",
                "no",
            ]);
        let child = ChildProcess::spawn("redis", cmd, &self.dir.join(format!("redis-{n}.log")))
            .context("start redis-server (is redis-server installed?)")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_status() {
                bail!(
                    "redis exited during start-up ({}): {}",
                    describe_exit(status),
                    child.log()
                );
            }
            if ping(&self.socket) {
                break;
            }
            if Instant::now() >= deadline {
                bail!("redis not ready after 30 s: {}", child.log());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        *process = Some(child);
        Ok(())
    }

    /// SIGTERM (Redis fsyncs the AOF and exits) and wait for the exit.
    pub fn stop(&self) -> anyhow::Result<()> {
        self.stop_with(Signal::Term)
    }

    /// SIGKILL and wait.
    pub fn kill(&self) -> anyhow::Result<()> {
        self.stop_with(Signal::Kill)
    }

    fn stop_with(&self, signal: Signal) -> anyhow::Result<()> {
        let Some(child) = self.process.lock().unwrap().take() else {
            bail!("redis is not running");
        };
        child.stop_with(signal, Duration::from_secs(30))?;
        Ok(())
    }

    /// Delete the persisted data (AOF and RDB), as a server restarted without its disk would
    /// find it. Only while stopped.
    pub fn wipe_data(&self) -> anyhow::Result<()> {
        if self.pid().is_some() {
            bail!("stop redis before wiping its data");
        }
        let _ = std::fs::remove_dir_all(self.dir.join("appendonlydir"));
        let _ = std::fs::remove_file(self.dir.join("dump.rdb"));
        Ok(())
    }
}

/// PING over the socket with a raw RESP request.
fn ping(socket: &Path) -> bool {
    let Ok(mut stream) = UnixStream::connect(socket) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    stream.read_exact(&mut reply).is_ok() && &reply == b"+PONG\r\n"
}

/// One server shared by every test of this test binary that does not stop or kill it.
pub fn shared_redis() -> &'static RedisServer {
    static SHARED: OnceLock<RedisServer> = OnceLock::new();
    SHARED.get_or_init(|| RedisServer::start().expect("start shared redis"))
}
