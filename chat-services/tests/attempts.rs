//! What counts toward dead-lettering an entry: only processing that ended with its process
//! (a crash on the entry), never a session restart, a lease handover or a claim, which raise
//! Redis's delivery count through no fault of the entry.

use std::time::Duration;

use crate::support::{send, ServiceProcess, Stack};
use chat_services::Side;
use testkit::{shared_postgres, wait_until, PgServer};

/// A metric summed over its labels.
async fn metric(service: &ServiceProcess, name: &str) -> f64 {
    let (_, text) = testkit::http::get(service.admin, "/metrics").await.unwrap();
    testkit::http::metric_samples(&text)
        .iter()
        .filter(|(k, _)| k.starts_with(name))
        .map(|(_, v)| v)
        .sum()
}

async fn wait_retrying(service: &ServiceProcess, more_than: f64) {
    wait_until(Duration::from_secs(30), "inbox write retried", || async {
        match metric(service, "chat_inbox_write_retries_total").await {
            n if n > more_than => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_handovers_while_an_entry_waits_on_the_database_do_not_count_as_deliveries() {
    // GIVEN two Workers instances allowing a single delivery, and an inbox the receiver may
    // not write (retried in place) while a message arrives
    let pg = PgServer::start().unwrap();
    let stack = Stack::start(&pg).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let flags = [
        "--max-deliveries",
        "1",
        "--lease-ttl",
        "2s",
        "--claim-idle",
        "500ms",
    ];
    let a = stack
        .service_process(Side::Workers, "workers-a", &flags)
        .await;
    let b = stack
        .service_process_standby(Side::Workers, "workers-b", &flags)
        .await;
    let admin = stack.db.connect().await.unwrap();
    admin
        .batch_execute("REVOKE INSERT ON workers.inbox FROM workers")
        .await
        .unwrap();
    let m = send(consumers.addr, 51, "waits").await;
    wait_retrying(&a, 0.0).await;

    // WHEN the lease moves to the other instance and back, three times, each new holder
    // claiming the entry and retrying it
    let mut redis = stack.redis().connect().await.unwrap();
    for round in 0..3 {
        let (to, name) = if round % 2 == 0 {
            (&b, "workers-b")
        } else {
            (&a, "workers-a")
        };
        let before = metric(to, "chat_inbox_write_retries_total").await;
        let () = redis::cmd("SET")
            .arg("inbox-lease:workers")
            .arg(format!("{name}/handed-over"))
            .arg("PX")
            .arg(5000)
            .query_async(&mut redis)
            .await
            .unwrap();
        to.wait_consuming().await;
        wait_retrying(to, before).await;
    }

    // THEN once the database takes it, the message is recorded, not dead-lettered
    admin
        .batch_execute("GRANT INSERT ON workers.inbox TO workers")
        .await
        .unwrap();
    wait_until(Duration::from_secs(30), "message recorded", || async {
        let n = stack
            .count(&format!(
                "SELECT count(*) FROM workers.inbox WHERE message_id = '{}'",
                m["id"].as_str().unwrap()
            ))
            .await;
        if n == 1 {
            Ok(())
        } else {
            Err(format!("{n}; dead letters {}", stack.dead_letters().await))
        }
    })
    .await;
    assert_eq!(stack.dead_letters().await, 0);
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_consumer_is_dead_lettered_after_one_crash_alone() {
    // GIVEN Workers that die on a message "boom" (with the default --max-deliveries)
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let flags = ["--consumer-name", "workers", "--crash-on-body", "boom"];

    // WHEN it is in one batch between two others (all in the stream before Workers starts,
    // so its first read takes the three), and the process is restarted each time it dies
    for body in ["beside one", "boom", "beside two"] {
        send(consumers.addr, 52, body).await;
    }
    wait_until(Duration::from_secs(20), "all three published", || async {
        let mut redis = stack.redis().connect().await.unwrap();
        match redis::cmd("XLEN")
            .arg("outbox:consumers")
            .query_async::<usize>(&mut redis)
            .await
            .unwrap()
        {
            3 => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;
    let first = stack.spawn_service(Side::Workers, "workers-1", &flags, &[]);
    first.child.wait_exit(Duration::from_secs(20)).unwrap();
    let second = stack.spawn_service(Side::Workers, "workers-2", &flags, &[]);
    second.child.wait_exit(Duration::from_secs(20)).unwrap();
    let workers = stack
        .service_process(Side::Workers, "workers-3", &flags)
        .await;

    // THEN the third run dead-letters it (the second, going one entry at a time, recorded
    // the first and died on it alone: conclusive, whatever --max-deliveries allows) instead
    // of dying, says why, and goes on
    wait_until(Duration::from_secs(20), "dead-lettered", || async {
        match stack.dead_letters().await {
            1 => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;
    let mut redis = stack.redis().connect().await.unwrap();
    let dead: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg("deadletter:workers")
        .arg("-")
        .arg("+")
        .query_async(&mut redis)
        .await
        .unwrap();
    let reason = redis::from_redis_value_ref::<String>(&dead.ids[0].map["reason"]).unwrap();
    assert!(
        reason.contains("while it was processed alone (conclusive)"),
        "{reason}"
    );
    send(consumers.addr, 52, "after").await;
    wait_until(Duration::from_secs(20), "the next one recorded", || async {
        match stack
            .count("SELECT count(*) FROM workers.inbox WHERE chat_id = 52")
            .await
        {
            3 => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;
    assert_eq!(workers.child.try_status(), None, "still running");
    assert_eq!(stack.dead_letters().await, 1, "only the message that kills");
    consumers.stop().await;
    stack.stop().await;
}

/// A Workers holder lost with entries pending (`signal`: SIGKILL, or SIGSTOP and left frozen)
/// while a standby waits: how long after the lost holder's lease expired its entries were
/// recorded.
async fn holder_lost_with_entries_pending(signal: testkit::Signal) -> Duration {
    let pg = PgServer::start().unwrap();
    let stack = Stack::start(&pg).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let a = stack.service_process(Side::Workers, "workers-a", &[]).await;
    let b = stack
        .service_process_standby(Side::Workers, "workers-b", &[])
        .await;
    // The holder has the entries and cannot write them (retried in place, never counted).
    let admin = stack.db.connect().await.unwrap();
    admin
        .batch_execute("REVOKE INSERT ON workers.inbox FROM workers")
        .await
        .unwrap();
    for n in 0..20 {
        send(consumers.addr, 53, &format!("pending {n}")).await;
    }
    wait_retrying(&a, 0.0).await;

    // WHEN the holder is lost without releasing its lease, and the database takes writes
    let mut redis = stack.redis().connect().await.unwrap();
    a.child.signal(signal).unwrap();
    let lease_left: i64 = redis::cmd("PTTL")
        .arg("inbox-lease:workers")
        .query_async(&mut redis)
        .await
        .unwrap();
    let expires = std::time::Instant::now() + Duration::from_millis(lease_left.max(0) as u64);
    admin
        .batch_execute("GRANT INSERT ON workers.inbox TO workers")
        .await
        .unwrap();

    // THEN the standby records every one of them, once, soon after the lease expired
    wait_until(
        Duration::from_secs(60),
        "the pending entries recorded",
        || async {
            match stack
                .count("SELECT count(*) FROM workers.inbox WHERE chat_id = 53")
                .await
            {
                20 => Ok(()),
                n => Err(format!("{n} of 20")),
            }
        },
    )
    .await;
    let after_expiry = std::time::Instant::now().saturating_duration_since(expires);
    b.wait_consuming().await;
    assert_eq!(
        stack.dead_letters().await,
        0,
        "nothing counted as a crash of its own"
    );
    if signal == testkit::Signal::Stop {
        // ... and the frozen one, thawed, stands down without writing anything more
        a.child.signal(testkit::Signal::Cont).unwrap();
        send(consumers.addr, 53, "after").await;
        wait_until(Duration::from_secs(30), "the next one recorded", || async {
            match stack
                .count("SELECT count(*) FROM workers.inbox WHERE chat_id = 53")
                .await
            {
                21 => Ok(()),
                n => Err(format!("{n} of 21")),
            }
        })
        .await;
    }
    consumers.stop().await;
    stack.stop().await;
    after_expiry
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_holders_pending_entries_are_recorded_within_two_seconds_of_its_lease_expiring() {
    let killed = holder_lost_with_entries_pending(testkit::Signal::Kill).await;
    let frozen = holder_lost_with_entries_pending(testkit::Signal::Stop).await;
    println!("a lost holder's pending entries recorded {killed:?} (SIGKILL) and {frozen:?} (SIGSTOP) after its lease expired");
    assert!(killed < Duration::from_millis(2500), "{killed:?}");
    assert!(frozen < Duration::from_millis(2500), "{frozen:?}");
}
