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
    match get(url) {
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

/// The status code and body of `GET url` (plain HTTP only: the probes are on loopback).
fn get(url: &str) -> Result<(u16, String), String> {
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
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    // HTTP/1.0 with Connection: close: the answer ends when the server closes.
    let mut answer = Vec::new();
    stream
        .take(MAX_ANSWER as u64)
        .read_to_end(&mut answer)
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP response: {:?}", &text[..text.len().min(64)]))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_string());
    Ok((status, body))
}
