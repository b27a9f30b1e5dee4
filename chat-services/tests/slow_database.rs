//! A database that is slow, not down: the receiver's inbox write of a large batch runs
//! past the server's statement timeout every time (a trigger sleeping per inbox row). The
//! batch is written in halves until it fits, every message arrives once, sends to other chats
//! keep answering meanwhile, and the service stays ready (busy is not dead).

use std::time::{Duration, Instant};

use crate::support::{send, Stack};
use chat_services::Side;
use testkit::PgServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_inbox_write_is_halved_and_sends_to_other_chats_keep_answering() {
    // GIVEN 120 messages waiting for Workers (stopped), over 40 chats
    let pg = PgServer::start().unwrap();
    let stack = Stack::start(&pg).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    for n in 0..120 {
        send(consumers.addr, 100 + n % 40, &format!("slow {n}")).await;
    }
    // ... and a database that takes 60 ms per inbox row (a 100-row batch: 6 s, past the 4 s
    // statement timeout of the services' sessions)
    let admin = stack.db.connect().await.unwrap();
    admin
        .batch_execute(
            "CREATE FUNCTION workers.slow_row() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_sleep(0.06); RETURN NEW; END $$;
             CREATE TRIGGER slow_row BEFORE INSERT ON workers.inbox
               FOR EACH ROW EXECUTE FUNCTION workers.slow_row();",
        )
        .await
        .unwrap();

    // WHEN Workers starts and records them, while its users send to other chats
    let workers = stack.service_process(Side::Workers, "workers-1", &[]).await;
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut ready = true;
    while stack
        .count("SELECT count(*) FROM workers.inbox WHERE chat_id BETWEEN 100 AND 139")
        .await
        < 120
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "not every message recorded in 2 minutes"
        );
        let t = Instant::now();
        send(workers.addr, 7, "meanwhile").await;
        slowest = slowest.max(t.elapsed());
        ready &= matches!(
            testkit::http::get(workers.admin, "/readyz").await,
            Ok((200, _))
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // THEN every message was recorded once, the batch was written in halves, sends to
    // another chat answered promptly and the service never went unready
    assert_eq!(
        stack
            .count("SELECT count(DISTINCT message_id) FROM workers.inbox WHERE chat_id BETWEEN 100 AND 139")
            .await,
        120
    );
    let (_, metrics) = testkit::http::get(workers.admin, "/metrics").await.unwrap();
    let halved =
        testkit::http::metric_value(&metrics, "chat_inbox_write_retries_total{cause=\"busy\"}");
    println!(
        "slow inbox: 120 messages recorded in {:?}, halved {halved:?} times; slowest send to another chat {slowest:?}",
        started.elapsed()
    );
    assert!(halved.is_some_and(|n| n >= 1.0), "{metrics}");
    assert!(slowest < Duration::from_secs(2), "{slowest:?}");
    assert!(
        ready,
        "the service went unready while the database was busy"
    );
    assert_eq!(stack.dead_letters().await, 0);
    consumers.stop().await;
    stack.stop().await;
}
