//! Shared fixtures of the relay's integration tests: a database with the migrations, a slot
//! and a stream per test, a witness slot that reads the same changes independently, the
//! relay in-process or as a real process, and readers for the stream and the slot.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use cdc_relay::cli::{Cli, Command as CliCommand};
use cdc_relay::decode::{self as pgoutput, OutboxEvent, PgOutput, RelationCache, Row};
use cdc_relay::{Relay, RelayConfig, RelayError};
use redis::streams::StreamRangeReply;
use testkit::{unique_name, wait_until, ChildProcess, PgServer, RedisServer, TestDb};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub(crate) const PUBLICATION: &str = "consumers_outbox";
pub(crate) const OUTBOX: &str = "consumers.outbox";

/// One test's world: its database, slot, stream, and the Redis they live on.
pub(crate) struct Fixture<'a> {
    pub redis: &'a RedisServer,
    pub db: TestDb,
    pub slot: String,
    pub stream: String,
    /// Shards of the stream (1: the plain key).
    pub shards: u32,
    /// A second pgoutput slot on the same publication, never acknowledged: the ground truth
    /// of what committed, in commit order, with LSNs.
    pub witness: String,
    /// What `setup` did (the slot's consistent point), to write the stream's first record
    /// on another Redis too.
    pub setup: Option<cdc_relay::SetupOutcome>,
}

