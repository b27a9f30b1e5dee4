//! What one user, or one client, may take: sends at a rate (429 with Retry-After), event
//! streams at once, a request body's arrival, and an answer's reading. Others are not
//! affected; memory stays bounded.

use std::time::{Duration, Instant};

use crate::support::{add_member, bearer, send_as, Idp, Stack};
use chat_services::Side;
use testkit::http::SseClient;
use testkit::{shared_postgres, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn flags(idp: &Idp, extra: &[&str]) -> Vec<String> {
    let mut flags = idp.flags();
    flags.extend(extra.iter().map(|s| s.to_string()));
    flags
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_sending_past_the_rate_gets_429_with_retry_after_and_others_do_not() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = flags(&idp, &["--send-rate", "0.2", "--send-burst", "3"]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    for user in ["alice", "bob"] {
        add_member(svc.addr, &idp, 1, user).await;
    }
    let alice = idp.token("alice");
    // A replay runs the whole statement too: it is charged like a send.
    let (name, value) = bearer(&alice);
    for replayed in [false, true] {
        let reply = testkit::http::post_json(
            svc.addr,
            "/chats/1/messages",
            &serde_json::json!({"body": "burst 0"}),
            &[(name, &value), ("idempotency-key", "k-0")],
        )
        .await
        .unwrap();
        assert_eq!(reply.status, 201, "{}", reply.body);
        assert_eq!(reply.header("idempotency-replayed").is_some(), replayed);
    }
    let reply = send_as(svc.addr, &alice, 1, "burst 1").await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    let refused = send_as(svc.addr, &alice, 1, "one too many").await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    let retry: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=5).contains(&retry), "Retry-After {retry}");
    assert!(refused.json()["error"].as_str().unwrap().contains("0.2/s"));
    // Bob's bucket is his own.
    let bob = send_as(svc.addr, &idp.token("bob"), 1, "bob is fine").await;
    assert_eq!(bob.status, 201, "{}", bob.body);
    // After Retry-After, alice may send again; nothing refused was written.
    let waited = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "alice's bucket refilled",
        || async {
            match send_as(svc.addr, &alice, 1, "later").await {
                r if r.status == 201 => Ok(()),
                r => Err(r.body),
            }
        },
    )
    .await;
    assert!(waited.elapsed() <= Duration::from_secs(retry + 1));
    assert_eq!(
        stack
            .count(
                "SELECT count(*) FROM consumers.messages WHERE body IN ('one too many', 'burst 0')"
            )
            .await,
        1,
        "one message of the two tries of k-0, none refused"
    );
    svc.stop().await;
}

