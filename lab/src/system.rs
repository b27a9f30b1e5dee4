//! The whole system as separate processes, for the experiments: throwaway Postgres and
//! Redis (testkit), and the workspace's release binaries for the relays and services, each
//! of which can be started, stopped (SIGTERM, a deploy), killed (SIGKILL, a crash) and
//! started again on the same address.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context};
pub use chat_services::Side;
use testkit::{ChildProcess, PgOptions, PgServer, RedisCluster, RedisServer, Signal, TestDb};

use crate::baseline::{RelayMode, SenderMode};
use crate::report;

/// What a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Relay(Side),
    Service(Side),
    /// A second instance of the side's service (its own ports and consumer name).
    Replica(Side),
    /// Instance `i` (1 up to [`MAX_INSTANCES`] - 1) of the side's service: its own ports
    /// and consumer name (`Replica` is instance 1).
    Instance(Side, usize),
    /// An earlier design's sending service, on the side's service address.
    BaselineSender(Side, SenderMode),
    /// The second design's polling/NOTIFY relay.
    BaselineRelay(Side, RelayMode),
}

/// Instances of one side's service a lab system can run.
pub const MAX_INSTANCES: usize = 4;

/// Where the binaries the lab runs are.
#[derive(Debug, Clone)]
pub struct Bins {
    pub relay: PathBuf,
    pub service: PathBuf,
    pub lab: PathBuf,
}

impl Bins {
    /// The debug builds beside the test binary `lab` (`CARGO_BIN_EXE_chat-lab`), built now
    /// if they are stale, for tests. With the lab, whose dependency turns on chat-services'
    /// failpoints: the chaos runs crash services on purpose (--crash-after-inbox-commit).
    /// (After `cargo test --workspace` this relinks the binaries once without the
    /// test-support features; the tests that use them ran before.)
    pub fn built_for_tests(lab: PathBuf, manifest_dir: &str) -> Self {
        let dir = lab.parent().expect("a directory").to_path_buf();
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([
                "build",
                "--quiet",
                "-p",
                "cdc-relay",
                "-p",
                "chat-services",
                "-p",
                "lab",
                "--bins",
            ])
            .current_dir(manifest_dir)
            .status()
            .expect("cargo build");
        assert!(status.success(), "cargo build of the binaries failed");
        Self {
            relay: dir.join("cdc-relay"),
            service: dir.join("chat-service"),
            lab,
        }
    }

    /// Beside this executable (`cargo build --release --workspace`).
    pub fn beside_this() -> anyhow::Result<Self> {
        Ok(Self {
            relay: report::workspace_binary("cdc-relay")?,
            service: report::workspace_binary("chat-service")?,
            lab: std::env::current_exe()?,
        })
    }
}

pub struct System {
    pub pg: PgServer,
    /// The single Redis: relays' and services' unless `cluster`, and the baselines'.
    pub redis: RedisServer,
    /// A Redis Cluster (3 masters, 1 replica each) that relays (waiting for a replica on
    /// every batch) and services use instead.
    pub cluster: Option<RedisCluster>,
    pub db: TestDb,
    bins: Bins,
    service_ports: HashMap<Side, u16>,
    /// The real services' admin listeners (/readyz, /metrics); baselines answer on their
    /// service port.
    service_admin_ports: HashMap<Side, u16>,
    /// Ports of instances 1.. of each side: (listen, admin).
    instance_ports: HashMap<(Side, usize), (u16, u16)>,
    /// Shards of both sides' streams (`--stream-shards` of relays and services).
    shards: u32,
    logs: PathBuf,
    processes: Mutex<HashMap<String, ChildProcess>>,
    generations: Mutex<HashMap<String, u32>>,
    admin_ports: Mutex<HashMap<String, u16>>,
    /// The services' flags for verifying tokens, once [`System::enable_tokens`] ran; until
    /// then they run with `--allow-anonymous`.
    auth_flags: Mutex<Option<Vec<String>>>,
    /// Environment variables of the processes started from now on.
    env: Mutex<Vec<(String, String)>>,
}

/// The user the lab's clients are, with tokens, and the chats it is a member of on both
/// sides.
pub const LAB_USER: &str = "lab";
const LAB_CHATS: i64 = 1000;

