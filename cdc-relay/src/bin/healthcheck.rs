//! `healthcheck URL`: exit 0 when an HTTP GET of URL answers 2xx within 2 s, 1 otherwise.
//! The container images have no shell and no curl; Docker and compose health checks run
//! this instead (`healthcheck http://127.0.0.1:8080/readyz`).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url] = args.as_slice() else {
        eprintln!("usage: healthcheck http://HOST:PORT/PATH");
        return ExitCode::from(2);
    };
    match check(url) {
        Ok(status) if (200..300).contains(&status) => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("healthcheck: {url} answered {status}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("healthcheck: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The status code of `GET url` (plain HTTP only: the probes are on loopback).
fn check(url: &str) -> Result<u16, String> {
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
    // The status line is in the first bytes; the body does not matter.
    let mut head = [0u8; 64];
    let mut len = 0;
    while len < 12 {
        let n = stream.read(&mut head[len..]).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        len += n;
    }
    let line = String::from_utf8_lossy(&head[..len]);
    line.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP response: {line:?}"))
}
