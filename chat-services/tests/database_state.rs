//! Errors that are the database's fault, not an entry's, never dead-letter: the inbox write
//! is retried in place while INSERT is revoked or the database is read-only (a failover onto
//! a demoted primary), and every message arrives once the database is repaired.

use std::time::Duration;

use crate::support::{next_message, send, Stack};
use chat_services::Side;
use testkit::http::SseClient;
use testkit::{wait_until, PgServer};

async fn retries(addr: std::net::SocketAddr) -> f64 {
    let (_, body) = testkit::http::get(addr, "/metrics").await.unwrap();
    testkit::http::metric_samples(&body)
        .iter()
        .filter(|(k, _)| {
            k.starts_with("chat_inbox_write_retries_total") && k.contains("database_state")
        })
        .map(|(_, v)| v)
        .sum()
}

/// Wait until the receiving side retried its inbox write `more` more times.
async fn wait_retrying(addr: std::net::SocketAddr, more: f64) {
    let start = retries(addr).await;
    wait_until(Duration::from_secs(30), "inbox writes retried", || async {
        let now = retries(addr).await;
        if now >= start + more {
            Ok(())
        } else {
            Err(format!("{now} retries"))
        }
    })
    .await
}

/// Close the workers role's sessions, so its pool reconnects under the new role settings.
async fn reconnect_workers(admin: &tokio_postgres::Client) {
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'workers'",
            &[],
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_insert_and_a_read_only_database_dead_letter_nothing() {
    // A server of its own: role settings are cluster-wide.
    let pg = PgServer::start().unwrap();
    let stack = Stack::start(&pg).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;
    let mut client = SseClient::connect(workers.addr, "/chats/5/events", None)
        .await
        .unwrap();
    let admin = stack.db.connect().await.unwrap();

    // WHEN the receiver may not insert into its inbox while messages arrive
    admin
        .batch_execute("REVOKE INSERT ON workers.inbox FROM workers")
        .await
        .unwrap();
    let mut sent = Vec::new();
    for i in 0..5 {
        sent.push(send(consumers.addr, 5, &format!("while revoked {i}")).await);
    }
    wait_retrying(workers.admin, 3.0).await;
    assert_eq!(stack.dead_letters().await, 0);
    // ... and after the grant comes back, they are all shown, once, in order
    admin
        .batch_execute("GRANT INSERT ON workers.inbox TO workers")
        .await
        .unwrap();
    for expected in &sent {
        let (_, shown) = next_message(&mut client, Duration::from_secs(30)).await;
        assert_eq!(shown["id"], expected["id"]);
    }

    // WHEN the database turns read-only for the receiver (a demoted primary)
    admin
        .batch_execute("ALTER ROLE workers SET default_transaction_read_only = on")
        .await
        .unwrap();
    reconnect_workers(&admin).await;
    let mut sent = Vec::new();
    for i in 0..5 {
        sent.push(send(consumers.addr, 5, &format!("while read-only {i}")).await);
    }
    wait_retrying(workers.admin, 3.0).await;
    assert_eq!(stack.dead_letters().await, 0);
    admin
        .batch_execute("ALTER ROLE workers RESET default_transaction_read_only")
        .await
        .unwrap();
    reconnect_workers(&admin).await;
    for expected in &sent {
        let (_, shown) = next_message(&mut client, Duration::from_secs(30)).await;
        assert_eq!(shown["id"], expected["id"]);
    }

    // THEN nothing was dead-lettered, and each message is in the inbox once
    assert_eq!(stack.dead_letters().await, 0);
    assert_eq!(
        stack
            .count("SELECT count(*) FROM workers.inbox WHERE chat_id = 5")
            .await,
        10
    );
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}
