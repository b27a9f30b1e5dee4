//! README's run command, for real: it starts the whole system (private Postgres and Redis,
//! migrations, both relays, both services), a message crosses it, and Ctrl-C (SIGINT) stops
//! everything cleanly.

use std::process::Command;
use std::time::Duration;

use testkit::http::SseClient;
use testkit::{wait_until, ChildProcess, Signal};

/// The command after the `run-command` marker in README.md.
fn readme_run_command() -> String {
    let readme = repo_checks::read("README.md");
    let mut lines = readme
        .lines()
        .skip_while(|l| !l.contains("<!-- run-command -->"));
    lines.next();
    lines.next(); // the fence
    lines
        .next()
        .expect("a command after the run-command marker")
        .trim()
        .to_string()
}

/// Live processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_run_command_starts_the_system_and_ctrl_c_stops_it() {
    let state = testkit::scratch_dir("local-stack");
    let ports: Vec<u16> = (0..8).map(|_| testkit::http::free_port()).collect();
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(readme_run_command())
        .current_dir(repo_checks::repo())
        .env("CHAT_LOCAL_DIR", &state)
        .env("CHAT_LOCAL_PROFILE", "debug")
        // The binaries as built for the checks: the run command building its own would
        // replace them for the tests running beside this one.
        .env("CHAT_LOCAL_BIN", repo_checks::binaries())
        .env("CONSUMERS_PORT", ports[0].to_string())
        .env("WORKERS_PORT", ports[1].to_string())
        .env("CONSUMERS_RELAY_ADMIN", ports[2].to_string())
        .env("WORKERS_RELAY_ADMIN", ports[3].to_string())
        .env("PG_PORT", ports[4].to_string())
        .env("REDIS_PORT", ports[5].to_string())
        .env("CONSUMERS_ADMIN", ports[6].to_string())
        .env("WORKERS_ADMIN", ports[7].to_string());
    let stack = ChildProcess::spawn("local-stack", cmd, &state.join("run.log")).unwrap();
    wait_until(Duration::from_secs(600), "the chat page URLs", || async {
        let out = stack.log();
        if out.contains("Workers chat:") {
            Ok(())
        } else if !stack.is_running() {
            panic!("the run command exited: {out}");
        } else {
            Err(common_tail(&out))
        }
    })
    .await;
    let out = stack.log();
    assert!(
        out.contains(&format!("Consumers chat: http://127.0.0.1:{}/", ports[0])),
        "{out}"
    );

    let consumers: std::net::SocketAddr = format!("127.0.0.1:{}", ports[0]).parse().unwrap();
    let workers: std::net::SocketAddr = format!("127.0.0.1:{}", ports[1]).parse().unwrap();
    let (status, page) = testkit::http::get(consumers, "/").await.unwrap();
    assert_eq!(status, 200);
    assert!(page.contains("<title>Chat · consumers</title>"));
    // Signed in as the users the run command made members of chat 7, with its links.
    let token = |user: &str| {
        std::fs::read_to_string(state.join("tokens").join(user))
            .unwrap()
            .trim()
            .to_string()
    };
    let (alice, bob) = (token("alice"), token("bob"));
    assert!(out.contains(&format!("#chat=7&token={bob}")), "{out}");
    let (status, _) = testkit::http::get(workers, "/chats/7/messages")
        .await
        .unwrap();
    assert_eq!(status, 401, "the local stack verifies tokens");
    let (name, value) = crate::support::bearer(&bob);
    let mut client = SseClient::connect_with(workers, "/chats/7/events", &[(name, &value)])
        .await
        .unwrap();
    let sent = crate::support::send_as(consumers, &alice, 7, "through the local stack").await;
    assert_eq!(sent.status, 201, "{}", sent.body);
    let (_, shown) = crate::support::next_message(&mut client, Duration::from_secs(20)).await;
    assert_eq!(shown["id"], sent.json()["id"]);
    assert_eq!(shown["sender"], "alice");
    drop(client);

    // TLS only: even the right password is refused over plaintext (deploy/postgres/pg_hba.conf).
    let password = std::fs::read_to_string(state.join("secrets/postgres/consumers")).unwrap();
    let plaintext = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port={} user=consumers dbname=chat_consumers sslmode=disable password={}",
            ports[4],
            password.trim()
        ),
        tokio_postgres::NoTls,
    )
    .await;
    let refusal = plaintext.err().expect("a plaintext connection is refused");
    let message = refusal
        .as_db_error()
        .map(|e| e.message().to_string())
        .unwrap_or_else(|| refusal.to_string());
    assert!(message.contains("no encryption"), "{message}");
    sides_are_kept_apart(&state, ports[4]).await;
    let sent_id = sent.json()["id"].as_str().unwrap().to_string();
    the_node_example_shows_what_was_sent(&state, ports[4], ports[5], &sent_id).await;
    // The ACL file Redis loaded holds password hashes only.
    let acl = std::fs::read_to_string(state.join("redis/users.acl")).unwrap();
    let redis_password = std::fs::read_to_string(state.join("secrets/redis/consumers")).unwrap();
    assert!(acl.contains("user consumers on #") && !acl.contains(redis_password.trim()));

    // Ctrl-C
    stack.signal(Signal::Int).unwrap();
    let status = stack.wait_exit(Duration::from_secs(120)).unwrap();
    let out = stack.log();
    assert!(status.success(), "exit {status:?}: {out}");
    for component in [
        "workers",
        "consumers",
        "relay-workers",
        "relay-consumers",
        "redis",
        "postgres",
    ] {
        assert!(
            out.contains(&format!("[local] stopped {component}")),
            "{component} not stopped: {out}"
        );
    }
    let state_path = state.display().to_string();
    wait_until(
        Duration::from_secs(20),
        "no process of the stack left",
        || async {
            let left = processes_mentioning(&state_path);
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            }
        },
    )
    .await;
}

