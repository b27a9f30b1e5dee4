//! Bounded resources: chats opened and closed leave nothing behind, a connection flood gets
//! 503 and idle connections are closed, and running out of file descriptors neither spins
//! nor floods the log. The service runs as a real process (its memory and CPU are measured).

use std::time::Duration;

use crate::support::{ServiceProcess, Stack};
use chat_services::Side;
use testkit::http::SseClient;
use testkit::{shared_postgres, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// User + system CPU seconds of a process so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

async fn metric(service: &ServiceProcess, name: &str) -> Option<f64> {
    let (_, body) = testkit::http::get(service.admin, "/metrics").await.ok()?;
    testkit::http::metric_value(&body, name)
}

/// Open and close one event stream for each of 20,000 chats from `first` on, 200 at a time;
/// then wait until the service holds no live channel and no stream.
async fn open_and_close_20_000_chats(service: &ServiceProcess, first: i64) {
    for wave in 0..100i64 {
        let mut open = Vec::new();
        for i in 0..200 {
            let chat = first + wave * 200 + i;
            let addr = service.addr;
            open.push(tokio::spawn(async move {
                SseClient::connect(addr, &format!("/chats/{chat}/events"), None).await
            }));
        }
        for client in open {
            client.await.unwrap().expect("event stream opened");
        }
        // A closed stream is noticed at its next write (a heartbeat): keep the waves from
        // outrunning that, or they meet the stream cap (another test's subject).
        wait_until(
            Duration::from_secs(30),
            "closed streams noticed",
            || async {
                match metric(service, "chat_sse_clients").await {
                    Some(n) if n <= 1000.0 => Ok(()),
                    other => Err(format!("clients: {other:?}")),
                }
            },
        )
        .await;
    }
    wait_until(
        Duration::from_secs(30),
        "every live channel freed",
        || async {
            match (
                metric(service, "chat_live_chats").await,
                metric(service, "chat_sse_clients").await,
            ) {
                (Some(0.0), Some(0.0)) => Ok(()),
                other => Err(format!("live chats, clients: {other:?}")),
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_chats_opened_and_closed_leave_nothing_behind() {
    let stack = Stack::start(shared_postgres()).await;
    let workers = stack
        .service_process(
            Side::Workers,
            "workers",
            &[
                "--sse-heartbeat",
                "1s",
                // Up to ~1,200 streams at once, all from this test's one address.
                "--max-connections-per-address",
                "2000",
                "--memory-budget",
                "1GiB",
            ],
        )
        .await;
    let pid = workers.child.pid();
    let start = crate::support::rss_mib(pid);

    // WHEN 20,000 chats are each subscribed and closed, twice over with new chat ids
    open_and_close_20_000_chats(&workers, 1).await;
    let after_first = crate::support::rss_mib(pid);
    open_and_close_20_000_chats(&workers, 20_001).await;
    let after_second = crate::support::rss_mib(pid);

    // THEN no live channel is left (checked above, exactly), and memory stays within what
    // the allocator keeps for reuse: 40,000 chats cost less than 150 MiB in all (keeping a
    // channel per chat cost ~370 MiB per 20,000; with at most ~1,000 streams open at once
    // the plateau is 40-50 MiB here, glibc's arenas making it vary between runs)
    eprintln!(
        "20,000 chats opened and closed, twice: RSS {start:.1} -> {after_first:.1} -> {after_second:.1} MiB"
    );
    assert!(
        after_second < start + 150.0,
        "RSS grew from {start:.1} MiB to {after_second:.1} MiB over 40,000 chats"
    );
    stack.stop().await;
}

/// Read a whole response (the server closes the connection after it).
async fn read_all(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut buf)).await;
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_gets_503_and_idle_connections_are_closed() {
    let stack = Stack::start(shared_postgres()).await;
    let workers = stack
        .service_process(
            Side::Workers,
            "workers-capped",
            &["--max-connections", "20", "--header-read-timeout", "2s"],
        )
        .await;

    // WHEN 20 connections sit idle, a 21st is refused with a JSON 503
    let mut idle = Vec::new();
    for _ in 0..20 {
        idle.push(TcpStream::connect(workers.addr).await.unwrap());
    }
    let mut extra = TcpStream::connect(workers.addr).await.unwrap();
    extra
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let refused = read_all(&mut extra).await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("too many connections"), "{refused}");

    // THEN the idle ones are closed after the header-read timeout, and the service answers
    for mut stream in idle {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "an idle connection stayed open: {read:?}"
        );
    }
    let (status, _) = testkit::http::get(workers.addr, "/healthz").await.unwrap();
    assert_eq!(status, 200);
    assert!(metric(&workers, "chat_connections_refused_total").await >= Some(1.0));
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_neither_spins_nor_floods_the_log() {
    let stack = Stack::start(shared_postgres()).await;
    let workers = stack
        .service_process_under(
            Side::Workers,
            "workers-few-fds",
            &[],
            &["prlimit", "--nofile=96:96", "--"],
        )
        .await;
    let pid = workers.child.pid();

    // WHEN clients hold more connections than the process has descriptors
    let mut held = Vec::new();
    for _ in 0..150 {
        if let Ok(stream) = TcpStream::connect(workers.addr).await {
            held.push(stream);
        }
    }
    wait_until(Duration::from_secs(10), "accept failing", || async {
        let log = workers.child.log();
        if log.contains("accept failed") {
            Ok(())
        } else {
            Err("no accept error yet".to_string())
        }
    })
    .await;
    let cpu_before = cpu_seconds(pid);
    let lines_before = workers.child.log().matches("accept failed").count();
    let window = std::time::Instant::now();
    // (the scenario: descriptors stay exhausted for three seconds)
    tokio::time::sleep(Duration::from_secs(3)).await;
    let cpu = cpu_seconds(pid) - cpu_before;
    let lines = workers.child.log().matches("accept failed").count() - lines_before;
    let seconds = window.elapsed().as_secs_f64();

    // THEN it paused instead of spinning, and answers again once descriptors are free
    eprintln!("fd exhaustion for {seconds:.1} s: {cpu:.2} CPU s, {lines} log lines");
    assert!(cpu < 0.5, "{cpu:.2} CPU seconds in {seconds:.1} s");
    assert!(lines < 20, "{lines} accept errors logged in {seconds:.1} s");
    drop(held);
    wait_until(Duration::from_secs(10), "the service answering", || async {
        match testkit::http::get(workers.addr, "/healthz").await {
            Ok((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_dropped_at_its_byte_budget() {
    // GIVEN an event-stream client that never reads (with a small receive window), and
    // heartbeats far apart, so only the byte budget can drop it
    let stack = Stack::start(shared_postgres()).await;
    let workers = stack
        .service_process(
            Side::Workers,
            "workers",
            &["--sse-client-buffer", "65536", "--sse-heartbeat", "10m"],
        )
        .await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(workers.addr).await.unwrap();
    stalled
        .write_all(b"GET /chats/61/events HTTP/1.1\r\nhost: test\r\n\r\n")
        .await
        .unwrap();

    // WHEN its chat gets far more than the budget (sends of this side are in its feed)
    let body = "x".repeat(4000);
    let mut sent = 0;
    while metric(&workers, "chat_sse_slow_clients_dropped_total").await != Some(1.0) {
        assert!(
            sent < 5000,
            "never dropped after {sent} messages of 4,000 bytes"
        );
        let batch: Vec<_> = (0..50)
            .map(|_| {
                let (addr, body) = (workers.addr, body.clone());
                tokio::spawn(async move { crate::support::send(addr, 61, &body).await })
            })
            .collect();
        for send in batch {
            send.await.unwrap();
        }
        sent += 50;
    }

    // THEN it was dropped (counted above), its stream slot freed, and the service answers
    eprintln!("stalled client dropped after {sent} messages of 4,000 bytes");
    wait_until(Duration::from_secs(10), "stream slot freed", || async {
        match metric(&workers, "chat_sse_clients").await {
            Some(0.0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        testkit::http::get(workers.addr, "/healthz")
            .await
            .unwrap()
            .0,
        200
    );
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_gone_with_a_full_queue_leave_no_queued_bytes_counted() {
    // GIVEN event-stream clients that never read (small receive windows), with byte budgets
    // and a write deadline far off, so their queues fill and the stream waits for room
    let stack = Stack::start(shared_postgres()).await;
    let workers = stack
        .service_process(
            Side::Workers,
            "workers",
            &[
                "--sse-client-buffer",
                "268435456",
                "--sse-buffer-total",
                "268435456",
                // The buffers above need a budget of their own.
                "--memory-budget",
                "512MiB",
                "--write-timeout",
                "60s",
                "--sse-heartbeat",
                "10m",
            ],
        )
        .await;
    let mut stalled = Vec::new();
    for _ in 0..3 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut client = socket.connect(workers.addr).await.unwrap();
        client
            .write_all(b"GET /chats/62/events HTTP/1.1\r\nhost: test\r\n\r\n")
            .await
            .unwrap();
        stalled.push(client);
    }
    wait_until(Duration::from_secs(10), "three streams open", || async {
        match metric(&workers, "chat_sse_clients").await {
            Some(3.0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // More for each than its socket can take in: the kernel grows a socket's send buffer
    // up to tcp_wmem's maximum (4 MiB by default) before anything waits in the queue of 64
    // frames; 256 KiB beyond that.
    let wmem_max: usize = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|t| t.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or(4 << 20);
    let body = "x".repeat(4000);
    for _ in 0..(wmem_max + (256 << 10)) / (50 * 4000) + 1 {
        let batch: Vec<_> = (0..50)
            .map(|_| {
                let (addr, body) = (workers.addr, body.clone());
                tokio::spawn(async move { crate::support::send(addr, 62, &body).await })
            })
            .collect();
        for send in batch {
            send.await.unwrap();
        }
    }
    // (Sends answer at commit; the streams get the messages a moment later.)
    wait_until(Duration::from_secs(30), "the queues filled", || async {
        match metric(&workers, "chat_sse_queued_bytes").await {
            Some(queued) if queued > 100_000.0 => Ok(()),
            other => Err(format!(
                "{other:?} bytes queued; clients {:?}, dropped {:?}",
                metric(&workers, "chat_sse_clients").await,
                metric(&workers, "chat_sse_slow_clients_dropped_total").await,
            )),
        }
    })
    .await;

    // WHEN the clients go away while their streams wait for room in their queues
    drop(stalled);

    // THEN every stream ends and the instance counts no byte queued any more (each frame
    // counted off once: not again by the send that was waiting for room)
    wait_until(
        Duration::from_secs(10),
        "streams gone, nothing queued",
        || async {
            match (
                metric(&workers, "chat_sse_clients").await,
                metric(&workers, "chat_sse_queued_bytes").await,
            ) {
                (Some(0.0), Some(0.0)) => Ok(()),
                other => Err(format!("clients, queued bytes: {other:?}")),
            }
        },
    )
    .await;
    stack.stop().await;
}