impl System {
    /// From now on, services verify bearer tokens as in production (a stand-in identity
    /// provider's Ed25519 key, made by openssl), with limits far above what the lab sends,
    /// and [`LAB_USER`] is a member of chats 1 to 1000 on both sides. Returns its token.
    pub async fn enable_tokens(&self) -> anyhow::Result<String> {
        let dir = self.logs.join("idp");
        std::fs::create_dir_all(&dir)?;
        let pem = report::openssl_key(&dir, "key", &["-algorithm", "ed25519"])?;
        let key = chat_services::token::SigningKey::from_pem(&pem, "lab-1")?;
        let jwks = dir.join("jwks.json");
        std::fs::write(&jwks, chat_services::token::jwks(&[&key])?)?;
        let (issuer, audience) = ("https://id.lab.invalid/", "chat");
        let db = self.db.connect().await?;
        for side in [Side::Consumers, Side::Workers] {
            db.execute(
                &format!(
                    "INSERT INTO {}.chat_members (chat_id, user_id, added_by)
                     SELECT c, $1, 'lab' FROM generate_series(1, $2::bigint) c
                     ON CONFLICT DO NOTHING",
                    side.schema()
                ),
                &[&LAB_USER, &LAB_CHATS],
            )
            .await?;
        }
        *self.auth_flags.lock().unwrap() = Some(vec![
            "--jwks-file".into(),
            jwks.display().to_string(),
            "--jwt-issuer".into(),
            issuer.into(),
            "--jwt-audience".into(),
            audience.into(),
            "--send-rate".into(),
            "1000000".into(),
            "--send-burst".into(),
            "1000000".into(),
            "--max-event-streams-per-user".into(),
            "100000".into(),
        ]);
        Ok(key.mint(
            issuer,
            audience,
            LAB_USER,
            Duration::from_secs(24 * 3600),
            None,
        )?)
    }

    /// The services' identity flags: tokens after [`System::enable_tokens`], else none.
    fn auth_args(&self) -> Vec<String> {
        self.auth_flags
            .lock()
            .unwrap()
            .clone()
            .unwrap_or_else(|| vec!["--allow-anonymous=true".into()])
    }

    /// Servers, database and relay slots; no relay or service runs yet.
    pub async fn new(durable: bool, bins: Bins) -> anyhow::Result<Self> {
        Self::new_sharded(durable, bins, 1).await
    }

    /// The same, with both sides' streams split into `shards` shards.
    pub async fn new_sharded(durable: bool, bins: Bins, shards: u32) -> anyhow::Result<Self> {
        Self::new_on(durable, bins, shards, false).await
    }

    /// The same, on a Redis Cluster when `cluster` (`shards` must be 2 or more).
    pub async fn new_on(
        durable: bool,
        bins: Bins,
        shards: u32,
        cluster: bool,
    ) -> anyhow::Result<Self> {
        let cluster = if cluster {
            Some(RedisCluster::start()?)
        } else {
            None
        };
        let pg = PgServer::start_with(PgOptions {
            durable,
            ..PgOptions::default()
        })?;
        let redis = RedisServer::start()?;
        let db = pg.create_database().await?;
        let system = Self {
            bins,
            service_ports: [Side::Consumers, Side::Workers]
                .into_iter()
                .map(|s| (s, testkit::http::free_port()))
                .collect(),
            service_admin_ports: [Side::Consumers, Side::Workers]
                .into_iter()
                .map(|s| (s, testkit::http::free_port()))
                .collect(),
            instance_ports: [Side::Consumers, Side::Workers]
                .into_iter()
                .flat_map(|s| (1..MAX_INSTANCES).map(move |i| (s, i)))
                .map(|k| (k, (testkit::http::free_port(), testkit::http::free_port())))
                .collect(),
            shards: 1,
            logs: testkit::scratch_dir("lab-logs"),
            processes: Mutex::new(HashMap::new()),
            generations: Mutex::new(HashMap::new()),
            admin_ports: Mutex::new(HashMap::new()),
            auth_flags: Mutex::new(None),
            env: Mutex::new(Vec::new()),
            pg,
            redis,
            cluster,
            db,
        };
        let system = Self { shards, ..system };
        for side in [Side::Consumers, Side::Workers] {
            let out = Command::new(&system.bins.relay)
                .arg("setup")
                .args(system.relay_connection(side))
                .output()?;
            if !out.status.success() {
                bail!("cdc-relay setup: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
        Ok(system)
    }

    fn relay_connection(&self, side: Side) -> Vec<String> {
        let s = side.as_str();
        vec![
            "--database-url".into(),
            self.db.url(&format!("{s}_relay")),
            "--slot".into(),
            format!("{s}_relay_{}", self.db.name),
            "--publication".into(),
            format!("{s}_outbox"),
            "--outbox-table".into(),
            format!("{s}.outbox"),
        ]
    }

    /// Shards of both sides' streams.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// How relays and services reach Redis: the single server, or every node of the
    /// cluster (so a process starting while one is down finds the others).
    fn redis_flags(&self) -> Vec<String> {
        match &self.cluster {
            Some(cluster) => cluster.client_flags(),
            None => vec!["--redis-url".into(), self.redis.url()],
        }
    }

    pub fn service_addr(&self, side: Side) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.service_ports[&side]))
    }

