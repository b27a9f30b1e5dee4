//! A whole chat system for tests: a database with the migrations, a Redis of the test's
//! own, both relays in-process, and both services in-process or as real processes.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use cdc_relay::Relay;
use chat_services::{Service, Side};
use clap::Parser;
use testkit::{ChildProcess, PgServer, RedisCluster, RedisServer, TestDb};
use tokio_util::sync::CancellationToken;

type RunningRelay = (
    Relay,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), cdc_relay::RelayError>>,
);

pub(crate) struct Stack<'a> {
    pub pg: &'a PgServer,
    pub db: TestDb,
    /// The single Redis, unless the stack runs on `cluster`.
    redis: Option<RedisServer>,
    pub cluster: Option<RedisCluster>,
    /// Shards of each side's stream.
    pub shards: u32,
    relays: Vec<RunningRelay>,
}

impl<'a> Stack<'a> {
    /// Database, Redis, and a running relay for each side.
    pub(crate) async fn start(pg: &'a PgServer) -> Stack<'a> {
        Self::start_sharded(pg, 1).await
    }

    /// The same, with both sides' streams split into `shards` shards.
    pub(crate) async fn start_sharded(pg: &'a PgServer, shards: u32) -> Stack<'a> {
        let redis = RedisServer::start().expect("redis");
        Self::start_on(pg, shards, Some(redis), None).await
    }

    /// The same on a Redis Cluster (3 masters, 1 replica each); relays wait for a replica
    /// to acknowledge each batch.
    pub(crate) async fn start_cluster(pg: &'a PgServer, shards: u32) -> Stack<'a> {
        let cluster = RedisCluster::start().expect("redis cluster");
        Self::start_on(pg, shards, None, Some(cluster)).await
    }

    async fn start_on(
        pg: &'a PgServer,
        shards: u32,
        redis: Option<RedisServer>,
        cluster: Option<RedisCluster>,
    ) -> Stack<'a> {
        let db = pg.create_database().await.expect("test database");
        let mut stack = Stack {
            pg,
            db,
            redis,
            cluster,
            shards,
            relays: Vec::new(),
        };
        for side in [Side::Consumers, Side::Workers] {
            stack.start_relay(side).await;
        }
        stack
    }

    /// The single Redis (a stack on a cluster has none).
    pub(crate) fn redis(&self) -> &RedisServer {
        self.redis
            .as_ref()
            .expect("a single Redis (this stack runs on a cluster)")
    }

    /// `--redis-url` and, on a cluster, `--redis-cluster` (every node named, so a process
    /// starting while one is down finds the others).
    fn redis_flags(&self) -> Vec<String> {
        match &self.cluster {
            Some(cluster) => cluster.client_flags(),
            None => vec!["--redis-url".into(), self.redis().url()],
        }
    }

    /// A connection to the stack's Redis, single or cluster.
    pub(crate) async fn redis_conn(&self) -> outbox_core::connect::RedisConn {
        let flags = self.redis_flags();
        outbox_core::connect::redis_target(
            &flags[1],
            self.cluster.is_some(),
            None,
            None,
            "--redis-url",
            Duration::from_secs(5),
        )
        .expect("redis target")
        .connect(Duration::from_secs(5))
        .await
        .expect("redis")
    }

    fn relay_args(&self, side: Side) -> cdc_relay::cli::RunArgs {
        let mut argv = vec![
            "cdc-relay".to_string(),
            "run".into(),
            "--database-url".into(),
            self.db.url(&format!("{side}_relay")),
            "--slot".into(),
            format!("{}_{side}", self.db.name),
            "--publication".into(),
            format!("{side}_outbox"),
            "--outbox-table".into(),
            format!("{side}.outbox"),
            "--stream".into(),
            side.outbox_stream(),
            "--stream-shards".into(),
            self.shards.to_string(),
            "--admin-addr".into(),
            "".into(),
            "--reconnect-max-backoff".into(),
            "300ms".into(),
        ];
        argv.extend(self.redis_flags());
        if self.cluster.is_some() {
            // A master's failover cannot lose what a replica acknowledged.
            argv.extend(["--redis-wait-replicas".into(), "1".into()]);
        }
        match cdc_relay::cli::Cli::try_parse_from(argv)
            .expect("relay flags")
            .command
        {
            cdc_relay::cli::Command::Run(args) => args,
            _ => unreachable!(),
        }
    }

    /// Panics at once, with the relay's own error, if a relay stopped: a relay stopped for
    /// good stalls delivery, which a wait would otherwise report only as a timeout.
    pub(crate) fn assert_relays_running(&self) {
        for (relay, _, task) in &self.relays {
            let status = relay.status().borrow().clone();
            assert!(
                status.role != cdc_relay::Role::Failed && !task.is_finished(),
                "a relay stopped: role {:?}, last error {:?}",
                status.role,
                status.last_error
            );
        }
    }

    async fn start_relay(&mut self, side: Side) {
        let args = self.relay_args(side);
        cdc_relay::setup(
            &args.connection.postgres().unwrap(),
            Duration::from_secs(10),
        )
        .await
        .expect("relay slot");
        let relay = Relay::new(args.validate().unwrap());
        let token = CancellationToken::new();
        let task = {
            let (relay, token) = (relay.clone(), token.clone());
            tokio::spawn(async move { relay.run(token).await })
        };
        // Streaming, and the stream caught up from the (empty) outbox: `setup` here writes no
        // record, so a relay's first session compares the table with the stream.
        let mut status = relay.status();
        tokio::time::timeout(
            Duration::from_secs(30),
            status.wait_for(|s| s.role == cdc_relay::Role::Streaming && s.behind_shards.is_empty()),
        )
        .await
        .expect("relay streaming within 30 s")
        .expect("relay status");
        self.relays.push((relay, token, task));
    }

    /// Entries of `stream` delivered to `group` and not yet acknowledged.
    pub(crate) async fn pending(&self, stream: &str, group: &str) -> usize {
        let mut redis = self.redis_conn().await;
        let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .query_async(&mut redis)
            .await
            .unwrap();
        pending.count()
    }

    /// Entries in Workers' dead-letter streams (one per shard).
    pub(crate) async fn dead_letters(&self) -> usize {
        let mut redis = self.redis_conn().await;
        let mut total = 0;
        for stream in outbox_core::stream::shard_keys("deadletter:workers", self.shards) {
            let n: usize = redis::cmd("XLEN")
                .arg(&stream)
                .query_async(&mut redis)
                .await
                .unwrap();
            total += n;
        }
        total
    }

    /// The single `count(*)` a query returns.
    pub(crate) async fn count(&self, sql: &str) -> i64 {
        let db = self.db.connect().await.unwrap();
        db.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// The service's flags (`extra` appended).
    pub(crate) fn service_args(&self, side: Side, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--side".into(),
            side.as_str().into(),
            "--database-url".into(),
            self.db.url(side.as_str()),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--admin-addr".into(),
            "127.0.0.1:0".into(),
            "--consumer-name".into(),
            format!("{side}-test"),
            "--lease-ttl".into(),
            "3s".into(),
            "--stream-shards".into(),
            self.shards.to_string(),
        ];
        args.extend(self.redis_flags());
        // The older tests predate identities: anonymous unless a test configures tokens.
        if !extra.contains(&"--jwks-file") && !extra.contains(&"--jwks-url") {
            args.push("--allow-anonymous=true".into());
        }
        // A flag given again in `extra` replaces the default's value (clap takes each once).
        let mut rest = extra.iter();
        while let Some(flag) = rest.next() {
            match args.iter().position(|a| a == flag) {
                Some(i) if flag.starts_with("--") && i + 1 < args.len() => {
                    if let Some(value) = rest.next() {
                        args[i + 1] = value.to_string();
                    }
                }
                _ => args.push(flag.to_string()),
            }
        }
        args
    }

    /// Start a service in-process.
    pub(crate) async fn service(&self, side: Side, extra: &[&str]) -> RunningService {
        self.service_with(self.service_args(side, extra)).await
    }

    /// Start a service in-process with exactly these flags.
    pub(crate) async fn service_with(&self, args: Vec<String>) -> RunningService {
        let mut argv = vec!["chat-service".to_string()];
        argv.extend(args);
        let config = chat_services::Cli::try_parse_from(argv)
            .expect("service flags")
            .validate()
            .expect("valid");
        let shutdown = CancellationToken::new();
        let service = Service::bind(config, shutdown.clone()).await.expect("bind");
        let addr = service.local_addr();
        let admin = service.admin_addr().expect("admin listener");
        let mut status = service.consumer_status();
        let task = tokio::spawn(service.run());
        testkit::wait_until(Duration::from_secs(20), "inbox consumer active", || {
            let s = status.borrow_and_update().clone();
            async move {
                if s.role == chat_services::ConsumerRole::Active {
                    Ok(())
                } else {
                    Err(format!("{s:?}"))
                }
            }
        })
        .await;
        RunningService {
            addr,
            admin,
            shutdown,
            task: Some(task),
        }
    }

    /// Start a service binary as a process on a free port; waits until it is ready.
    pub(crate) async fn service_process(
        &self,
        side: Side,
        name: &str,
        extra: &[&str],
    ) -> ServiceProcess {
        self.service_process_under(side, name, extra, &[]).await
    }

    /// A service process that stands by (another instance holds the inbox lease): waits
    /// until it answers /readyz.
    pub(crate) async fn service_process_standby(
        &self,
        side: Side,
        name: &str,
        extra: &[&str],
    ) -> ServiceProcess {
        let process = self.spawn_service(side, name, extra, &[]);
        testkit::wait_until(Duration::from_secs(30), "service ready", || async {
            match testkit::http::get(process.admin, "/readyz").await {
                Ok((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
        process
    }

    /// Same, run through `wrapper` (a command that execs the rest, such as `prlimit`).
    pub(crate) async fn service_process_under(
        &self,
        side: Side,
        name: &str,
        extra: &[&str],
        wrapper: &[&str],
    ) -> ServiceProcess {
        let process = self.spawn_service(side, name, extra, wrapper);
        process.wait_consuming().await;
        process
    }

    /// Start a service process and return at once (it may die before it is ready).
    pub(crate) fn spawn_service(
        &self,
        side: Side,
        name: &str,
        extra: &[&str],
        wrapper: &[&str],
    ) -> ServiceProcess {
        let port = testkit::http::free_port();
        let listen = format!("127.0.0.1:{port}");
        let admin = format!("127.0.0.1:{}", testkit::http::free_port());
        // Each process its own consumer (lease holder) name unless `extra` names one.
        let named: Vec<&str> = ["--consumer-name", name]
            .into_iter()
            .chain(extra.iter().copied())
            .collect();
        let mut args = self.service_args(side, &named);
        let i = args.iter().position(|a| a == "127.0.0.1:0").unwrap();
        args[i] = listen.clone();
        let a = args.iter().position(|a| a == "--admin-addr").unwrap() + 1;
        args[a] = admin.clone();
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut cmd = Command::new(program);
                cmd.args(rest).arg(env!("CARGO_BIN_EXE_chat-service"));
                cmd
            }
            None => Command::new(env!("CARGO_BIN_EXE_chat-service")),
        };
        cmd.args(args).env("RUST_LOG", "info");
        let log = testkit::scratch_dir("service-log").join(format!("{name}.log"));
        let child = ChildProcess::spawn(name, cmd, &log).expect("spawn chat-service");
        ServiceProcess {
            child,
            addr: listen.parse().unwrap(),
            admin: admin.parse().unwrap(),
        }
    }

    pub(crate) async fn stop(mut self) {
        for (_, token, task) in self.relays.drain(..) {
            token.cancel();
            let _ = task.await;
        }
    }
}

pub(crate) struct RunningService {
    pub addr: SocketAddr,
    /// /healthz, /readyz, /metrics.
    pub admin: SocketAddr,
    shutdown: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl RunningService {
    pub(crate) async fn stop(mut self) {
        self.shutdown.cancel();
        let _ = self.task.take().unwrap().await;
    }
}

impl Drop for RunningService {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub(crate) struct ServiceProcess {
    pub child: ChildProcess,
    pub addr: SocketAddr,
    /// /healthz, /readyz, /metrics.
    pub admin: SocketAddr,
}

impl ServiceProcess {
    /// Until /readyz says the inbox consumer is active.
    pub(crate) async fn wait_consuming(&self) {
        testkit::wait_until(Duration::from_secs(30), "service consuming", || async {
            match testkit::http::get(self.admin, "/readyz").await {
                Ok((200, body)) if body.contains("\"consumer\":\"active\"") => Ok(()),
                other => Err(format!("{other:?}; exited: {:?}", self.child.try_status())),
            }
        })
        .await
    }
}

/// Send `body` to chat `chat_id` on the service at `addr`; returns the message JSON.
pub(crate) async fn send(addr: SocketAddr, chat_id: i64, body: &str) -> serde_json::Value {
    let reply = testkit::http::post_json(
        addr,
        &format!("/chats/{chat_id}/messages"),
        &serde_json::json!({"body": body}),
        &[],
    )
    .await
    .expect("POST");
    assert_eq!(reply.status, 201, "{}", reply.body);
    reply.json()
}

/// The next `message` event's data as JSON, or a panic after `timeout`.
pub(crate) async fn next_message(
    client: &mut testkit::http::SseClient,
    timeout: Duration,
) -> (String, serde_json::Value) {
    let event = client.next(timeout).await.expect("an SSE message in time");
    assert_eq!(event.event, "message");
    (
        event.id.expect("SSE id"),
        serde_json::from_str(&event.data).expect("JSON data"),
    )
}

/// Append an entry to `stream` with the id right after its top, as the relay would (an
/// automatic `*` id would jump past the relay's LSN-based ids and stop it).
pub(crate) async fn append_after_top(
    redis: &testkit::RedisServer,
    stream: &str,
    fields: &[(&str, &str)],
) -> String {
    let mut conn = redis.connect().await.unwrap();
    let info: redis::streams::StreamInfoStreamReply = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query_async(&mut conn)
        .await
        .unwrap();
    let (ms, seq) = info.last_generated_id.split_once('-').unwrap();
    let id = format!("{ms}-{}", seq.parse::<u64>().unwrap() + 1);
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg(&id);
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query_async::<String>(&mut conn).await.unwrap()
}

/// A browser tab on one chat: an SSE stream from the start of the feed that reconnects
/// with its Last-Event-ID whenever the stream ends (like EventSource), recording the id of
/// every message it was shown, in order.
pub(crate) struct Viewer {
    pub name: String,
    shown: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Viewer {
    pub(crate) fn start(name: &str, addr: SocketAddr, chat_id: i64) -> Self {
        Self::start_balanced(name, &[addr], chat_id)
    }

    /// A tab behind a load balancer: each reconnect goes to the next of `addrs`.
    pub(crate) fn start_balanced(name: &str, addrs: &[SocketAddr], chat_id: i64) -> Self {
        let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let addrs = addrs.to_vec();
        let task = tokio::spawn({
            let shown = shown.clone();
            async move {
                let path = format!("/chats/{chat_id}/events?after=p0");
                let mut last: Option<String> = None;
                for addr in addrs.iter().cycle() {
                    let Ok(mut client) =
                        testkit::http::SseClient::connect(*addr, &path, last.as_deref()).await
                    else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    loop {
                        match client.next(Duration::from_millis(500)).await {
                            Some(event) => {
                                let message: serde_json::Value =
                                    serde_json::from_str(&event.data).expect("JSON data");
                                shown
                                    .lock()
                                    .unwrap()
                                    .push(message["id"].as_str().unwrap().to_string());
                                last = event.id;
                            }
                            None if client.is_closed() => break,
                            None => {}
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        Self {
            name: name.to_string(),
            shown,
            task,
        }
    }

    pub(crate) fn shown(&self) -> Vec<String> {
        self.shown.lock().unwrap().clone()
    }

    /// Wait until the tab shows as many messages as `side`'s feed of the chat holds, then
    /// assert it shows exactly that feed: every message once, in feed order.
    pub(crate) async fn assert_shows_feed(&self, db: &TestDb, side: Side, chat_id: i64) {
        let feed = feed(db, side, chat_id).await;
        testkit::wait_until(
            Duration::from_secs(30),
            &format!(
                "{} showing the {} messages of the feed",
                self.name,
                feed.len()
            ),
            || async {
                let n = self.shown().len();
                if n >= feed.len() {
                    Ok(())
                } else {
                    Err(format!("{n} shown"))
                }
            },
        )
        .await;
        let shown = self.shown();
        let missing: Vec<_> = feed.iter().filter(|id| !shown.contains(id)).collect();
        assert_eq!(
            shown,
            feed,
            "{}: must show the feed once, in order ({} missing)",
            self.name,
            missing.len()
        );
    }
}

impl Drop for Viewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Chat `chat_id` as `side` shows it: message ids of sent and received, in feed order.
pub(crate) async fn feed(db: &TestDb, side: Side, chat_id: i64) -> Vec<String> {
    db.connect()
        .await
        .unwrap()
        .query(
            &format!(
                "SELECT id::text FROM (
                   SELECT id, pos FROM {side}.messages WHERE chat_id = $1
                   UNION ALL
                   SELECT message_id, pos FROM {side}.inbox WHERE chat_id = $1) f
                 ORDER BY pos"
            ),
            &[&chat_id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Every message `from` sent to `chat` is in the other side's inbox once, in the order it
/// was sent (the chat's feed order on the sending side).
pub(crate) async fn assert_received_in_sent_order(stack: &Stack<'_>, from: Side, chat: i64) {
    stack.assert_relays_running();
    let db = stack.db.connect().await.unwrap();
    let to = from.other();
    let ids = |sql: String| {
        let db = &db;
        async move {
            db.query(&sql, &[&chat])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
        }
    };
    let sent = ids(format!(
        "SELECT id::text FROM {from}.messages WHERE chat_id = $1 ORDER BY pos"
    ))
    .await;
    testkit::wait_until(
        Duration::from_secs(60),
        &format!(
            "chat {chat}: all {} messages from {from} received",
            sent.len()
        ),
        || async {
            stack.assert_relays_running();
            let n = stack
                .count(&format!(
                    "SELECT count(*) FROM {to}.inbox WHERE chat_id = {chat}"
                ))
                .await as usize;
            if n >= sent.len() {
                Ok(())
            } else {
                Err(format!("{n} received"))
            }
        },
    )
    .await;
    let received = ids(format!(
        "SELECT message_id::text FROM {to}.inbox WHERE chat_id = $1 ORDER BY pos"
    ))
    .await;
    assert_eq!(received, sent, "chat {chat}: received once, in sent order");
}

/// The team's identity provider, as the services see it: a signing key (P-256, from
/// rcgen), the JWKS file the services verify with, and tokens for any user.
pub(crate) struct Idp {
    keys: Vec<chat_services::token::SigningKey>,
    minted: usize,
    pub(crate) jwks: std::path::PathBuf,
}

pub(crate) const ISSUER: &str = "https://id.test.invalid/";
pub(crate) const AUDIENCE: &str = "chat";

impl Idp {
    pub(crate) fn new() -> Self {
        let jwks = testkit::scratch_dir("idp").join("jwks.json");
        let mut idp = Self {
            keys: Vec::new(),
            minted: 0,
            jwks,
        };
        idp.rotate();
        idp
    }

    /// A new signing key (the newest signs from now on), published beside the old ones.
    pub(crate) fn rotate(&mut self) {
        let pem = rcgen::KeyPair::generate().unwrap().serialize_pem();
        self.minted += 1;
        let kid = format!("key-{}", self.minted);
        self.keys
            .push(chat_services::token::SigningKey::from_pem(pem.as_bytes(), &kid).unwrap());
        self.publish();
    }

    /// Stop publishing the oldest key (as after a compromise), written over the file in
    /// place (as an editor or `kubectl cp` would), not renamed.
    pub(crate) fn withdraw_oldest(&mut self) {
        self.keys.remove(0);
        let keys: Vec<_> = self.keys.iter().collect();
        std::fs::write(&self.jwks, chat_services::token::jwks(&keys).unwrap()).unwrap();
    }

    fn publish(&self) {
        let keys: Vec<_> = self.keys.iter().collect();
        // Written whole, then renamed, as a provider's sync job would.
        let tmp = self.jwks.with_extension("tmp");
        std::fs::write(&tmp, chat_services::token::jwks(&keys).unwrap()).unwrap();
        std::fs::rename(&tmp, &self.jwks).unwrap();
    }

    fn newest(&self) -> &chat_services::token::SigningKey {
        self.keys.last().unwrap()
    }

    /// A token for `user`, valid for an hour.
    pub(crate) fn token(&self, user: &str) -> String {
        self.token_for(user, Duration::from_secs(3600), None)
    }

    pub(crate) fn token_for(&self, user: &str, ttl: Duration, scope: Option<&str>) -> String {
        self.newest()
            .mint(ISSUER, AUDIENCE, user, ttl, scope)
            .unwrap()
    }

    /// A token that may manage members.
    pub(crate) fn admin(&self) -> String {
        self.token_for("admin", Duration::from_secs(3600), Some("chat:admin"))
    }

    /// Token claims signed as given (for expired, foreign and malformed tokens).
    pub(crate) fn sign(&self, claims: serde_json::Value) -> String {
        self.newest().sign(&claims).unwrap()
    }

    /// The service flags that verify this provider's tokens.
    pub(crate) fn flags(&self) -> Vec<String> {
        vec![
            "--jwks-file".into(),
            self.jwks.display().to_string(),
            "--jwt-issuer".into(),
            ISSUER.into(),
            "--jwt-audience".into(),
            AUDIENCE.into(),
            "--jwt-leeway".into(),
            "0s".into(),
        ]
    }
}

/// `Authorization: Bearer <token>`.
pub(crate) fn bearer(token: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {token}"))
}

/// Make `user` a member of `chat_id` on the service at `addr` (with an admin token).
pub(crate) async fn add_member(addr: SocketAddr, idp: &Idp, chat_id: i64, user: &str) {
    let (name, value) = bearer(&idp.admin());
    let reply = testkit::http::request(
        addr,
        "PUT",
        &format!("/chats/{chat_id}/members/{user}"),
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert!(matches!(reply.status, 200 | 201), "{}", reply.body);
}

/// Send `body` to chat `chat_id` as the holder of `token`; the reply.
pub(crate) async fn send_as(
    addr: SocketAddr,
    token: &str,
    chat_id: i64,
    body: &str,
) -> testkit::http::Reply {
    let (name, value) = bearer(token);
    testkit::http::post_json(
        addr,
        &format!("/chats/{chat_id}/messages"),
        &serde_json::json!({"body": body}),
        &[(name, &value)],
    )
    .await
    .unwrap()
}

/// The resident memory of process `pid`, in MiB.
pub(crate) fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb / 1024.0
}
