//! The container health-check probe: exit 0 only for a 2xx answer, 1 for any other answer or
//! none, 2 for bad usage.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;

/// Serve one request with `status` on a free loopback port; returns the URL.
fn answer_once(status: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut request = Vec::new();
        let mut chunk = [0u8; 256];
        while !request.ends_with(b"\r\n\r\n") {
            let n = conn.read(&mut chunk).unwrap();
            assert!(n > 0, "request ended early");
            request.extend_from_slice(&chunk[..n]);
        }
        assert!(String::from_utf8_lossy(&request).starts_with("GET /readyz HTTP/1.0\r\n"));
        let body = r#"{"status":"x"}"#;
        write!(
            conn,
            "HTTP/1.1 {status}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    });
    format!("http://127.0.0.1:{port}/readyz")
}

fn probe(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_healthcheck"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn exit_status_follows_the_http_status() {
    assert_eq!(probe(&[&answer_once("200 OK")]).0, Some(0));
    let (code, stderr) = probe(&[&answer_once("503 Service Unavailable")]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("answered 503"), "{stderr}");
}

#[test]
fn no_answer_and_bad_usage_fail() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (code, stderr) = probe(&[&format!("http://127.0.0.1:{port}/readyz")]);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(probe(&[]).0, Some(2));
    let (code, stderr) = probe(&["https://127.0.0.1:1/readyz"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("only http://"), "{stderr}");
}

/// `--verbose` prints the status and the body (a relay's `/readyz`: its `last_error`), for
/// an operator inside a pod with no curl.
#[test]
fn verbose_prints_the_answer() {
    let out = Command::new(env!("CARGO_BIN_EXE_healthcheck"))
        .args(["--verbose", &answer_once("503 Service Unavailable")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "503 {\"status\":\"x\"}\n"
    );
    assert_eq!(probe(&["--verbose"]).0, Some(2));
}

/// A server that answers and keeps the connection open (a proxy with keep-alive) passes:
/// the probe reads the status line, not up to the close (which would time out and fail).
#[test]
fn a_probe_does_not_wait_for_the_server_to_close() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut chunk = [0u8; 256];
        let _ = conn.read(&mut chunk).unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .unwrap();
        // Held open until the probe finished.
        let _ = wait.recv();
    });
    let url = format!("http://127.0.0.1:{port}/readyz");
    assert_eq!(probe(&[&url]).0, Some(0));
    let _ = done.send(());
}