impl<'a> Fixture<'a> {
    /// A fresh database with the relay slot (via `setup`) and the witness slot.
    pub(crate) async fn new(pg: &'a PgServer, redis: &'a RedisServer) -> Fixture<'a> {
        Self::sharded(pg, redis, 1).await
    }

    /// The same, for a stream of `shards` shards.
    pub(crate) async fn sharded(
        pg: &'a PgServer,
        redis: &'a RedisServer,
        shards: u32,
    ) -> Fixture<'a> {
        Self::with_setup(pg, redis, shards, &[]).await
    }

    /// The same, the slot set up with these relay flags (e.g. `--failover true`).
    pub(crate) async fn with_setup(
        pg: &'a PgServer,
        redis: &'a RedisServer,
        shards: u32,
        setup_flags: &[&str],
    ) -> Fixture<'a> {
        let db = pg.create_database().await.expect("create test database");
        Self::set_up(redis, db, shards, setup_flags).await
    }

    /// A fixture on a database that already exists (a standby's copy).
    pub(crate) async fn on_database(redis: &'a RedisServer, db: TestDb) -> Fixture<'a> {
        Self::set_up(redis, db, 1, &[]).await
    }

    async fn set_up(
        redis: &'a RedisServer,
        db: TestDb,
        shards: u32,
        setup_flags: &[&str],
    ) -> Fixture<'a> {
        let mut fixture = Fixture {
            redis,
            db,
            slot: unique_name("relay"),
            stream: format!("outbox:{}", unique_name("s")),
            shards,
            witness: unique_name("witness"),
            setup: None,
        };
        let admin = fixture.db.connect().await.unwrap();
        admin
            .query_one(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&fixture.witness],
            )
            .await
            .expect("create witness slot");
        let pg = fixture
            .config_args(setup_flags)
            .connection
            .postgres()
            .unwrap();
        let outcome = cdc_relay::setup(&pg, Duration::from_secs(10))
            .await
            .expect("setup relay slot");
        assert!(
            matches!(outcome, cdc_relay::SetupOutcome::Created { .. }),
            "slot not created: {outcome:?}"
        );
        let record = cdc_relay::test_support::init_stream_record(
            &pg,
            &outcome,
            &outbox_core::connect::RedisTarget::Single(redis::Client::open(redis.url()).unwrap()),
            &fixture.stream,
            shards,
            Duration::from_secs(10),
        )
        .await
        .expect("stream record");
        assert_eq!(record, cdc_relay::test_support::RecordOutcome::Written);
        fixture.setup = Some(outcome);
        fixture
    }

    /// Write the stream's first records on the Redis Cluster at `urls` too (as `setup` does
    /// there), before any row is written.
    pub(crate) async fn init_records_on_cluster(&self, urls: &str) {
        let pg = self.config_args(&[]).connection.postgres().unwrap();
        let target = outbox_core::connect::redis_target(
            urls,
            true,
            None,
            None,
            "--redis-url",
            Duration::from_secs(10),
        )
        .unwrap();
        let record = cdc_relay::test_support::init_stream_record(
            &pg,
            self.setup.as_ref().expect("set up"),
            &target,
            &self.stream,
            self.shards,
            Duration::from_secs(10),
        )
        .await
        .expect("stream record on the cluster");
        assert_eq!(record, cdc_relay::test_support::RecordOutcome::Written);
    }

    /// The relay's flags for this fixture (`overrides`: flag/value pairs replacing or
    /// adding to the defaults).
    pub(crate) fn flags(&self, overrides: &[&str]) -> Vec<String> {
        let mut flags: Vec<(String, String)> = vec![
            ("--database-url".into(), self.db.url("consumers_relay")),
            ("--slot".into(), self.slot.clone()),
            ("--publication".into(), PUBLICATION.into()),
            ("--outbox-table".into(), OUTBOX.into()),
            ("--redis-url".into(), self.redis.url()),
            ("--stream".into(), self.stream.clone()),
            ("--stream-shards".into(), self.shards.to_string()),
            ("--admin-addr".into(), "127.0.0.1:0".into()),
            ("--reconnect-max-backoff".into(), "500ms".into()),
            ("--redis-timeout".into(), "2s".into()),
        ];
        for pair in overrides.chunks(2) {
            match flags.iter_mut().find(|(flag, _)| flag == pair[0]) {
                Some(entry) => entry.1 = pair[1].to_string(),
                None => flags.push((pair[0].to_string(), pair[1].to_string())),
            }
        }
        flags.into_iter().flat_map(|(f, v)| [f, v]).collect()
    }

    pub(crate) fn config_args(&self, overrides: &[&str]) -> cdc_relay::cli::RunArgs {
        let mut argv = vec!["cdc-relay".to_string(), "run".to_string()];
        argv.extend(self.flags(overrides));
        match Cli::try_parse_from_args(argv) {
            CliCommand::Run(args) => args,
            _ => unreachable!(),
        }
    }

    pub(crate) fn config(&self, overrides: &[&str]) -> RelayConfig {
        self.config_args(overrides)
            .validate()
            .expect("valid relay config")
    }

    /// Start the relay in-process and wait until it streams.
    pub(crate) async fn start_relay(&self, overrides: &[&str]) -> RunningRelay {
        let relay = Relay::new(self.config(overrides));
        let shutdown = CancellationToken::new();
        let task = {
            let relay = relay.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move { relay.run(shutdown).await })
        };
        let mut status = relay.status();
        tokio::time::timeout(
            Duration::from_secs(30),
            status.wait_for(|s| s.role == cdc_relay::Role::Streaming),
        )
        .await
        .expect("relay streaming within 30 s")
        .expect("relay status");
        RunningRelay {
            relay,
            shutdown,
            task: Some(task),
        }
    }

    /// Start the relay binary as a separate process with its admin server on a free port.
    pub(crate) fn spawn_relay(&self, name: &str, overrides: &[&str]) -> RelayProcess {
        let port = testkit::http::free_port();
        let admin = format!("127.0.0.1:{port}");
        let mut all = vec!["--admin-addr", admin.as_str()];
        all.extend_from_slice(overrides);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cdc-relay"));
        cmd.arg("run")
            .args(self.flags(&all))
            .env("RUST_LOG", "info,cdc_relay=debug,pgwire_replication=off");
        let log = testkit::scratch_dir("relay-log").join(format!("{name}.log"));
        RelayProcess {
            child: ChildProcess::spawn(name, cmd, &log).expect("spawn cdc-relay"),
            admin: admin.parse().unwrap(),
        }
    }

    /// Connect as the Consumers service role (it owns consumers.outbox).
    pub(crate) async fn writer(&self) -> tokio_postgres::Client {
        self.db
            .connect_as("consumers")
            .await
            .expect("connect as consumers")
    }

    /// Every entry of the stream, in stream order.
    pub(crate) async fn stream_entries(&self) -> Vec<Entry> {
        read_stream(self.redis, &self.stream)
            .await
            .expect("read stream")
    }

    pub(crate) async fn stream_len(&self) -> usize {
        let mut conn = self.redis.connect().await.expect("redis");
        redis::cmd("XLEN")
            .arg(&self.stream)
            .query_async(&mut conn)
            .await
            .expect("XLEN")
    }

    /// Wait until the stream holds at least `n` entries.
    pub(crate) async fn wait_stream_len(&self, n: usize, within: Duration) {
        testkit::wait_until(within, &format!("{n} entries in the stream"), || async {
            let len = self.stream_len().await;
            if len >= n {
                Ok(())
            } else {
                Err(format!("{len} of {n}"))
            }
        })
        .await
    }

    /// The relay slot's `confirmed_flush_lsn`.
    pub(crate) async fn confirmed_flush_lsn(&self) -> u64 {
        let client = self.db.connect().await.unwrap();
        let lsn: String = client
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .unwrap()
            .get(0);
        parse_lsn(&lsn)
    }

    /// What committed into the outbox, in commit order, read through the witness slot.
    pub(crate) async fn witness(&self) -> Vec<WitnessTxn> {
        read_witness(&self.db, &self.witness).await
    }

    /// The entries the stream must hold: one per committed outbox insert, in commit order,
    /// with id `<commit_lsn>-<position>`.
    pub(crate) async fn expected_entries(&self) -> Vec<Entry> {
        expected_from(&self.witness().await)
    }
}

