//! The example Node service (`examples/node-inbox`, built by `deploy/install-deps.sh`) against
//! real Postgres, Redis and the relay: two instances share the shards; the chat's messages
//! land in the inbox table once each, in order per chat, through a SIGKILL; a page on one
//! instance gets every message once, those the other recorded too, and a page that
//! reconnects with the last id it got misses none; a poison message is dead-lettered; a
//! listener that is not loopback, and a request naming another host, are refused.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use conformance::{tail, Settings, World};
use testkit::http::{free_port, get, SseClient};
use testkit::{wait_until, ChildProcess, Signal};

use super::{node, relay, rust};

fn example_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/node-inbox/dist/main.js")
        .canonicalize()
        .expect("examples/node-inbox is not built: run deploy/install-deps.sh")
}

struct Example {
    schema: String,
    logs: PathBuf,
}

impl Example {
    /// Its own schema and log directory.
    fn new() -> Self {
        Self {
            schema: testkit::unique_name("node_inbox"),
            logs: testkit::scratch_dir("node-inbox"),
        }
    }

    fn command(&self, world: &World, listen: &str, name: &str) -> Command {
        let mut cmd = Command::new(node());
        cmd.arg(example_script())
            .env("DATABASE_URL", world.db.url("postgres"))
            .env("REDIS_URL", world.redis.url())
            .env("STREAM", &world.stream)
            .env("STREAM_SHARDS", world.shards.to_string())
            .env("GROUP", &world.group)
            .env("CONSUMER_NAME", name)
            .env("INBOX_SCHEMA", &self.schema)
            .env("LISTEN", listen);
        cmd
    }

