//! A throwaway redis-server on a Unix socket with the production durability settings
//! (`appendonly yes`, `appendfsync always`, `noeviction`), restartable on its AOF;
//! optionally with a TLS port on loopback and an ACL file.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::pids::describe_exit;
use crate::process::{ChildProcess, Signal};
use crate::scratch::scratch_dir;
use crate::tls::ServerCert;

/// The server program every [`RedisServer`] and Redis Cluster node runs: `redis-server`, or
/// what `TESTKIT_REDIS_SERVER` names (a Valkey build: see [`valkey_server`]).
pub fn server_program() -> PathBuf {
    std::env::var_os(REDIS_SERVER_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("redis-server"))
}

/// The variable that picks the server program.
pub const REDIS_SERVER_ENV: &str = "TESTKIT_REDIS_SERVER";

/// The Valkey server `deploy/install-deps.sh` unpacks into the workspace's `.cache/valkey`
/// (or the one `VALKEY_SERVER` names).
pub fn valkey_server() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("VALKEY_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/valkey/bin/valkey-server")
        });
    if path.is_file() {
        Ok(path)
    } else {
        bail!(
            "no Valkey server at {}: run deploy/install-deps.sh (or set VALKEY_SERVER)",
            path.display()
        )
    }
}

/// Run the tests named `exact` of the test binary this process is, again, against Valkey
/// (the suites' named Valkey subset): the child's output, and whether every one of them
/// ran and passed. Two threads, as CI's machine has two cores.
pub fn run_on_valkey(exact: &[&str]) -> anyhow::Result<(bool, String)> {
    let program = valkey_server()?;
    let banner = Command::new(&program).arg("--version").output()?;
    let banner = String::from_utf8_lossy(&banner.stdout).into_owned();
    if !banner.starts_with("Valkey server") {
        bail!("{} is not a Valkey server: {banner}", program.display());
    }
    let output = Command::new(std::env::current_exe()?)
        .args(exact)
        .args(["--exact", "--test-threads", "2", "--nocapture"])
        .env(REDIS_SERVER_ENV, &program)
        .output()
        .context("run the test binary again")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let all_ran = text.contains(&format!("test result: ok. {} passed", exact.len()));
    Ok((output.status.success() && all_ran, text))
}

/// Settings beyond the test defaults.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Also listen with TLS on a free 127.0.0.1 port (clients are not asked for
    /// certificates; they authenticate with ACL passwords).
    pub tls: Option<ServerCert>,
    /// Load users from this ACL file.
    pub acl_file: Option<PathBuf>,
    /// The user and password the testkit itself connects as (needed when the ACL file
    /// turns the default user off).
    pub admin: Option<(String, String)>,
}

/// One redis-server process over one data directory.
pub struct RedisServer {
    dir: PathBuf,
    socket: PathBuf,
    tls_port: Option<u16>,
    extra_args: Vec<String>,
    admin: Option<(String, String)>,
    process: Mutex<Option<ChildProcess>>,
    starts: Mutex<u32>,
}

impl RedisServer {
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(RedisOptions::default())
    }

    pub fn start_with(options: RedisOptions) -> anyhow::Result<Self> {
        let dir = scratch_dir("redis");
        let mut extra_args = Vec::new();
        let mut tls_port = None;
        if let Some(cert) = &options.tls {
            let port = crate::http::free_port();
            tls_port = Some(port);
            extra_args.extend([
                "--tls-port".to_string(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--tls-cert-file".into(),
                cert.cert.display().to_string(),
                "--tls-key-file".into(),
                cert.key.display().to_string(),
                "--tls-auth-clients".into(),
                "no".into(),
            ]);
        }
        if let Some(acl) = &options.acl_file {
            extra_args.extend(["--aclfile".to_string(), acl.display().to_string()]);
        }
        let server = Self {
            socket: dir.join("redis.sock"),
            dir,
            tls_port,
            extra_args,
            admin: options.admin,
            process: Mutex::new(None),
            starts: Mutex::new(0),
        };
        server.start_again()?;
        Ok(server)
    }

    /// `redis+unix://` URL of the server (with the admin credentials, if any).
    pub fn url(&self) -> String {
        match &self.admin {
            None => format!("redis+unix://{}", self.socket.display()),
            Some((user, pass)) => format!(
                "redis+unix://{}?user={user}&pass={pass}",
                self.socket.display()
            ),
        }
    }

    /// `redis+unix://` URL for `user` with `password`.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!(
            "redis+unix://{}?user={user}&pass={password}",
            self.socket.display()
        )
    }

    /// `rediss://` URL of the TLS port, naming the server `localhost` (servers started with
    /// [`RedisOptions::tls`]); `userinfo` is `user:password@` or empty.
    pub fn tls_url(&self, userinfo: &str) -> String {
        let port = self
            .tls_port
            .expect("tls_url needs a server started with RedisOptions::tls");
        format!("rediss://{userinfo}localhost:{port}")
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
        let mut cmd = Command::new(server_program());
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
            ])
            .args(&self.extra_args);
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
            if ping(&self.socket, self.admin.as_ref()) {
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

/// PING over the socket with a raw RESP request (after AUTH when credentials are given).
fn ping(socket: &Path, auth: Option<&(String, String)>) -> bool {
    let Ok(mut stream) = UnixStream::connect(socket) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut request = Vec::new();
    let mut expected = Vec::new();
    if let Some((user, pass)) = auth {
        request.extend_from_slice(b"*3\r\n$4\r\nAUTH\r\n");
        for arg in [user, pass] {
            request.extend_from_slice(format!("${}\r\n{arg}\r\n", arg.len()).as_bytes());
        }
        expected.extend_from_slice(b"+OK\r\n");
    }
    request.extend_from_slice(b"PING\r\n");
    expected.extend_from_slice(b"+PONG\r\n");
    if stream.write_all(&request).is_err() {
        return false;
    }
    let mut reply = vec![0u8; expected.len()];
    stream.read_exact(&mut reply).is_ok() && reply == expected
}

/// One server shared by every test of this test binary that does not stop or kill it.
pub fn shared_redis() -> &'static RedisServer {
    static SHARED: OnceLock<RedisServer> = OnceLock::new();
    SHARED.get_or_init(|| RedisServer::start().expect("start shared redis"))
}
