//! A backlog in a shard (left while the receiving side was down, or one chat's burst) is
//! caught up in each chat's order without holding back the chats of that shard that have
//! nothing in it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::support::{assert_received_in_sent_order, send, Stack};
use chat_services::Side;
use testkit::shared_postgres;

/// Messages of `chat` written on the Consumers side as its sends write them (message and
/// outbox row in one statement), `count` of them at once.
async fn write_backlog(stack: &Stack<'_>, chat: i64, count: i64) {
    let db = stack.db.connect().await.unwrap();
    db.batch_execute(&format!(
        "WITH m AS (
           INSERT INTO consumers.messages (id, chat_id, body, created_at, idempotency_key, sender)
           SELECT gen_random_uuid(), {chat}, 'backlog ' || g, date_trunc('milliseconds', now()), 'backlog-' || g, NULL
             FROM generate_series(1, {count}) g
           RETURNING id, chat_id, body, created_at, pos)
         INSERT INTO consumers.outbox (event, payload, partition_key)
         SELECT 'message.created',
                jsonb_build_object('id', id, 'chat_id', chat_id, 'body', body,
                                   'created_at', to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
                                   'side', 'consumers', 'sender', NULL),
                chat_id::text
           FROM m ORDER BY pos"
    ))
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_one_chat_does_not_hold_back_another_chat_of_its_shard() {
    const BACKLOG: i64 = 20_000;
    // One shard: every chat shares it.
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    // GIVEN a backlog of chat 1 in the Workers' stream, left while Workers was not running
    write_backlog(&stack, 1, BACKLOG).await;
    testkit::wait_until(
        Duration::from_secs(60),
        "the relay published the backlog",
        || async {
            let mut redis = stack.redis().connect().await.unwrap();
            let len: i64 = redis::cmd("XLEN")
                .arg("outbox:consumers")
                .query_async(&mut redis)
                .await
                .unwrap();
            if len >= BACKLOG {
                Ok(())
            } else {
                Err(format!("{len} entries"))
            }
        },
    )
    .await;

    // WHEN Workers starts, and a message is sent to chat 2 (same shard, nothing in the
    // backlog) once it has begun on the backlog
    let workers = stack.service(Side::Workers, &[]).await;
    testkit::wait_until(
        Duration::from_secs(60),
        "Workers began recording the backlog",
        || async {
            let n = stack
                .count("SELECT count(*) FROM workers.inbox WHERE chat_id = 1")
                .await;
            if n > 0 {
                Ok(())
            } else {
                Err("nothing recorded".into())
            }
        },
    )
    .await;
    let sent_at = Instant::now();
    let live = send(consumers.addr, 2, "live, beside the backlog").await;
    let live_id = live["id"].as_str().unwrap().to_string();

    // THEN it is recorded while chat 1's backlog is still being caught up ...
    let backlog_then = testkit::wait_until(
        Duration::from_secs(120),
        "chat 2's message recorded",
        || async {
            let db = stack.db.connect().await.unwrap();
            let row = db
                .query_one(
                    "SELECT count(*) FILTER (WHERE message_id::text = $1),
                            count(*) FILTER (WHERE chat_id = 1)
                       FROM workers.inbox",
                    &[&live_id],
                )
                .await
                .unwrap();
            if row.get::<_, i64>(0) == 1 {
                Ok(row.get::<_, i64>(1))
            } else {
                Err(format!("{} of chat 1 recorded", row.get::<_, i64>(1)))
            }
        },
    )
    .await;
    let took = sent_at.elapsed();
    println!(
        "chat 2's message recorded {took:?} after its send, with {backlog_then} of chat 1's {BACKLOG} recorded"
    );
    assert!(
        backlog_then < BACKLOG / 2,
        "chat 2's message waited for chat 1's backlog: recorded with {backlog_then} of {BACKLOG} of chat 1 recorded ({took:?} after its send)"
    );

    // ... AND every message of both chats is recorded once, in each chat's order
    assert_received_in_sent_order(&stack, Side::Consumers, 1).await;
    assert_received_in_sent_order(&stack, Side::Consumers, 2).await;
    assert_eq!(stack.dead_letters().await, 0);

    workers.stop().await;
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_consumer_while_recorded_ahead_is_dead_lettered_after_one_crash_alone(
) {
    // GIVEN Workers that die on a message "boom", which waits in chat 2 behind a backlog of
    // chat 1 (so the first run meets it looking ahead, not in its reads)
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let flags = ["--consumer-name", "workers", "--crash-on-body", "boom"];
    write_backlog(&stack, 1, 1_000).await;
    for body in ["before", "boom", "after"] {
        send(consumers.addr, 2, body).await;
    }
    testkit::wait_until(Duration::from_secs(30), "all published", || async {
        let mut redis = stack.redis().connect().await.unwrap();
        match redis::cmd("XLEN")
            .arg("outbox:consumers")
            .query_async::<i64>(&mut redis)
            .await
            .unwrap()
        {
            1_003 => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;

    // WHEN the process is restarted each time it dies
    let first = stack.spawn_service(Side::Workers, "workers-1", &flags, &[]);
    first.child.wait_exit(Duration::from_secs(30)).unwrap();
    // Only recording ahead leaves an attempt record for an entry on its first delivery:
    // the ordered path costs first deliveries none.
    let mut redis = stack.redis().connect().await.unwrap();
    let records: HashMap<String, String> = redis::cmd("HGETALL")
        .arg("inbox-attempts:workers")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(
        first.child.log().contains("failpoint: crashing") && !records.is_empty(),
        "the first run met it looking ahead: attempt records {records:?}"
    );
    let second = stack.spawn_service(Side::Workers, "workers-2", &flags, &[]);
    second.child.wait_exit(Duration::from_secs(30)).unwrap();
    let workers = stack
        .service_process(Side::Workers, "workers-3", &flags)
        .await;

    // THEN the second, taking the first's unfinished record for a crash, processed it
    // alone and died on it (conclusive): the third dead-letters it and records the rest
    testkit::wait_until(Duration::from_secs(30), "dead-lettered", || async {
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
    testkit::wait_until(Duration::from_secs(60), "the rest recorded", || async {
        match stack.count("SELECT count(*) FROM workers.inbox").await {
            1_002 => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;
    let chat_2: Vec<String> = stack
        .db
        .connect()
        .await
        .unwrap()
        .query(
            "SELECT body FROM workers.inbox WHERE chat_id = 2 ORDER BY pos",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        chat_2,
        ["before", "after"],
        "chat 2 in order, without the poison"
    );
    assert_received_in_sent_order(&stack, Side::Consumers, 1).await;
    assert_eq!(workers.child.try_status(), None, "still running");
    consumers.stop().await;
    stack.stop().await;
}

/// The rules of `deploy/redis/users.acl`'s `user` line for `name`, as ACL SETUSER takes
/// them (a selector in parentheses is one argument), with the password `password` and
/// without `dropped` (the commands a previous version's file did not grant).
fn acl_rules(name: &str, password: &str, dropped: &[&str]) -> Vec<String> {
    let acl = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/redis/users.acl"
    ))
    .unwrap();
    let line = acl
        .lines()
        .find(|l| l.starts_with(&format!("user {name} ")))
        .expect("the user's line");
    let mut rules = Vec::new();
    let mut selector: Option<String> = None;
    for word in line.split_whitespace().skip(2) {
        let word = if word.starts_with('#') {
            format!(">{password}")
        } else {
            word.to_string()
        };
        match selector.as_mut() {
            Some(open) => {
                if !dropped.contains(&word.trim_end_matches(')')) {
                    open.push(' ');
                    open.push_str(&word);
                } else if word.ends_with(')') {
                    open.push(')');
                }
                if word.ends_with(')') {
                    rules.push(selector.take().unwrap());
                }
            }
            None if word.starts_with('(') => selector = Some(word),
            None if dropped.contains(&word.as_str()) => {}
            None => rules.push(word),
        }
    }
    rules
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_acl_from_before_the_look_ahead_a_backlog_is_consumed_in_order_and_the_operator_told(
) {
    // GIVEN Workers' Redis user as the previous deploy/redis/users.acl made it (no XRANGE of
    // the stream, no HLEN/HGETALL of the attempt records), and a backlog of two chats
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let mut admin = stack.redis().connect().await.unwrap();
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg("workers").arg("reset");
    for rule in acl_rules("workers", "old-acl", &["+xrange", "+hlen", "+hgetall"]) {
        setuser.arg(rule);
    }
    let _: () = setuser.query_async(&mut admin).await.unwrap();
    // The user may only call functions: the admin loads them (as `migrate --redis-url` does).
    for library in chat_services::functions::libraries() {
        library.load(&mut admin).await.unwrap();
    }
    write_backlog(&stack, 1, 600).await;
    for i in 0..5 {
        send(consumers.addr, 2, &format!("m{i}")).await;
    }

    // WHEN Workers starts as that user
    let url = stack.redis().url_as("workers", "old-acl");
    let workers = stack
        .service_process(Side::Workers, "workers-1", &["--redis-url", &url])
        .await;

    // THEN every message is recorded once, in its chat's order, nothing dead-lettered, and
    // the log says what to load
    testkit::wait_until(Duration::from_secs(60), "all recorded", || async {
        match stack.count("SELECT count(*) FROM workers.inbox").await {
            605 => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;
    assert_received_in_sent_order(&stack, Side::Consumers, 1).await;
    assert_received_in_sent_order(&stack, Side::Consumers, 2).await;
    assert_eq!(stack.dead_letters().await, 0);
    let log = workers.child.log();
    assert!(
        log.contains("may not scan the stream (XRANGE)")
            && log.contains("load the current deploy/redis/users.acl"),
        "the log names the ACL to load"
    );
}