/// `Cli::try_parse_from` that panics with clap's message.
trait ParseArgs {
    fn try_parse_from_args(argv: Vec<String>) -> CliCommand;
}

impl ParseArgs for Cli {
    fn try_parse_from_args(argv: Vec<String>) -> CliCommand {
        use clap::Parser;
        Cli::try_parse_from(argv)
            .unwrap_or_else(|e| panic!("{e}"))
            .command
    }
}

pub(crate) struct RunningRelay {
    pub relay: Relay,
    pub shutdown: CancellationToken,
    task: Option<JoinHandle<Result<(), RelayError>>>,
}

impl RunningRelay {
    /// Cancel and wait for the relay to finish its graceful shutdown.
    pub(crate) async fn stop(mut self) -> Result<(), RelayError> {
        self.shutdown.cancel();
        self.task
            .take()
            .unwrap()
            .await
            .expect("relay task panicked")
    }

    pub(crate) fn metric(&self, name: &str) -> f64 {
        testkit::http::metric_value(&self.relay.metrics().encode(), name).unwrap_or(0.0)
    }
}

impl Drop for RunningRelay {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub(crate) struct RelayProcess {
    pub child: ChildProcess,
    pub admin: SocketAddr,
}

impl RelayProcess {
    /// A metric from the process's /metrics (`None` while not answering).
    pub(crate) async fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = testkit::http::get(self.admin, "/metrics").await.ok()?;
        testkit::http::metric_value(&body, name)
    }

    /// /readyz status code and body (`None` while not answering).
    pub(crate) async fn readyz(&self) -> Option<(u16, String)> {
        testkit::http::get(self.admin, "/readyz").await.ok()
    }

    /// SIGTERM, and wait (10 s at most) for the graceful exit.
    pub(crate) fn stop(&self) -> std::process::ExitStatus {
        self.child
            .stop_with(testkit::Signal::Term, Duration::from_secs(10))
            .unwrap()
    }

    pub(crate) async fn wait_streaming(&self) {
        testkit::wait_until(
            Duration::from_secs(30),
            "relay ready (streaming)",
            || async {
                match self.readyz().await {
                    Some((200, _)) => Ok(()),
                    other => Err(format!(
                        "readyz {other:?}; log: {}",
                        tail(&self.child.log())
                    )),
                }
            },
        )
        .await
    }
}

/// The process failed, and the last line of its stderr is one `cdc-relay: ...` line
/// containing each of `expected`.
pub(crate) fn assert_refused(output: &std::process::Output, expected: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "exit {:?}; stderr: {stderr}",
        output.status
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("cdc-relay: "), "last line: {last:?}");
    for word in expected {
        assert!(last.contains(word), "{last:?} does not say {word:?}");
    }
}

pub(crate) fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// A stream entry as the tests compare it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub id: String,
    pub outbox_id: String,
    pub event: String,
    pub payload: serde_json::Value,
    pub created_at: String,
}

