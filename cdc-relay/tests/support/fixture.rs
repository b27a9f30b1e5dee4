//! One test's world ([`Fixture`]): its database with the migrations, a slot, a stream and
//! a witness slot that reads the same changes independently, and the relay's flags for it.

use std::process::Command;
use std::time::Duration;

use cdc_relay::cli::{Cli, Command as CliCommand};
use cdc_relay::{Relay, RelayConfig};
use testkit::{unique_name, ChildProcess, PgServer, RedisServer, TestDb};
use tokio_util::sync::CancellationToken;

use super::{
    expected_from, parse_lsn, read_stream, read_witness, Entry, RelayProcess, RunningRelay,
    WitnessTxn,
};

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

    /// A fixture on a database whose outbox the test made itself, set up with
    /// `setup_flags` (which name that table, its publication and its mapping).
    pub(crate) async fn set_up(
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
