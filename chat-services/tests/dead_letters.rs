//! Dead letters an operator can act on: `chat-service dead-letters list|replay|drop`, run as
//! a process with the service's configuration beside a running service, and the cap on the
//! dead-letter stream.

use std::process::{Command, Output};
use std::time::Duration;

use crate::support::{send, Stack, Viewer};
use chat_services::Side;
use testkit::shared_postgres;

/// Run `chat-service <Workers' flags and `flags`> dead-letters <args>`.
fn run_dead_letters(stack: &Stack<'_>, flags: &[&str], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_chat-service"))
        .args(stack.service_args(Side::Workers, flags))
        .arg("dead-letters")
        .args(args)
        .output()
        .expect("run chat-service dead-letters")
}

/// Run `chat-service <service flags> dead-letters <args>`: (exit success, stdout lines).
fn dead_letters(stack: &Stack<'_>, args: &[&str]) -> (bool, Vec<serde_json::Value>) {
    let output = run_dead_letters(stack, &[], args);
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    (output.status.success(), lines)
}

async fn wait_dead_letters(stack: &Stack<'_>, n: usize) {
    testkit::wait_until(Duration::from_secs(20), "dead letters", || async {
        match stack.dead_letters().await {
            got if got >= n => Ok(()),
            got => Err(format!("{got}")),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_replayed_in_order_after_the_fix_and_dropped_with_an_audit() {
    // GIVEN Workers whose inbox refuses two messages (a constraint, standing for any cause
    // an operator can fix) and a poison entry, with a tab on the chat
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &[]).await;
    let tab = Viewer::start("workers tab", workers.addr, 41);
    let admin = stack.db.connect().await.unwrap();
    admin
        .batch_execute(
            "ALTER TABLE workers.inbox ADD CONSTRAINT no_refused CHECK (body NOT LIKE 'refused%')",
        )
        .await
        .unwrap();
    send(consumers.addr, 41, "before").await;
    let first = send(consumers.addr, 41, "refused one").await;
    let second = send(consumers.addr, 41, "refused two").await;
    wait_dead_letters(&stack, 2).await;
    crate::support::append_after_top(
        stack.redis(),
        "outbox:consumers",
        &[("event", "message.created"), ("payload", "{not json")],
    )
    .await;
    send(consumers.addr, 41, "after").await;
    wait_dead_letters(&stack, 3).await;

    // WHEN the operator lists them
    let (ok, listed) = dead_letters(&stack, &["list"]);
    assert!(ok);
    let reasons: Vec<&str> = listed
        .iter()
        .map(|l| l["reason"].as_str().unwrap())
        .collect();
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(reasons[0].contains("no_refused"), "{reasons:?}");
    assert!(
        reasons[2].starts_with("payload is not a valid message"),
        "{reasons:?}"
    );
    assert_eq!(listed[0]["body"], "refused one");

    // ... replays everything before fixing the cause: nothing moves
    let (ok, report) = dead_letters(&stack, &["replay", "--all", "--by", "alice"]);
    assert!(!ok, "a replay that leaves dead letters fails");
    assert!(
        report.iter().all(|r| r.get("not_replayed").is_some()),
        "{report:?}"
    );
    assert_eq!(stack.dead_letters().await, 3);

    // ... fixes it and replays everything
    admin
        .batch_execute("ALTER TABLE workers.inbox DROP CONSTRAINT no_refused")
        .await
        .unwrap();
    let (ok, report) = dead_letters(&stack, &["replay", "--all", "--by", "alice"]);

    // THEN the two messages are recorded, in their original order, and shown on the tab;
    // the poison entry stays, and the command says so
    assert!(!ok, "the poison entry is left");
    let replayed: Vec<&str> = report
        .iter()
        .filter_map(|r| r["message_id"].as_str())
        .collect();
    assert_eq!(
        replayed,
        [
            first["id"].as_str().unwrap(),
            second["id"].as_str().unwrap()
        ]
    );
    assert_eq!(stack.dead_letters().await, 1);
    tab.assert_shows_feed(&stack.db, Side::Workers, 41).await;
    let shown = tab.shown();
    assert_eq!(shown.len(), 4);
    assert_eq!(
        &shown[2..],
        replayed.as_slice(),
        "replayed after what was shown, in order"
    );

    // AND replaying them again records nothing twice (they are gone from the stream)
    let id = listed[0]["dead_letter_id"].as_str().unwrap();
    let (ok, _) = dead_letters(&stack, &["replay", id, "--by", "alice"]);
    assert!(!ok, "an id no longer there is refused");

    // AND the poison entry is dropped; every action is in the audit log with its operator
    let (ok, report) = dead_letters(&stack, &["drop", "--all", "--by", "bob"]);
    assert!(ok);
    assert_eq!(report.len(), 1);
    assert_eq!(stack.dead_letters().await, 0);
    let audit = stack.read_stream("deadletter:workers:audit").await;
    let field = |i: usize, name: &str| {
        redis::from_redis_value_ref::<String>(&audit.ids[i].map[name]).unwrap()
    };
    assert_eq!(audit.ids.len(), 3);
    assert_eq!(
        (field(0, "action"), field(0, "by")),
        ("replay".into(), "alice".into())
    );
    assert_eq!(field(0, "message_id"), first["id"].as_str().unwrap());
    assert_eq!(field(0, "by_source"), "stated", "a name said, not verified");
    assert_eq!(
        (field(2, "action"), field(2, "by")),
        ("drop".into(), "bob".into())
    );
    assert_eq!(
        stack
            .count("SELECT count(*) FROM workers.inbox WHERE chat_id = 41")
            .await,
        4
    );
    workers.stop().await;
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_stream_is_capped_and_what_it_trims_is_counted() {
    // GIVEN Workers keeping at most two dead letters
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack
        .service(Side::Workers, &["--dead-letter-max-len", "2"])
        .await;
    send(consumers.addr, 42, "creates the stream").await;
    // Recorded, so the relay published it: nothing of ours lands above the entries below
    // (an entry appended before the relay's own would make the relay's XADD the smaller id).
    stack
        .wait_inbox(Side::Workers, 42, 1, "first recorded")
        .await;

    // WHEN three poison entries arrive
    for _ in 0..3 {
        crate::support::append_after_top(
            stack.redis(),
            "outbox:consumers",
            &[("event", "message.created"), ("payload", "{not json")],
        )
        .await;
    }
    send(consumers.addr, 42, "after").await;
    stack
        .wait_inbox(Side::Workers, 42, 2, "after recorded")
        .await;

    // THEN two are kept and the trimmed one is counted
    assert_eq!(stack.dead_letters().await, 2);
    let (_, metrics) = testkit::http::get(workers.admin, "/metrics").await.unwrap();
    assert_eq!(
        testkit::http::metric_value(&metrics, "chat_dead_letters_trimmed_total"),
        Some(1.0)
    );
    workers.stop().await;
    consumers.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_dead_letters_are_counted_listed_and_acted_on_across_every_shard() {
    // GIVEN 4 shards, a Workers inbox that refuses two messages of chats in two different
    // shards, and a letter left in the one dead-letter stream of before shards (its id the
    // same as a shard's letter)
    let stack = Stack::start_sharded(shared_postgres(), 4).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &["--claim-idle", "1s"]).await;
    let admin = stack.db.connect().await.unwrap();
    admin
        .batch_execute(
            "ALTER TABLE workers.inbox ADD CONSTRAINT no_refused CHECK (body NOT LIKE 'refused%')",
        )
        .await
        .unwrap();
    let shard = |chat: i64| outbox_core::stream::shard_of(Some(chat.to_string().as_bytes()), 4);
    let (a, b) = (1, (2..100).find(|c| shard(*c) != shard(1)).unwrap());
    let first = send(consumers.addr, a, "refused in one shard").await;
    let second = send(consumers.addr, b, "refused in another").await;
    wait_dead_letters(&stack, 2).await;
    let (_, listed) = dead_letters(&stack, &["list"]);
    let shared_id = listed[0]["dead_letter_id"].as_str().unwrap().to_string();
    let mut redis = stack.redis().connect().await.unwrap();
    let _: String = redis::cmd("XADD")
        .arg("deadletter:workers")
        .arg(&shared_id)
        .arg("stream")
        .arg("outbox:consumers")
        .arg("id")
        .arg("1-1")
        .arg("reason")
        .arg("left by the previous release")
        .query_async(&mut redis)
        .await
        .unwrap();

    // WHEN the operator lists them
    let (ok, listed) = dead_letters(&stack, &["list"]);

    // THEN all three are listed, the old stream's first, each naming its stream; and the
    // gauge counts all three once
    assert!(ok);
    let streams: Vec<&str> = listed
        .iter()
        .map(|l| l["dead_letter_stream"].as_str().unwrap())
        .collect();
    assert_eq!(streams.len(), 3, "{listed:?}");
    assert_eq!(streams[0], "deadletter:workers");
    let mut shard_streams = [
        format!("deadletter:workers:{{{}}}", shard(a)),
        format!("deadletter:workers:{{{}}}", shard(b)),
    ];
    shard_streams.sort();
    let mut listed_shards = [streams[1].to_string(), streams[2].to_string()];
    listed_shards.sort();
    assert_eq!(listed_shards, shard_streams);
    testkit::wait_until(Duration::from_secs(20), "the gauge counts 3", || async {
        let (_, metrics) = testkit::http::get(workers.admin, "/metrics").await.unwrap();
        match testkit::http::metric_samples(&metrics).get("chat_dead_letter_entries") {
            Some(n) if *n == 3.0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // AND an id in two streams is refused until named with its stream
    let (ok, report) = dead_letters(&stack, &["drop", &shared_id, "--by", "alice"]);
    assert!(!ok && report.is_empty(), "{report:?}");
    let (ok, report) = dead_letters(
        &stack,
        &[
            "drop",
            &format!("deadletter:workers@{shared_id}"),
            "--by",
            "alice",
        ],
    );
    assert!(ok, "{report:?}");
    assert_eq!(report[0]["dead_letter_stream"], "deadletter:workers");

    // AND once the cause is fixed, replaying everything records both shards' messages
    admin
        .batch_execute("ALTER TABLE workers.inbox DROP CONSTRAINT no_refused")
        .await
        .unwrap();
    let (ok, report) = dead_letters(&stack, &["replay", "--all", "--by", "alice"]);
    assert!(ok, "{report:?}");
    let mut replayed: Vec<&str> = report
        .iter()
        .filter_map(|r| r["message_id"].as_str())
        .collect();
    replayed.sort_unstable();
    let mut expected = [
        first["id"].as_str().unwrap(),
        second["id"].as_str().unwrap(),
    ];
    expected.sort_unstable();
    assert_eq!(replayed, expected);
    assert_eq!(stack.dead_letters().await, 0);
    drop(consumers);
    drop(workers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_tokens_are_verified_the_audit_names_the_operators_admin_token() {
    // GIVEN Workers verifying tokens, with a poison entry dead-lettered
    let stack = Stack::start(shared_postgres()).await;
    let idp = crate::support::Idp::new();
    let flags: Vec<String> = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let consumers = stack.service(Side::Consumers, &[]).await;
    let workers = stack.service(Side::Workers, &flags).await;
    send(consumers.addr, 43, "creates the stream").await;
    stack.wait_inbox(Side::Workers, 43, 1, "recorded").await;
    crate::support::append_after_top(
        stack.redis(),
        "outbox:consumers",
        &[("event", "message.created"), ("payload", "{not json")],
    )
    .await;
    wait_dead_letters(&stack, 1).await;
    let dir = testkit::scratch_dir("operator");
    let user_token = dir.join("user");
    std::fs::write(&user_token, idp.token("mallory")).unwrap();
    let admin_token = dir.join("admin");
    std::fs::write(
        &admin_token,
        idp.token_for("ops-carol", Duration::from_secs(600), Some("chat:admin")),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let output = run_dead_letters(&stack, &flags, args);
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };

    // WHEN an operator states a name instead of a token, or brings a user's token
    // THEN nothing is dropped, and the command says what to give
    let (ok, err) = run(&["drop", "--all", "--by", "anyone"]);
    assert!(!ok && err.contains("--token-file"), "{err}");
    let (ok, err) = run(&["drop", "--all"]);
    assert!(!ok && err.contains("--token-file"), "{err}");
    let user = user_token.display().to_string();
    let (ok, err) = run(&["drop", "--all", "--token-file", &user]);
    assert!(!ok && err.contains("no admin rights"), "{err}");
    assert_eq!(stack.dead_letters().await, 1);

    // WHEN an admin's token comes with the command
    let admin = admin_token.display().to_string();
    let (ok, err) = run(&["drop", "--all", "--token-file", &admin]);

    // THEN the letter is dropped and the audit log names the token's subject
    assert!(ok, "{err}");
    assert_eq!(stack.dead_letters().await, 0);
    let audit = stack.read_stream("deadletter:workers:audit").await;
    assert_eq!(audit.ids.len(), 1);
    let field =
        |name: &str| redis::from_redis_value_ref::<String>(&audit.ids[0].map[name]).unwrap();
    assert_eq!(
        (field("action"), field("by"), field("by_source")),
        ("drop".into(), "ops-carol".into(), "token".into())
    );
    workers.stop().await;
    consumers.stop().await;
    stack.stop().await;
}
