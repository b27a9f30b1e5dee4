//! Transport security and least privilege, against real servers: Postgres with TLS (a
//! throwaway CA) and SCRAM passwords, Redis with a TLS port and the ACL users rendered from
//! `deploy/redis/users.acl`; and secrets kept out of every log line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use crate::support::{assert_refused, assert_same_entries, insert_txn, read_stream, tail, Fixture};
use testkit::tls::{ServerCert, TestCa};
use testkit::{
    scratch_dir, wait_until, ChildProcess, PgOptions, PgServer, RedisOptions, RedisServer, Signal,
};

/// The CA, a certificate for `localhost` and one for another name, shared by the tests.
struct Pki {
    ca: TestCa,
    localhost: ServerCert,
    elsewhere: ServerCert,
}

fn pki() -> &'static Pki {
    static PKI: OnceLock<Pki> = OnceLock::new();
    PKI.get_or_init(|| {
        let ca = TestCa::new().expect("test CA");
        Pki {
            localhost: ca.issue("localhost", &["localhost"]).unwrap(),
            elsewhere: ca.issue("elsewhere", &["db.example.com"]).unwrap(),
            ca,
        }
    })
}

/// Postgres with TLS on a loopback port, serving the certificate for `localhost`; one per
/// test, as each sets its own passwords on the cluster-wide roles.
fn tls_postgres() -> PgServer {
    PgServer::start_with(PgOptions::default().tls(pki().localhost.clone()))
        .expect("start TLS postgres")
}

/// Postgres whose certificate names another host.
fn misnamed_postgres() -> &'static PgServer {
    static PG: OnceLock<PgServer> = OnceLock::new();
    PG.get_or_init(|| {
        PgServer::start_with(PgOptions::default().tls(pki().elsewhere.clone()))
            .expect("start misnamed TLS postgres")
    })
}

/// Passwords of this test binary's roles and Redis users (random per run).
struct Secrets {
    dir: PathBuf,
}

impl Secrets {
    fn new() -> Self {
        let dir = scratch_dir("secrets");
        for user in [
            "admin",
            "consumers_relay",
            "workers_relay",
            "consumers",
            "workers",
        ] {
            std::fs::write(dir.join(user), format!("{}\n", random_hex())).unwrap();
        }
        Self { dir }
    }

    fn file(&self, user: &str) -> PathBuf {
        self.dir.join(user)
    }

    fn password(&self, user: &str) -> String {
        std::fs::read_to_string(self.file(user))
            .unwrap()
            .trim()
            .to_string()
    }
}

/// A Redis with the deploy ACL users (passwords from `secrets`), optionally with TLS, and
/// the relay's functions loaded by its admin (the relay's user may only call them).
async fn acl_redis(secrets: &Secrets, tls: Option<ServerCert>) -> RedisServer {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/redis");
    let acl = scratch_dir("acl").join("users.acl");
    let status = Command::new(deploy.join("render-acl.sh"))
        .arg(deploy.join("users.acl"))
        .arg(&secrets.dir)
        .arg(&acl)
        .status()
        .expect("run render-acl.sh");
    assert!(status.success(), "render-acl.sh failed");
    let redis = RedisServer::start_with(RedisOptions {
        tls,
        acl_file: Some(acl),
        admin: Some(("admin".into(), secrets.password("admin"))),
    })
    .expect("start redis with ACL users");
    let mut admin = redis.connect().await.expect("admin connects");
    for library in cdc_relay::libraries() {
        library.load(&mut admin).await.expect("admin loads");
    }
    redis
}

/// 128 random bits, hex: a password no log line could contain by chance.
fn random_hex() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("read /dev/urandom");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn set_password(pg: &PgServer, role: &str, password: &str) {
    let client = pg.connect("postgres").await.unwrap();
    // ALTER ROLE takes no bind parameters; the password is ours and hex.
    client
        .batch_execute(&format!("ALTER ROLE {role} PASSWORD '{password}'"))
        .await
        .unwrap();
}

fn relay_command(args: &[String], rust_log: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cdc-relay"));
    cmd.args(args).env("RUST_LOG", rust_log);
    cmd
}

