//! Recorded means shown, with several instances per side: every tab on every instance shows
//! every message of its chat's feed (both sides' messages) once, in feed order, whatever
//! happens between a commit and its live hint. `--feed-check-interval` is set far out where
//! a test is about another mechanism, so the safety net cannot hide that mechanism failing.

use std::time::Duration;

use crate::support::{send, Stack, Viewer};
use chat_services::Side;
use testkit::proxy::Proxy;
use testkit::shared_postgres;

const NO_TIP_CHECK: [&str; 2] = ["--feed-check-interval", "1h"];

async fn wait_recorded(stack: &Stack<'_>, side: Side, chat_id: i64, n: i64) {
    testkit::wait_until(
        Duration::from_secs(60),
        &format!("{n} messages in {side}' inbox"),
        || async {
            let got = stack
                .count(&format!(
                    "SELECT count(*) FROM {side}.inbox WHERE chat_id = {chat_id}"
                ))
                .await;
            if got >= n {
                Ok(())
            } else {
                Err(format!("{got}"))
            }
        },
    )
    .await;
}

async fn wait_metric_at_least(admin: std::net::SocketAddr, name: &str, at_least: f64) {
    testkit::wait_until(Duration::from_secs(20), name, || async {
        let (_, text) = testkit::http::get(admin, "/metrics")
            .await
            .map_err(|e| e.to_string())?;
        match testkit::http::metric_value(&text, name) {
            Some(v) if v >= at_least => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}

async fn acl(stack: &Stack<'_>, rule: &str) {
    let mut redis = stack.redis().connect().await.unwrap();
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg(rule)
        .query_async(&mut redis)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_refused_for_a_while_hides_nothing_on_any_instance_of_either_side() {
    // GIVEN two instances per side, a tab on each, all on chat 31
    let stack = Stack::start(shared_postgres()).await;
    let c1 = stack
        .service_process(Side::Consumers, "consumers-1", &NO_TIP_CHECK)
        .await;
    let c2 = stack
        .service_process_standby(Side::Consumers, "consumers-2", &NO_TIP_CHECK)
        .await;
    let w1 = stack
        .service_process(Side::Workers, "workers-1", &NO_TIP_CHECK)
        .await;
    let w2 = stack
        .service_process_standby(Side::Workers, "workers-2", &NO_TIP_CHECK)
        .await;
    let tabs = [
        (
            Side::Consumers,
            Viewer::start("consumers-1 tab", c1.addr, 31),
        ),
        (
            Side::Consumers,
            Viewer::start("consumers-2 tab", c2.addr, 31),
        ),
        (Side::Workers, Viewer::start("workers-1 tab", w1.addr, 31)),
        (Side::Workers, Viewer::start("workers-2 tab", w2.addr, 31)),
    ];
    let mut n = 0;
    let mut burst = |count: usize| {
        let range = n..n + count;
        n += count;
        let (c1, w2) = (c1.addr, w2.addr);
        async move {
            for i in range {
                send(c1, 31, &format!("c{i}")).await;
                if i % 4 == 0 {
                    send(w2, 31, &format!("w{i}")).await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    burst(10).await;

    // WHEN Redis refuses PUBLISH (an ACL change) while one message is sent and recorded,
    // then takes it again
    acl(&stack, "-publish").await;
    send(c1.addr, 31, "while refused").await;
    wait_recorded(&stack, Side::Workers, 31, 11).await;
    for instance in [c1.admin, w1.admin] {
        wait_metric_at_least(instance, "chat_live_hints_unpublished_total", 1.0).await;
    }
    acl(&stack, "+publish").await;

    // THEN every tab shows its side's whole feed, once, in order, though nothing sent
    // after the refusal reveals a gap
    for (side, tab) in &tabs {
        tab.assert_shows_feed(&stack.db, *side, 31).await;
    }

    // AND so through a longer refusal with traffic on both sides, and what follows
    acl(&stack, "-publish").await;
    burst(20).await;
    acl(&stack, "+publish").await;
    burst(10).await;
    wait_recorded(&stack, Side::Workers, 31, 41).await;
    wait_recorded(&stack, Side::Consumers, 31, 10).await;
    for (side, tab) in &tabs {
        tab.assert_shows_feed(&stack.db, *side, 31).await;
    }
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_killed_between_inbox_commit_and_hint_hides_nothing() {
    // GIVEN three Workers instances; the lease holder SIGKILLs itself right after its
    // fifth inbox commit, before any hint or XACK
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let flags = [
        "--lease-ttl",
        "1s",
        "--claim-idle",
        "500ms",
        NO_TIP_CHECK[0],
        NO_TIP_CHECK[1],
    ];
    let mut crashing = flags.to_vec();
    crashing.extend(["--crash-after-inbox-commit", "5"]);
    let w1 = stack
        .service_process(Side::Workers, "workers-1", &crashing)
        .await;
    let w2 = stack
        .service_process_standby(Side::Workers, "workers-2", &flags)
        .await;
    let w3 = stack
        .service_process_standby(Side::Workers, "workers-3", &flags)
        .await;
    let tabs = [
        Viewer::start("workers-2 tab", w2.addr, 32),
        Viewer::start("workers-3 tab", w3.addr, 32),
        // On the instance that dies, then reconnecting (through a balancer) to the others.
        Viewer::start_balanced("workers-1 tab", &[w1.addr, w2.addr, w3.addr], 32),
    ];

    // WHEN 20 messages arrive, one by one
    for i in 0..20 {
        send(consumers.addr, 32, &format!("m{i}")).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = w1.child.wait_exit(Duration::from_secs(20)).unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "the holder died by its failpoint"
    );

    // THEN every tab shows all 20, once, in order: those on the survivors, and the one on
    // the dead instance across its reconnect
    wait_recorded(&stack, Side::Workers, 32, 20).await;
    for tab in &tabs {
        tab.assert_shows_feed(&stack.db, Side::Workers, 32).await;
    }
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_connection_cut_after_commit_hides_nothing() {
    // GIVEN Workers reaching Postgres through a proxy that can cut a connection right
    // after the server answered, and a tab on each of two Workers instances
    let pg = shared_postgres();
    let stack = Stack::start(pg).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let proxy = Proxy::to_unix(pg.socket_dir().join(".s.PGSQL.5432"))
        .await
        .unwrap();
    let mut args = stack.service_args(Side::Workers, &NO_TIP_CHECK);
    let url = args.iter().position(|a| a == "--database-url").unwrap() + 1;
    args[url] = format!(
        "postgres://workers@{}/{}?sslmode=disable",
        proxy.addr(),
        stack.db.name
    );
    let holder = stack.service_with(args).await;
    let other = stack
        .service_process_standby(Side::Workers, "workers-2", &NO_TIP_CHECK)
        .await;
    let tabs = [
        Viewer::start("holder tab", holder.addr, 33),
        Viewer::start("other tab", other.addr, 33),
    ];
    send(consumers.addr, 33, "first").await;
    wait_recorded(&stack, Side::Workers, 33, 1).await;

    // WHEN the connection carrying the inbox insert of a message is cut right after
    // Postgres committed it (the write is retried and finds the message there)
    proxy.cut_reply_after(b"cut after commit");
    send(consumers.addr, 33, "cut after commit").await;
    wait_recorded(&stack, Side::Workers, 33, 2).await;

    // THEN both tabs show it, though nothing comes after it to reveal a gap
    assert!(proxy.cut_done(), "the proxy never cut the connection");
    for tab in &tabs {
        tab.assert_shows_feed(&stack.db, Side::Workers, 33).await;
    }
    // AND what follows, once, in order
    for i in 0..5 {
        send(consumers.addr, 33, &format!("after {i}")).await;
    }
    wait_recorded(&stack, Side::Workers, 33, 7).await;
    for tab in &tabs {
        tab.assert_shows_feed(&stack.db, Side::Workers, 33).await;
    }
    holder.stop().await;
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_committed_without_any_hint_is_shown_within_the_check_interval() {
    // GIVEN a tab on each of two Consumers instances checking tips every 200 ms
    let stack = Stack::start(shared_postgres()).await;
    let flags = ["--feed-check-interval", "200ms"];
    let c1 = stack
        .service_process(Side::Consumers, "consumers-1", &flags)
        .await;
    let c2 = stack
        .service_process_standby(Side::Consumers, "consumers-2", &flags)
        .await;
    let tabs = [
        Viewer::start("consumers-1 tab", c1.addr, 34),
        Viewer::start("consumers-2 tab", c2.addr, 34),
    ];
    send(c1.addr, 34, "with a hint").await;

    // WHEN a message is committed by a writer that never hints (an older binary, a process
    // killed right after its commit)
    let db = stack.db.connect().await.unwrap();
    db.execute(
        "INSERT INTO consumers.messages (id, chat_id, body) VALUES (gen_random_uuid(), 34, 'no hint')",
        &[],
    )
    .await
    .unwrap();

    // THEN both tabs show it, after the first, and nothing twice
    for tab in &tabs {
        tab.assert_shows_feed(&stack.db, Side::Consumers, 34).await;
    }
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hint_past_a_gap_makes_the_stream_read_the_gap_first() {
    // GIVEN a tab on Consumers, with no tip check to fall back on
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &NO_TIP_CHECK).await;
    let tab = Viewer::start("tab", consumers.addr, 35);
    send(consumers.addr, 35, "first").await;
    tab.assert_shows_feed(&stack.db, Side::Consumers, 35).await;

    // WHEN a message is committed with no hint, and the next one comes with its hint
    let db = stack.db.connect().await.unwrap();
    db.execute(
        "INSERT INTO consumers.messages (id, chat_id, body) VALUES (gen_random_uuid(), 35, 'no hint')",
        &[],
    )
    .await
    .unwrap();
    send(consumers.addr, 35, "hinted").await;

    // THEN the tab shows all three in order: the hint's position revealed the gap
    tab.assert_shows_feed(&stack.db, Side::Consumers, 35).await;
    assert_eq!(tab.shown().len(), 3);
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_rolling_deploy_the_two_versions_tell_each_other_to_re_read() {
    // GIVEN a Consumers instance of this version with a tab, no tip check to fall back on,
    // and a listener standing for an instance of the previous version
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &NO_TIP_CHECK).await;
    let tab = Viewer::start("tab", consumers.addr, 36);
    let mut previous = redis::Client::open(stack.redis().url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    previous.subscribe("inbox:consumers").await.unwrap();
    send(consumers.addr, 36, "first").await;

    // THEN the previous version is told to re-read, in its own format
    let note = tokio::time::timeout(Duration::from_secs(5), async {
        use futures::StreamExt;
        previous.on_message().next().await.unwrap()
    })
    .await
    .expect("a resync for the previous version");
    let note: serde_json::Value =
        serde_json::from_str(&note.get_payload::<String>().unwrap()).unwrap();
    assert_eq!(note["resync"], true);
    assert_eq!(note["seq"], 0);
    assert_eq!(
        note["feed"], true,
        "marked, so instances of this version skip it"
    );

    // WHEN the previous version records a message and hints it its way
    let db = stack.db.connect().await.unwrap();
    db.execute(
        "INSERT INTO consumers.inbox (message_id, chat_id, body, sent_at, stream_id)
         VALUES (gen_random_uuid(), 36, 'recorded by the previous version', now(), '1-0')",
        &[],
    )
    .await
    .unwrap();
    let mut redis = stack.redis().connect().await.unwrap();
    let hint = serde_json::json!({"from": "old", "chat_id": 36, "seq": 99, "frame": "id: 99\n\n"});
    let _: i64 = redis::cmd("PUBLISH")
        .arg("inbox:consumers")
        .arg(hint.to_string())
        .query_async(&mut redis)
        .await
        .unwrap();

    // THEN this version's tab re-reads and shows it
    tab.assert_shows_feed(&stack.db, Side::Consumers, 36).await;
    assert_eq!(tab.shown().len(), 2);
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_event_id_of_the_previous_version_resumes_without_a_loss() {
    // GIVEN three received messages (inbox seq 1, 2, 3) and a browser that saw the first
    // under the previous version's ids (the bare inbox seq)
    let stack = Stack::start(shared_postgres()).await;
    let workers = stack.service(Side::Workers, &NO_TIP_CHECK).await;
    let db = stack.db.connect().await.unwrap();
    for body in ["a", "b", "c"] {
        db.execute(
            "INSERT INTO workers.inbox (message_id, chat_id, body, sent_at, stream_id)
             VALUES (gen_random_uuid(), 37, $1, now(), '1-0')",
            &[&body],
        )
        .await
        .unwrap();
    }

    // WHEN it reconnects with Last-Event-ID 1
    let mut client = testkit::http::SseClient::connect(workers.addr, "/chats/37/events", Some("1"))
        .await
        .unwrap();

    // THEN it gets the two after it, with ids of this version
    let mut shown = Vec::new();
    for _ in 0..2 {
        let (id, message) =
            crate::support::next_message(&mut client, Duration::from_secs(10)).await;
        shown.push((id, message["body"].as_str().unwrap().to_string()));
    }
    assert_eq!(
        shown,
        [
            ("p2".to_string(), "b".to_string()),
            ("p3".into(), "c".into())
        ]
    );

    // AND one that saw the last received message resumes before a message sent after it
    db.execute(
        "INSERT INTO workers.messages (id, chat_id, body) VALUES (gen_random_uuid(), 37, 'd')",
        &[],
    )
    .await
    .unwrap();
    let mut client = testkit::http::SseClient::connect(workers.addr, "/chats/37/events", Some("3"))
        .await
        .unwrap();
    let (id, message) = crate::support::next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(
        (id.as_str(), message["body"].as_str().unwrap()),
        ("p4", "d")
    );

    // AND `after=0` (the beginning, then as now) starts before a chat's first message, even
    // when that one was sent, not received
    db.batch_execute(
        "INSERT INTO workers.messages (id, chat_id, body) VALUES (gen_random_uuid(), 38, 'sent');
         INSERT INTO workers.inbox (message_id, chat_id, body, sent_at, stream_id)
         VALUES (gen_random_uuid(), 38, 'received', now(), '1-0');",
    )
    .await
    .unwrap();
    let mut client =
        testkit::http::SseClient::connect(workers.addr, "/chats/38/events?after=0", None)
            .await
            .unwrap();
    for (id, body) in [("p1", "sent"), ("p2", "received")] {
        let (got, message) =
            crate::support::next_message(&mut client, Duration::from_secs(10)).await;
        assert_eq!(
            (got.as_str(), message["body"].as_str().unwrap()),
            (id, body)
        );
    }
    workers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_ahead_of_the_feed_is_clamped_to_its_tip_and_new_messages_are_shown() {
    // GIVEN a chat with two messages, and a client resuming from p1000: a position the
    // database does not have (it was restored from a backup since the client saw it)
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &NO_TIP_CHECK).await;
    for body in ["one", "two"] {
        send(consumers.addr, 41, body).await;
    }
    let mut client =
        testkit::http::SseClient::connect(consumers.addr, "/chats/41/events", Some("p1000"))
            .await
            .unwrap();

    // WHEN a new message is sent
    send(consumers.addr, 41, "three").await;

    // THEN the client is shown it (resuming from the feed's tip), not nothing until some
    // future position passes 1000
    let (id, message) = crate::support::next_message(&mut client, Duration::from_secs(10)).await;
    assert_eq!(message["body"], "three");
    assert_eq!(id, "p3");
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_hint_shows_nothing_the_database_does_not_hold() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let mut viewer = testkit::http::SseClient::connect(consumers.addr, "/chats/8/events", None)
        .await
        .unwrap();
    // Whoever may publish on the side's hint channel claims a message at the next position.
    let forged = serde_json::json!({
        "from": "another-instance",
        "chat_id": 8,
        "pos": 1,
        "frame": "id: p1\nevent: message\ndata: {\"id\":\"00000000-0000-7000-8000-000000000000\",\"chat_id\":8,\"body\":\"forged\",\"pos\":1}\n\n",
    });
    let mut redis = stack.redis().connect().await.unwrap();
    let heard: i64 = redis::cmd("PUBLISH")
        .arg("feed:consumers")
        .arg(forged.to_string())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(heard >= 1, "the service follows the channel");
    // THEN the first message shown is the one the database holds at that position.
    let sent = send(consumers.addr, 8, "the real one").await;
    let (id, shown) = crate::support::next_message(&mut viewer, Duration::from_secs(10)).await;
    assert_eq!(id, "p1");
    assert_eq!(shown["id"], sent["id"], "{shown}");
    assert_eq!(shown["body"], "the real one");
    consumers.stop().await;
    stack.stop().await;
}
