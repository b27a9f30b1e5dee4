//! `healthcheck [--verbose] URL`: exit 0 when an HTTP GET of URL answers 2xx within 2 s, 1
//! otherwise. The container images have no shell and no curl; Docker and compose health
//! checks run this instead (`healthcheck http://127.0.0.1:8080/readyz`), and an operator
//! reads a relay's or service's own view with `--verbose`, which prints the answer's body
//! (`/readyz`: state, `reason`, `last_error`) from inside the pod.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(2);
/// The most of an answer read: /readyz and /healthz are small; /metrics is cut here.
const MAX_ANSWER: usize = 256 * 1024;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (verbose, url) = match args.as_slice() {
        [url] if url != "--verbose" => (false, url),
        [flag, url] if flag == "--verbose" => (true, url),
        _ => {
            eprintln!("usage: healthcheck [--verbose] http://HOST:PORT/PATH");
            return ExitCode::from(2);
        }
    };
    match get(url, verbose) {
        Ok((status, body)) => {
            if verbose {
                println!("{status} {}", body.trim_end());
            }
            if (200..300).contains(&status) {
                ExitCode::SUCCESS
            } else {
                eprintln!("healthcheck: {url} answered {status}");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("healthcheck: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The status code of `GET url`, and with `body` its body (plain HTTP only: the probes are
/// on loopback). Everything within [`TIMEOUT`] in all: a server that keeps the connection
/// open or trickles its answer cannot hold the probe longer.
fn get(url: &str, body: bool) -> Result<(u16, String), String> {
    let deadline = std::time::Instant::now() + TIMEOUT;
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are supported")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr = authority
        .to_socket_addrs()
        .map_err(|e| format!("address {authority}: {e}"))?
        .next()
        .ok_or_else(|| format!("address {authority} resolves to nothing"))?;
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut head_end = None;
    loop {
        // Done: the status line (without --verbose), or the body's announced length.
        if let Some(end) = head_end {
            if !body || content_length(&answer[..end]).is_some_and(|n| answer.len() >= end + n) {
                break;
            }
        } else if !body && answer.contains(&b'\n') {
            break;
        }
        if answer.len() >= MAX_ANSWER {
            break;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(format!("no whole answer within {TIMEOUT:?}"));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| e.to_string())?;
        let n = stream.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&chunk[..n]);
        if head_end.is_none() {
            head_end = answer
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|i| i + 4);
        }
    }
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            format!(
                "not an HTTP response: {:?}",
                text.chars().take(64).collect::<String>()
            )
        })?;
    let body = head_end.map_or(String::new(), |end| {
        String::from_utf8_lossy(&answer[end.min(answer.len())..]).into_owned()
    });
    Ok((status, body))
}

/// The Content-Length header of an answer's head, if it has one.
fn content_length(head: &[u8]) -> Option<usize> {
    String::from_utf8_lossy(head).lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse().ok())?
    })
}
