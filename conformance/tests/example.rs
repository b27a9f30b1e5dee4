//! The example Node service (`examples/node-inbox`, built by `deploy/install-deps.sh`) against
//! real Postgres, Redis and the relay: the chat's messages land in its inbox table once
//! each, in order per chat, through a SIGKILL; its page's stream sends each once, and a page
//! that reconnects with the last id it got misses none; a poison message is dead-lettered;
//! a listener that is not loopback is refused at start.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use conformance::{tail, Settings, World};
use testkit::http::{free_port, get, SseClient};
use testkit::{ChildProcess, Signal};

use super::{node, relay, rust};

fn example_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/node-inbox/dist/main.js")
        .canonicalize()
        .expect("examples/node-inbox is not built: run deploy/install-deps.sh")
}

struct Example {
    schema: String,
    port: u16,
    logs: PathBuf,
}

impl Example {
    fn command(&self, world: &World, listen: &str) -> Command {
        let mut cmd = Command::new(node());
        cmd.arg(example_script())
            .env("DATABASE_URL", world.db.url("postgres"))
            .env("REDIS_URL", world.redis.url())
            .env("STREAM", &world.stream)
            .env("STREAM_SHARDS", world.shards.to_string())
            .env("GROUP", &world.group)
            .env("CONSUMER_NAME", "node-inbox-1")
            .env("INBOX_SCHEMA", &self.schema)
            .env("LISTEN", listen);
        cmd
    }

    /// Start it and wait until it answers.
    async fn start(&self, world: &World, run: u32) -> ChildProcess {
        let cmd = self.command(world, &format!("127.0.0.1:{}", self.port));
        let child = ChildProcess::spawn(
            &format!("node-inbox-{run}"),
            cmd,
            &self.logs.join(format!("node-inbox-{run}.log")),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", self.port).parse().unwrap();
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
    // GIVEN the relay publishing the chat's outbox into two shards, and the example consuming
    // it, its page open
    let world = World::start(rust(), &relay(), 2, Settings::default())
        .await
        .unwrap();
    let example = Example {
        schema: testkit::unique_name("node_inbox"),
        port: free_port(),
        logs: testkit::scratch_dir("node-inbox"),
    };
    let addr = format!("127.0.0.1:{}", example.port).parse().unwrap();
    let first = example.start(&world, 1).await;
    let mut page = SseClient::connect(addr, "/events", None).await.unwrap();

    // WHEN messages come (one of them poison)
    send(&world, 0..30, &[10]).await;

    // THEN the page gets each once, in order per chat, with increasing ids
    let before = receive(&mut page, 29, || tail(&first.log())).await;
    let mut sorted: Vec<String> = before.iter().map(|(_, b)| b.clone()).collect();
    sorted.sort();
    let mut expected = bodies(0..30, &[10]);
    expected.sort();
    assert_eq!(sorted, expected);
    assert!(before.windows(2).all(|w| w[0].0 < w[1].0), "{before:?}");
    assert_in_order_per_chat(&before);

    // WHEN the service is SIGKILLed, messages come while it is down, and it starts again
    first.kill().unwrap();
    send(&world, 30..60, &[]).await;
    let second = example.start(&world, 2).await;

    // THEN a page that reconnects with the last id it got receives exactly the rest
    let last = before.last().unwrap().0.to_string();
    let mut page = SseClient::connect(addr, "/events", Some(&last))
        .await
        .unwrap();
    let after = receive(&mut page, 30, || tail(&second.log())).await;
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
        "an event past the 59 messages"
    );

    // AND the table holds each message once, the poison one is dead-lettered with its reason,
    // and nothing is left pending
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
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (59, 59));
    let dead = world.dead_letters().await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0].get("reason").cloned().unwrap_or_default();
    assert!(reason.contains("'id' is not a UUID"), "{reason}");

    // WHEN it is stopped (SIGTERM) THEN it exits at once, cleanly
    let status = second
        .stop_with(Signal::Term, Duration::from_secs(15))
        .unwrap();
    assert!(status.success(), "{status:?}: {}", tail(&second.log()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_example_refuses_to_listen_beyond_loopback() {
    // GIVEN a world to consume
    let world = World::start(rust(), &relay(), 1, Settings::default())
        .await
        .unwrap();
    let example = Example {
        schema: testkit::unique_name("node_inbox"),
        port: free_port(),
        logs: testkit::scratch_dir("node-inbox"),
    };
    // WHEN it is told to listen on every address THEN it refuses at start, saying why
    let out = example
        .command(&world, &format!("0.0.0.0:{}", example.port))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no authentication"), "{stderr}");
}