    /// Start instance `name` on `port` and wait until it answers.
    async fn start(&self, world: &World, name: &str, run: u32, port: u16) -> ChildProcess {
        let cmd = self.command(world, &format!("127.0.0.1:{port}"), name);
        let child = ChildProcess::spawn(
            &format!("{name}-{run}"),
            cmd,
            &self.logs.join(format!("{name}-{run}.log")),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok((200, _)) = get(addr, "/healthz").await {
                return child;
            }
            assert!(
                child.is_running() && Instant::now() < deadline,
                "the example did not answer: {}",
                tail(&child.log())
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Write chat messages `from..to` (chat `n % 3 + 1`), each in its own transaction as the
/// chat's service does; `poison` ones carry a payload that is no message.
async fn send(world: &World, rows: std::ops::Range<u32>, poison: &[u32]) {
    let client = world.db.connect().await.unwrap();
    for n in rows {
        let chat = i64::from(n % 3 + 1);
        let sql = if poison.contains(&n) {
            "INSERT INTO consumers.outbox (event, payload, partition_key)
             VALUES ('message.created', jsonb_build_object('id', 'not-a-uuid', 'body', $2::text), $1::bigint::text)"
        } else {
            "INSERT INTO consumers.outbox (event, payload, partition_key)
             VALUES ('message.created', jsonb_build_object('id', gen_random_uuid(), 'chat_id', $1::bigint,
                     'body', $2::text, 'created_at', now(), 'side', 'consumers', 'sender', 'alice'), $1::text)"
        };
        client
            .execute(sql, &[&chat, &format!("m{n}")])
            .await
            .unwrap();
    }
}

/// `n` events from the page's stream: (seq, body) each.
async fn receive(events: &mut SseClient, n: usize, log: impl Fn() -> String) -> Vec<(u64, String)> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(event) = events.next(left).await else {
            panic!("{} of {n} events; log:\n{}", got.len(), log());
        };
        let row: serde_json::Value = serde_json::from_str(&event.data).unwrap();
        let seq = row["seq"].as_u64().unwrap();
        assert_eq!(event.id.as_deref(), Some(seq.to_string().as_str()));
        got.push((seq, row["body"].as_str().unwrap().to_string()));
    }
    got
}

fn bodies(range: std::ops::Range<u32>, poison: &[u32]) -> Vec<String> {
    range
        .filter(|n| !poison.contains(n))
        .map(|n| format!("m{n}"))
        .collect()
}

/// Each chat's messages in the order they were sent (`m<n>`, n increasing).
fn assert_in_order_per_chat(got: &[(u64, String)]) {
    for chat in 0..3 {
        let ns: Vec<u32> = got
            .iter()
            .map(|(_, b)| b[1..].parse::<u32>().unwrap())
            .filter(|n| n % 3 == chat)
            .collect();
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "chat {}: {ns:?}",
            chat + 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_example_records_each_message_once_and_its_page_misses_none_across_a_kill() {
    // GIVEN the relay publishing the chat's outbox into two shards, two instances of the
    // example sharing them (each holds one), and a page open on the first
    let world = World::start(rust(), &relay(), 2, Settings::default())
        .await
        .unwrap();
    let example = Example::new();
    let (port, other_port) = (free_port(), free_port());
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let first = example.start(&world, "inbox-1", 1, port).await;
    let other = example.start(&world, "inbox-2", 1, other_port).await;
    wait_until(
        Duration::from_secs(30),
        "each instance holds a shard",
        || async {
            let holders = (world.lease_holder(0).await, world.lease_holder(1).await);
            match &holders {
                (Ok(Some(a)), Ok(Some(b))) if a != b => Ok(()),
                _ => Err(format!("{holders:?}")),
            }
        },
    )
    .await;
    let mut page = SseClient::connect(addr, "/events", None).await.unwrap();

    // WHEN messages come (one of them poison)
    send(&world, 0..30, &[10]).await;

    // THEN the page gets each once, those the other instance recorded too, in order per chat,
    // with increasing ids
    let logs = || format!("{}\n{}", tail(&first.log()), tail(&other.log()));
    let before = receive(&mut page, 29, &logs).await;
    let mut sorted: Vec<String> = before.iter().map(|(_, b)| b.clone()).collect();
    sorted.sort();
    let mut expected = bodies(0..30, &[10]);
    expected.sort();
    assert_eq!(sorted, expected);
    assert!(before.windows(2).all(|w| w[0].0 < w[1].0), "{before:?}");
    assert_in_order_per_chat(&before);

    // WHEN messages come only for a chat the other instance records
    let shard = if world.lease_holder(0).await.unwrap().as_deref() == Some("inbox-2") {
        0
    } else {
        1
    };
    // (chats 1 and 2 are in shards 0 and 1 of 2)
    let chat = [1i64, 2][shard];
    let client = world.db.connect().await.unwrap();
    for n in 0..5 {
        client
            .execute(
                "INSERT INTO consumers.outbox (event, payload, partition_key)
                 VALUES ('message.created', jsonb_build_object('id', gen_random_uuid(), 'chat_id', $1::bigint,
                         'body', $2::text, 'created_at', now(), 'side', 'consumers', 'sender', 'bob'), $1::text)",
                &[&chat, &format!("o{n}")],
            )
            .await
            .unwrap();
    }
    // THEN the page on the first instance shows them too (the other's commits wake it)
    let others = receive(&mut page, 5, &logs).await;
    let got: Vec<&str> = others.iter().map(|(_, b)| b.as_str()).collect();
    assert_eq!(got, ["o0", "o1", "o2", "o3", "o4"]);
    let before = [before, others].concat();

    // WHEN the first instance is SIGKILLed, messages come while it is down, and it starts again
    first.kill().unwrap();
    send(&world, 30..60, &[]).await;
    let first = example.start(&world, "inbox-1", 2, port).await;

    // THEN a page that reconnects to it with the last id it got receives exactly the rest
    let last = before.last().unwrap().0.to_string();
    let mut page = SseClient::connect(addr, "/events", Some(&last))
        .await
        .unwrap();
    let logs = || format!("{}\n{}", tail(&first.log()), tail(&other.log()));
    let after = receive(&mut page, 30, logs).await;
    let got: Vec<String> = after.iter().map(|(_, b)| b.clone()).collect();
    let mut sorted = got.clone();
    sorted.sort();
    let mut expected = bodies(30..60, &[]);
    expected.sort();
    assert_eq!(sorted, expected, "after the restart");
    assert!(after[0].0 > before.last().unwrap().0);
    assert_in_order_per_chat(&after);
    // (nothing more: no message twice)
    assert!(
        page.next(Duration::from_millis(500)).await.is_none(),
        "an event past the 64 messages"
    );

    // AND the table holds each message once, the poison one is dead-lettered with its reason
    let db = world.db.connect().await.unwrap();
    let row = db
        .query_one(
            &format!(
                "SELECT count(*), count(DISTINCT message_id) FROM {}.inbox",
                example.schema
            ),
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (64, 64));
    let dead = world.dead_letters().await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0].get("reason").cloned().unwrap_or_default();
    assert!(reason.contains("'id' is not a UUID"), "{reason}");

    // AND a request naming another host (a page of another site whose name was rebound to
    // loopback) is refused
    let (status, body) = get_with_host(addr, "/messages", "attacker.example:80").await;
    assert_eq!(status, 421, "{body}");

    // WHEN both are stopped (SIGTERM) THEN each exits at once, cleanly
    for instance in [first, other] {
        let status = instance
            .stop_with(Signal::Term, Duration::from_secs(15))
            .unwrap();
        assert!(status.success(), "{status:?}: {}", tail(&instance.log()));
    }
}

/// GET `path` with this `Host` header: (status, body).
async fn get_with_host(addr: std::net::SocketAddr, path: &str, host: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_example_refuses_to_listen_beyond_loopback() {
    // GIVEN a world to consume
    let world = World::start(rust(), &relay(), 1, Settings::default())
        .await
        .unwrap();
    let example = Example::new();
    // WHEN it is told to listen on every address THEN it refuses at start, saying why
    let out = example
        .command(&world, &format!("0.0.0.0:{}", free_port()), "inbox-1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no authentication"), "{stderr}");
}
