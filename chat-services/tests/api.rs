//! The HTTP API's contract: what it accepts, what it refuses (one assertion per bad input),
//! idempotent retries, history, and the database roles behind it.

use crate::support::{send, Stack};
use chat_services::Side;
use testkit::http::{post_json, request, Reply};
use testkit::{shared_postgres, PgServer};

fn assert_error(reply: &Reply, status: u16, says: &str) {
    assert_eq!(reply.status, status, "{}", reply.body);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let error = reply.json()["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        error.contains(says),
        "error {error:?} does not say {says:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_a_json_error_naming_the_problem() {
    // As users send it: with a member's token, so every case passes identification and
    // membership and meets the input checks themselves.
    let stack = Stack::start(shared_postgres()).await;
    let idp = crate::support::Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let svc = stack.service(Side::Consumers, &flags).await;
    let a = svc.addr;
    crate::support::add_member(a, &idp, 7, "alice").await;
    let token = format!("Bearer {}", idp.token("alice"));
    let auth = ("authorization", token.as_str());
    let json = "application/json";
    let post_raw = |addr, path: &'static str, content_type: &'static str, body: &str| {
        let body = body.to_string();
        async move {
            request(
                addr,
                "POST",
                path,
                &[("content-type", content_type), auth],
                body,
            )
            .await
            .unwrap()
        }
    };

    assert_error(
        &post_raw(a, "/chats/0/messages", json, r#"{"body":"x"}"#).await,
        400,
        "chat_id must be a positive integer, got '0'",
    );
    assert_error(
        &post_raw(a, "/chats/-3/messages", json, r#"{"body":"x"}"#).await,
        400,
        "got '-3'",
    );
    assert_error(
        &post_raw(a, "/chats/abc/messages", json, r#"{"body":"x"}"#).await,
        400,
        "got 'abc'",
    );
    assert_error(
        &post_raw(
            a,
            "/chats/99999999999999999999/messages",
            json,
            r#"{"body":"x"}"#,
        )
        .await,
        400,
        "positive integer",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"{}"#).await,
        400,
        "body is missing",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"{"body":""}"#).await,
        400,
        "body is empty",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"{"body":"   "}"#).await,
        400,
        "body is empty",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"{"body":42}"#).await,
        400,
        "body must be a string",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"{"body":["a"]}"#).await,
        400,
        "body must be a string",
    );
    let long = format!(r#"{{"body":"{}"}}"#, "x".repeat(4001));
    assert_error(
        &post_raw(a, "/chats/7/messages", json, &long).await,
        413,
        "body has 4001 characters; the limit is 4000",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"{"body":"x"#).await,
        400,
        "malformed JSON",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, "not json").await,
        400,
        "malformed JSON",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"["body"]"#).await,
        400,
        "must be a JSON object",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"{"body":"x","to":1}"#).await,
        400,
        "unknown field 'to'",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", json, r#"{"body":"a\u0000b"}"#).await,
        400,
        "NUL",
    );
    assert_error(
        &post_raw(a, "/chats/7/messages", "text/plain", r#"{"body":"x"}"#).await,
        415,
        "Content-Type must be application/json",
    );
    // No Content-Type at all (what a cross-site no-cors fetch of a string sends is
    // text/plain; without the header nothing is assumed either).
    assert_error(
        &request(
            a,
            "POST",
            "/chats/7/messages",
            &[auth],
            r#"{"body":"x"}"#.to_string(),
        )
        .await
        .unwrap(),
        415,
        "Content-Type must be application/json",
    );
    let huge = format!(r#"{{"body":"{}"}}"#, "x".repeat(70_000));
    assert_error(
        &post_raw(a, "/chats/7/messages", json, &huge).await,
        413,
        "request body is over 65536 bytes",
    );
    let bad_key = post_json(
        a,
        "/chats/7/messages",
        &serde_json::json!({"body": "x"}),
        &[auth, ("idempotency-key", "has space")],
    )
    .await
    .unwrap();
    assert_error(&bad_key, 400, "Idempotency-Key must be");
    assert_error(
        &request(a, "GET", "/nowhere", &[auth], "").await.unwrap(),
        404,
        "no route /nowhere",
    );
    assert_error(
        &request(a, "GET", "/chats/7", &[auth], "").await.unwrap(),
        404,
        "no route",
    );
    let wrong = request(a, "DELETE", "/chats/7/messages", &[auth], "")
        .await
        .unwrap();
    assert_error(&wrong, 405, "DELETE is not allowed");
    assert_eq!(wrong.header("allow"), Some("GET, POST"));
    assert_error(
        &request(a, "POST", "/chats/7/events", &[auth], "")
            .await
            .unwrap(),
        405,
        "POST is not allowed",
    );
    assert_error(
        &request(a, "GET", "/chats/7/messages?limit=0", &[auth], "")
            .await
            .unwrap(),
        400,
        "limit must be an integer from 1 to 500",
    );
    assert_error(
        &request(a, "GET", "/chats/7/messages?limit=x", &[auth], "")
            .await
            .unwrap(),
        400,
        "limit must be",
    );
    assert_error(
        &request(a, "GET", "/chats/7/messages?before=nope", &[auth], "")
            .await
            .unwrap(),
        400,
        "before must be a message id",
    );
    assert_error(
        &request(
            a,
            "GET",
            "/chats/7/messages?before=0193c0de-8a4b-7cc1-9a1e-3f1d2e4b5a6c",
            &[auth],
            "",
        )
        .await
        .unwrap(),
        400,
        "is not a message of this chat",
    );
    assert_error(
        &request(a, "GET", "/chats/7/messages?color=red", &[auth], "")
            .await
            .unwrap(),
        400,
        "unknown query parameter 'color'",
    );
    assert_error(
        &request(a, "GET", "/chats/7/events?after=-1", &[auth], "")
            .await
            .unwrap(),
        400,
        "after must be an event id like p42",
    );
    assert_error(
        &request(
            a,
            "GET",
            "/chats/7/events",
            &[auth, ("last-event-id", "x")],
            "",
        )
        .await
        .unwrap(),
        400,
        "Last-Event-ID must be an event id like p42",
    );

    // None of that wrote anything.
    let db = stack.db.connect().await.unwrap();
    let counts: (i64, i64) = {
        let row = db
            .query_one("SELECT (SELECT count(*) FROM consumers.messages), (SELECT count(*) FROM consumers.outbox)", &[])
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(counts, (0, 0));

    // An HTML/script body is stored and returned verbatim (rendering is the page's job).
    let script = "<script>alert('x')</script><b>bold</b> & \"quotes\"";
    let sent = crate::support::send_as(a, &idp.token("alice"), 7, script).await;
    assert_eq!(sent.status, 201, "{}", sent.body);
    let sent = sent.json();
    assert_eq!(sent["body"], script);
    let stored: String = db
        .query_one("SELECT body FROM consumers.messages", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, script);
    let payload: serde_json::Value = db
        .query_one("SELECT payload FROM consumers.outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(payload["body"], script);
    svc.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_writes_the_message_and_its_event_and_answers_the_message() {
    let stack = Stack::start(shared_postgres()).await;
    let svc = stack.service(Side::Workers, &[]).await;
    let sent = send(svc.addr, 42, "hi").await;
    let id = uuid::Uuid::parse_str(sent["id"].as_str().unwrap()).unwrap();
    assert_eq!(id.get_version_num(), 7, "UUIDv7");
    assert_eq!(sent["chat_id"], 42);
    assert_eq!(sent["side"], "workers");
    assert!(sent["created_at"].as_str().unwrap().ends_with('Z'));
    let (status, metrics) = testkit::http::get(svc.admin, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        testkit::http::metric_value(&metrics, "chat_messages_sent_total"),
        Some(1.0)
    );
    testkit::http::promtool_check_metrics(&metrics).unwrap();
    let db = stack.db.connect().await.unwrap();
    let row = db
        .query_one("SELECT event, payload FROM workers.outbox", &[])
        .await
        .unwrap();
    let event: String = row.get(0);
    let payload: serde_json::Value = row.get(1);
    assert_eq!(event, "message.created");
    // The answer adds the message's place in this side's feed; the event is the message.
    let mut answered = sent.clone();
    assert_eq!(answered["pos"], 1, "the chat's first message");
    answered.as_object_mut().unwrap().remove("pos");
    assert_eq!(
        payload, answered,
        "the event carries the message as answered"
    );
    svc.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_post_with_the_same_idempotency_key_returns_the_original() {
    let stack = Stack::start(shared_postgres()).await;
    let svc = stack.service(Side::Consumers, &[]).await;
    let body = serde_json::json!({"body": "once"});
    let key = [("idempotency-key", "k-123")];
    let first = post_json(svc.addr, "/chats/7/messages", &body, &key)
        .await
        .unwrap();
    let second = post_json(svc.addr, "/chats/7/messages", &body, &key)
        .await
        .unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(second.status, 201);
    assert_eq!(first.json(), second.json());
    assert_eq!(second.header("idempotency-replayed"), Some("true"));
    let other = post_json(
        svc.addr,
        "/chats/7/messages",
        &serde_json::json!({"body": "different"}),
        &key,
    )
    .await
    .unwrap();
    assert_error(
        &other,
        422,
        "Idempotency-Key was already used for a different message",
    );
    let db = stack.db.connect().await.unwrap();
    let row = db
        .query_one("SELECT (SELECT count(*) FROM consumers.messages), (SELECT count(*) FROM consumers.outbox)", &[])
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (1, 1));
    svc.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_shows_sent_and_received_in_order_and_pages_back() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;
    let history = |query: String| {
        let addr = consumers.addr;
        async move {
            let reply = request(addr, "GET", &format!("/chats/8/messages{query}"), &[], "")
                .await
                .unwrap();
            assert_eq!(reply.status, 200, "{}", reply.body);
            reply.json()["messages"].as_array().unwrap().clone()
        }
    };
    // Each one shown on consumers before the next is sent: consumers' order is then the
    // sending order (history shows the order of arrival on this side).
    let mut ids = Vec::new();
    for i in 0..6 {
        let from = if i % 2 == 0 {
            consumers.addr
        } else {
            workers.addr
        };
        ids.push(send(from, 8, &format!("m{i}")).await["id"].clone());
        testkit::wait_until(
            std::time::Duration::from_secs(10),
            "the message in consumers' history",
            || async move {
                let n = history(String::new()).await.len();
                if n == i + 1 {
                    Ok(())
                } else {
                    Err(format!("{n}"))
                }
            },
        )
        .await;
    }
    let all = history(String::new()).await;
    let got: Vec<_> = all.iter().map(|m| m["id"].clone()).collect();
    assert_eq!(got, ids, "oldest first, both sides");
    let positions: Vec<_> = all.iter().map(|m| m["pos"].as_i64().unwrap()).collect();
    assert_eq!(positions, [1, 2, 3, 4, 5, 6], "one feed, sent and received");
    let page = history(format!("?limit=2&before={}", ids[4].as_str().unwrap())).await;
    let got: Vec<_> = page.iter().map(|m| m["id"].clone()).collect();
    assert_eq!(got, ids[2..4]);
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_answers_503_with_retry_after_and_writes_nothing() {
    let pg = PgServer::start().unwrap();
    let stack = Stack::start(&pg).await;
    let svc = stack.service(Side::Consumers, &[]).await;
    send(svc.addr, 7, "before").await;
    // A fast shutdown waits for each walsender's client (the in-process relays) to confirm
    // the end of the WAL: the wait must not hold this worker thread, where a relay task may
    // be queued. A relay that cannot confirm lets the server go after its --shutdown-grace
    // (cdc-relay's faults::postgres_stops_fast_while_redis_is_down), so this stop is short.
    tokio::task::block_in_place(|| pg.stop_fast_within(std::time::Duration::from_secs(30)))
        .unwrap();
    let reply = post_json(
        svc.addr,
        "/chats/7/messages",
        &serde_json::json!({"body": "during"}),
        &[],
    )
    .await
    .unwrap();
    assert_error(&reply, 503, "nothing was written");
    assert_eq!(reply.header("retry-after"), Some("1"));
    let (status, body) = testkit::http::get(svc.admin, "/readyz").await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("postgres_unavailable"));
    pg.start_again().unwrap();
    testkit::wait_until(
        std::time::Duration::from_secs(20),
        "ready again",
        || async {
            match testkit::http::get(svc.admin, "/readyz").await {
                Ok((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    send(svc.addr, 7, "after").await;
    let db = stack.db.connect().await.unwrap();
    let bodies: Vec<String> = db
        .query(
            "SELECT body FROM consumers.messages ORDER BY created_at",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(bodies, ["before", "after"]);
    let events: i64 = db
        .query_one("SELECT count(*) FROM consumers.outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(events, 2);
    svc.stop().await;
    stack.stop().await;
}

#[tokio::test]
async fn each_role_is_refused_the_other_sides_schema() {
    let db = shared_postgres().create_database().await.unwrap();
    for (role, foreign) in [("workers", "consumers"), ("consumers", "workers")] {
        let client = db.connect_as(role).await.unwrap();
        for sql in [
            format!("SELECT * FROM {foreign}.messages"),
            format!("SELECT * FROM {foreign}.inbox"),
            format!("INSERT INTO {foreign}.outbox (event, payload) VALUES ('x', '{{}}')"),
        ] {
            let err = client.batch_execute(&sql).await.expect_err(&sql);
            assert_eq!(
                err.code(),
                Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
                "{sql}: {err}"
            );
            assert!(
                err.as_db_error()
                    .unwrap()
                    .message()
                    .contains("permission denied"),
                "{sql}"
            );
        }
        // Its own schema works.
        client
            .batch_execute(&format!("SELECT * FROM {role}.messages"))
            .await
            .unwrap();
        // ... for its data only: the tables and the schema belong to a role nobody logs in
        // as, so the service cannot change them, plant a trigger (which would run as whoever
        // writes next, a migration's superuser included) or add objects.
        for sql in [
            format!("ALTER TABLE {role}.messages ADD COLUMN x int"),
            format!(
                "CREATE FUNCTION {role}.f() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$"
            ),
            format!("CREATE TABLE {role}.planted (x int)"),
            format!("DROP TABLE {role}.outbox"),
        ] {
            let err = client.batch_execute(&sql).await.expect_err(&sql);
            assert!(
                matches!(
                    err.code(),
                    Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE)
                ),
                "{sql}: {err:?}"
            );
        }
    }
    // A relay role may read its own outbox (to rebuild its stream) and nothing else.
    let relay = db.connect_as("consumers_relay").await.unwrap();
    relay
        .batch_execute("SELECT * FROM consumers.outbox")
        .await
        .unwrap();
    for sql in [
        "SELECT * FROM consumers.messages",
        "SELECT * FROM consumers.inbox",
        "SELECT * FROM workers.outbox",
        "INSERT INTO consumers.outbox (event, payload) VALUES ('x', '{}')",
        "DELETE FROM consumers.outbox",
    ] {
        let err = relay.batch_execute(sql).await.expect_err(sql);
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{sql}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_and_metrics_answer_on_the_admin_listener_only() {
    let stack = Stack::start(shared_postgres()).await;
    let svc = stack.service(Side::Consumers, &[]).await;
    for path in ["/readyz", "/metrics"] {
        let (status, body) = testkit::http::get(svc.addr, path).await.unwrap();
        assert_eq!(status, 404, "{path} on the public listener: {body}");
        assert!(body.contains("admin listener"), "{body}");
        let (status, _) = testkit::http::get(svc.admin, path).await.unwrap();
        assert_eq!(status, 200, "{path} on the admin listener");
    }
    for addr in [svc.addr, svc.admin] {
        let (status, _) = testkit::http::get(addr, "/healthz").await.unwrap();
        assert_eq!(status, 200);
    }
    let (status, _) = testkit::http::get(svc.admin, "/chats/1/messages")
        .await
        .unwrap();
    assert_eq!(status, 404, "the API is not on the admin listener");
    svc.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_runs_no_inline_code_cannot_be_framed_and_no_answer_is_sniffed() {
    let stack = Stack::start(shared_postgres()).await;
    let svc = stack.service(Side::Consumers, &[]).await;
    for (path, mime) in [
        ("/", "text/html"),
        ("/page.js", "text/javascript"),
        ("/page.css", "text/css"),
    ] {
        let reply = request(svc.addr, "GET", path, &[], "").await.unwrap();
        assert_eq!(reply.status, 200, "{path}");
        assert!(
            reply.header("content-type").unwrap().starts_with(mime),
            "{path}"
        );
        let policy = reply.header("content-security-policy").unwrap();
        assert!(!policy.contains("unsafe-inline"), "{path}: {policy}");
        for directive in [
            "script-src 'self'",
            "style-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(policy.contains(directive), "{path}: {policy}");
        }
    }
    let (_, page) = testkit::http::get(svc.addr, "/").await.unwrap();
    assert!(
        !page.contains("<script>") && !page.contains("<style>"),
        "inline code in the page"
    );
    // Every answer, errors included.
    for path in ["/", "/chats/7/messages", "/nowhere"] {
        let reply = request(svc.addr, "GET", path, &[], "").await.unwrap();
        assert_eq!(
            reply.header("x-content-type-options"),
            Some("nosniff"),
            "{path}"
        );
        assert_eq!(
            reply.header("referrer-policy"),
            Some("no-referrer"),
            "{path}"
        );
    }
    svc.stop().await;
    stack.stop().await;
}
