//! What a stranger (no token, any address) can take from a service on the internet: a
//! request head that never ends is cut at a small cap, and one address holding thousands of
//! idle connections does not keep other addresses out. Run against the real binary, its
//! memory read from /proc.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::{add_member, bearer, Idp, RssPeak, Stack};
use chat_services::Side;
use testkit::{shared_postgres, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A raw `GET` from `from` (a loopback address of its own), its status line.
async fn get_from(
    from: [u8; 4],
    to: SocketAddr,
    path: &str,
    token: &str,
) -> Result<String, String> {
    let socket = TcpSocket::new_v4().map_err(|e| e.to_string())?;
    socket
        .bind(SocketAddr::from((from, 0)))
        .map_err(|e| e.to_string())?;
    let mut stream = socket.connect(to).await.map_err(|e| e.to_string())?;
    let (name, value) = bearer(token);
    let request = format!(
        "GET {path} HTTP/1.1\r\nhost: chat\r\n{name}: {value}\r\nconnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
        .await
        .map_err(|_| "no answer in 5 s".to_string())?
        .map_err(|e| e.to_string())?;
    let answer = String::from_utf8_lossy(&answer);
    Ok(answer.lines().next().unwrap_or_default().to_string())
}

/// Sends a request head that never ends (`X-Pad: aaaa...`, 400 KB, no blank line) and then
/// waits up to 5 s for the server to answer or close: whether it was cut.
async fn never_ending_head(to: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect(to).await else {
        return true; // refused outright: nothing held
    };
    if stream
        .write_all(b"GET /chats/7/messages HTTP/1.1\r\nhost: chat\r\nx-pad: ")
        .await
        .is_err()
    {
        return true;
    }
    let chunk = [b'a'; 16 * 1024];
    for _ in 0..25 {
        if stream.write_all(&chunk).await.is_err() {
            return true;
        }
    }
    // An answer (431), an end or a reset within 5 s: the server let go.
    let mut buf = [0u8; 1024];
    tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_that_never_end_are_cut_early_and_a_member_is_answered_meanwhile() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    // One address sends all 300: its share is raised so every cut is the head cap's.
    let mut flags = flags;
    flags.extend(["--max-connections-per-address", "1000"]);
    let svc = stack
        .service_process(Side::Consumers, "consumers-strangers", &flags)
        .await;
    add_member(svc.addr, &idp, 7, "alice").await;
    let alice = idp.token("alice");
    let memory = RssPeak::watch(svc.child.pid());
    let started = Instant::now();
    let attack: Vec<_> = (0..300)
        .map(|_| tokio::spawn(never_ending_head(svc.addr)))
        .collect();
    // A member (on an address of their own: the attack's would be over its share) is
    // answered while the heads arrive.
    let answered = get_from([127, 0, 0, 5], svc.addr, "/chats/7/messages", &alice).await;
    let mut cut = 0;
    for task in attack {
        if task.await.unwrap() {
            cut += 1;
        }
    }
    let took = started.elapsed();
    let before = memory.before;
    let grew = memory.growth();
    eprintln!(
        "300 never-ending heads: {cut} cut in {took:?}; RSS {before:.0} MiB, peak growth {grew:.0} MiB; member: {answered:?}"
    );
    assert_eq!(
        answered.as_deref(),
        Ok("HTTP/1.1 200 OK"),
        "the member is answered during the attack"
    );
    assert_eq!(
        cut, 300,
        "every never-ending head is cut, not held to the header deadline"
    );
    assert!(
        grew < 40.0,
        "RSS grew {grew:.0} MiB under 300 never-ending heads"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_connections_from_one_address_do_not_keep_others_out() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    // The held connections must outlast the test on a loaded machine (by default an idle
    // connection is closed after 30 s).
    let mut flags = flags;
    flags.extend(["--header-read-timeout", "300s"]);
    let svc = stack
        .service_process(Side::Consumers, "consumers-idle", &flags)
        .await;
    add_member(svc.addr, &idp, 7, "alice").await;
    let alice = idp.token("alice");

    // One address opens 10,000 connections and sends nothing.
    let mut idle = Vec::with_capacity(10_000);
    for _ in 0..10_000 {
        match TcpStream::connect(svc.addr).await {
            Ok(stream) => idle.push(stream),
            Err(e) => panic!("connect {}: {e}", idle.len()),
        }
    }
    // Another address is served (a member's read, and a stranger's health check).
    let answered = get_from([127, 0, 0, 2], svc.addr, "/chats/7/messages", &alice).await;
    assert_eq!(
        answered.as_deref(),
        Ok("HTTP/1.1 200 OK"),
        "another address is answered while one holds 10,000 idle connections"
    );
    // The same address, past its share, is told so (not left hanging); while the flood's
    // own refusals are still being answered, it may be closed without an answer instead.
    wait_until(
        Duration::from_secs(10),
        "the address over its share answered 429",
        || async {
            match get_from([127, 0, 0, 1], svc.addr, "/healthz", "x").await {
                Ok(status) if status == "HTTP/1.1 429 Too Many Requests" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let metrics = testkit::http::get(svc.admin, "/metrics").await.unwrap().1;
    let over = testkit::http::metric_value(&metrics, "chat_connections_over_address_share_total");
    assert!(over >= Some(9_000.0), "refusals counted: {over:?}");
    assert_eq!(
        testkit::http::metric_value(&metrics, "chat_client_addresses"),
        Some(1.0),
        "only the flooding address holds connections"
    );
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_sending_forged_tokens_is_refused_before_they_are_verified() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    add_member(svc.addr, &idp, 7, "alice").await;
    let alice = idp.token("alice");
    // A real key id and claims, a signature that is not the key's.
    let mut forged = idp.token("mallory");
    forged.truncate(forged.len() - 8);
    forged.push_str("AAAAAAAA");

    // A member on the same address (a shared NAT) signed in before the flood.
    let before = get_from([127, 0, 0, 3], svc.addr, "/chats/7/messages", &alice).await;
    assert_eq!(before.as_deref(), Ok("HTTP/1.1 200 OK"));
    let mut statuses = Vec::new();
    for _ in 0..100 {
        let status = get_from([127, 0, 0, 3], svc.addr, "/chats/7/messages", &forged)
            .await
            .unwrap();
        statuses.push(status);
    }
    let unauthorized = statuses
        .iter()
        .filter(|s| s.starts_with("HTTP/1.1 401"))
        .count();
    let limited = statuses
        .iter()
        .filter(|s| s.starts_with("HTTP/1.1 429"))
        .count();
    eprintln!("100 forged tokens from one address: {unauthorized} verified (401), {limited} refused unverified (429)");
    assert!(
        statuses[..20].iter().all(|s| s.starts_with("HTTP/1.1 401")),
        "the first failures are verified and answered 401: {statuses:?}"
    );
    assert_eq!(unauthorized + limited, 100, "{statuses:?}");
    assert!(
        limited >= 70,
        "past the burst, forged tokens are refused unverified: {limited}"
    );
    // The member's token, verified before, is recognised and passes on the same address.
    let same = get_from([127, 0, 0, 3], svc.addr, "/chats/7/messages", &alice).await;
    assert_eq!(
        same.as_deref(),
        Ok("HTTP/1.1 200 OK"),
        "a known token is not held back"
    );
    // Another address is not affected, nor a request from the same one without credentials.
    let member = get_from([127, 0, 0, 1], svc.addr, "/chats/7/messages", &alice).await;
    assert_eq!(member.as_deref(), Ok("HTTP/1.1 200 OK"));
    let (status, _) = testkit::http::get(svc.addr, "/healthz").await.unwrap();
    assert_eq!(status, 200);
    // A token longer than any provider's is refused before it is decoded, saying why.
    let long = format!("{}.{}.x", "a".repeat(4_500), "b".repeat(4_500));
    let (name, value) = bearer(&long);
    let reply = testkit::http::request(
        svc.addr,
        "GET",
        "/chats/7/messages",
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(reply.status, 401, "{}", reply.body);
    assert!(reply.body.contains("over 8192"), "{}", reply.body);
    let metrics = testkit::http::get(svc.admin, "/metrics").await.unwrap().1;
    assert_eq!(
        testkit::http::metric_value(
            &metrics,
            "chat_requests_refused_total{reason=\"auth_failures\"}"
        ),
        Some(limited as f64)
    );
}