    /// Where instance `i` of `side` answers (0: the service, 1: its replica, ...).
    pub fn instance_addr(&self, side: Side, i: usize) -> SocketAddr {
        match i {
            0 => self.service_addr(side),
            _ => SocketAddr::from(([127, 0, 0, 1], self.instance_ports[&(side, i)].0)),
        }
    }

    /// The admin listener of instance `i` of `side`.
    pub fn instance_admin(&self, side: Side, i: usize) -> SocketAddr {
        match i {
            0 => self.service_admin(side),
            _ => SocketAddr::from(([127, 0, 0, 1], self.instance_ports[&(side, i)].1)),
        }
    }

    /// The running processes this system started, by name.
    pub fn pids(&self) -> Vec<(String, u32)> {
        let processes = self.processes.lock().unwrap();
        let mut pids: Vec<(String, u32)> = processes
            .iter()
            .filter(|(_, p)| p.is_running())
            .map(|(name, p)| (name.clone(), p.pid()))
            .collect();
        pids.sort();
        pids
    }

    /// What accounts for the CPU of everything running now (see `cpu`).
    pub fn cpu_sampler(&self) -> crate::cpu::Sampler {
        crate::cpu::Sampler {
            named: self.pids(),
            postmaster: self.pg.pid(),
            redis: self.redis.pid().into_iter().collect(),
        }
    }

    /// User plus system CPU seconds process `name` used so far (0 when it is gone).
    pub fn cpu_seconds(&self, name: &str) -> f64 {
        self.processes
            .lock()
            .unwrap()
            .get(name)
            .map_or(0.0, |p| crate::cpu::cpu_seconds(p.pid()))
    }