/// Run the relay to its exit; a relay still running after 30 s (retrying what it should have
/// refused) fails the test with its log.
fn output(args: &[String]) -> Output {
    let log = scratch_dir("relay-log").join("refused.log");
    let child =
        ChildProcess::spawn("relay", relay_command(args, "warn"), &log).expect("spawn relay");
    let status = match child.wait_exit(Duration::from_secs(30)) {
        Ok(status) => status,
        Err(e) => panic!("relay did not exit ({e}): {}", tail(&child.log())),
    };
    Output {
        status,
        stdout: Vec::new(),
        stderr: child.log().into_bytes(),
    }
}

fn s(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|p| p.to_string()).collect()
}

/// The whole secure path: Postgres over `sslmode=verify-full` as a password role (password
/// and CA from files), Redis over TLS as the relay's ACL user. Plaintext TCP is rejected by
/// the server's pg_hba, so streaming at all proves both the SQL and the replication
/// connection are encrypted.
#[tokio::test]
async fn relay_streams_over_verified_tls_with_password_files() {
    let pg = &tls_postgres();
    let secrets = Secrets::new();
    let redis = acl_redis(&secrets, Some(pki().localhost.clone())).await;
    let fx = Fixture::new(pg, &redis).await;
    set_password(pg, "consumers_relay", &secrets.password("consumers_relay")).await;

    let database_url = pg.tcp_url("consumers_relay", &fx.db.name, "sslmode=verify-full");
    let redis_url = redis.tls_url("consumers_relay@");
    let ca = pki().ca.ca_file().display().to_string();
    let pg_password = secrets.file("consumers_relay").display().to_string();
    let redis_password = pg_password.clone();
    let port = testkit::http::free_port();
    let admin = format!("127.0.0.1:{port}");
    let mut args = vec!["run".to_string()];
    args.extend(fx.flags(&[
        "--database-url",
        &database_url,
        "--redis-url",
        &redis_url,
        "--stream",
        "outbox:consumers",
        "--admin-addr",
        &admin,
    ]));
    let mut cmd = relay_command(&args, "info,cdc_relay=debug");
    cmd.env("DATABASE_PASSWORD_FILE", &pg_password)
        .env("DATABASE_CA_FILE", &ca)
        .env("REDIS_PASSWORD_FILE", &redis_password)
        .env("REDIS_CA_FILE", &ca);
    let log = scratch_dir("relay-log").join("tls.log");
    let relay = ChildProcess::spawn("relay-tls", cmd, &log).expect("spawn relay");
    wait_ready(&admin, &relay).await;

    let mut writer = fx.writer().await;
    for txn in 0..5 {
        insert_txn(&mut writer, 1, txn, txn % 2 + 1, true)
            .await
            .unwrap();
    }
    let expected = fx.expected_entries().await;
    assert_eq!(expected.len(), 7);
    wait_until(
        Duration::from_secs(30),
        "stream has every entry",
        || async {
            let got = read_stream(&redis, "outbox:consumers")
                .await
                .map_err(|e| e.to_string())?;
            if got.len() == expected.len() {
                Ok(())
            } else {
                Err(format!(
                    "{} of {} entries; log: {}",
                    got.len(),
                    expected.len(),
                    tail(&relay.log())
                ))
            }
        },
    )
    .await;
    assert_same_entries(
        &read_stream(&redis, "outbox:consumers").await.unwrap(),
        &expected,
    );

    // Both of the relay's connections run as the password role over TLS.
    let admin_client = pg.connect(&fx.db.name).await.unwrap();
    let rows = admin_client
        .query(
            "SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.usename = 'consumers_relay' AND a.client_addr IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    let kinds: Vec<(String, bool)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(
        kinds.iter().any(|(k, ssl)| k == "walsender" && *ssl),
        "{kinds:?}"
    );
    assert!(kinds.iter().all(|(_, ssl)| *ssl), "{kinds:?}");

    relay.signal(Signal::Term).unwrap();
    let status = relay
        .wait_exit(Duration::from_secs(30))
        .expect("relay exits on SIGTERM");
    assert!(
        status.success(),
        "relay exit {status:?}: {}",
        tail(&relay.log())
    );
}

