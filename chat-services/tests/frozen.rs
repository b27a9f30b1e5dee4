//! A Postgres that stops answering without closing its connections (every process
//! SIGSTOPped: a frozen VM, a stalled disk): a send answers 503 within the promised 5 s
//! (with the key that makes its retry safe), readiness says so, and when the server
//! answers again everything sent is delivered, once.

use std::time::{Duration, Instant};

use chat_services::Side;
use testkit::{wait_until, PgServer};

use crate::support::{send, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_postgres_answers_sends_with_503_within_5_s_and_delivery_resumes() {
    // GIVEN both sides running against a Postgres of their own, a message delivered
    let pg = PgServer::start().unwrap();
    let stack = Stack::start(&pg).await;
    let consumers = stack
        .service_process(Side::Consumers, "consumers-1", &[])
        .await;
    let _workers = stack.service_process(Side::Workers, "workers-1", &[]).await;
    send(consumers.addr, 1, "before").await;
    let received = |n: i64| {
        let stack = &stack;
        async move {
            wait_until(Duration::from_secs(60), "messages received", || async {
                match stack.count("SELECT count(*) FROM workers.inbox").await {
                    got if got >= n => Ok(()),
                    got => Err(format!("{got} of {n}")),
                }
            })
            .await
        }
    };
    received(1).await;
    let health_before = health_backend(&stack).await;

    // WHEN every Postgres process is SIGSTOPped
    pg.freeze().unwrap();
    let asked = Instant::now();
    let reply = tokio::time::timeout(
        Duration::from_secs(30),
        testkit::http::post_json(
            consumers.addr,
            "/chats/1/messages",
            &serde_json::json!({"body": "while frozen"}),
            &[],
        ),
    )
    .await
    .expect("a send while Postgres is frozen answers")
    .expect("POST");
    let took = asked.elapsed();
    let ready = tokio::time::timeout(
        Duration::from_secs(10),
        testkit::http::get(consumers.admin, "/readyz"),
    )
    .await
    .expect("readyz answers")
    .expect("GET /readyz");
    pg.thaw().unwrap();

    // THEN the send was answered 503 within about 5 s, with the key for a safe retry, and
    // readiness said the database is unavailable
    println!("send with Postgres frozen: {} after {took:?}", reply.status);
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(took < Duration::from_secs(7), "503 after {took:?}");
    let key = reply
        .headers
        .get("idempotency-key")
        .expect("the 503 names the key to retry with")
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(ready.0, 503, "{}", ready.1);
    // ... and once Postgres answers again, the retry with that key and a new send are
    // delivered, each once
    let retried = testkit::http::post_json(
        consumers.addr,
        "/chats/1/messages",
        &serde_json::json!({"body": "while frozen"}),
        &[("idempotency-key", &key)],
    )
    .await
    .unwrap();
    assert_eq!(retried.status, 201, "{}", retried.body);
    send(consumers.addr, 1, "after").await;
    received(3).await;
    assert_eq!(
        stack
            .count("SELECT count(DISTINCT body) FROM workers.inbox")
            .await,
        3
    );
    // AND the health check kept its connection through the freeze: a new one would queue
    // behind every connection abandoned meanwhile, and the instance would learn that
    // Postgres is back (readiness, the inbox membership, the retries that wait for it) only
    // once the server had forked a backend for each of those first
    assert_eq!(
        health_backend(&stack).await,
        health_before,
        "the health check's backend (pid) after the freeze is the one from before"
    );
}

/// The pid of the Consumers service's health-check backend.
async fn health_backend(stack: &Stack<'_>) -> i32 {
    let db = stack.db.connect().await.unwrap();
    let rows = db
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'chat-consumers-health'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "one health-check connection");
    rows[0].get(0)
}
