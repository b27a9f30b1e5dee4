//! The stack: a database with the migrations, a Redis of the test's own (single or a
//! cluster), and both relays in-process, streaming before a test begins; what a test reads
//! back from them (pending entries, dead letters, counts).

use std::time::Duration;

use cdc_relay::Relay;
use chat_services::Side;
use clap::Parser;
use testkit::{PgServer, RedisCluster, RedisServer, TestDb};
use tokio_util::sync::CancellationToken;

type RunningRelay = (
    Relay,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), cdc_relay::RelayError>>,
);

pub(crate) struct Stack<'a> {
    pub pg: &'a PgServer,
    pub db: TestDb,
    /// The single Redis, unless the stack runs on `cluster`.
    redis: Option<RedisServer>,
    pub cluster: Option<RedisCluster>,
    /// Shards of each side's stream.
    pub shards: u32,
    relays: Vec<RunningRelay>,
}

impl<'a> Stack<'a> {
    /// Database, Redis, and a running relay for each side.
    pub(crate) async fn start(pg: &'a PgServer) -> Stack<'a> {
        Self::start_sharded(pg, 1).await
    }

    /// The same, with both sides' streams split into `shards` shards.
    pub(crate) async fn start_sharded(pg: &'a PgServer, shards: u32) -> Stack<'a> {
        let redis = RedisServer::start().expect("redis");
        Self::start_on(pg, shards, Some(redis), None).await
    }

    /// The same on a Redis Cluster (3 masters, 1 replica each); relays wait for a replica
    /// to acknowledge each batch.
    pub(crate) async fn start_cluster(pg: &'a PgServer, shards: u32) -> Stack<'a> {
        let cluster = RedisCluster::start().expect("redis cluster");
        Self::start_on(pg, shards, None, Some(cluster)).await
    }

    async fn start_on(
        pg: &'a PgServer,
        shards: u32,
        redis: Option<RedisServer>,
        cluster: Option<RedisCluster>,
    ) -> Stack<'a> {
        let db = pg.create_database().await.expect("test database");
        let mut stack = Stack {
            pg,
            db,
            redis,
            cluster,
            shards,
            relays: Vec::new(),
        };
        for side in [Side::Consumers, Side::Workers] {
            stack.start_relay(side).await;
        }
        stack
    }

    /// The single Redis (a stack on a cluster has none).
    pub(crate) fn redis(&self) -> &RedisServer {
        self.redis
            .as_ref()
            .expect("a single Redis (this stack runs on a cluster)")
    }

    /// `--redis-url` and, on a cluster, `--redis-cluster` (every node named, so a process
    /// starting while one is down finds the others).
    pub(crate) fn redis_flags(&self) -> Vec<String> {
        match &self.cluster {
            Some(cluster) => cluster.client_flags(),
            None => vec!["--redis-url".into(), self.redis().url()],
        }
    }

    /// A connection to the stack's Redis, single or cluster.
    pub(crate) async fn redis_conn(&self) -> outbox_core::connect::RedisConn {
        let flags = self.redis_flags();
        outbox_core::connect::redis_target(
            &flags[1],
            self.cluster.is_some(),
            None,
            None,
            "--redis-url",
            Duration::from_secs(5),
        )
        .expect("redis target")
        .connect(Duration::from_secs(5))
        .await
        .expect("redis")
    }

    fn relay_args(&self, side: Side) -> cdc_relay::cli::RunArgs {
        let mut argv = vec![
            "cdc-relay".to_string(),
            "run".into(),
            "--database-url".into(),
            self.db.url(&format!("{side}_relay")),
            "--slot".into(),
            format!("{}_{side}", self.db.name),
            "--publication".into(),
            format!("{side}_outbox"),
            "--outbox-table".into(),
            format!("{side}.outbox"),
            "--stream".into(),
            side.outbox_stream(),
            "--stream-shards".into(),
            self.shards.to_string(),
            "--admin-addr".into(),
            "".into(),
            "--reconnect-max-backoff".into(),
            "300ms".into(),
        ];
        argv.extend(self.redis_flags());
        if self.cluster.is_some() {
            // A master's failover cannot lose what a replica acknowledged.
            argv.extend(["--redis-wait-replicas".into(), "1".into()]);
        }
        match cdc_relay::cli::Cli::try_parse_from(argv)
            .expect("relay flags")
            .command
        {
            cdc_relay::cli::Command::Run(args) => args,
            _ => unreachable!(),
        }
    }

    /// Panics at once, with the relay's own error, if a relay stopped: a relay stopped for
    /// good stalls delivery, which a wait would otherwise report only as a timeout.
    pub(crate) fn assert_relays_running(&self) {
        for (relay, _, task) in &self.relays {
            let status = relay.status().borrow().clone();
            assert!(
                status.role != cdc_relay::Role::Failed && !task.is_finished(),
                "a relay stopped: role {:?}, last error {:?}",
                status.role,
                status.last_error
            );
        }
    }

    async fn start_relay(&mut self, side: Side) {
        let args = self.relay_args(side);
        cdc_relay::setup(
            &args.connection.postgres().unwrap(),
            Duration::from_secs(10),
        )
        .await
        .expect("relay slot");
        let relay = Relay::new(args.validate().unwrap());
        let token = CancellationToken::new();
        let task = {
            let (relay, token) = (relay.clone(), token.clone());
            tokio::spawn(async move { relay.run(token).await })
        };
        // Streaming, and the stream caught up from the (empty) outbox: `setup` here writes no
        // record, so a relay's first session compares the table with the stream.
        let mut status = relay.status();
        tokio::time::timeout(
            Duration::from_secs(30),
            status.wait_for(|s| s.role == cdc_relay::Role::Streaming && s.behind_shards.is_empty()),
        )
        .await
        .expect("relay streaming within 30 s")
        .expect("relay status");
        self.relays.push((relay, token, task));
    }

    /// Entries of `stream` delivered to `group` and not yet acknowledged.
    pub(crate) async fn pending(&self, stream: &str, group: &str) -> usize {
        let mut redis = self.redis_conn().await;
        let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .query_async(&mut redis)
            .await
            .unwrap();
        pending.count()
    }

    /// Entries in Workers' dead-letter streams (one per shard).
    pub(crate) async fn dead_letters(&self) -> usize {
        let mut redis = self.redis_conn().await;
        let mut total = 0;
        for stream in outbox_core::stream::shard_keys("deadletter:workers", self.shards) {
            let n: usize = redis::cmd("XLEN")
                .arg(&stream)
                .query_async(&mut redis)
                .await
                .unwrap();
            total += n;
        }
        total
    }

    /// The single `count(*)` a query returns.
    pub(crate) async fn count(&self, sql: &str) -> i64 {
        let db = self.db.connect().await.unwrap();
        db.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// Wait (20 s at most) until `chat` has exactly `n` messages in `side`'s inbox.
    pub(crate) async fn wait_inbox(&self, side: Side, chat: i64, n: i64, what: &str) {
        let sql = format!("SELECT count(*) FROM {side}.inbox WHERE chat_id = {chat}");
        testkit::wait_until(Duration::from_secs(20), what, || async {
            match self.count(&sql).await {
                got if got == n => Ok(()),
                got => Err(format!("{got}")),
            }
        })
        .await;
    }

    /// Every entry of a Redis stream, oldest first.
    pub(crate) async fn read_stream(&self, key: &str) -> redis::streams::StreamRangeReply {
        let mut redis = self.redis().connect().await.unwrap();
        redis::cmd("XRANGE")
            .arg(key)
            .arg("-")
            .arg("+")
            .query_async(&mut redis)
            .await
            .unwrap()
    }

    pub(crate) async fn stop(mut self) {
        for (_, token, task) in self.relays.drain(..) {
            token.cancel();
            let _ = task.await;
        }
    }
}