/// The example Node service (examples/node-inbox/run-local.sh) consumes the stack's
/// Consumers stream as its own role and Redis user, shows what alice sent, and stops cleanly
/// on Ctrl-C.
async fn the_node_example_shows_what_was_sent(
    state: &std::path::Path,
    pg_port: u16,
    redis_port: u16,
    sent_id: &str,
) {
    let port = testkit::http::free_port();
    let mut cmd = Command::new("bash");
    cmd.arg(repo_checks::repo().join("examples/node-inbox/run-local.sh"))
        .env("CHAT_LOCAL_DIR", state)
        .env("PG_PORT", pg_port.to_string())
        .env("REDIS_PORT", redis_port.to_string())
        .env("NODE_INBOX_PORT", port.to_string());
    let example = ChildProcess::spawn("node-inbox", cmd, &state.join("node-inbox.log")).unwrap();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_until(
        Duration::from_secs(60),
        "the Node example shows the message",
        || async {
            match testkit::http::get(addr, "/messages").await {
                Ok((200, body)) if body.contains(sent_id) => Ok(()),
                other => {
                    let log = example.log();
                    assert!(example.is_running(), "the example exited: {log}");
                    Err(format!("{other:?}; its log: {}", common_tail(&log)))
                }
            }
        },
    )
    .await;
    example.signal(Signal::Int).unwrap();
    let status = example.wait_exit(Duration::from_secs(30)).unwrap();
    assert!(status.success(), "exit {status:?}: {}", example.log());
}

/// A connection as `role` to `database` over TLS (verified against the stack's CA), with
/// the role's password from the stack's secrets.
async fn connect_as(
    state: &std::path::Path,
    port: u16,
    role: &str,
    database: &str,
) -> Result<tokio_postgres::Client, String> {
    let secrets = state.join("secrets");
    let endpoint = outbox_core::connect::PgEndpoint::parse(&format!(
        "postgres://{role}@localhost:{port}/{database}?sslmode=verify-full"
    ))
    .unwrap()
    .with_password_file(Some(&secrets.join("postgres").join(role)))
    .unwrap()
    .with_ca_file(Some(&secrets.join("ca.pem")));
    endpoint
        .connect_as(Duration::from_secs(10), "local-stack-check")
        .await
        .map_err(|e| e.to_string())
}

/// One database per side: no role of one side connects to the other's database, and a
/// relay role cannot decode a slot of the other's (a slot decodes its own database only).
/// What Postgres does not stop, a role with REPLICATION dropping a slot that no relay holds,
/// is shown too: the relay makes a dropped slot anew (cdc-relay's
/// `recovery::a_slot_dropped_between_sessions_is_made_anew_with_recover`).
async fn sides_are_kept_apart(state: &std::path::Path, port: u16) {
    for (role, other) in [
        ("consumers_relay", "chat_workers"),
        ("consumers", "chat_workers"),
        ("workers_relay", "chat_consumers"),
        ("workers", "chat_consumers"),
    ] {
        let refused = connect_as(state, port, role, other).await;
        let message = refused
            .err()
            .unwrap_or_else(|| panic!("{role} connected to {other}"));
        assert!(
            message.contains("pg_hba.conf rejects"),
            "{role} to {other}: {message}"
        );
    }
    // A slot of the Workers' database that no relay holds (an active one refuses everyone).
    let admin = connect_as(state, port, "postgres", "chat_workers")
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pg_create_logical_replication_slot('local_check_workers', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    let relay = connect_as(state, port, "consumers_relay", "chat_consumers")
        .await
        .unwrap();
    let decoded = relay
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('local_check_workers', NULL, NULL, 'proto_version', '1', 'publication_names', 'workers_outbox')",
            &[],
        )
        .await;
    let error = decoded.expect_err("the other side's slot decoded");
    let message = error
        .as_db_error()
        .map_or(error.to_string(), |e| e.message().to_string());
    assert!(
        message.contains("was not created in this database"),
        "{message}"
    );
    let dropped = relay
        .execute(
            "SELECT pg_drop_replication_slot('local_check_workers')",
            &[],
        )
        .await;
    assert!(
        dropped.is_ok(),
        "Postgres now refuses a drop across databases: {dropped:?}"
    );
}

fn common_tail(out: &str) -> String {
    let lines: Vec<&str> = out.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}