/// `verify-full` refuses a certificate for another name, and a certificate from a CA it was
/// not given; `verify-ca` checks only the chain, so it accepts the misnamed one; `disable`
/// is refused by a server that takes TCP only over TLS.
#[tokio::test]
async fn postgres_certificates_are_verified_as_sslmode_says() {
    let pg = misnamed_postgres();
    let secrets = Secrets::new();
    let db = pg.create_database().await.unwrap();
    set_password(pg, "consumers_relay", &secrets.password("consumers_relay")).await;
    let ca = pki().ca.ca_file().display().to_string();
    let password = secrets.file("consumers_relay").display().to_string();
    let setup = |sslmode: &str, with_ca: bool| {
        let url = pg.tcp_url("consumers_relay", &db.name, &format!("sslmode={sslmode}"));
        let mut args = s(&[
            "setup",
            "--database-url",
            &url,
            "--database-password-file",
            &password,
            "--slot",
            &testkit::unique_name("relay"),
            "--publication",
            crate::support::PUBLICATION,
            "--outbox-table",
            crate::support::OUTBOX,
        ]);
        if with_ca {
            args.extend(s(&["--database-ca-file", &ca]));
        }
        output(&args)
    };

    assert_refused(&setup("verify-full", true), &["certificate", "localhost"]);
    assert_refused(&setup("verify-full", false), &["certificate"]);
    assert_refused(&setup("verify-ca", false), &["certificate"]);
    let accepted = setup("verify-ca", true);
    assert!(
        accepted.status.success(),
        "verify-ca refused a certificate from the trusted CA: {}",
        String::from_utf8_lossy(&accepted.stderr)
    );
    let encrypted_only = setup("require", false);
    assert!(
        encrypted_only.status.success(),
        "sslmode=require must not verify: {}",
        String::from_utf8_lossy(&encrypted_only.stderr)
    );
    assert_refused(&setup("disable", false), &["pg_hba.conf"]);
}

/// Redis over TLS: a certificate for another name is refused, with or without the CA.
#[tokio::test]
async fn redis_certificates_are_verified() {
    let secrets = Secrets::new();
    let redis = acl_redis(&secrets, Some(pki().elsewhere.clone())).await;
    let pg = testkit::shared_postgres();
    let fx = Fixture::new(pg, testkit::shared_redis()).await;
    let ca = pki().ca.ca_file().display().to_string();
    let password = secrets.file("consumers_relay").display().to_string();
    let redis_url = redis.tls_url("consumers_relay@");
    let mut args = vec!["run".to_string()];
    args.extend(fx.flags(&[
        "--redis-url",
        &redis_url,
        "--stream",
        "outbox:consumers",
        "--redis-password-file",
        &password,
        "--redis-ca-file",
        &ca,
    ]));
    assert_refused(&output(&args), &["certificate", "Redis"]);
}