pub(crate) async fn read_stream(redis: &RedisServer, stream: &str) -> anyhow::Result<Vec<Entry>> {
    let mut conn = redis.connect().await?;
    let mut entries = Vec::new();
    let mut start = "-".to_string();
    loop {
        let reply: StreamRangeReply = redis::cmd("XRANGE")
            .arg(stream)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(2_000)
            .query_async(&mut conn)
            .await?;
        let n = reply.ids.len();
        for item in reply.ids {
            let field = |name: &str| -> String {
                item.map
                    .get(name)
                    .map(|v| redis::from_redis_value_ref::<String>(v).unwrap_or_default())
                    .unwrap_or_default()
            };
            entries.push(Entry {
                id: item.id.clone(),
                outbox_id: field("outbox_id"),
                event: field("event"),
                payload: serde_json::from_str(&field("payload")).unwrap_or(serde_json::Value::Null),
                created_at: field("created_at"),
            });
            start = format!("({}", item.id);
        }
        if n < 2_000 {
            return Ok(entries);
        }
    }
}

pub(crate) fn parse_lsn(text: &str) -> u64 {
    let (hi, lo) = text.split_once('/').expect("LSN hi/lo");
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

/// One committed transaction as the witness slot saw it.
#[derive(Debug, Clone)]
pub(crate) struct WitnessTxn {
    pub commit_lsn: u64,
    pub end_lsn: u64,
    pub events: Vec<OutboxEvent>,
}

async fn read_witness(db: &TestDb, slot: &str) -> Vec<WitnessTxn> {
    let client = db.connect().await.unwrap();
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                 'proto_version', '1', 'publication_names', $2)",
            &[&slot, &PUBLICATION],
        )
        .await
        .expect("peek witness slot");
    let mut relations = RelationCache::new(OUTBOX.parse().unwrap());
    let mut txns = Vec::new();
    let mut open: Option<WitnessTxn> = None;
    for row in rows {
        let data: Vec<u8> = row.get(0);
        let be64 = |at: usize| u64::from_be_bytes(data[at..at + 8].try_into().unwrap());
        match data[0] {
            b'B' => {
                open = Some(WitnessTxn {
                    commit_lsn: be64(1),
                    end_lsn: 0,
                    events: Vec::new(),
                })
            }
            b'C' => {
                let mut txn = open.take().expect("commit after begin");
                assert_eq!(txn.commit_lsn, be64(2), "commit lsn = begin final_lsn");
                txn.end_lsn = be64(10);
                txns.push(txn);
            }
            _ => match pgoutput::decode(&bytes::Bytes::from(data)).expect("witness decodes") {
                PgOutput::Relation(rel) => relations.on_relation(&rel).unwrap(),
                PgOutput::Insert(ins) => {
                    if let Row::Outbox(event) = relations.on_insert(ins).unwrap() {
                        open.as_mut().expect("insert inside txn").events.push(event);
                    }
                }
                PgOutput::Skipped(_) => {}
            },
        }
    }
    txns
}

pub(crate) fn expected_from(txns: &[WitnessTxn]) -> Vec<Entry> {
    let text = |b: &bytes::Bytes| String::from_utf8(b.to_vec()).unwrap();
    txns.iter()
        .flat_map(|txn| {
            txn.events.iter().enumerate().map(move |(k, e)| Entry {
                id: format!("{}-{k}", txn.commit_lsn),
                outbox_id: text(&e.outbox_id),
                event: text(&e.event),
                payload: serde_json::from_slice(&e.payload).unwrap(),
                created_at: text(&e.created_at),
            })
        })
        .collect()
}

/// What each shard must hold: every committed row in the shard of its partition key, in
/// commit order, with the id `<commit_lsn>-<position in its transaction>`.
pub(crate) fn expected_by_shard(txns: &[WitnessTxn], count: u32) -> Vec<Vec<Entry>> {
    let mut shards = vec![Vec::new(); count as usize];
    let text = |b: &bytes::Bytes| String::from_utf8(b.to_vec()).unwrap();
    for txn in txns {
        for (k, e) in txn.events.iter().enumerate() {
            let shard = outbox_core::stream::shard_of(e.partition_key.as_deref(), count);
            shards[shard as usize].push(Entry {
                id: format!("{}-{k}", txn.commit_lsn),
                outbox_id: text(&e.outbox_id),
                event: text(&e.event),
                payload: serde_json::from_slice(&e.payload).unwrap(),
                created_at: text(&e.created_at),
            });
        }
    }
    shards
}

