//! deploy/compose.yaml, for real: the three images are built (on a base made from Debian's
//! packages, with the binaries this test build already made), the whole file runs under podman
//! (docker-compose against `podman system service`), a message crosses each way through the
//! running containers, and restarting a relay container and the Redis container loses nothing
//! and shows nothing twice.
//!
//! What this sandbox needs, and why (each is set here, not on the machine): runc instead of
//! crun (crun refuses cgroups in hybrid mode), default ulimits at or below the host's (no
//! CAP_SYS_RESOURCE to raise them), and the test runs the healthchecks itself (podman schedules
//! them with systemd timers; there is no systemd here). Containers talk on podman's bridge
//! inside this machine; everything the test reaches is published on 127.0.0.1.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use testkit::{wait_until, ChildProcess, Signal};

use repo_checks::repo;

/// Runs `cmd`; its output, or a panic naming it with what it printed.
fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Podman with this test's engine configuration.
struct Podman {
    conf: PathBuf,
    socket: PathBuf,
    service: Option<ChildProcess>,
}

impl Podman {
    fn start(dir: &Path) -> Podman {
        // Limits the runtime may set without CAP_SYS_RESOURCE: never above the host's.
        let hard = |option: &str| -> u64 {
            let out = run(Command::new("bash").args(["-c", &format!("ulimit -H{option}")]));
            stdout(&out).parse().unwrap_or(u64::MAX)
        };
        let nofile = hard("n").min(16_384);
        let nproc = hard("u").min(8_192);
        let runtime = if Path::new("/usr/sbin/runc").exists() || Path::new("/usr/bin/runc").exists()
        {
            "runtime = \"runc\"\n"
        } else {
            ""
        };
        let conf = dir.join("containers.conf");
        std::fs::write(
            &conf,
            format!(
                "[containers]\ndefault_ulimits = [\"nofile={nofile}:{nofile}\", \"nproc={nproc}:{nproc}\"]\n[engine]\n{runtime}"
            ),
        )
        .unwrap();
        let socket = dir.join("podman.sock");
        let mut podman = Podman {
            conf,
            socket,
            service: None,
        };
        let mut cmd = podman.command();
        cmd.args(["system", "service", "--time=0"])
            .arg(format!("unix://{}", podman.socket.display()));
        podman.service =
            Some(ChildProcess::spawn("podman-service", cmd, &dir.join("podman.log")).unwrap());
        podman
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf);
        cmd
    }

    fn podman(&self, args: &[&str]) -> String {
        stdout(&run(self.command().args(args)))
    }

    /// Both outputs of a podman command whose failure is only reported (diagnostics).
    fn podman_outputs(&self, args: &[&str]) -> (String, String) {
        match self.command().args(args).stdin(Stdio::null()).output() {
            Ok(o) => (
                String::from_utf8_lossy(&o.stdout).into_owned(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            ),
            Err(e) => (String::new(), format!("podman {args:?}: {e}")),
        }
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        if let Some(service) = self.service.take() {
            let _ = service.stop_with(Signal::Term, Duration::from_secs(10));
        }
    }
}

/// Images this test tagged, removed when dropped.
struct Images<'a> {
    podman: &'a Podman,
    names: Vec<String>,
}

impl Drop for Images<'_> {
    fn drop(&mut self) {
        let _ = self
            .podman
            .command()
            .args(["rmi", "--force"])
            .args(&self.names)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// One compose project of deploy/compose.yaml; brought down with its volumes when dropped.
struct Project<'a> {
    podman: &'a Podman,
    name: String,
    env: Vec<(String, String)>,
}