    /// Wait until instance `i` of `side` answers /readyz (consuming or standing by).
    pub async fn wait_instance(
        &self,
        side: Side,
        i: usize,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = testkit::http::get(self.instance_admin(side, i), "/readyz").await
            {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("{} instance {i} not ready after {timeout:?}", side.as_str());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Where the real service of `side` answers /readyz and /metrics.
    pub fn service_admin(&self, side: Side) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.service_admin_ports[&side]))
    }

    /// /readyz of whatever serves `side`: the real service's admin listener, or a
    /// baseline's own port.
    async fn readyz(&self, side: Side) -> Option<(u16, String)> {
        for addr in [self.service_admin(side), self.service_addr(side)] {
            if let Ok(reply) = testkit::http::get(addr, "/readyz").await {
                if reply.0 != 404 {
                    return Some(reply);
                }
            }
        }
        None
    }

    /// Start a process called `name` of `kind` (`extra` flags appended).
    pub fn start(&self, name: &str, kind: Kind, extra: &[String]) -> anyhow::Result<()> {
        let mut cmd = match kind {
            Kind::Relay(side) => {
                let port = testkit::http::free_port();
                self.admin_ports
                    .lock()
                    .unwrap()
                    .insert(name.to_string(), port);
                let mut cmd = Command::new(&self.bins.relay);
                cmd.arg("run")
                    .args(self.relay_connection(side))
                    .args(self.redis_flags())
                    .args([
                        "--stream",
                        &side.outbox_stream(),
                        "--stream-shards",
                        &self.shards.to_string(),
                    ])
                    // Every other knob at its shipped default: what the soak measures is what
                    // deploys run.
                    .args(["--admin-addr", &format!("127.0.0.1:{port}")]);
                if self.cluster.is_some() {
                    // A master's failover cannot lose what a replica acknowledged.
                    cmd.args(["--redis-wait-replicas", "1"]);
                }
                cmd
            }
            Kind::BaselineSender(side, mode) => {
                let mut cmd = Command::new(&self.bins.lab);
                cmd.args(["baseline", "sender", "--side", side.as_str()])
                    .args([
                        "--mode",
                        if mode == SenderMode::DualWrite {
                            "dual-write"
                        } else {
                            "notify"
                        },
                    ])
                    .args(["--database-url", &self.db.url("postgres")])
                    .args(["--redis-url", &self.redis.url()])
                    .args(["--listen", &self.service_addr(side).to_string()]);
                cmd
            }
            Kind::BaselineRelay(side, mode) => {
                let mut cmd = Command::new(&self.bins.lab);
                cmd.args(["baseline", "relay", "--side", side.as_str()])
                    .args([
                        "--mode",
                        if mode == RelayMode::Notify {
                            "notify"
                        } else {
                            "poll"
                        },
                    ])
                    .args(["--database-url", &self.db.url("postgres")])
                    .args(["--redis-url", &self.redis.url()]);
                cmd
            }
            Kind::Service(side) | Kind::Replica(side) | Kind::Instance(side, _) => {
                let (i, consumer) = match kind {
                    Kind::Service(_) => (0, format!("{}-lab", side.as_str())),
                    Kind::Instance(_, i) => (i, format!("{}-lab-{}", side.as_str(), i + 1)),
                    _ => (1, format!("{}-lab-2", side.as_str())),
                };
                let mut cmd = Command::new(&self.bins.service);
                cmd.args(["--side", side.as_str()])
                    .args(["--database-url", &self.db.url(side.as_str())])
                    .args(self.redis_flags())
                    .args(["--listen", &self.instance_addr(side, i).to_string()])
                    .args(["--admin-addr", &self.instance_admin(side, i).to_string()])
                    .args(["--consumer-name", &consumer])
                    .args(self.auth_args())
                    .args(["--lease-ttl", "3s", "--claim-idle", "5s"])
                    .args(["--stream-shards", &self.shards.to_string()]);
                cmd
            }
        };
        cmd.args(extra).env("RUST_LOG", "info");
        cmd.envs(self.env.lock().unwrap().iter().cloned());
        let generation = {
            let mut g = self.generations.lock().unwrap();
            let n = g.entry(name.to_string()).or_insert(0);
            *n += 1;
            *n
        };
        let log = self.logs.join(format!("{name}.{generation}.log"));
        let child =
            ChildProcess::spawn(name, cmd, &log).with_context(|| format!("start {name}"))?;
        if let Some(old) = self
            .processes
            .lock()
            .unwrap()
            .insert(name.to_string(), child)
        {
            if old.is_running() {
                bail!("{name} was still running");
            }
        }
        Ok(())
    }

    /// Set `name=value` in the environment of every process started from now on.
    pub fn set_env(&self, name: &str, value: &str) {
        self.env
            .lock()
            .unwrap()
            .push((name.to_string(), value.to_string()));
    }

    /// The admin address of relay process `name`.
    pub fn relay_admin(&self, name: &str) -> Option<SocketAddr> {
        let port = *self.admin_ports.lock().unwrap().get(name)?;
        Some(SocketAddr::from(([127, 0, 0, 1], port)))
    }

    /// Wait until whatever serves `side` answers /readyz: the real service with its inbox
    /// consumer active, or a baseline sender.
    pub async fn wait_service(&self, side: Side, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let seen = self.readyz(side).await;
            if let Some((200, body)) = &seen {
                if body.contains("\"consumer\":\"active\"")
                    || body.contains("\"consumer\":\"none\"")
                {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{} not ready (an active inbox consumer) after {timeout:?}; last /readyz: {seen:?}",
                    side.as_str()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Wait until whatever serves `side` accepts sends (/readyz 200; its inbox consumer may
    /// still be waiting for Redis).
    pub async fn wait_accepting(&self, side: Side, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some((200, _)) = self.readyz(side).await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("{} not accepting sends after {timeout:?}", side.as_str());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Wait until relay process `name` holds its slot.
    pub async fn wait_relay(&self, name: &str, timeout: Duration) -> anyhow::Result<()> {
        let addr = self
            .relay_admin(name)
            .with_context(|| format!("no relay {name}"))?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = testkit::http::get(addr, "/readyz").await {
                return Ok(());
            }
            if !self.is_running(name) {
                bail!("relay {name} exited: {}", self.logs(name));
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("relay {name} not streaming after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Send `signal` to process `name` and wait for it to exit.
    pub fn stop(&self, name: &str, signal: Signal) -> anyhow::Result<()> {
        let processes = self.processes.lock().unwrap();
        let child = processes
            .get(name)
            .with_context(|| format!("no process {name}"))?;
        child.stop_with(signal, Duration::from_secs(60))?;
        Ok(())
    }

    pub fn is_running(&self, name: &str) -> bool {
        self.processes
            .lock()
            .unwrap()
            .get(name)
            .is_some_and(|c| c.is_running())
    }

    /// Where the processes' logs go (`<name>.<generation>.log`); removed at exit unless
    /// `TESTKIT_KEEP_SCRATCH` is set.
    pub fn logs_dir(&self) -> &std::path::Path {
        &self.logs
    }

    /// Everything process `name` logged, all generations.
    pub fn logs(&self, name: &str) -> String {
        let generations = self
            .generations
            .lock()
            .unwrap()
            .get(name)
            .copied()
            .unwrap_or(0);
        (1..=generations)
            .map(|g| {
                std::fs::read_to_string(self.logs.join(format!("{name}.{g}.log")))
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Stop every process (SIGTERM, then whatever is left is killed on drop).
    pub fn shutdown(&self) {
        let processes = self.processes.lock().unwrap();
        for child in processes.values() {
            let _ = child.stop_with(Signal::Term, Duration::from_secs(15));
        }
    }
}