/// Compare two entry lists and describe the first difference.
pub(crate) fn assert_same_entries(actual: &[Entry], expected: &[Entry]) {
    if actual == expected {
        return;
    }
    let first_diff = actual
        .iter()
        .zip(expected)
        .position(|(a, e)| a != e)
        .unwrap_or(actual.len().min(expected.len()));
    let actual_ids: HashMap<&str, usize> =
        actual
            .iter()
            .map(|e| e.outbox_id.as_str())
            .fold(HashMap::new(), |mut m, id| {
                *m.entry(id).or_default() += 1;
                m
            });
    let duplicated = actual_ids.values().filter(|n| **n > 1).count();
    let missing = expected
        .iter()
        .filter(|e| !actual_ids.contains_key(e.outbox_id.as_str()))
        .count();
    panic!(
        "stream differs from what committed: {} entries vs {} expected; {missing} missing, {duplicated} duplicated; first difference at #{first_diff}: {:?} vs {:?}",
        actual.len(),
        expected.len(),
        actual.get(first_diff),
        expected.get(first_diff)
    );
}

/// A stream (or shard) that was caught up from the outbox table holds each committed row of
/// `expected` exactly once, and nothing else, and each chat's (or, without chats, each
/// writer's) rows in commit order; its ids need not be commit LSNs.
pub(crate) fn assert_caught_up(actual: &[Entry], expected: &[Entry], what: &str) {
    let got: Vec<&str> = actual.iter().map(|e| e.outbox_id.as_str()).collect();
    let unique: std::collections::HashSet<&str> = got.iter().copied().collect();
    assert_eq!(unique.len(), got.len(), "{what}: a row twice");
    let want: std::collections::HashSet<&str> =
        expected.iter().map(|e| e.outbox_id.as_str()).collect();
    let missing = want.difference(&unique).count();
    let extra = unique.difference(&want).count();
    assert!(
        missing == 0 && extra == 0,
        "{what}: {missing} rows missing, {extra} rows that never committed"
    );
    let key = |e: &Entry| {
        e.payload
            .get("chat_id")
            .or_else(|| e.payload.get("writer"))
            .map(|v| v.to_string())
            .unwrap_or_default()
    };
    let order = |entries: &[Entry]| {
        let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
        for e in entries {
            by_key.entry(key(e)).or_default().push(e.outbox_id.clone());
        }
        by_key
    };
    let (got, want) = (order(actual), order(expected));
    for (k, ids) in &want {
        assert_eq!(got.get(k), Some(ids), "{what}: order of {k}'s rows");
    }
}

/// Insert `rows` outbox rows in one transaction; payload marks writer, txn and row.
pub(crate) async fn insert_txn(
    client: &mut tokio_postgres::Client,
    writer: u32,
    txn: u32,
    rows: u32,
    commit: bool,
) -> Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    for row in 0..rows {
        let payload =
            serde_json::json!({"writer": writer, "txn": txn, "row": row, "committed": commit});
        tx.execute(
            "INSERT INTO consumers.outbox (event, payload) VALUES ('test.event', $1::text::jsonb)",
            &[&payload.to_string()],
        )
        .await?;
    }
    if commit {
        tx.commit().await
    } else {
        tx.rollback().await
    }
}

/// Every sample of the relay's /metrics, by series (`name{labels}`).
pub(crate) async fn metrics(relay: &RelayProcess) -> HashMap<String, f64> {
    let Ok((_, body)) = testkit::http::get(relay.admin, "/metrics").await else {
        return HashMap::new();
    };
    testkit::http::metric_samples(&body)
}

pub(crate) async fn wait_metric(
    relay: &RelayProcess,
    series: &str,
    what: &str,
    ok: impl Fn(f64) -> bool,
) {
    wait_until(Duration::from_secs(30), what, || async {
        match metrics(relay).await.get(series) {
            Some(v) if ok(*v) => Ok(()),
            other => Err(format!("{series} = {other:?}")),
        }
    })
    .await
}

/// Wait until the relay counted a rebuild for `reason`: the counters move after the last
/// entry is in the stream, so a test that saw the stream complete must still wait for them.
pub(crate) async fn wait_rebuild_counted(relay: &RelayProcess, reason: &str) {
    let series = format!("cdc_relay_rebuilds_total{{reason=\"{reason}\"}}");
    wait_metric(relay, &series, "the rebuild counted", |v| v >= 1.0).await
}

/// A shard that refuses every write: its record is swapped for a string (the publish script
/// fails with WRONGTYPE, which the relay retries as it would a node that refuses writes),
/// its stream left as it is. [`StuckShard::release`] puts the record back as it was.
pub(crate) struct StuckShard {
    conn: redis::aio::MultiplexedConnection,
    key: String,
    dump: Vec<u8>,
}