impl Project<'_> {
    fn compose(&self) -> Command {
        let mut cmd = Command::new("docker-compose");
        cmd.current_dir(repo().join("deploy"))
            .args(["-f", "compose.yaml", "-p", &self.name])
            .env(
                "DOCKER_HOST",
                format!("unix://{}", self.podman.socket.display()),
            )
            .env("COMPOSE_HTTP_TIMEOUT", "300")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// The last lines every container of the project printed, on both of its outputs, and
    /// how each that stopped ended (for a failure's message: compose shows a container's
    /// stderr on its own stderr, and nothing of how it exited).
    fn logs(&self) -> String {
        let out = self
            .compose()
            .args(["logs", "--no-color", "--tail", "60"])
            .output();
        let mut logs = out
            .map(|o| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .unwrap_or_default();
        let (stopped, _) = self.podman.podman_outputs(&[
            "ps",
            "--all",
            "--filter",
            &format!("label=com.docker.compose.project={}", self.name),
            "--filter",
            "status=exited",
            "--format",
            "{{.Names}}",
        ]);
        for name in stopped.lines() {
            let (state, _) = self.podman.podman_outputs(&[
                "inspect",
                "--format",
                "exit {{.State.ExitCode}} {{.State.Error}} at {{.State.FinishedAt}}",
                name,
            ]);
            let (out, err) = self.podman.podman_outputs(&["logs", "--tail", "20", name]);
            logs.push_str(&format!("\n--- {name}: {}\n{out}{err}", state.trim()));
        }
        logs
    }

    fn container(&self, service: &str) -> String {
        format!("{}_{service}_1", self.name)
    }

    fn containers(&self) -> Vec<String> {
        self.podman
            .podman(&[
                "ps",
                "--filter",
                &format!("label=com.docker.compose.project={}", self.name),
                "--format",
                "{{.Names}}",
            ])
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn inspect(&self, service: &str, format: &str) -> String {
        self.podman
            .podman(&["inspect", "--format", format, &self.container(service)])
    }
}

impl Drop for Project<'_> {
    fn drop(&mut self) {
        // A service and the relay in its network namespace can be removed in the wrong order
        // once (podman refuses: "in use"); the second pass removes what is left.
        for _ in 0..3 {
            let _ = self
                .compose()
                .args(["down", "--volumes", "--timeout", "20"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let left = self
                .podman
                .command()
                .args(["ps", "--all", "--quiet", "--filter"])
                .arg(format!("label=com.docker.compose.project={}", self.name))
                .output();
            if left.is_ok_and(|o| o.stdout.is_empty()) {
                break;
            }
        }
    }
}

/// The healthcheck thread, stopped and joined when dropped (a failing test included).
struct Pump {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Pump {
    fn start(podman: &Podman, project: &str) -> Pump {
        let stop = Arc::new(AtomicBool::new(false));
        let podman = Podman {
            conf: podman.conf.clone(),
            socket: podman.socket.clone(),
            service: None,
        };
        let (flag, project) = (stop.clone(), project.to_string());
        let thread = std::thread::spawn(move || healthcheck_pump(&podman, &project, flag));
        Pump {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Pump {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs the healthcheck of every running container of the project each second (what
/// podman's systemd timers would do).
fn healthcheck_pump(podman: &Podman, project: &str, stop: Arc<AtomicBool>) {
    let label = format!("label=com.docker.compose.project={project}");
    while !stop.load(Ordering::Relaxed) {
        let names = podman
            .command()
            .args(["ps", "--filter", &label, "--format", "{{.Names}}"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for name in names.lines() {
            let _ = podman
                .command()
                .args(["healthcheck", "run", name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Copies the binaries into `ctx/.prebuilt/`, stripped (the images need no debug info).
/// They are the workspace's binaries as built for the checks ([`repo_checks::binaries`]).
fn stage_binaries(ctx: &Path) {
    let out = ctx.join(".prebuilt");
    std::fs::create_dir_all(&out).unwrap();
    for binary in ["cdc-relay", "chat-service", "migrate", "healthcheck"] {
        let to = out.join(binary);
        std::fs::copy(repo_checks::binary(binary), &to).unwrap();
        run(Command::new("strip").arg(&to));
    }
}

fn mint(secrets: &Path, args: &[&str]) -> String {
    stdout(&run(Command::new(repo_checks::binary("chat-token"))
        .arg("--key")
        .arg(secrets.join("idp/key.pem"))
        .args(["mint", "--issuer", "http://localhost/local-idp"])
        .args(args)))
}

async fn ready(addr: SocketAddr) -> Result<(), String> {
    match testkit::http::get(addr, "/readyz").await {
        Ok((200, _)) => Ok(()),
        Ok((status, body)) => Err(format!("{status} {body}")),
        Err(e) => Err(e.to_string()),
    }
}

/// The bodies of chat 7's messages from `sender`, oldest first, as `reader` sees them.
async fn bodies_from(addr: SocketAddr, reader: &str, sender: &str) -> Result<Vec<String>, String> {
    let (name, value) = crate::support::bearer(reader);
    let reply = testkit::http::request(addr, "GET", "/chats/7/messages", &[(name, &value)], "")
        .await
        .map_err(|e| e.to_string())?;
    if reply.status != 200 {
        return Err(format!("{} {}", reply.status, reply.body));
    }
    let messages: Vec<serde_json::Value> = reply.json()["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    Ok(messages
        .iter()
        .filter(|m| m["sender"] == sender)
        .filter_map(|m| m["body"].as_str().map(str::to_string))
        .collect())
}

/// Waits until `addr` shows exactly `expected` from `sender`, in that order.
async fn shows_exactly(
    project: &Project<'_>,
    addr: SocketAddr,
    reader: &str,
    sender: &str,
    expected: &[String],
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = bodies_from(addr, reader, sender).await;
        match &got {
            Ok(got) if got == expected => return,
            // More than sent, or out of order, never becomes right: stop at once.
            Ok(got) => assert!(
                got.len() <= expected.len() && expected.starts_with(got),
                "shown {got:?}, sent {expected:?}"
            ),
            Err(_) => {}
        }
        assert!(
            Instant::now() < deadline,
            "{addr} did not show the {} messages of {sender} within 60 s; last seen: {got:?}\n{}",
            expected.len(),
            project.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

struct Users {
    alice: String,
    bob: String,
}

impl Users {
    /// Three messages each way, each answered 201; what was sent is appended to the lists.
    async fn send_round(
        &self,
        round: &str,
        addr: impl Fn(usize) -> SocketAddr,
        from_alice: &mut Vec<String>,
        from_bob: &mut Vec<String>,
    ) {
        for i in 0..3 {
            let (a, b) = (format!("{round} alice {i}"), format!("{round} bob {i}"));
            let sent = crate::support::send_as(addr(0), &self.alice, 7, &a).await;
            assert_eq!(sent.status, 201, "{}", sent.body);
            let sent = crate::support::send_as(addr(1), &self.bob, 7, &b).await;
            assert_eq!(sent.status, 201, "{}", sent.body);
            from_alice.push(a);
            from_bob.push(b);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_runs_under_podman_and_a_relay_or_redis_restart_loses_nothing() {
    let dir = testkit::scratch_dir("containers");
    let started = Instant::now();
    run(&mut Command::new(
        repo().join("deploy/images/build-bases.sh"),
    ));
    eprintln!("base images ready after {:?}", started.elapsed());

    let podman = Podman::start(&dir);
    // Our own tag, so a developer's `local` images are left alone; removed at the end.
    let tag = format!("test-{}", std::process::id());
    let _images = Images {
        podman: &podman,
        names: ["cdc-relay", "chat-service", "migrate"]
            .map(|t| format!("localhost/outbox/{t}:{tag}"))
            .to_vec(),
    };
    let ctx = dir.join("context");
    stage_binaries(&ctx);
    for target in ["cdc-relay", "chat-service", "migrate"] {
        let dockerfile = repo().join("Dockerfile");
        run(podman.command().args([
            "build",
            "--quiet",
            "--file",
            dockerfile.to_str().unwrap(),
            "--target",
            target,
            "--build-arg",
            "BINARIES=prebuilt",
            "--build-arg",
            "RUNTIME_BASE=localhost/outbox/runtime:bookworm",
            "--tag",
            &format!("localhost/outbox/{target}:{tag}"),
            ctx.to_str().unwrap(),
        ]));
        let size = podman.podman(&[
            "image",
            "inspect",
            "--format",
            "{{.Size}}",
            &format!("localhost/outbox/{target}:{tag}"),
        ]);
        eprintln!("image {target}: {size} bytes");
    }
    eprintln!("images built after {:?}", started.elapsed());

    let secrets = dir.join("secrets");
    run(Command::new(repo().join("deploy/make-secrets.sh"))
        .env("CONTAINER_READABLE", "1")
        .arg(&secrets)
        .args(["postgres", "redis", "localhost"]));
    let port_names = [
        "CONSUMERS_PORT",
        "WORKERS_PORT",
        "CONSUMERS_ADMIN",
        "WORKERS_ADMIN",
        "CONSUMERS_RELAY_ADMIN",
        "WORKERS_RELAY_ADMIN",
    ];
    let ports: Vec<u16> = port_names
        .iter()
        .map(|_| testkit::http::free_port())
        .collect();
    let addr = |i: usize| SocketAddr::from(([127, 0, 0, 1], ports[i]));
    let mut env: Vec<(String, String)> = port_names
        .iter()
        .zip(&ports)
        .map(|(name, port)| (name.to_string(), port.to_string()))
        .collect();
    env.extend([
        ("OUTBOX_SECRETS".into(), secrets.display().to_string()),
        // The images this run built, not whatever `local` ones the machine has.
        ("OUTBOX_TAG".into(), tag.clone()),
        (
            "POSTGRES_IMAGE".into(),
            "localhost/outbox/postgres:15".into(),
        ),
        ("REDIS_IMAGE".into(), "localhost/outbox/redis:7".into()),
    ]);
    let project = Project {
        podman: &podman,
        name: format!("outbox-ct-{}", std::process::id()),
        env,
    };

    let _pump = Pump::start(&podman, &project.name);
    let up_started = Instant::now();
    let mut up = project.compose();
    up.args(["up", "--detach", "--no-build"]);
    let up = ChildProcess::spawn("compose-up", up, &dir.join("compose-up.log")).unwrap();
    let status = up.wait_exit(Duration::from_secs(300));
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "compose up: {status:?}\n{}\n{}",
        up.log(),
        project.logs()
    );
    for (i, what) in [
        (2, "consumers"),
        (3, "workers"),
        (4, "consumers relay"),
        (5, "workers relay"),
    ] {
        wait_until(Duration::from_secs(120), &format!("{what} ready"), || {
            ready(addr(i))
        })
        .await;
        eprintln!("{what} ready {:?} after compose up", up_started.elapsed());
    }

    // The images as built: the unprivileged user, a read-only root, a healthcheck that passes.
    for service in ["consumers", "consumers-relay", "workers", "workers-relay"] {
        assert_eq!(project.inspect(service, "{{.Config.User}}"), "65532:65532");
        assert_eq!(
            project.inspect(service, "{{.HostConfig.ReadonlyRootfs}}"),
            "true"
        );
        run(podman
            .command()
            .args(["healthcheck", "run", &project.container(service)]));
    }

    // Each side has its audience, and its admins theirs.
    let (alice, bob) = (
        mint(
            &secrets,
            &["--audience", "chat-consumers", "--sub", "alice"],
        ),
        mint(&secrets, &["--audience", "chat-workers", "--sub", "bob"]),
    );
    for (side, user, name) in [(0, "alice", "consumers"), (1, "bob", "workers")] {
        let admin = mint(
            &secrets,
            &[
                "--audience",
                &format!("chat-{name}-admin"),
                "--sub",
                "ops",
                "--scope",
                "chat:admin",
                "--ttl",
                "10m",
            ],
        );
        let (name, value) = crate::support::bearer(&admin);
        let reply = testkit::http::request(
            addr(side),
            "PUT",
            &format!("/chats/7/members/{user}"),
            &[(name, &value)],
            "",
        )
        .await
        .unwrap();
        assert!(matches!(reply.status, 200 | 201), "{}", reply.body);
    }

    let users = Users { alice, bob };
    let (mut from_alice, mut from_bob) = (Vec::new(), Vec::new());
    users
        .send_round("first", addr, &mut from_alice, &mut from_bob)
        .await;
    shows_exactly(&project, addr(1), &users.bob, "alice", &from_alice).await;
    shows_exactly(&project, addr(0), &users.alice, "bob", &from_bob).await;
    eprintln!(
        "a message crossed each way {:?} after compose up",
        up_started.elapsed()
    );

    // The consumers' relay stopped (SIGTERM) and started again on the same slot, then Redis
    // stopped and started on its append-only file, each with messages written meanwhile.
    for service in ["consumers-relay", "redis"] {
        run(project.compose().args(["stop", "--timeout", "30", service]));
        users
            .send_round(
                &format!("{service} down"),
                addr,
                &mut from_alice,
                &mut from_bob,
            )
            .await;
        run(project.compose().args(["start", service]));
        users
            .send_round(
                &format!("{service} back"),
                addr,
                &mut from_alice,
                &mut from_bob,
            )
            .await;
        shows_exactly(&project, addr(1), &users.bob, "alice", &from_alice).await;
        shows_exactly(&project, addr(0), &users.alice, "bob", &from_bob).await;
    }
    wait_until(
        Duration::from_secs(60),
        "every container ready again",
        || async {
            for i in 2..6 {
                ready(addr(i)).await?;
            }
            Ok(())
        },
    )
    .await;
    assert_eq!(
        project.containers().len(),
        6,
        "postgres, redis, two services, two relays"
    );
    // The relays read their streams' consumer groups as the ACL users of
    // deploy/redis/users.acl allow (the other tests' Redis has no ACLs).
    wait_until(
        Duration::from_secs(60),
        "both relays' stream gauges",
        || async {
            for i in [4, 5] {
                let (_, metrics) = testkit::http::get(addr(i), "/metrics")
                    .await
                    .map_err(|e| e.to_string())?;
                let up = testkit::http::metric_value(&metrics, "cdc_relay_stream_up");
                if up != Some(1.0) || !metrics.contains("cdc_relay_stream_group_lag_entries{") {
                    let stream_lines: Vec<&str> = metrics
                        .lines()
                        .filter(|l| {
                            l.starts_with("cdc_relay_stream") || l.starts_with("cdc_relay_state")
                        })
                        .collect();
                    return Err(format!(
                        "relay {i}: cdc_relay_stream_up {up:?}: {stream_lines:?}"
                    ));
                }
            }
            Ok(())
        },
    )
    .await;
}
