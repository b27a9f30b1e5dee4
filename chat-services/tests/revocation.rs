//! Revocation holds: an event stream opened with a key later withdrawn ends within seconds
//! (no request needed to make the service look), a token valid for longer than the maximum
//! lifetime is refused, and a key set with no usable key refuses everyone and says so in
//! its metrics, while a set with one broken key still withdraws the others.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::support::{add_member, bearer, Idp, Stack, AUDIENCE, ISSUER};
use chat_services::Side;
use testkit::http::SseClient;
use testkit::{shared_postgres, wait_until};

async fn status_with(addr: std::net::SocketAddr, token: &str) -> (u16, String) {
    let (name, value) = bearer(token);
    let reply = testkit::http::request(
        addr,
        "GET",
        "/chats/7/messages",
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    (reply.status, reply.body)
}

async fn stream(addr: std::net::SocketAddr, token: &str) -> SseClient {
    let (name, value) = bearer(token);
    SseClient::connect_with(addr, "/chats/7/events", &[(name, &value)])
        .await
        .expect("stream opened")
}

async fn metric(admin: std::net::SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = testkit::http::get(admin, "/metrics").await.ok()?;
    testkit::http::metric_value(&body, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_opened_with_a_key_later_withdrawn_ends_within_seconds() {
    let stack = Stack::start(shared_postgres()).await;
    let mut idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    add_member(svc.addr, &idp, 7, "alice").await;
    let old = stream(svc.addr, &idp.token("alice")).await;
    idp.rotate();
    let token = idp.token("alice");
    // The new kid makes the service read the key set again (at most once a second).
    wait_until(Duration::from_secs(5), "the new key accepted", || async {
        match status_with(svc.addr, &token).await {
            (200, _) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let new = stream(svc.addr, &token).await;
    assert!(!old.is_closed(), "a rotation alone ends no stream");

    // WHEN the first key is withdrawn (a compromise), and no request comes in
    idp.withdraw_oldest();
    let withdrawn = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "the old key's stream ended",
        || async {
            if old.is_closed() {
                Ok(())
            } else {
                Err("open".to_string())
            }
        },
    )
    .await;
    let took = withdrawn.elapsed();
    eprintln!("a stream of a withdrawn key ended {took:?} after the withdrawal");
    assert!(took < Duration::from_secs(4), "{took:?}");
    assert!(!new.is_closed(), "the current key's stream goes on");
    assert!(
        metric(svc.admin, "chat_event_streams_revoked_total").await >= Some(1.0),
        "counted as revoked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_valid_past_the_maximum_lifetime_is_refused() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let mut flags = idp.flags();
    flags.extend(["--jwt-max-lifetime".into(), "12h".into()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    add_member(svc.addr, &idp, 7, "alice").await;
    let hours = |h: u64| Duration::from_secs(h * 3600);

    let (status, _) = status_with(svc.addr, &idp.token_for("alice", hours(8), None)).await;
    assert_eq!(status, 200, "within the lifetime");
    let (status, body) = status_with(svc.addr, &idp.token_for("alice", hours(13), None)).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("--jwt-max-lifetime"), "{body}");

    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = |iat: Option<u64>, exp: u64| {
        let mut claims = serde_json::json!({
            "iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "exp": exp,
        });
        if let Some(iat) = iat {
            claims["iat"] = iat.into();
        }
        claims
    };
    // Without `iat`, the lifetime counts from now.
    let (status, body) = status_with(svc.addr, &idp.sign(claims(None, now + 20 * 3600))).await;
    assert_eq!(status, 401, "{body}");
    let (status, _) = status_with(svc.addr, &idp.sign(claims(None, now + 3600))).await;
    assert_eq!(status, 200);
    // Issued in the future: refused.
    let (status, body) =
        status_with(svc.addr, &idp.sign(claims(Some(now + 3600), now + 7200))).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("future"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_set_with_no_usable_key_refuses_everyone_and_says_so() {
    let stack = Stack::start(shared_postgres()).await;
    let mut idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    add_member(svc.addr, &idp, 7, "alice").await;
    assert_eq!(metric(svc.admin, "chat_jwks_keys").await, Some(1.0));
    let old = idp.token("alice");
    idp.rotate();
    let new = idp.token("alice");
    wait_until(Duration::from_secs(5), "both keys published", || async {
        match metric(svc.admin, "chat_jwks_keys").await {
            Some(2.0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // A set whose other key is broken still withdraws the one left out.
    let published: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idp.jwks).unwrap()).unwrap();
    let newest = published["keys"][1].clone();
    let mut broken = newest.clone();
    broken["kid"] = "broken".into();
    broken["x"] = "@@ not base64 @@".into();
    let partly_bad = serde_json::json!({"keys": [newest, broken]});
    std::fs::write(&idp.jwks, partly_bad.to_string()).unwrap();
    wait_until(Duration::from_secs(5), "one usable key", || async {
        match metric(svc.admin, "chat_jwks_keys").await {
            Some(1.0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        status_with(svc.addr, &new).await.0,
        200,
        "the good key still verifies"
    );
    assert_eq!(
        status_with(svc.addr, &old).await.0,
        401,
        "the left-out key is withdrawn"
    );

    // An empty set: every token refused, and the metric an alert watches says 0.
    let live = stream(svc.addr, &new).await;
    std::fs::write(&idp.jwks, r#"{"keys":[]}"#).unwrap();
    wait_until(Duration::from_secs(5), "everyone refused", || async {
        match status_with(svc.addr, &new).await {
            (401, _) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(metric(svc.admin, "chat_jwks_keys").await, Some(0.0));
    wait_until(Duration::from_secs(5), "the open stream ended", || async {
        if live.is_closed() {
            Ok(())
        } else {
            Err("open".to_string())
        }
    })
    .await;
}