/// How many of `tries` sends by `token` to chat 1 are taken, alternating between `addrs`.
async fn taken(addrs: &[std::net::SocketAddr], token: &str, tries: usize, tag: &str) -> usize {
    let mut taken = 0;
    for i in 0..tries {
        let reply = send_as(addrs[i % addrs.len()], token, 1, &format!("{tag} {i}")).await;
        match reply.status {
            201 => taken += 1,
            429 => {}
            other => panic!("send {tag} {i}: {other} {}", reply.body),
        }
    }
    taken
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_budget_is_one_across_instances_and_each_counts_alone_while_redis_is_down() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    // A bucket that does not refill within the test: each send taken is one of the burst.
    let flags = flags(&idp, &["--send-rate", "0.0001", "--send-burst", "4"]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let one = stack
        .service_process(Side::Consumers, "budget-one", &flags)
        .await;
    // The second stands by for the inbox (one shard, one consumer) and serves all the same.
    let two = stack
        .service_process_standby(Side::Consumers, "budget-two", &flags)
        .await;
    for user in ["alice", "bob"] {
        add_member(one.addr, &idp, 1, user).await;
    }
    let budgets_local = |admin| async move {
        let metrics = testkit::http::get(admin, "/metrics").await.unwrap().1;
        testkit::http::metric_value(&metrics, "chat_budgets_local")
    };
    // Shared once both instances reached Redis (they connect in the background).
    for admin in [one.admin, two.admin] {
        wait_until(Duration::from_secs(10), "budgets shared", || async {
            match budgets_local(admin).await {
                Some(0.0) => Ok(()),
                other => Err(format!("chat_budgets_local {other:?}")),
            }
        })
        .await;
    }
    // Alternating between the two instances, alice gets her burst once, not twice.
    let alice = idp.token("alice");
    assert_eq!(taken(&[one.addr, two.addr], &alice, 8, "alice").await, 4);

    // Redis gone: each instance judges alone (a fresh bucket of its own), and says so.
    stack.redis().stop().unwrap();
    let bob = idp.token("bob");
    let alone = taken(&[one.addr, two.addr], &bob, 12, "bob").await;
    assert_eq!(
        alone, 8,
        "each instance allows bob its own burst while Redis is down"
    );
    for admin in [one.admin, two.admin] {
        assert_eq!(budgets_local(admin).await, Some(1.0));
    }
    // Redis back: shared again, and the budgets there are as they were left.
    stack.redis().start_again().unwrap();
    wait_until(
        Duration::from_secs(20),
        "budgets judged by Redis again",
        || async {
            let refused = send_as(one.addr, &alice, 1, "alice again").await;
            match (refused.status, budgets_local(one.admin).await) {
                (429, Some(0.0)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    drop((one, two));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_opening_streams_past_the_cap_is_refused_and_nobody_else_is() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = flags(&idp, &["--max-event-streams-per-user", "2"]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    for user in ["alice", "bob"] {
        add_member(svc.addr, &idp, 1, user).await;
    }
    let (name, alice) = bearer(&idp.token("alice"));
    let first = SseClient::connect_with(svc.addr, "/chats/1/events", &[(name, &alice)])
        .await
        .unwrap();
    let _second = SseClient::connect_with(svc.addr, "/chats/1/events", &[(name, &alice)])
        .await
        .unwrap();
    let third = SseClient::connect_with(svc.addr, "/chats/1/events", &[(name, &alice)]).await;
    let error = third.err().expect("a third stream is refused").to_string();
    assert!(
        error.contains("429") && error.contains("2 event streams"),
        "{error}"
    );
    let (_, bob) = bearer(&idp.token("bob"));
    SseClient::connect_with(svc.addr, "/chats/1/events", &[(name, &bob)])
        .await
        .expect("bob's streams are counted apart");
    // A stream closed gives its place back.
    drop(first);
    wait_until(Duration::from_secs(10), "alice's place back", || async {
        SseClient::connect_with(svc.addr, "/chats/1/events", &[(name, &alice)])
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    })
    .await;
    svc.stop().await;
}

/// Reads what the server sends until it closes the connection; panics if it has not
/// within 10 s.
async fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut all))
        .await
        .expect("the server closes the connection")
        .ok();
    all
}

/// A client connection with a small receive window, as a client that stopped reading.
async fn small_window(addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(addr).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_and_a_client_that_never_reads_are_cut_at_their_deadlines() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = flags(
        &idp,
        &[
            "--body-read-timeout",
            "1s",
            "--write-timeout",
            "2s",
            "--header-read-timeout",
            "3s",
        ],
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack
        .service_process(Side::Consumers, "limits", &flags)
        .await;
    add_member(svc.addr, &idp, 9, "alice").await;
    let token = idp.token("alice");

    // A POST that announces 64 KiB and sends 10 bytes: 408 after the body deadline.
    let mut stalled = TcpStream::connect(svc.addr).await.unwrap();
    let head = format!(
        "POST /chats/9/messages HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\ncontent-type: application/json\r\ncontent-length: 65536\r\n\r\n{{\"body\":\"x"
    );
    stalled.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let answer = String::from_utf8_lossy(&read_to_close(&mut stalled).await).into_owned();
    let took = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 1s"), "{answer}");
    assert!(took < Duration::from_secs(3), "cut after {took:?}");

    // The largest history there is: 500 messages of 4,000 control characters, each
    // escaped to 6 bytes in JSON (~12 MB whole).
    let db = stack.db.connect().await.unwrap();
    db.execute(
        "INSERT INTO consumers.messages (id, chat_id, body, idempotency_key, sender)
         SELECT gen_random_uuid(), 9, repeat(chr(1), 4000), 'bulk-' || g, 'alice'
           FROM generate_series(1, 500) g",
        &[],
    )
    .await
    .unwrap();
    let (name, value) = bearer(&token);
    let reply = testkit::http::request(
        svc.addr,
        "GET",
        "/chats/9/messages?limit=500",
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(reply.status, 200);
    assert!(
        reply.body.len() <= 1024 * 1024,
        "{} bytes",
        reply.body.len()
    );
    let page = reply.json();
    assert_eq!(page["truncated"], true);
    let kept = page["messages"].as_array().unwrap();
    assert!(kept.len() >= 40 && kept.len() < 500, "{} kept", kept.len());
    // The newest are kept, oldest first.
    assert_eq!(kept.last().unwrap()["body"].as_str().unwrap().len(), 4000);

    // 40 clients ask for it and never read: each costs at most its capped answer (on
    // loopback the kernel's buffers take all of it, so the write deadline is not reached),
    // and each connection is closed at the idle deadline.
    let pid = svc.child.pid();
    let before = crate::support::rss_mib(pid);
    let mut silent = Vec::new();
    for _ in 0..40 {
        let mut s = small_window(svc.addr).await;
        let request = format!(
            "GET /chats/9/messages?limit=500 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n\r\n"
        );
        s.write_all(request.as_bytes()).await.unwrap();
        silent.push(s);
    }
    // Every one of them answered (its answer waiting, unread).
    let mut peak = before;
    for s in &silent {
        let mut byte = [0u8; 1];
        tokio::time::timeout(Duration::from_secs(10), s.peek(&mut byte))
            .await
            .expect("each was answered")
            .unwrap();
        peak = peak.max(crate::support::rss_mib(pid));
    }
    println!("RSS with 40 clients that never read a 1 MiB answer: {before:.1} -> {peak:.1} MiB");
    assert!(peak - before < 80.0, "RSS {before:.1} -> {peak:.1} MiB");
    // Closed: reading now yields at most the capped answer, then the close.
    for s in &mut silent {
        let got = read_to_close(s).await;
        assert!(got.len() < 1024 * 1024 + 1024, "{} bytes", got.len());
    }
    let metrics = testkit::http::get(svc.admin, "/metrics").await.unwrap().1;
    assert_eq!(
        testkit::http::metric_value(
            &metrics,
            "chat_requests_refused_total{reason=\"body_timeout\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_client_stopped_reading_is_cut_at_the_write_deadline() {
    let stack = Stack::start(shared_postgres()).await;
    // Only the write deadline can cut it: the stream's own budget and heartbeat are far off.
    let svc = stack
        .service(
            Side::Consumers,
            &[
                "--write-timeout",
                "2s",
                "--sse-client-buffer",
                "268435456",
                "--sse-buffer-total",
                "268435456",
                // The buffers above need a budget of their own.
                "--memory-budget",
                "512MiB",
                "--sse-heartbeat",
                "120s",
            ],
        )
        .await;
    let mut reader = small_window(svc.addr).await;
    reader
        .write_all(b"GET /chats/5/events HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let streams = |want: f64| async move {
        let metrics = testkit::http::get(svc.admin, "/metrics").await.unwrap().1;
        match testkit::http::metric_value(&metrics, "chat_sse_clients") {
            Some(n) if n == want => Ok(()),
            other => Err(format!("{other:?}")),
        }
    };
    wait_until(Duration::from_secs(10), "the stream open", || streams(1.0)).await;
    // ~6 MB of frames (4,000 control characters escaped to 6 bytes each, 250 times).
    let big = "\u{1}".repeat(4000);
    for _ in 0..250 {
        crate::support::send(svc.addr, 5, &big).await;
    }
    let flooded = Instant::now();
    wait_until(Duration::from_secs(15), "the stream cut", || streams(0.0)).await;
    println!(
        "a stream not read was cut {:?} after the flood",
        flooded.elapsed()
    );
    let got = read_to_close(&mut reader).await;
    assert!(
        got.len() < 250 * 24_000,
        "{} bytes: it was sent everything",
        got.len()
    );
    svc.stop().await;
}
