//! Who may do what: bearer tokens verified against the provider's JWKS, chat membership,
//! the sender of every message end to end, the page's session cookie, and streams that end
//! when their user leaves the chat or their token expires.

use std::time::Duration;

use crate::support::{add_member, bearer, send_as, Idp, Stack, AUDIENCE, ISSUER};
use chat_services::Side;
use testkit::http::{request, Reply, SseClient};
use testkit::{shared_postgres, wait_until};

async fn get_as(addr: std::net::SocketAddr, path: &str, token: Option<&str>) -> Reply {
    let auth = token.map(bearer);
    let headers: Vec<(&str, &str)> = auth.iter().map(|(n, v)| (*n, v.as_str())).collect();
    request(addr, "GET", path, &headers, bytes::Bytes::new())
        .await
        .unwrap()
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A token for `user` signed by a key the provider never published, named `kid`.
fn foreign_token(kid: &str, user: &str) -> String {
    let pem = rcgen::KeyPair::generate().unwrap().serialize_pem();
    chat_services::token::SigningKey::from_pem(pem.as_bytes(), kid)
        .unwrap()
        .mint(ISSUER, AUDIENCE, user, Duration::from_secs(600), None)
        .unwrap()
}

fn assert_401(reply: &Reply, says: &str) {
    assert_eq!(reply.status, 401, "{}", reply.body);
    assert!(
        reply
            .header("www-authenticate")
            .is_some_and(|c| c.starts_with("Bearer")),
        "{:?}",
        reply.headers
    );
    let error = reply.json()["error"].as_str().unwrap().to_string();
    assert!(error.contains(says), "{error:?} does not say {says:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_valid_token_is_refused_on_post_history_and_events() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    // Every bad token here comes from one address: past the default burst they would be
    // refused unverified (strangers.rs), and this test is about the reasons given.
    let mut flags = idp.flags();
    flags.extend(["--failed-auth-burst".into(), "1000".into()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    let a = svc.addr;
    add_member(a, &idp, 7, "alice").await;

    // No credentials at all.
    assert_401(
        &get_as(a, "/chats/7/messages", None).await,
        "no credentials",
    );
    assert_401(&get_as(a, "/chats/7/events", None).await, "no credentials");
    let post = testkit::http::post_json(
        a,
        "/chats/7/messages",
        &serde_json::json!({"body": "x"}),
        &[],
    )
    .await
    .unwrap();
    assert_401(&post, "no credentials");

    let claims = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut c = serde_json::json!({
            "iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "exp": now() + 600,
        });
        f(&mut c);
        idp.sign(c)
    };
    let expired = claims(&|c| c["exp"] = (now() - 5).into());
    let wrong_issuer = claims(&|c| c["iss"] = "https://evil.invalid/".into());
    let wrong_audience = claims(&|c| c["aud"] = "other-service".into());
    let no_subject = claims(&|c| {
        c.as_object_mut().unwrap().remove("sub");
    });
    let not_yet = claims(&|c| c["nbf"] = (now() + 600).into());
    // Signed by a key the provider never published, under a kid it does publish.
    let foreign = foreign_token("key-1", "alice");
    let unknown_kid = foreign_token("made-up", "alice");
    // The same claims with the signature of another token: tampering.
    let tampered = {
        let good = idp.token("alice");
        let other = idp.token("mallory");
        let (head, _) = good.rsplit_once('.').unwrap();
        let (_, sig) = other.rsplit_once('.').unwrap();
        format!("{head}.{sig}")
    };
    // alg "none" (the classic forgery) and a token with an HMAC header.
    let unsigned = {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let header = b64.encode(r#"{"alg":"none","typ":"JWT","kid":"key-1"}"#);
        let body = b64.encode(
            serde_json::json!({"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "exp": now() + 600})
                .to_string(),
        );
        format!("{header}.{body}.")
    };
    for (token, says) in [
        (expired.as_str(), "expired"),
        (&wrong_issuer, "wrong issuer"),
        (&wrong_audience, "wrong audience"),
        (&no_subject, "'sub' claim is missing"),
        (&not_yet, "not valid yet"),
        (&foreign, "signature does not verify"),
        (&unknown_kid, "no key 'made-up'"),
        (&tampered, "signature does not verify"),
        (&unsigned, "invalid token"),
        ("not-a-jwt", "invalid token"),
    ] {
        for path in ["/chats/7/messages", "/chats/7/events"] {
            assert_401(&get_as(a, path, Some(token)).await, says);
        }
        let reply = send_as(a, token, 7, "forged").await;
        assert_401(&reply, says);
    }
    // The valid token of a member passes.
    let alice = idp.token("alice");
    assert_eq!(
        get_as(a, "/chats/7/messages", Some(&alice)).await.status,
        200
    );
    let sent = send_as(a, &alice, 7, "hello").await;
    assert_eq!(sent.status, 201, "{}", sent.body);
    assert_eq!(sent.json()["sender"], "alice");
    assert_eq!(
        stack
            .count("SELECT count(*) FROM consumers.messages WHERE body = 'forged'")
            .await,
        0
    );
    let metrics = testkit::http::get(svc.admin, "/metrics").await.unwrap().1;
    assert!(
        testkit::http::metric_value(
            &metrics,
            "chat_requests_refused_total{reason=\"invalid_token\"}"
        )
        .is_some_and(|n| n >= 30.0),
        "{metrics}"
    );
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_member_gets_the_same_answer_as_for_a_chat_that_does_not_exist() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    let a = svc.addr;
    add_member(a, &idp, 7, "alice").await;
    add_member(a, &idp, 8, "bob").await;
    let bob_writes = send_as(a, &idp.token("bob"), 8, "in chat 8").await;
    assert_eq!(bob_writes.status, 201);

    let alice = idp.token("alice");
    // Chat 8 exists (bob wrote in it); chat 9 has never existed.
    for verb in ["history", "events", "send"] {
        let answer = |chat: i64| {
            let alice = alice.clone();
            async move {
                let reply = match verb {
                    "history" => get_as(a, &format!("/chats/{chat}/messages"), Some(&alice)).await,
                    "events" => get_as(a, &format!("/chats/{chat}/events"), Some(&alice)).await,
                    _ => send_as(a, &alice, chat, "let me in").await,
                };
                (
                    reply.status,
                    reply.json()["error"]
                        .as_str()
                        .unwrap()
                        .replace(&chat.to_string(), "N"),
                )
            }
        };
        let existing = answer(8).await;
        let missing = answer(9).await;
        assert_eq!(existing.0, 404, "{verb}: {existing:?}");
        assert_eq!(
            existing, missing,
            "{verb}: a non-member can tell chat 8 exists"
        );
    }
    assert_eq!(
        stack
            .count("SELECT count(*) FROM consumers.messages WHERE body = 'let me in'")
            .await,
        0
    );
    // Members are managed with the admin scope only.
    let (name, value) = bearer(&alice);
    let reply = request(
        a,
        "PUT",
        "/chats/8/members/alice",
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(reply.status, 403, "{}", reply.body);
    assert!(reply.body.contains("scope 'chat:admin'"), "{}", reply.body);
    let members = get_as(a, "/chats/8/members", Some(&idp.admin())).await;
    assert_eq!(members.json()["members"], serde_json::json!(["bob"]));
    // A user id is the path segment as it is: '+' stays '+'; bad UTF-8 is refused.
    let (name, admin) = bearer(&idp.admin());
    let plus = request(
        a,
        "PUT",
        "/chats/8/members/a+b%40x",
        &[(name, &admin)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(plus.json()["user"], "a+b@x", "{}", plus.body);
    let bad = request(
        a,
        "PUT",
        "/chats/8/members/%ff",
        &[(name, &admin)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(bad.status, 400, "{}", bad.body);
    // The page's cookie never manages members: an admin token cannot sign a page in, and
    // a user's cookie is no bearer token.
    let session = request(
        a,
        "POST",
        "/session",
        &[(name, &admin)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(session.status, 403, "{}", session.body);
    assert!(session.header("set-cookie").is_none());
    let (_, bob) = bearer(&idp.token("bob"));
    let session = request(a, "POST", "/session", &[(name, &bob)], bytes::Bytes::new())
        .await
        .unwrap();
    let cookie = session
        .header("set-cookie")
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let by_cookie = request(
        a,
        "PUT",
        "/chats/8/members/x",
        &[("cookie", &cookie)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(by_cookie.status, 401, "{}", by_cookie.body);

    // Idempotency keys are each user's own: bob reusing alice's key in his chat writes his
    // own message and learns nothing of hers.
    add_member(a, &idp, 7, "alice").await;
    let with_key = |token: String, chat: i64, body: &'static str| async move {
        let (name, value) = bearer(&token);
        testkit::http::post_json(
            a,
            &format!("/chats/{chat}/messages"),
            &serde_json::json!({"body": body}),
            &[(name, &value), ("idempotency-key", "shared-key")],
        )
        .await
        .unwrap()
    };
    let hers = with_key(idp.token("alice"), 7, "alice's").await;
    let his = with_key(idp.token("bob"), 8, "bob's").await;
    assert_eq!(
        (hers.status, his.status),
        (201, 201),
        "{} {}",
        hers.body,
        his.body
    );
    assert_ne!(hers.json()["id"], his.json()["id"]);
    assert_eq!(his.json()["body"], "bob's");
    let again = with_key(idp.token("alice"), 7, "alice's").await;
    assert_eq!(again.json()["id"], hers.json()["id"]);
    assert_eq!(again.header("idempotency-replayed"), Some("true"));
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_posts_and_the_other_sides_member_sees_it_with_its_sender() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let consumers = stack.service(Side::Consumers, &flags).await;
    let workers = stack.service(Side::Workers, &flags).await;
    add_member(consumers.addr, &idp, 3, "alice").await;
    add_member(workers.addr, &idp, 3, "bob").await;
    let bob = idp.token("bob");
    let (name, value) = bearer(&bob);
    let mut feed =
        SseClient::connect_with(workers.addr, "/chats/3/events?after=p0", &[(name, &value)])
            .await
            .unwrap();

    let sent = send_as(consumers.addr, &idp.token("alice"), 3, "hi bob").await;
    assert_eq!(sent.status, 201, "{}", sent.body);
    let (_, shown) = crate::support::next_message(&mut feed, Duration::from_secs(20)).await;
    assert_eq!(shown["id"], sent.json()["id"]);
    assert_eq!(shown["sender"], "alice");
    assert_eq!(shown["side"], "consumers");
    let history = get_as(workers.addr, "/chats/3/messages", Some(&bob)).await;
    assert_eq!(history.json()["messages"][0]["sender"], "alice");
    // And in the inbox row itself.
    assert_eq!(
        stack
            .count("SELECT count(*) FROM workers.inbox WHERE sender = 'alice' AND body = 'hi bob'")
            .await,
        1
    );
    // Bob answers; alice's history shows him.
    let answer = send_as(workers.addr, &bob, 3, "hi alice").await;
    assert_eq!(answer.status, 201);
    let alice = idp.token("alice");
    wait_until(
        Duration::from_secs(20),
        "bob's answer at consumers",
        || async {
            let history = get_as(consumers.addr, "/chats/3/messages", Some(&alice)).await;
            let messages = history.json()["messages"].clone();
            match messages.as_array().and_then(|m| m.last()) {
                Some(last) if last["body"] == "hi alice" => {
                    assert_eq!(last["sender"], "bob");
                    Ok(())
                }
                _ => Err(messages.to_string()),
            }
        },
    )
    .await;
    consumers.stop().await;
    workers.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_member_s_stream_ends_within_a_second_on_every_instance() {
    // Two shards: each instance holds one (a service in the tests waits for a shard).
    let stack = Stack::start_sharded(shared_postgres(), 2).await;
    let idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut extra = flags.clone();
    extra.extend(["--consumer-name", "workers-2"]);
    let one = stack.service(Side::Workers, &flags).await;
    let two = stack.service(Side::Workers, &extra).await;
    add_member(one.addr, &idp, 5, "carol").await;
    let carol = idp.token("carol");
    let (name, value) = bearer(&carol);
    let mut on_one = SseClient::connect_with(one.addr, "/chats/5/events", &[(name, &value)])
        .await
        .unwrap();
    let mut on_two = SseClient::connect_with(two.addr, "/chats/5/events", &[(name, &value)])
        .await
        .unwrap();
    // Both streams are live: a message reaches both.
    let sent = send_as(one.addr, &carol, 5, "still here").await;
    assert_eq!(sent.status, 201);
    for feed in [&mut on_one, &mut on_two] {
        let (_, shown) = crate::support::next_message(feed, Duration::from_secs(10)).await;
        assert_eq!(shown["body"], "still here");
    }

    let (name, admin) = bearer(&idp.admin());
    let removed_at = std::time::Instant::now();
    let reply = request(
        one.addr,
        "DELETE",
        "/chats/5/members/carol",
        &[(name, &admin)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    for (instance, feed) in [
        ("the instance that removed her", &on_one),
        ("the other instance", &on_two),
    ] {
        wait_until(Duration::from_secs(3), instance, || async {
            if feed.is_closed() {
                Ok(())
            } else {
                Err("stream still open".to_string())
            }
        })
        .await;
        let took = removed_at.elapsed();
        assert!(
            took < Duration::from_millis(1500),
            "{instance}: stream ended {took:?} after the removal"
        );
    }
    // And she cannot come back in.
    assert_eq!(
        get_as(two.addr, "/chats/5/events", Some(&carol))
            .await
            .status,
        404
    );
    assert_eq!(send_as(two.addr, &carol, 5, "after").await.status, 404);
    one.stop().await;
    two.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_removed_while_their_message_arrives_does_not_get_it_in() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    add_member(svc.addr, &idp, 6, "erin").await;
    let erin = idp.token("erin");
    // The request is admitted (its head read, erin a member) while its body is on the way:
    // the server asks for the body (`100 Continue`) only once the head was admitted.
    let body = r#"{"body":"sent while being removed"}"#;
    let mut post = tokio::net::TcpStream::connect(svc.addr).await.unwrap();
    let head = format!(
        "POST /chats/6/messages HTTP/1.1\r\nhost: chat\r\nauthorization: Bearer {erin}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n",
        body.len(),
    );
    post.write_all(head.as_bytes()).await.unwrap();
    let mut asked = [0u8; 25];
    tokio::time::timeout(Duration::from_secs(10), post.read_exact(&mut asked))
        .await
        .expect("asked for the body")
        .unwrap();
    assert!(
        asked.starts_with(b"HTTP/1.1 100 Continue"),
        "{}",
        String::from_utf8_lossy(&asked)
    );
    let (name, admin) = bearer(&idp.admin());
    let reply = request(
        svc.addr,
        "DELETE",
        "/chats/6/members/erin",
        &[(name, &admin)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    post.write_all(body.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), post.read_to_end(&mut answer))
        .await
        .expect("answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    assert_eq!(
        stack
            .count("SELECT count(*) FROM consumers.messages WHERE chat_id = 6")
            .await,
        0,
        "nothing written for a member removed before the insert"
    );
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audiences_and_admin_rights_do_not_cross_sides_clients_or_the_page() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let mut flags = idp.flags();
    flags.extend(
        [
            "--jwt-audience",
            "chat-consumers",
            "--jwt-admin-audience",
            "chat-consumers-admin",
            "--jwt-admin-clients",
            "backend",
            "--jwt-type",
            "at+jwt",
        ]
        .map(String::from),
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    let token = |aud: serde_json::Value, sub: &str, scope: Option<&str>, azp: Option<&str>| {
        let mut claims = serde_json::json!({
            "iss": ISSUER, "aud": aud, "sub": sub, "iat": now(), "exp": now() + 600,
        });
        if let Some(scope) = scope {
            claims["scope"] = scope.into();
        }
        if let Some(azp) = azp {
            claims["azp"] = azp.into();
        }
        idp.sign(claims)
    };
    let put = |token: String| async move {
        let (name, value) = bearer(&token);
        request(
            svc.addr,
            "PUT",
            "/chats/3/members/frank",
            &[(name, &value)],
            bytes::Bytes::new(),
        )
        .await
        .unwrap()
    };
    let admin = |aud: &str, azp: &str| token(aud.into(), "ops", Some("chat:admin"), Some(azp));

    // The Workers side's admin token is refused here: another audience.
    assert_401(
        &put(admin("chat-workers-admin", "backend")).await,
        "wrong audience",
    );
    // A user who got the scope from a provider that grants what is asked is no admin: the
    // admin audience is missing; nor is the admin audience from another client enough.
    let scoped_user = token("chat-consumers".into(), "frank", Some("chat:admin"), None);
    let refused = put(scoped_user.clone()).await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert!(
        refused.body.contains("chat-consumers-admin"),
        "{}",
        refused.body
    );
    assert_eq!(put(admin("chat-consumers-admin", "page")).await.status, 403);
    // This side's admin audience, from the backend: an admin.
    let ops = admin("chat-consumers-admin", "backend");
    assert_eq!(put(ops.clone()).await.status, 201);

    // An admin-audience token is for managing members only; no admin token signs a page in.
    let (name, value) = bearer(&ops);
    let history = request(
        svc.addr,
        "GET",
        "/chats/3/messages",
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(history.status, 403, "{}", history.body);
    let both = token(
        serde_json::json!(["chat-consumers", "chat-consumers-admin"]),
        "ops",
        Some("chat:admin"),
        Some("backend"),
    );
    for admin_token in [&ops, &both] {
        let (name, value) = bearer(admin_token);
        let signed_in = request(
            svc.addr,
            "POST",
            "/session",
            &[(name, &value)],
            bytes::Bytes::new(),
        )
        .await
        .unwrap();
        assert_eq!(signed_in.status, 403, "{}", signed_in.body);
        assert!(signed_in.header("set-cookie").is_none());
    }
    // A user's access token signs in; the same claims as an ID token (typ JWT) do not.
    let (name, value) = bearer(&scoped_user);
    let signed_in = request(
        svc.addr,
        "POST",
        "/session",
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(signed_in.status, 200, "{}", signed_in.body);
    let id_token = idp.sign_typed(
        serde_json::json!({
            "iss": ISSUER, "aud": "chat-consumers", "sub": "frank", "iat": now(), "exp": now() + 600,
        }),
        "JWT",
    );
    assert_401(
        &get_as(svc.addr, "/chats/3/messages", Some(&id_token)).await,
        "typ",
    );
    assert_eq!(
        get_as(svc.addr, "/chats/3/messages", Some(&scoped_user))
            .await
            .status,
        200
    );
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_is_used_without_a_restart() {
    let stack = Stack::start(shared_postgres()).await;
    let mut idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    add_member(svc.addr, &idp, 2, "dave").await;
    let before = idp.token("dave");
    idp.rotate();
    let after = idp.token("dave");
    assert_ne!(
        jsonwebtoken::decode_header(&before).unwrap().kid,
        jsonwebtoken::decode_header(&after).unwrap().kid
    );
    // The new kid makes the service read the key set again (at most once a second).
    wait_until(Duration::from_secs(5), "the new key accepted", || async {
        match get_as(svc.addr, "/chats/2/messages", Some(&after)).await {
            r if r.status == 200 => Ok(()),
            r => Err(r.body),
        }
    })
    .await;
    // Tokens of the old key stay good while it is published.
    assert_eq!(
        get_as(svc.addr, "/chats/2/messages", Some(&before))
            .await
            .status,
        200
    );
    // Withdrawn (a compromise): its tokens are refused within a second or two, with no
    // token of an unknown key needed to make the service look.
    idp.withdraw_oldest();
    let withdrawn = std::time::Instant::now();
    wait_until(
        Duration::from_secs(5),
        "the withdrawn key refused",
        || async {
            match get_as(svc.addr, "/chats/2/messages", Some(&before)).await {
                r if r.status == 401 => Ok(()),
                r => Err(r.body),
            }
        },
    )
    .await;
    assert!(
        withdrawn.elapsed() < Duration::from_secs(3),
        "{:?}",
        withdrawn.elapsed()
    );
    assert_eq!(
        get_as(svc.addr, "/chats/2/messages", Some(&after))
            .await
            .status,
        200
    );
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_signs_in_with_a_cookie_and_its_stream_ends_when_the_token_expires() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    let a = svc.addr;
    add_member(a, &idp, 4, "erin").await;
    let short = idp.token_for("erin", Duration::from_secs(3), None);
    let (name, value) = bearer(&short);
    let signed_in = request(
        a,
        "POST",
        "/session",
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(signed_in.status, 200, "{}", signed_in.body);
    assert_eq!(signed_in.json()["user"], "erin");
    let cookie = signed_in.header("set-cookie").unwrap().to_string();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    let pair = cookie.split(';').next().unwrap().to_string();
    // The cookie alone identifies the page's requests, the event stream included.
    let session = request(
        a,
        "GET",
        "/session",
        &[("cookie", &pair)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(session.json()["user"], "erin");
    let opened = std::time::Instant::now();
    let feed = SseClient::connect_with(a, "/chats/4/events", &[("cookie", &pair)])
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the stream ended at expiry",
        || async {
            if feed.is_closed() {
                Ok(())
            } else {
                Err("open".to_string())
            }
        },
    )
    .await;
    assert!(
        opened.elapsed() < Duration::from_secs(5),
        "{:?}",
        opened.elapsed()
    );
    // Expired: the page is asked to sign in again.
    let again = SseClient::connect_with(a, "/chats/4/events", &[("cookie", &pair)]).await;
    assert!(again.err().unwrap().to_string().contains("401"));
    let out = request(a, "DELETE", "/session", &[], bytes::Bytes::new())
        .await
        .unwrap();
    assert!(out.header("set-cookie").unwrap().contains("Max-Age=0"));
    svc.stop().await;
}

/// The page's cookie is host-only and HTTPS-only by default, and holds a session token the
/// service signed, never the provider's: it is no bearer token, any instance sharing the
/// key knows it, a second cookie of its name is refused, and withdrawing the provider's key
/// that signed the token it began with ends the session and its open stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_session_is_a_narrowed_host_only_cookie_that_ends_with_its_key() {
    let stack = Stack::start(shared_postgres()).await;
    let mut idp = Idp::new();
    let key_file = testkit::scratch_dir("session-key").join("key");
    std::fs::write(
        &key_file,
        "k3y-for-the-session-cookies-of-this-test-0123456789\n",
    )
    .unwrap();
    let key_file = key_file.display().to_string();
    let mut flags = idp.flags();
    flags.extend(["--session-key-file".to_string(), key_file]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let one = stack.service(Side::Consumers, &flags).await;
    let two = stack.service(Side::Consumers, &flags).await;
    // Another deployment: the same provider, its own made-up session key.
    let idp_flags = idp.flags();
    let idp_flags: Vec<&str> = idp_flags.iter().map(String::as_str).collect();
    let other = stack.service(Side::Consumers, &idp_flags).await;
    add_member(one.addr, &idp, 5, "frank").await;
    let token = idp.token("frank");
    let (name, value) = bearer(&token);
    let signed_in = request(
        one.addr,
        "POST",
        "/session",
        &[(name, &value)],
        bytes::Bytes::new(),
    )
    .await
    .unwrap();
    assert_eq!(signed_in.status, 200, "{}", signed_in.body);
    let set_cookie = signed_in.header("set-cookie").unwrap().to_string();
    assert!(
        set_cookie.starts_with("__Host-chat_session_consumers="),
        "{set_cookie}"
    );
    for attribute in ["; Secure", "; HttpOnly", "; SameSite=Strict", "; Path=/"] {
        assert!(set_cookie.contains(attribute), "{set_cookie}");
    }
    let pair = set_cookie.split(';').next().unwrap().to_string();
    let session = pair.split_once('=').unwrap().1.to_string();
    // Not the provider's token, nor any part of it.
    assert_ne!(session, token);
    for part in token.split('.') {
        assert!(
            !session.contains(part),
            "the cookie holds part of the token"
        );
    }
    let by_cookie = |addr, cookie: String| async move {
        request(
            addr,
            "GET",
            "/chats/5/messages",
            &[("cookie", &cookie)],
            bytes::Bytes::new(),
        )
        .await
        .unwrap()
    };
    let history = by_cookie(one.addr, pair.clone()).await;
    assert_eq!(history.status, 200);
    // A user's messages are kept by no cache, and plain HTTP promises no HTTPS.
    assert_eq!(history.header("cache-control"), Some("no-store"));
    assert_eq!(history.header("strict-transport-security"), None);
    // Every instance sharing the key knows the session.
    assert_eq!(by_cookie(two.addr, pair.clone()).await.status, 200);
    // One with another key does not.
    assert_401(&by_cookie(other.addr, pair.clone()).await, "session cookie");
    // The session token is no bearer token.
    assert_401(
        &get_as(one.addr, "/chats/5/messages", Some(&session)).await,
        "invalid token",
    );
    // A second cookie of the name (planted by a parent domain): refused, and ours removed.
    let doubled = by_cookie(
        one.addr,
        format!("{pair}; __Host-chat_session_consumers=planted"),
    )
    .await;
    assert_401(&doubled, "more than once");
    assert!(doubled.header("set-cookie").unwrap().contains("Max-Age=0"));
    // The provider's key that signed the token withdrawn: the session and its stream end.
    let feed = SseClient::connect_with(one.addr, "/chats/5/events", &[("cookie", &pair)])
        .await
        .unwrap();
    idp.rotate();
    idp.withdraw_oldest();
    let withdrawn = std::time::Instant::now();
    wait_until(Duration::from_secs(10), "the stream ended", || async {
        if feed.is_closed() {
            Ok(())
        } else {
            Err("open".to_string())
        }
    })
    .await;
    assert!(
        withdrawn.elapsed() < Duration::from_secs(5),
        "{:?}",
        withdrawn.elapsed()
    );
    assert_401(
        &by_cookie(one.addr, pair.clone()).await,
        "no longer published",
    );
    // The other instance looks at the key set within a second of its own.
    wait_until(
        Duration::from_secs(3),
        "the other instance refuses it",
        || async {
            match by_cookie(two.addr, pair.clone()).await {
                r if r.status == 401 => Ok(()),
                r => Err(r.body),
            }
        },
    )
    .await;
    assert_401(&by_cookie(two.addr, pair).await, "no longer published");
    for svc in [one, two, other] {
        svc.stop().await;
    }
}

#[test]
fn a_service_without_authentication_refuses_to_start_and_says_what_to_set() {
    let parse = |extra: &[&str]| {
        let mut argv = vec![
            "chat-service",
            "--side",
            "consumers",
            "--database-url",
            "postgres://consumers@localhost/chat?sslmode=disable",
            "--redis-url",
            "redis://localhost",
        ];
        argv.extend(extra);
        <chat_services::Cli as clap::Parser>::try_parse_from(argv)
            .unwrap()
            .validate()
            .err()
            .map(|e| e.to_string())
    };
    let refused = parse(&[]).expect("refused");
    assert!(
        refused.contains("--jwks-file") && refused.contains("--allow-anonymous"),
        "{refused}"
    );
    assert_eq!(parse(&["--allow-anonymous"]), None);
    let missing = parse(&[
        "--jwks-file",
        "/nonexistent/jwks.json",
        "--jwt-issuer",
        "i",
        "--jwt-audience",
        "a",
    ])
    .unwrap();
    assert!(
        missing.contains("cannot read /nonexistent/jwks.json"),
        "{missing}"
    );
    let idp = Idp::new();
    let jwks = idp.jwks.display().to_string();
    let no_audience = parse(&["--jwks-file", &jwks, "--jwt-issuer", "i"]).unwrap();
    assert!(no_audience.contains("--jwt-audience"), "{no_audience}");
    let both = parse(&[
        "--jwks-file",
        &jwks,
        "--jwt-issuer",
        "i",
        "--jwt-audience",
        "a",
        "--allow-anonymous",
    ])
    .unwrap();
    assert!(both.contains("exclude each other"), "{both}");
    assert_eq!(
        parse(&[
            "--jwks-file",
            &jwks,
            "--jwt-issuer",
            "i",
            "--jwt-audience",
            "a"
        ]),
        None
    );
}

/// The provider's `jwks_uri`: an HTTPS server on loopback serving `file` as it is now.
async fn jwks_endpoint(
    port: u16,
    file: std::path::PathBuf,
    cert: &testkit::tls::ServerCert,
) -> tokio::task::JoinHandle<()> {
    use hyper_util::rt::TokioIo;
    let chain = rustls_pemfile::certs(&mut std::fs::read(&cert.cert).unwrap().as_slice())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls_pemfile::private_key(&mut std::fs::read(&cert.key).unwrap().as_slice())
        .unwrap()
        .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, file) = (acceptor.clone(), file.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |_req| {
                    let body = std::fs::read(&file).unwrap();
                    async move {
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from(body)),
                        ))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_fetched_from_the_providers_url_follow_a_rotation_and_outlive_an_outage() {
    let stack = Stack::start(shared_postgres()).await;
    let mut idp = Idp::new();
    let ca = testkit::tls::TestCa::new().unwrap();
    let cert = ca.issue("idp", &["localhost"]).unwrap();
    // The provider is not up yet when the service starts.
    let port = testkit::http::free_port();
    let url = format!("https://localhost:{port}/.well-known/jwks.json");
    let ca_file = ca.ca_file().display().to_string();
    let svc = stack
        .service(
            Side::Consumers,
            &[
                "--jwks-url",
                &url,
                "--jwks-ca-file",
                &ca_file,
                "--jwt-issuer",
                ISSUER,
                "--jwt-audience",
                AUDIENCE,
            ],
        )
        .await;
    // No keys yet: not ready, and a request is told to come back (503), not that its token
    // is bad (401).
    let (status, body) = testkit::http::get(svc.admin, "/readyz").await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no_token_keys"), "{body}");
    let early = get_as(svc.addr, "/chats/6/messages", Some(&idp.token("frank"))).await;
    assert_eq!(early.status, 503, "{}", early.body);
    assert!(early.header("retry-after").is_some());
    let server = jwks_endpoint(port, idp.jwks.clone(), &cert).await;
    // Fetched in the background once the provider answers.
    let admin = idp.admin();
    wait_until(Duration::from_secs(10), "the key set fetched", || async {
        match get_as(svc.addr, "/chats/6/members", Some(&admin)).await {
            r if r.status == 200 => Ok(()),
            r => Err(r.body),
        }
    })
    .await;
    add_member(svc.addr, &idp, 6, "frank").await;
    let before = idp.token("frank");
    assert_eq!(
        get_as(svc.addr, "/chats/6/messages", Some(&before))
            .await
            .status,
        200
    );

    // A new key at the provider: its first token makes the service fetch (at most every
    // 10 s), and it passes soon after.
    idp.rotate();
    let after = idp.token("frank");
    wait_until(
        Duration::from_secs(20),
        "the rotated key fetched",
        || async {
            match get_as(svc.addr, "/chats/6/messages", Some(&after)).await {
                r if r.status == 200 => Ok(()),
                r => Err(r.body),
            }
        },
    )
    .await;

    // The provider unreachable, and a fetch made to fail (a token of a key nobody has): the
    // keys there are keep verifying.
    server.abort();
    let _ = server.await;
    let failures = || async {
        let metrics = testkit::http::get(svc.admin, "/metrics").await.unwrap().1;
        testkit::http::metric_value(&metrics, "chat_jwks_fetch_failures_total").unwrap_or(0.0)
    };
    let failed_before = failures().await;
    let stranger = foreign_token("nobody", "frank");
    assert_eq!(
        get_as(svc.addr, "/chats/6/messages", Some(&stranger))
            .await
            .status,
        401
    );
    wait_until(Duration::from_secs(30), "a fetch that failed", || async {
        match failures().await {
            n if n > failed_before => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;
    assert_eq!(
        get_as(svc.addr, "/chats/6/messages", Some(&after))
            .await
            .status,
        200
    );
    assert_eq!(
        get_as(svc.addr, "/chats/6/messages", Some(&before))
            .await
            .status,
        200
    );
    // Refused at start: not https.
    let mut argv = vec!["chat-service".to_string()];
    argv.extend(stack.service_args(
        Side::Consumers,
        &[
            "--jwks-url",
            "http://id.example.com/jwks",
            "--jwt-issuer",
            "i",
            "--jwt-audience",
            "a",
        ],
    ));
    let refused = <chat_services::Cli as clap::Parser>::try_parse_from(argv)
        .unwrap()
        .validate()
        .expect_err("plain http")
        .to_string();
    assert!(refused.contains("must be an https:// URL"), "{refused}");
    svc.stop().await;
}