impl StuckShard {
    pub(crate) async fn start(redis: &RedisServer, shard_stream: &str) -> Self {
        let mut conn = redis.connect().await.unwrap();
        let key = format!("{shard_stream}:origin");
        let dump: Vec<u8> = redis::cmd("DUMP")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let () = redis::cmd("SET")
            .arg(&key)
            .arg("refusing writes")
            .query_async(&mut conn)
            .await
            .unwrap();
        Self { conn, key, dump }
    }

    pub(crate) async fn release(mut self) {
        let () = redis::cmd("RESTORE")
            .arg(&self.key)
            .arg(0)
            .arg(&self.dump)
            .arg("REPLACE")
            .query_async(&mut self.conn)
            .await
            .unwrap();
    }
}

/// Wait until the relay caught a shard up from the outbox table comparing `mode` (`since`
/// or `everything`), and no shard is behind any more.
pub(crate) async fn wait_caught_up(relay: &RelayProcess, mode: &str) {
    let series = format!("cdc_relay_catch_ups_total{{mode=\"{mode}\"}}");
    wait_until(Duration::from_secs(30), "a catch-up counted", || async {
        match metrics(relay).await.get(&series) {
            Some(v) if *v >= 1.0 => Ok(()),
            other => Err(format!(
                "{series} = {other:?}; log: {}",
                tail(&relay.child.log())
            )),
        }
    })
    .await;
    wait_until(Duration::from_secs(30), "no shard behind", || async {
        let m = metrics(relay).await;
        let behind: Vec<&String> = m
            .iter()
            .filter(|(k, v)| k.starts_with("cdc_relay_shard_behind{") && **v != 0.0)
            .map(|(k, _)| k)
            .collect();
        if behind.is_empty() {
            Ok(())
        } else {
            Err(format!("{behind:?}; log: {}", tail(&relay.child.log())))
        }
    })
    .await;
}

/// Bytes of WAL written into a table outside the publication.
pub(crate) async fn write_noise(db: &tokio_postgres::Client, megabytes: usize) {
    db.batch_execute("CREATE TABLE IF NOT EXISTS public.noise (pad text)")
        .await
        .unwrap();
    for _ in 0..megabytes {
        db.batch_execute(
            "INSERT INTO public.noise SELECT repeat('x', 1000) FROM generate_series(1, 1000)",
        )
        .await
        .unwrap();
    }
}

/// Outbox ids in the stream, with how many times each appears.
pub(crate) async fn stream_ids(fx: &Fixture<'_>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for e in fx.stream_entries().await {
        *counts.entry(e.outbox_id).or_default() += 1;
    }
    counts
}

/// Wait until every one of `outbox_ids` has an entry in the stream.
pub(crate) async fn wait_published(fx: &Fixture<'_>, outbox_ids: &[String], relay: &RelayProcess) {
    wait_until(
        Duration::from_secs(30),
        "every outbox row in the stream",
        || async {
            let ids = stream_ids(fx).await;
            let missing = outbox_ids
                .iter()
                .filter(|id| !ids.contains_key(*id))
                .count();
            if missing == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{missing} of {} missing; log: {}",
                    outbox_ids.len(),
                    tail(&relay.child.log())
                ))
            }
        },
    )
    .await;
}

pub(crate) async fn outbox_ids(fx: &Fixture<'_>) -> Vec<String> {
    let db = fx.db.connect().await.unwrap();
    db.query("SELECT id::text FROM consumers.outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// A stream id as a comparable pair.
pub(crate) fn parse_stream_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').expect("a stream id");
    (ms.parse().unwrap(), seq.parse().unwrap())
}

/// Test functions running `body` on Postgres 16, 17 and 18 (the version matrix's focused
/// subset; the default server, 15, runs every test). `server:` bodies take a fresh
/// `&PgServer` of the version; `options:` bodies take `PgOptions` naming it, for servers
/// with settings of their own.
#[macro_export]
macro_rules! on_newer_versions {
    (server: $body:ident, $($name:ident => $version:expr),+ $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let pg = testkit::PgServer::start_with(testkit::PgOptions::default().version($version))
                .unwrap();
            $body(&pg).await;
        }
    )+};
    (options: $body:ident, $($name:ident => $version:expr),+ $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            $body(testkit::PgOptions::default().version($version)).await;
        }
    )+};
}
