//! What one member can take by reading: history loops, answers never read, replays of a
//! whole chat on every open. Reads are metered per user (429 past the budget), answers are
//! bounded in what they fetch, and a busy pool never reads as a frozen database: another
//! member's sends are answered within a second, memory stays bounded, the breaker never
//! trips and no stream is ended for it. Run against the real binary, its memory read from
//! /proc.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{add_member, bearer, send_as, Idp, RssPeak, Stack};
use chat_services::Side;
use testkit::shared_postgres;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long the flood lasts: long enough for budgets to refill many times over and for a
/// tripped breaker to end every stream (30 s of failed membership checks before).
const FLOOD: Duration = Duration::from_secs(20);

/// Answers by status.
#[derive(Default)]
struct Tally {
    ok: AtomicUsize,
    too_many: AtomicUsize,
    unavailable: AtomicUsize,
    other: AtomicUsize,
}

impl Tally {
    fn count(&self, status: u16) {
        match status {
            200 => &self.ok,
            429 => &self.too_many,
            503 => &self.unavailable,
            _ => &self.other,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    fn line(&self) -> String {
        format!(
            "200: {}, 429: {}, 503: {}, other: {}",
            self.ok.load(Ordering::Relaxed),
            self.too_many.load(Ordering::Relaxed),
            self.unavailable.load(Ordering::Relaxed),
            self.other.load(Ordering::Relaxed)
        )
    }
}

/// A raw request on a connection of its own; the status of its answer (0 if none), after
/// reading it whole or for `read_for` at most (an event stream never ends).
async fn request(to: SocketAddr, head: &str, read_for: Duration) -> u16 {
    let Ok(mut stream) = TcpStream::connect(to).await else {
        return 0;
    };
    if stream.write_all(head.as_bytes()).await.is_err() {
        return 0;
    }
    let mut answer = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let _ = tokio::time::timeout(read_for, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    std::str::from_utf8(answer.get(9..12).unwrap_or_default())
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_flooding_reads_does_not_slow_anyone_else() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let mut flags = idp.flags();
    // The shipped budgets (the test support's are generous).
    flags.extend(
        [
            "--history-rate",
            "5",
            "--history-burst",
            "30",
            "--stream-open-rate",
            "1",
            "--stream-open-burst",
            "20",
        ]
        .map(String::from),
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack
        .service_process(Side::Consumers, "consumers-reads", &flags)
        .await;
    add_member(svc.addr, &idp, 5, "mallory").await;
    add_member(svc.addr, &idp, 6, "bob").await;
    // The chat mallory reads: 500 long messages (4,000 two-byte characters, ~8 KB each).
    let db = stack.db.connect().await.unwrap();
    db.execute(
        "INSERT INTO consumers.messages (id, chat_id, body, idempotency_key, sender)
         SELECT gen_random_uuid(), 5, repeat('é', 4000), 'bulk-' || g, 'mallory'
           FROM generate_series(1, 500) g",
        &[],
    )
    .await
    .unwrap();
    let mallory = idp.token("mallory");
    let bob = idp.token("bob");
    let (name, value) = bearer(&mallory);
    let history = format!(
        "GET /chats/5/messages?limit=500 HTTP/1.1\r\nhost: chat\r\n{name}: {value}\r\nconnection: close\r\n\r\n"
    );
    let replay = format!(
        "GET /chats/5/events HTTP/1.1\r\nhost: chat\r\n{name}: {value}\r\nlast-event-id: p0\r\nconnection: close\r\n\r\n"
    );

    let memory = RssPeak::watch(svc.child.pid());
    let until = Instant::now() + FLOOD;
    let histories = Arc::new(Tally::default());
    let replays = Arc::new(Tally::default());
    let mut flood = Vec::new();
    // 32 history loops that read their answers.
    for _ in 0..32 {
        let (head, tally, to) = (history.clone(), histories.clone(), svc.addr);
        flood.push(tokio::spawn(async move {
            while Instant::now() < until {
                tally.count(request(to, &head, Duration::from_secs(10)).await);
            }
        }));
    }
    // 16 loops opening the chat's stream from its start, reading for a second each.
    for _ in 0..16 {
        let (head, tally, to) = (replay.clone(), replays.clone(), svc.addr);
        flood.push(tokio::spawn(async move {
            while Instant::now() < until {
                tally.count(request(to, &head, Duration::from_secs(1)).await);
            }
        }));
    }
    // 150 history requests whose answers are never read.
    let mut unread = Vec::new();
    for _ in 0..150 {
        if let Ok(mut stream) = TcpStream::connect(svc.addr).await {
            let _ = stream.write_all(history.as_bytes()).await;
            unread.push(stream);
        }
    }

    // Meanwhile bob sends to his own chat, four times a second.
    let mut slowest = Duration::ZERO;
    let mut sends = 0;
    while Instant::now() < until {
        let started = Instant::now();
        let reply = send_as(svc.addr, &bob, 6, &format!("bob {sends}")).await;
        let took = started.elapsed();
        assert_eq!(
            reply.status, 201,
            "bob's send {sends} during the flood: {}",
            reply.body
        );
        slowest = slowest.max(took);
        sends += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for task in flood {
        task.await.unwrap();
    }
    drop(unread);
    let before = memory.before;
    let grew = memory.growth();
    let metrics = testkit::http::get(svc.admin, "/metrics").await.unwrap().1;
    let metric = |name: &str| {
        testkit::http::metric_value(&metrics, name).unwrap_or_else(|| panic!("{name} is exported"))
    };
    eprintln!(
        "flood of {FLOOD:?}: history {}; replays {}; bob's {sends} sends, slowest {slowest:?}; RSS {before:.0} MiB, peak growth {grew:.0} MiB",
        histories.line(),
        replays.line()
    );
    assert!(
        slowest < Duration::from_secs(1),
        "bob's slowest send took {slowest:?}"
    );
    assert!(
        histories.too_many.load(Ordering::Relaxed) > 0
            && replays.too_many.load(Ordering::Relaxed) > 0,
        "mallory's reads are metered"
    );
    assert!(
        histories.ok.load(Ordering::Relaxed) > 0 && replays.ok.load(Ordering::Relaxed) > 0,
        "within the budget mallory is served"
    );
    assert_eq!(
        metric("chat_database_breaker_trips_total"),
        0.0,
        "a busy pool is not a frozen database"
    );
    assert_eq!(metric("chat_membership_checks_failed_total"), 0.0);
    assert!(grew < 64.0, "RSS grew {grew:.0} MiB under the flood");
}