/// A secret in a URL never reaches a log line, at any level, on success or on failure.
#[tokio::test]
async fn secrets_in_urls_never_reach_the_logs() {
    let pg = &tls_postgres();
    let secrets = Secrets::new();
    let redis = acl_redis(&secrets, Some(pki().localhost.clone())).await;
    let fx = Fixture::new(pg, &redis).await;
    // Different passwords for Postgres and Redis, so either leak is told apart.
    let pg_secret = random_hex();
    let redis_secret = secrets.password("consumers_relay");
    set_password(pg, "consumers_relay", &pg_secret).await;
    let ca = pki().ca.ca_file().display().to_string();
    let database_url = pg.tcp_url(
        &format!("consumers_relay:{pg_secret}"),
        &fx.db.name,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let redis_url = redis.tls_url(&format!("consumers_relay:{redis_secret}@"));
    let port = testkit::http::free_port();
    let admin = format!("127.0.0.1:{port}");
    let mut args = vec!["run".to_string()];
    args.extend(fx.flags(&[
        "--database-url",
        &database_url,
        "--redis-url",
        &redis_url,
        "--redis-ca-file",
        &ca,
        "--stream",
        "outbox:consumers",
        "--admin-addr",
        &admin,
    ]));

    let mut logs = Vec::new();
    // Streaming, at trace level for every crate (the TLS and protocol libraries included).
    {
        let log = scratch_dir("relay-log").join("trace.log");
        let relay = ChildProcess::spawn("relay-trace", relay_command(&args, "trace"), &log)
            .expect("spawn relay");
        wait_ready(&admin, &relay).await;
        let mut writer = fx.writer().await;
        insert_txn(&mut writer, 1, 0, 2, true).await.unwrap();
        wait_until(Duration::from_secs(30), "entries published", || async {
            match read_stream(&redis, "outbox:consumers").await {
                Ok(entries) if entries.len() == 2 => Ok(()),
                other => Err(format!(
                    "{:?}; log: {}",
                    other.map(|e| e.len()),
                    tail(&relay.log())
                )),
            }
        })
        .await;
        let metrics = testkit::http::get(admin.parse().unwrap(), "/metrics")
            .await
            .expect("metrics");
        logs.push(("metrics".to_string(), metrics.1));
        relay.signal(Signal::Term).unwrap();
        relay
            .wait_exit(Duration::from_secs(30))
            .expect("relay exits");
        let log = relay.log();
        assert!(
            log.contains("TRACE"),
            "not logging at trace level: {}",
            tail(&log)
        );
        logs.push(("trace run".to_string(), log));
    }
    // Failing: a wrong Postgres password, then a wrong Redis password (the secret is then
    // in the URL the error is about).
    let wrong_pg = database_url.replace(&pg_secret, &format!("{pg_secret}x"));
    let mut failing = args.clone();
    replace_flag(&mut failing, "--database-url", &wrong_pg);
    let out = relay_command(&failing, "trace").output().unwrap();
    assert_refused(&out, &["password authentication failed"]);
    logs.push((
        "wrong postgres password".into(),
        String::from_utf8_lossy(&out.stderr).into(),
    ));

    let wrong_redis = redis_url.replace(&redis_secret, &format!("{redis_secret}x"));
    let mut failing = args.clone();
    replace_flag(&mut failing, "--redis-url", &wrong_redis);
    let out = relay_command(&failing, "trace").output().unwrap();
    assert_refused(&out, &["redis", "authentication failed"]);
    logs.push((
        "wrong redis password".into(),
        String::from_utf8_lossy(&out.stderr).into(),
    ));

    for (what, text) in &logs {
        assert!(!text.is_empty(), "{what}: no output captured");
        for secret in [&pg_secret, &redis_secret] {
            assert!(
                !text.contains(secret.as_str()),
                "{what} shows a password:\n{text}"
            );
        }
    }
}

/// Wait until the relay streams (rows committed before would be published by the first
/// start's rebuild, with other ids than the comparison expects).
/// Ready, and no shard behind (a stream with no record yet is caught up from the outbox
/// first: rows written before that ends come from the table, under ids of its own).
async fn wait_ready(admin: &str, relay: &ChildProcess) {
    let addr = admin.parse().unwrap();
    wait_until(Duration::from_secs(30), "relay ready", || async {
        match testkit::http::get(addr, "/readyz").await {
            Ok((200, _)) => {}
            other => return Err(format!("{other:?}; log: {}", tail(&relay.log()))),
        }
        let (_, body) = testkit::http::get(addr, "/metrics")
            .await
            .map_err(|e| e.to_string())?;
        let behind = testkit::http::metric_samples(&body)
            .iter()
            .any(|(k, v)| k.starts_with("cdc_relay_shard_behind{") && *v != 0.0);
        if behind {
            Err(format!("a shard behind; log: {}", tail(&relay.log())))
        } else {
            Ok(())
        }
    })
    .await;
}

fn replace_flag(args: &mut [String], flag: &str, value: &str) {
    let i = args.iter().position(|a| a == flag).expect("flag present");
    args[i + 1] = value.to_string();
}

/// The ACL users of `deploy/redis/users.acl` can do their job and nothing else. Commands run
/// in order, so earlier ones set up later ones (the stream, the consumer group).
#[tokio::test]
async fn redis_acl_users_have_least_privilege() {
    let secrets = Secrets::new();
    let redis = acl_redis(&secrets, None).await;
    // (user, command, allowed)
    let cases: &[(&str, &str, bool)] = &[
        ("consumers_relay", "XADD outbox:consumers 1-1 k v", true),
        ("consumers_relay", "XRANGE outbox:consumers - +", true),
        (
            "consumers_relay",
            "XTRIM outbox:consumers MAXLEN ~ 1000",
            true,
        ),
        (
            "consumers_relay",
            "HSET outbox:consumers:origin system_id 1",
            true,
        ),
        // Its trim asks whether Redis has ACKED trimming (8.2+).
        ("consumers_relay", "COMMAND INFO XACKDEL", true),
        ("consumers_relay", "COMMAND DOCS XTRIM", false),
        ("consumers_relay", "XADD outbox:workers * k v", false),
        ("consumers_relay", "XRANGE outbox:workers - +", false),
        ("consumers_relay", "XREAD STREAMS outbox:consumers 0", false),
        (
            "consumers_relay",
            "XREADGROUP GROUP g c STREAMS outbox:consumers >",
            false,
        ),
        ("consumers_relay", "DEL outbox:consumers", false),
        ("consumers_relay", "UNLINK outbox:consumers", false),
        ("consumers_relay", "FLUSHALL", false),
        ("consumers_relay", "SET outbox:consumers:origin x", false),
        // The rebuild lock: only through the selector's commands.
        (
            "consumers_relay",
            "SET outbox:consumers:rebuilding me PX 1000",
            true,
        ),
        ("consumers_relay", "DEL outbox:consumers:rebuilding", true),
        (
            "consumers_relay",
            "XADD outbox:consumers:rebuilding * k v",
            false,
        ),
        // A service, with the other side's stream as its relay leaves it.
        ("workers_relay", "XADD outbox:workers 1-1 k v", true),
        (
            "consumers",
            "XGROUP CREATE outbox:workers consumers 0",
            true,
        ),
        (
            "consumers",
            "XREADGROUP GROUP consumers c1 COUNT 10 STREAMS outbox:workers >",
            true,
        ),
        ("consumers", "XPENDING outbox:workers consumers", true),
        (
            "consumers",
            "XAUTOCLAIM outbox:workers consumers c2 0 0",
            true,
        ),
        ("consumers", "XACK outbox:workers consumers 1-1", true),
        ("consumers", "XADD deadletter:consumers * reason test", true),
        ("consumers", "XLEN deadletter:consumers", true),
        ("consumers", "SET inbox-lease:consumers me PX 1000", true),
        ("consumers", "PUBLISH inbox:consumers hello", true),
        ("consumers", "PUBLISH feed:consumers hello", true),
        ("consumers", "HSET inbox-attempts:consumers 1-1 x", true),
        ("consumers", "HMGET inbox-attempts:consumers 1-1", true),
        ("consumers", "HGET inbox-attempts:consumers 1-1", true),
        ("consumers", "HDEL inbox-attempts:consumers 1-1", true),
        ("consumers", "XRANGE deadletter:consumers - +", true),
        ("consumers", "XDEL deadletter:consumers 1-1", true),
        (
            "consumers",
            "XADD deadletter:consumers:audit * action drop",
            true,
        ),
        ("consumers", "XADD outbox:workers * k v", false),
        ("consumers", "XADD outbox:consumers * k v", false),
        ("consumers", "XTRIM outbox:workers MAXLEN 0", false),
        ("consumers", "XDEL outbox:workers 1-1", false),
        ("consumers", "DEL outbox:workers", false),
        ("consumers", "DEL deadletter:consumers", false),
        (
            "consumers",
            "XGROUP DESTROY outbox:workers consumers",
            false,
        ),
        (
            "consumers",
            "XREADGROUP GROUP g c STREAMS outbox:consumers >",
            false,
        ),
        ("consumers", "XADD deadletter:workers * k v", false),
        ("consumers", "PUBLISH inbox:workers hello", false),
        ("consumers", "PUBLISH feed:workers hello", false),
        ("consumers", "HSET inbox-attempts:workers 1-1 x", false),
        ("consumers", "XDEL deadletter:workers 1-1", false),
        ("consumers", "FLUSHALL", false),
        // Shards of a stream: the same rights on every shard's keys ({k}), nothing more.
        ("consumers_relay", "XADD outbox:consumers:{3} 1-1 k v", true),
        (
            "consumers_relay",
            "HSET outbox:consumers:{3}:origin shards 8",
            true,
        ),
        (
            "consumers_relay",
            "SET outbox:consumers:{0}:rebuilding me PX 1000",
            true,
        ),
        ("consumers_relay", "WAIT 0 10", true),
        ("consumers_relay", "XADD outbox:workers:{3} 1-1 k v", false),
        ("consumers_relay", "DEL outbox:consumers:{3}", false),
        ("workers_relay", "XADD outbox:workers:{3} 1-1 k v", true),
        (
            "workers_relay",
            "HSET outbox:workers:{3}:origin shards 8",
            true,
        ),
        (
            "consumers",
            "XGROUP CREATE outbox:workers:{3} consumers 0",
            true,
        ),
        (
            "consumers",
            "XREADGROUP GROUP consumers c1 COUNT 10 STREAMS outbox:workers:{3} >",
            true,
        ),
        ("consumers", "XACK outbox:workers:{3} consumers 1-1", true),
        (
            "consumers",
            "HMGET outbox:workers:{3}:origin system_id shards",
            true,
        ),
        (
            "consumers",
            "HMGET outbox:workers:origin system_id shards",
            true,
        ),
        (
            "consumers",
            "HSET outbox:workers:{3}:origin shards 1",
            false,
        ),
        (
            "consumers",
            "SET inbox-lease:consumers:{3} me PX 1000",
            true,
        ),
        ("consumers", "HSET inbox-attempts:consumers:{3} 1-1 x", true),
        // The look-ahead past a backlog: it scans the stream and reads the attempt records.
        ("consumers", "XRANGE outbox:workers:{3} - + COUNT 1", true),
        ("consumers", "HLEN inbox-attempts:consumers:{3}", true),
        ("consumers", "HGETALL inbox-attempts:consumers:{3}", true),
        ("consumers", "HGETALL inbox-attempts:workers:{3}", false),
        ("consumers", "XRANGE deadletter:workers - + COUNT 1", false),
        ("consumers", "ZADD inbox-members:consumers 1 me", true),
        (
            "consumers",
            "ZRANGEBYSCORE inbox-members:consumers -inf +inf",
            true,
        ),
        ("consumers", "TIME", true),
        ("consumers", "ZADD inbox-members:workers 1 me", false),
        ("consumers", "SET inbox-lease:workers:{3} me PX 1000", false),
        ("consumers", "XADD outbox:workers:{3} * k v", false),
        // On a cluster: per-shard dead letters and sharded live hints, its own only.
        (
            "consumers",
            "XADD deadletter:consumers:{3} * reason test",
            true,
        ),
        (
            "consumers",
            "XADD deadletter:consumers:{3}:audit * action drop",
            true,
        ),
        ("consumers", "XDEL deadletter:consumers:{3} 1-1", true),
        // The audit log is append-only for the service: no entry deleted, none trimmed.
        ("consumers", "XDEL deadletter:consumers:audit 1-1", false),
        (
            "consumers",
            "XDEL deadletter:consumers:{3}:audit 1-1",
            false,
        ),
        (
            "consumers",
            "XTRIM deadletter:consumers:audit MAXLEN 0",
            false,
        ),
        ("consumers", "DEL deadletter:consumers:audit", false),
        ("consumers", "XRANGE deadletter:consumers:audit - +", true),
        ("consumers", "SPUBLISH feed:consumers hello", true),
        ("consumers", "PUBSUB SHARDNUMSUB feed:consumers", true),
        ("consumers", "SPUBLISH feed:workers hello", false),
        ("consumers", "XADD deadletter:workers:{3} * k v", false),
        ("consumers", "DEL deadletter:consumers:{3}", false),
    ];
    // No component runs code of its own: functions loaded by the admin are all they call.
    let mut cases = cases.to_vec();
    for user in ["consumers", "workers", "consumers_relay", "workers_relay"] {
        for command in [
            "EVAL return 0",
            "EVAL_RO return 0",
            "EVALSHA 0123456789012345678901234567890123456789 0",
            "SCRIPT LOAD return",
            "SCRIPT FLUSH",
            "FUNCTION LOAD code",
            "FUNCTION DELETE outbox_relay",
            "FUNCTION FLUSH",
            "FUNCTION RESTORE payload",
        ] {
            cases.push((user, command, false));
        }
    }
    let mut connections = std::collections::HashMap::new();
    for &(user, command, allowed) in &cases {
        if !connections.contains_key(user) {
            let url = redis.url_as(user, &secrets.password(user));
            let conn = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap_or_else(|e| panic!("{user} logs in: {e}"));
            connections.insert(user, conn);
        }
        let reply = run_words(connections.get_mut(user).unwrap(), command).await;
        match (allowed, reply) {
            (true, Err(e)) => panic!("{user} must be allowed `{command}`: {e}"),
            (false, Ok(())) => panic!("{user} must not be allowed `{command}`"),
            (false, Err(e)) => assert!(
                e.to_uppercase().contains("NOPERM"),
                "{user} `{command}`: expected NOPERM, got {e}"
            ),
            (true, Ok(())) => {}
        }
    }

    // A function runs with its caller's rights: the dead-letters command's (delete the
    // letter, log it) runs as the service; one deleting from the audit log does not.
    static TEST: std::sync::LazyLock<outbox_core::functions::Library> =
        std::sync::LazyLock::new(|| {
            outbox_core::functions::Library::new(
                "security_test",
                &[
                    outbox_core::functions::Body {
                        name: "remove_and_log",
                        body: "if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end \
                               return redis.call('XADD', KEYS[2], '*', 'action', 'drop')",
                        flags: &[],
                    },
                    outbox_core::functions::Body {
                        name: "erase",
                        body: "return redis.call('XDEL', KEYS[1], ARGV[1])",
                        flags: &[],
                    },
                ],
            )
        });
    let service = connections.get_mut("consumers").unwrap();
    let not_loaded = TEST
        .function("erase")
        .key("deadletter:consumers:audit")
        .arg("1-1")
        .invoke_async::<i64>(service)
        .await
        .expect_err("the service loaded a library");
    assert_eq!(
        not_loaded.code(),
        Some(outbox_core::functions::NOT_LOADED),
        "{not_loaded}"
    );
    assert!(
        not_loaded.to_string().contains("load it as Redis's admin"),
        "{not_loaded}"
    );
    TEST.load(&mut redis.connect().await.unwrap())
        .await
        .unwrap();
    let service = connections.get_mut("consumers").unwrap();
    let letter: String = redis::cmd("XADD")
        .arg("deadletter:consumers")
        .arg("*")
        .arg("reason")
        .arg("test")
        .query_async(service)
        .await
        .unwrap();
    let logged: String = TEST
        .function("remove_and_log")
        .key("deadletter:consumers")
        .key("deadletter:consumers:audit")
        .arg(&letter)
        .invoke_async(service)
        .await
        .expect("the dead-letters command's function runs as the service");
    let refused = TEST
        .function("erase")
        .key("deadletter:consumers:audit")
        .arg(&logged)
        .invoke_async::<i64>(service)
        .await
        .expect_err("a function erased an audit entry");
    // Inside a function Redis says it in words, not with the NOPERM code.
    assert!(
        refused
            .to_string()
            .contains("can't access at least one of the keys"),
        "{refused}"
    );

    // Nobody logs in without a password.
    let anonymous = redis::Client::open(format!("redis+unix://{}", redis.socket().display()))
        .unwrap()
        .get_multiplexed_async_connection()
        .await;
    let err = match anonymous {
        Ok(mut conn) => run_words(&mut conn, "PING").await.unwrap_err(),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("NOAUTH") || err.contains("auth"),
        "default user answered: {err}"
    );

    // A transaction (as every script's writes are in the AOF) comes back after a restart:
    // Redis replays the file as the default user, and EXEC re-checks that user's rights.
    let relay = connections.get_mut("consumers_relay").unwrap();
    redis::pipe()
        .atomic()
        .cmd("XADD")
        .arg("outbox:consumers")
        .arg("7-1")
        .arg("k")
        .arg("v")
        .cmd("HSET")
        .arg("outbox:consumers:origin")
        .arg("restarted")
        .arg("1")
        .query_async::<redis::Value>(relay)
        .await
        .unwrap();
    redis.stop().unwrap();
    redis.start_again().unwrap();
    let url = redis.url_as("consumers_relay", &secrets.password("consumers_relay"));
    let mut relay = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let (top, restarted): (Vec<redis::streams::StreamId>, Option<String>) = redis::pipe()
        .cmd("XREVRANGE")
        .arg("outbox:consumers")
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .cmd("HGET")
        .arg("outbox:consumers:origin")
        .arg("restarted")
        .query_async::<(redis::streams::StreamRangeReply, Option<String>)>(&mut relay)
        .await
        .map(|(range, restarted)| (range.ids, restarted))
        .unwrap();
    assert_eq!(
        (top.first().map(|e| e.id.as_str()), restarted.as_deref()),
        (Some("7-1"), Some("1")),
        "a transaction's writes must survive a restart on the AOF"
    );
}

/// Run a command given as space-separated words.
async fn run_words(
    conn: &mut redis::aio::MultiplexedConnection,
    command: &str,
) -> Result<(), String> {
    let mut words = command.split_whitespace();
    let mut cmd = redis::cmd(words.next().unwrap());
    for word in words {
        cmd.arg(word);
    }
    cmd.query_async::<redis::Value>(conn)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// A Redis that lost its functions (a restart without its data) holds the relay, which
/// says what to load and who may, until the admin step runs; then it resumes, losing
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_lost_its_functions_holds_the_relay_until_the_admin_loads_them() {
    // GIVEN a relay streaming as its own Redis user, the functions loaded by the admin
    let secrets = Secrets::new();
    let redis = acl_redis(&secrets, None).await;
    let mut fx = Fixture::new(testkit::shared_postgres(), &redis).await;
    // The stream the ACL lets the relay write, starting at the slot as `setup` starts it.
    fx.stream = "outbox:consumers".into();
    let pg = fx.config_args(&[]).connection.postgres().unwrap();
    let record = cdc_relay::test_support::init_stream_record(
        &pg,
        fx.setup.as_ref().unwrap(),
        &outbox_core::connect::RedisTarget::Single(redis::Client::open(redis.url()).unwrap()),
        &fx.stream,
        1,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(record, cdc_relay::test_support::RecordOutcome::Written);
    let url = redis.url_as("consumers_relay", &secrets.password("consumers_relay"));
    let relay = fx.spawn_relay("relay-functions", &["--redis-url", &url]);
    relay.wait_streaming().await;
    let mut writer = fx.writer().await;
    insert_txn(&mut writer, 0, 1, 1, true).await.unwrap();
    fx.wait_stream_len(1, Duration::from_secs(30)).await;

    // WHEN Redis loses its functions and a message is written
    let mut admin = redis.connect().await.unwrap();
    let _: () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut admin)
        .await
        .unwrap();
    insert_txn(&mut writer, 0, 2, 1, true).await.unwrap();

    // THEN the relay says what is missing and that the admin must load it, and publishes
    // nothing meanwhile (it may not load code itself)
    wait_until(
        Duration::from_secs(30),
        "the relay says NOTLOADED",
        || async {
            let log = relay.child.log();
            if log.contains("NOTLOADED") && log.contains("cdc-relay functions") {
                Ok(())
            } else {
                Err(tail(&log))
            }
        },
    )
    .await;
    assert_eq!(fx.stream_len().await, 1);

    // WHEN the admin step runs
    let loaded = Command::new(env!("CARGO_BIN_EXE_cdc-relay"))
        .args(["functions", "--redis-url", &redis.url()])
        .output()
        .unwrap();
    assert!(loaded.status.success(), "{loaded:?}");
    assert!(String::from_utf8_lossy(&loaded.stdout).contains("loaded outbox_relay_"));

    // THEN the message arrives, once, and the stream is what the outbox holds
    fx.wait_stream_len(2, Duration::from_secs(60)).await;
    assert_same_entries(&fx.stream_entries().await, &fx.expected_entries().await);
    relay.stop();
}
