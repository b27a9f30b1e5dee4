//! A throwaway Redis Cluster on loopback: 3 masters with 1 replica each, created with
//! `redis-cli --cluster create`, each node with the production durability settings; a
//! master can be SIGKILLed (its replica is promoted) and started again (it rejoins as a
//! replica).

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::process::{ChildProcess, Signal};
use crate::scratch::scratch_dir;

/// How long a node may be unreachable before the cluster fails it over: short, so a test's
/// failover takes about a second.
const NODE_TIMEOUT_MS: u32 = 1000;

struct Node {
    port: u16,
    dir: PathBuf,
    process: Option<ChildProcess>,
    starts: u32,
}

pub struct RedisCluster {
    nodes: Mutex<Vec<Node>>,
}

impl RedisCluster {
    /// Six nodes (3 masters, 1 replica each), cluster state ok on every node.
    pub fn start() -> anyhow::Result<Self> {
        let mut nodes = Vec::new();
        let ports = node_ports(6);
        for (i, port) in ports.into_iter().enumerate() {
            let dir = scratch_dir(&format!("redis-cluster-{i}"));
            nodes.push(Node {
                port,
                dir,
                process: None,
                starts: 0,
            });
        }
        let cluster = Self {
            nodes: Mutex::new(nodes),
        };
        for i in 0..6 {
            cluster.start_node(i)?;
        }
        let addrs: Vec<String> = cluster
            .ports()
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .context("redis-cli --cluster create (is redis-tools installed?)")?;
        if !out.status.success() {
            bail!(
                "redis-cli --cluster create: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        cluster.wait_ok(Duration::from_secs(60))?;
        cluster.wait_replicas_synced(Duration::from_secs(60))?;
        Ok(cluster)
    }

    /// Until every running replica's link to its master is up (it holds the master's data)
    /// and no node is rewriting its AOF (a replica writes its first AOF after a full sync,
    /// and refuses SIGTERM until it is written: "Writing initial AOF, can't exit").
    pub fn wait_replicas_synced(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let synced = self.running_ports().iter().all(|p| {
                self.cli(*p, &["INFO", "replication"]).is_ok_and(|info| {
                    info.contains("role:master") || info.contains("master_link_status:up")
                }) && !self.rewriting_aof(*p)
            });
            if synced {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("replicas not in sync after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether the node on `port` is rewriting its AOF, or about to.
    fn rewriting_aof(&self, port: u16) -> bool {
        self.cli(port, &["INFO", "persistence"]).is_ok_and(|info| {
            info.contains("aof_rewrite_in_progress:1") || info.contains("aof_rewrite_scheduled:1")
        })
    }

    fn ports(&self) -> Vec<u16> {
        self.nodes.lock().unwrap().iter().map(|n| n.port).collect()
    }

    /// A `redis://` URL naming one node (clients discover the rest).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.ports()[0])
    }

    /// The flags that point a relay or a service at this cluster: `--redis-url` naming
    /// every node (so a process starting while one is down finds the others) and
    /// `--redis-cluster`.
    pub fn client_flags(&self) -> Vec<String> {
        vec![
            "--redis-url".into(),
            self.urls().join(","),
            "--redis-cluster".into(),
        ]
    }

    /// Every node's URL.
    pub fn urls(&self) -> Vec<String> {
        self.ports()
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    fn start_node(&self, i: usize) -> anyhow::Result<()> {
        let mut nodes = self.nodes.lock().unwrap();
        let node = &mut nodes[i];
        node.starts += 1;
        let mut cmd = Command::new(crate::redis_server::server_program());
        cmd.args(["--port", &node.port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&node.dir)
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                &NODE_TIMEOUT_MS.to_string(),
                // A replica may always be promoted, however long ago it last heard its
                // master (the default refuses a replica that never synced recently).
                "--cluster-replica-validity-factor",
                "0",
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
        let log = node.dir.join(format!("redis-{}.log", node.starts));
        let child = ChildProcess::spawn(&format!("redis-cluster-{i}"), cmd, &log)
            .context("start redis-server")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        // The node answering must be this child (not one that took the port meanwhile).
        while !serves(node.port, child.pid()) {
            if child.try_status().is_some() || Instant::now() >= deadline {
                bail!("cluster node {i} did not start: {}", child.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        node.process = Some(child);
        Ok(())
    }

    /// Run `redis-cli -p <port> <args>` and return its output.
    pub fn cli(&self, port: u16, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Until every running node says `cluster_state:ok` and the masters of all 16,384
    /// slots are reachable.
    pub fn wait_ok(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let running = self.running_ports();
            let all_ok = running.iter().all(|p| {
                self.cli(*p, &["CLUSTER", "INFO"])
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
            });
            if all_ok && !running.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("cluster not ok after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn running_ports(&self) -> Vec<u16> {
        self.nodes
            .lock()
            .unwrap()
            .iter()
            .filter(|n| n.process.as_ref().is_some_and(|p| p.is_running()))
            .map(|n| n.port)
            .collect()
    }

    /// The node index serving `key` as master now.
    pub fn master_of(&self, key: &str) -> anyhow::Result<usize> {
        let slot: u16 = self
            .cli(self.running_ports()[0], &["CLUSTER", "KEYSLOT", key])?
            .trim()
            .parse()?;
        let ports = self.ports();
        for (i, port) in ports.iter().enumerate() {
            if !self.running_ports().contains(port) {
                continue;
            }
            let role = self.cli(*port, &["ROLE"])?;
            if !role.starts_with("master") {
                continue;
            }
            let slots = self.cli(*port, &["CLUSTER", "MYID"])?;
            let myid = slots.trim().to_string();
            let nodes = self.cli(*port, &["CLUSTER", "NODES"])?;
            let mine = nodes
                .lines()
                .find(|l| l.starts_with(&myid))
                .unwrap_or_default();
            for range in mine.split_whitespace().skip(8) {
                let (lo, hi) = match range.split_once('-') {
                    Some((lo, hi)) => (lo.parse::<u16>()?, hi.parse::<u16>()?),
                    None => match range.parse::<u16>() {
                        Ok(s) => (s, s),
                        Err(_) => continue,
                    },
                };
                if (lo..=hi).contains(&slot) {
                    return Ok(i);
                }
            }
        }
        bail!("no running master serves slot {slot} of {key}")
    }

    /// The port of node `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.ports()[i]
    }

    /// The node index of a replica of master `master`.
    pub fn replica_of(&self, master: usize) -> anyhow::Result<usize> {
        let ports = self.ports();
        let id = self
            .cli(ports[master], &["CLUSTER", "MYID"])?
            .trim()
            .to_string();
        for (i, port) in ports.iter().enumerate() {
            if i == master || !self.running_ports().contains(port) {
                continue;
            }
            let role = self.cli(*port, &["ROLE"])?;
            let of = self.cli(*port, &["CLUSTER", "MYID"])?.trim().to_string();
            let nodes = self.cli(*port, &["CLUSTER", "NODES"])?;
            let mine = nodes
                .lines()
                .find(|l| l.starts_with(&of))
                .unwrap_or_default();
            if role.starts_with("slave") && mine.split_whitespace().nth(3) == Some(id.as_str()) {
                return Ok(i);
            }
        }
        bail!("master {master} has no running replica")
    }

    /// SIGSTOP node `i`: it keeps its connections but answers nothing (a frozen host).
    pub fn pause_node(&self, i: usize) -> anyhow::Result<()> {
        self.signal_node(i, Signal::Stop)
    }

    /// SIGCONT node `i` after [`RedisCluster::pause_node`].
    pub fn resume_node(&self, i: usize) -> anyhow::Result<()> {
        self.signal_node(i, Signal::Cont)
    }

    fn signal_node(&self, i: usize, signal: Signal) -> anyhow::Result<()> {
        let nodes = self.nodes.lock().unwrap();
        match &nodes[i].process {
            Some(process) => process.signal(signal),
            None => bail!("node {i} is not running"),
        }
    }

    /// SIGKILL node `i` and wait until the others marked it failed and the cluster is ok
    /// again without it (a master's replica was promoted).
    pub fn kill_node(&self, i: usize) -> anyhow::Result<()> {
        let port = self.ports()[i];
        let id = self.cli(port, &["CLUSTER", "MYID"])?.trim().to_string();
        let child = self.nodes.lock().unwrap()[i].process.take();
        if let Some(child) = child {
            child.stop_with(Signal::Kill, Duration::from_secs(10))?;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let failed = self.running_ports().iter().all(|p| {
                self.cli(*p, &["CLUSTER", "NODES"]).is_ok_and(|nodes| {
                    nodes.lines().any(|l| {
                        l.starts_with(&id)
                            && l.split_whitespace()
                                .nth(2)
                                .is_some_and(|flags| flags.split(',').any(|f| f == "fail"))
                    })
                })
            });
            if failed {
                break;
            }
            if Instant::now() >= deadline {
                bail!("node {i} not marked failed within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_ok(Duration::from_secs(60))
    }

    /// `CLUSTER FAILOVER` on replica `i`: it and its master swap roles without data loss
    /// (what an operator does before maintenance); waits until `i` is a master and the
    /// cluster is ok.
    pub fn failover_to(&self, i: usize) -> anyhow::Result<()> {
        let port = self.ports()[i];
        let reply = self.cli(port, &["CLUSTER", "FAILOVER"])?;
        if reply.trim() != "OK" {
            bail!("CLUSTER FAILOVER on node {i}: {reply}");
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.cli(port, &["ROLE"])?.starts_with("master") {
            if Instant::now() >= deadline {
                bail!("node {i} not promoted within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_ok(Duration::from_secs(60))?;
        self.wait_replicas_synced(Duration::from_secs(60))
    }

    /// Move the (keyless) hash slot of `key` to master `to`, as a resharding would:
    /// `IMPORTING`/`MIGRATING`, then `SETSLOT NODE` on every master. Fails if keys live in
    /// that slot (moving them is not needed by any test).
    pub fn move_slot_of(&self, key: &str, to: usize) -> anyhow::Result<()> {
        let from = self.master_of(key)?;
        let ports = self.ports();
        let slot = self
            .cli(ports[from], &["CLUSTER", "KEYSLOT", key])?
            .trim()
            .to_string();
        let keys = self.cli(ports[from], &["CLUSTER", "COUNTKEYSINSLOT", &slot])?;
        if keys.trim() != "0" {
            bail!("slot {slot} of {key} holds keys ({})", keys.trim());
        }
        let id = |i: usize| -> anyhow::Result<String> {
            Ok(self.cli(ports[i], &["CLUSTER", "MYID"])?.trim().to_string())
        };
        let (from_id, to_id) = (id(from)?, id(to)?);
        let ok = |reply: String| -> anyhow::Result<()> {
            if reply.trim() == "OK" {
                Ok(())
            } else {
                bail!("moving slot {slot}: {reply}")
            }
        };
        ok(self.cli(
            ports[to],
            &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id],
        )?)?;
        ok(self.cli(
            ports[from],
            &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id],
        )?)?;
        ok(self.cli(ports[to], &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])?)?;
        ok(self.cli(ports[from], &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])?)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.master_of(key)? != to {
            if Instant::now() >= deadline {
                bail!("slot {slot} not served by node {to} within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_ok(Duration::from_secs(60))
    }

    /// The running masters' node indexes.
    pub fn masters(&self) -> Vec<usize> {
        let ports = self.ports();
        let running = self.running_ports();
        (0..ports.len())
            .filter(|i| running.contains(&ports[*i]))
            .filter(|i| {
                self.cli(ports[*i], &["ROLE"])
                    .is_ok_and(|r| r.starts_with("master"))
            })
            .collect()
    }

    /// SIGTERM every node (each writes its data out): the whole cluster is down.
    pub fn stop_all(&self) -> anyhow::Result<()> {
        let children: Vec<(u16, ChildProcess)> = self
            .nodes
            .lock()
            .unwrap()
            .iter_mut()
            .filter_map(|n| Some((n.port, n.process.take()?)))
            .collect();
        for (port, child) in children {
            // A node writing its first AOF (after a full sync) would refuse the signal.
            let deadline = Instant::now() + Duration::from_secs(30);
            while self.rewriting_aof(port) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Err(e) = child.stop_with(Signal::Term, Duration::from_secs(30)) {
                let log = child.log();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                bail!("{e}; its log ends:\n{tail}");
            }
        }
        Ok(())
    }

    /// Start every stopped node on its data and wait until the cluster is ok and in sync.
    pub fn start_all(&self) -> anyhow::Result<()> {
        let stopped: Vec<usize> = {
            let nodes = self.nodes.lock().unwrap();
            (0..nodes.len())
                .filter(|i| nodes[*i].process.is_none())
                .collect()
        };
        for i in stopped {
            self.start_node(i)?;
        }
        self.wait_ok(Duration::from_secs(60))?;
        self.wait_replicas_synced(Duration::from_secs(60))
    }

    /// Start every stopped node but `except` on its data, and wait until the cluster is ok
    /// without it (a node lost for good while the rest of the cluster restarted).
    pub fn start_all_but(&self, except: usize) -> anyhow::Result<()> {
        let stopped: Vec<usize> = {
            let nodes = self.nodes.lock().unwrap();
            (0..nodes.len())
                .filter(|i| *i != except && nodes[*i].process.is_none())
                .collect()
        };
        for i in stopped {
            self.start_node(i)?;
        }
        self.wait_ok(Duration::from_secs(60))
    }

    /// Start node `i` again on its data (it rejoins, as a replica if it was failed over)
    /// and wait until it is in sync.
    pub fn restart_node(&self, i: usize) -> anyhow::Result<()> {
        self.start_node(i)?;
        self.wait_ok(Duration::from_secs(60))?;
        self.wait_replicas_synced(Duration::from_secs(60))
    }
}

/// Whether the Redis at `port` is the process `pid`.
fn serves(port: u16, pid: u32) -> bool {
    Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "INFO", "server"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.trim() == format!("process_id:{pid}"))
        })
}

/// `n` free ports whose cluster bus ports (port + 10000) are free too, below the kernel's
/// ephemeral range like the ports themselves (a node restarted on its ports must find
/// them free), and collide with no other node's port or bus port.
fn node_ports(n: usize) -> Vec<u16> {
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < n {
        let port = crate::http::free_port();
        let bus = port + 10_000;
        if bus >= 32_768 {
            continue;
        }
        let taken = ports
            .iter()
            .any(|p| [*p, p + 10_000].iter().any(|q| *q == port || *q == bus));
        if !taken && std::net::TcpListener::bind(("127.0.0.1", bus)).is_ok() {
            ports.push(port);
        }
    }
    ports
}
