//! Relay drain throughput: a pre-filled outbox drained by the relay (release binary, Redis
//! with `appendfsync always`), by the second design's NOTIFY relay (`SELECT ... FOR UPDATE`
//! batches of 100), and, on a second slot over the same WAL, by `pg_recvlogical`, which does
//! nothing with the changes: the walsender's own ceiling. Then the end-to-end knee
//! (see `knee`).
//!
//! Shapes: many single-row transactions (the chat's real shape) and fewer 1,000-row ones.
//! The slots are created before the fill, so every consumer decodes exactly the same WAL.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use testkit::{unique_name, ChildProcess, PgServer, RedisServer, Signal, TestDb};

use crate::report;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Single-row transactions in shape (a).
    #[arg(long, default_value_t = 200_000)]
    single_row_txns: u32,
    /// Transactions of 1,000 rows in shape (b).
    #[arg(long, default_value_t = 200)]
    batch_txns: u32,
    /// Rows per transaction in shape (b).
    #[arg(long, default_value_t = 1_000)]
    rows_per_batch_txn: u32,
    /// Drains of each consumer per shape (fresh slots each time); the best is reported.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Extra flag for the relay, repeatable (e.g. --relay-arg=--batch-max-entries=1).
    #[arg(long = "relay-arg", allow_hyphen_values = true)]
    relay_args: Vec<String>,
    /// Route the rows by their event column into this many streams (`--stream` a template,
    /// each route made before the fill, as a route made by its first row is); 0: one stream.
    #[arg(long, default_value_t = 0)]
    routes: u32,
    /// Skip the NOTIFY relay's drain (it is slow).
    #[arg(long)]
    skip_notify: bool,
    /// Skip the end-to-end knee.
    #[arg(long)]
    skip_e2e: bool,
    #[command(flatten)]
    knee: crate::knee::Args,
}

#[derive(Debug, Serialize)]
pub struct ShapeResult {
    pub shape: String,
    pub transactions: u32,
    pub events: u64,
    pub wal_bytes: i64,
    pub relay_seconds: Vec<f64>,
    pub pg_recvlogical_seconds: Vec<f64>,
    pub notify_seconds: Vec<f64>,
    pub relay_events_per_second: f64,
    pub pg_recvlogical_events_per_second: f64,
    pub notify_events_per_second: Option<f64>,
    pub relay_percent_of_ceiling: f64,
    /// CPU seconds each process spent in each relay round.
    pub relay_cpu: Vec<DrainCpu>,
    /// An upper bound on the relay's drain from the CPU its fastest round spent (see
    /// [`cpu_bound_percent`]), as a percentage of pg_recvlogical's rate: a drain close to
    /// it is bound by CPU, not by waiting. `None` when no CPU could be read.
    pub cpu_bound_percent_of_ceiling: Option<f64>,
}

/// The most a drain could reach, as a percentage of `ceiling` (events/s), given the CPU its
/// fastest round spent: its processes can together use at most `cores`, and the walsender,
/// Redis's main thread and the relay (one thread each) at most one core each, so the drain
/// takes at least `max(total / cores, walsender, redis, relay)` seconds. Not counted: Redis's
/// AOF-rewrite child (a separate process) and the little the lab's own polling costs Redis.
pub fn cpu_bound_percent(
    cores: usize,
    events: u64,
    relay_seconds: &[f64],
    relay_cpu: &[DrainCpu],
    ceiling: f64,
) -> Option<f64> {
    let fastest = relay_seconds
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .and_then(|(i, _)| relay_cpu.get(i))?;
    let seconds = (fastest.total() / cores as f64)
        .max(fastest.walsender)
        .max(fastest.redis)
        .max(fastest.relay);
    (seconds > 0.0).then(|| 100.0 * events as f64 / seconds / ceiling)
}

/// CPU seconds of the processes a relay drain keeps busy.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DrainCpu {
    pub relay: f64,
    pub redis: f64,
    pub walsender: f64,
}

impl DrainCpu {
    pub fn total(&self) -> f64 {
        self.relay + self.redis + self.walsender
    }
}

#[derive(Debug, Serialize)]
struct Result {
    command: String,
    machine: report::Machine,
    shapes: Vec<ShapeResult>,
    end_to_end: Option<crate::knee::Knee>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    // Read before the runs: after them the disk is still writing back what they wrote.
    let machine = report::machine();
    let results = drains(&args, &report::workspace_binary("cdc-relay")?).await?;
    println!();
    println!("machine: {}", machine.describe());
    println!(
        "Relay drain throughput (events/s; best of {} rounds; Redis appendfsync always)",
        args.rounds
    );
    println!(
        "{:<26} {:>9} {:>12} {:>12} {:>16} {:>9} {:>11}",
        "shape", "events", "cdc-relay", "notify", "pg_recvlogical", "relay %", "CPU bound"
    );
    for r in &results {
        println!(
            "{:<26} {:>9} {:>12.0} {:>12} {:>16.0} {:>8.1}% {:>11}",
            r.shape,
            r.events,
            r.relay_events_per_second,
            r.notify_events_per_second
                .map_or_else(|| "-".to_string(), |n| format!("{n:.0}")),
            r.pg_recvlogical_events_per_second,
            r.relay_percent_of_ceiling,
            r.cpu_bound_percent_of_ceiling
                .map_or_else(|| "-".to_string(), |p| format!("{p:.1}%"))
        );
    }
    println!(
        "(CPU bound: the most the drain could reach at the CPU the relay's fastest round spent in relay + Redis + walsender, on {} cores with one core at most for each of them, against pg_recvlogical)",
        machine.cpus
    );
    let end_to_end = if args.skip_e2e {
        None
    } else {
        let knee = crate::knee::measure(&args.knee).await?;
        crate::knee::print(&knee);
        Some(knee)
    };
    let result = Result {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine,
        shapes: results,
        end_to_end,
    };
    let path = report::write_json("throughput", &result)?;
    println!("\nwritten to {}", path.display());
    Ok(())
}

/// Drain each shape's pre-filled outbox with the relay and with pg_recvlogical (and the
/// NOTIFY relay unless skipped: it runs this executable's `baseline relay`, so only
/// chat-lab itself can include it), `args.rounds` times each, on servers of their own.
pub async fn drains(args: &Args, relay_bin: &std::path::Path) -> anyhow::Result<Vec<ShapeResult>> {
    // Dropped on return: they hold hundreds of MB of WAL and stream data, and the
    // end-to-end run that may follow should have the machine to itself.
    let pg = PgServer::start()?;
    let redis = RedisServer::start()?;
    let shapes = [
        ("single-row transactions", args.single_row_txns, 1),
        (
            "1,000-row transactions",
            args.batch_txns,
            args.rows_per_batch_txn,
        ),
    ];
    let mut results = Vec::new();
    for (name, txns, rows) in shapes {
        eprintln!("[throughput] {name}: filling {txns} transactions of {rows} rows");
        let shape = Shape { name, txns, rows };
        results.push(measure_shape(&pg, &redis, relay_bin, &shape, args).await?);
    }
    Ok(results)
}

struct Shape {
    name: &'static str,
    txns: u32,
    rows: u32,
}

async fn measure_shape(
    pg: &PgServer,
    redis: &RedisServer,
    relay_bin: &std::path::Path,
    shape: &Shape,
    args: &Args,
) -> anyhow::Result<ShapeResult> {
    let db = pg.create_database().await?;
    let admin = db.connect().await?;
    let slots = make_slots(&db, &admin, redis, relay_bin, args).await?;
    let fill = fill(&admin, shape, args.routes).await?;
    let events = fill.events;
    let drains = drain_slots(pg, &db, redis, relay_bin, args, &slots, &fill).await?;
    let notify_seconds = if args.skip_notify {
        Vec::new()
    } else {
        drain_notify(&db, &admin, redis, args.rounds, events).await?
    };
    let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    // Rounds >= 1 (clap), so every vector here has at least one value.
    let relay_rate = events as f64 / best(&drains.relay_seconds);
    let recv_rate = events as f64 / best(&drains.recv_seconds);
    let cpu_bound = cpu_bound_percent(
        report::cpus(),
        events,
        &drains.relay_seconds,
        &drains.relay_cpu,
        recv_rate,
    );
    Ok(ShapeResult {
        shape: shape.name.to_string(),
        transactions: shape.txns,
        events,
        wal_bytes: fill.wal_bytes,
        relay_seconds: drains.relay_seconds,
        pg_recvlogical_seconds: drains.recv_seconds,
        notify_events_per_second: (!notify_seconds.is_empty())
            .then(|| events as f64 / best(&notify_seconds)),
        notify_seconds,
        relay_events_per_second: relay_rate,
        pg_recvlogical_events_per_second: recv_rate,
        relay_percent_of_ceiling: 100.0 * relay_rate / recv_rate,
        relay_cpu: drains.relay_cpu,
        cpu_bound_percent_of_ceiling: cpu_bound,
    })
}

/// Each round's slots: one for pg_recvlogical, and one the relay's `setup` makes with its
/// stream.
struct Slots {
    recv: Vec<String>,
    relay: Vec<String>,
    streams: Vec<String>,
}

async fn make_slots(
    db: &TestDb,
    admin: &tokio_postgres::Client,
    redis: &RedisServer,
    relay_bin: &std::path::Path,
    args: &Args,
) -> anyhow::Result<Slots> {
    let mut slots = Slots {
        recv: Vec::new(),
        relay: Vec::new(),
        streams: Vec::new(),
    };
    for _ in 0..args.rounds {
        let slot = unique_name("lab");
        admin
            .query_one(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await?;
        slots.recv.push(slot);
        slots.relay.push(unique_name("lab"));
    }
    // `setup` creates each relay round's slot before the fill, with the outbox still empty,
    // so it records that the stream starts at the slot's position: the relay streams the
    // fill rather than rebuilding it from the table.
    for slot in &slots.relay {
        let stream = if args.routes > 0 {
            format!("lab.{}.${{routedByValue}}", unique_name("stream"))
        } else {
            format!("lab:{}", unique_name("stream"))
        };
        let out = Command::new(relay_bin)
            .args([
                "setup",
                "--database-url",
                &db.url("consumers_relay"),
                "--slot",
                slot,
            ])
            .args([
                "--publication",
                "consumers_outbox",
                "--outbox-table",
                "consumers.outbox",
            ])
            .args(["--redis-url", &redis.url(), "--stream", &stream])
            .args(["--stream-shards", &args.knee.shards.to_string()])
            .args(if args.routes > 0 {
                &["--outbox-route-column", "event"][..]
            } else {
                &[]
            })
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "setup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if args.routes > 0 {
            // Each route first seen here, past the slot's position (as the relay registers a
            // route at its first row's commit): its stream starts at the slot's position.
            let here: String = admin
                .query_one("SELECT (pg_current_wal_lsn() - '0/0')::text", &[])
                .await?
                .get(0);
            let mut conn = redis.connect().await?;
            for route in route_names(args.routes) {
                let _: () = redis::cmd("HSET")
                    .arg(stream.replace("${routedByValue}", "_routes"))
                    .arg(&route)
                    .arg(&here)
                    .query_async(&mut conn)
                    .await?;
            }
        }
        slots.streams.push(stream);
    }
    Ok(slots)
}

/// The routes of a routed drain (the fill's event types).
fn route_names(routes: u32) -> Vec<String> {
    (0..routes).map(|r| format!("r{r}")).collect()
}

/// Every stream key a drain fills.
fn drain_keys(stream: &str, shards: u32, routes: u32) -> Vec<String> {
    if routes == 0 {
        return outbox_core::stream::shard_keys(stream, shards);
    }
    route_names(routes)
        .iter()
        .flat_map(|r| {
            outbox_core::stream::shard_keys(&stream.replace("${routedByValue}", r), shards)
        })
        .collect()
}

/// What the fill wrote.
struct Fill {
    events: u64,
    end_lsn: String,
    wal_bytes: i64,
}

/// Write the shape's transactions into the outbox (one procedure, a commit per
/// transaction), with the NOTIFY relay's column and index made first so its drain times
/// only itself.
async fn fill(admin: &tokio_postgres::Client, shape: &Shape, routes: u32) -> anyhow::Result<Fill> {
    admin
        .batch_execute(&crate::baseline::SENT_AT_DDL.replace("{s}", "consumers"))
        .await?;
    admin
        .batch_execute(
            "CREATE PROCEDURE lab_fill(txns int, rows_per_txn int, routes int) LANGUAGE plpgsql AS $$
             BEGIN
               FOR t IN 1..txns LOOP
                 INSERT INTO consumers.outbox (event, payload, partition_key)
                 SELECT CASE WHEN routes = 0 THEN 'message.created'
                             ELSE 'r' || ((t * rows_per_txn + r) % routes) END,
                        jsonb_build_object(
                          'id', gen_random_uuid(), 'chat_id', 7, 'side', 'consumers',
                          'body', 'hello from the lab, message ' || t || '.' || r,
                          'created_at', now()), ((t * rows_per_txn + r) % 64)::text
                   FROM generate_series(1, rows_per_txn) AS r;
                 COMMIT;
               END LOOP;
             END $$",
        )
        .await?;
    let start_lsn: String = admin
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let filled = Instant::now();
    admin
        .execute(
            "CALL lab_fill($1, $2, $3)",
            &[&(shape.txns as i32), &(shape.rows as i32), &(routes as i32)],
        )
        .await?;
    let end_lsn: String = admin
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let wal_bytes: i64 = admin
        .query_one(
            "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::bigint",
            &[&end_lsn, &start_lsn],
        )
        .await?
        .get(0);
    let events = u64::from(shape.txns) * u64::from(shape.rows);
    eprintln!(
        "[throughput] filled {events} events ({} MB of WAL) in {:.1?}",
        wal_bytes >> 20,
        filled.elapsed()
    );
    Ok(Fill {
        events,
        end_lsn,
        wal_bytes,
    })
}

/// Each round's drains of the slots: pg_recvlogical's, then the relay's (with its CPU).
struct Drains {
    relay_seconds: Vec<f64>,
    relay_cpu: Vec<DrainCpu>,
    recv_seconds: Vec<f64>,
}

async fn drain_slots(
    pg: &PgServer,
    db: &TestDb,
    redis: &RedisServer,
    relay_bin: &std::path::Path,
    args: &Args,
    slots: &Slots,
    fill: &Fill,
) -> anyhow::Result<Drains> {
    let events = fill.events;
    let mut drains = Drains {
        relay_seconds: Vec::new(),
        relay_cpu: Vec::new(),
        recv_seconds: Vec::new(),
    };
    for round in 0..args.rounds as usize {
        let t = drain_with_pg_recvlogical(pg, db, &slots.recv[round], &fill.end_lsn)?;
        eprintln!(
            "[throughput] pg_recvlogical round {}: {:.2} s ({:.0} events/s)",
            round + 1,
            t,
            events as f64 / t
        );
        drains.recv_seconds.push(t);
        let stream = slots.streams[round].clone();
        let (t, cpu) = drain_with_relay(
            relay_bin,
            &args.relay_args,
            db,
            redis,
            RelayTarget {
                slot: &slots.relay[round],
                stream: &stream,
                shards: args.knee.shards,
                routes: args.routes,
            },
            events,
        )
        .await?;
        eprintln!(
            "[throughput] cdc-relay round {}: {:.2} s ({:.0} events/s)",
            round + 1,
            t,
            events as f64 / t
        );
        drains.relay_seconds.push(t);
        drains.relay_cpu.push(cpu);
        let mut conn = redis.connect().await?;
        let _: () = redis::cmd("DEL")
            .arg(drain_keys(&stream, args.knee.shards, args.routes))
            .query_async(&mut conn)
            .await?;
    }
    Ok(drains)
}

/// The NOTIFY relay's drains. It marks rows sent, which writes WAL: it runs after the
/// slots' drains, and each of its rounds starts from every row unsent again.
async fn drain_notify(
    db: &TestDb,
    admin: &tokio_postgres::Client,
    redis: &RedisServer,
    rounds: u32,
    events: u64,
) -> anyhow::Result<Vec<f64>> {
    let mut seconds = Vec::new();
    for round in 0..rounds as usize {
        admin
            .batch_execute("UPDATE consumers.outbox SET sent_at = NULL")
            .await?;
        admin.batch_execute("VACUUM consumers.outbox").await?;
        let t = drain_with_notify_relay(db, redis, events).await?;
        eprintln!(
            "[throughput] notify relay round {}: {:.2} s ({:.0} events/s)",
            round + 1,
            t,
            events as f64 / t
        );
        seconds.push(t);
    }
    Ok(seconds)
}

/// Seconds for the NOTIFY relay (baseline) to move every unsent outbox row into a stream.
async fn drain_with_notify_relay(
    db: &TestDb,
    redis: &RedisServer,
    events: u64,
) -> anyhow::Result<f64> {
    let stream = crate::system::Side::Consumers.outbox_stream();
    let stream = stream.as_str();
    let mut conn = redis.connect().await?;
    let _: () = redis::cmd("DEL").arg(stream).query_async(&mut conn).await?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        "baseline",
        "relay",
        "--mode",
        "notify",
        "--side",
        "consumers",
    ])
    .args([
        "--database-url",
        &db.url("postgres"),
        "--redis-url",
        &redis.url(),
    ]);
    let log = testkit::scratch_dir("lab-notify").join("relay.log");
    let started = Instant::now();
    let relay = ChildProcess::spawn("notify-relay", cmd, &log)?;
    wait_drained(
        &mut conn,
        &[stream.to_string()],
        events,
        &relay,
        started,
        Duration::from_secs(900),
    )
    .await?;
    let elapsed = started.elapsed().as_secs_f64();
    relay.kill()?;
    Ok(elapsed)
}

/// Seconds for pg_recvlogical to stream the slot up to `end_lsn` (output discarded).
fn drain_with_pg_recvlogical(
    pg: &PgServer,
    db: &TestDb,
    slot: &str,
    end_lsn: &str,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let output = Command::new("/usr/lib/postgresql/15/bin/pg_recvlogical")
        .args([
            "--dbname",
            &db.url("consumers_relay"),
            "--slot",
            slot,
            "--start",
            "--no-loop",
        ])
        .args(["--endpos", end_lsn, "--file", "/dev/null"])
        .args([
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=consumers_outbox",
        ])
        .output()
        .context("run pg_recvlogical")?;
    let elapsed = started.elapsed().as_secs_f64();
    if !output.status.success() {
        bail!(
            "pg_recvlogical failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let _ = pg;
    Ok(elapsed)
}

/// The slot a drain reads and the stream (of `shards` shards) it fills.
struct RelayTarget<'a> {
    slot: &'a str,
    stream: &'a str,
    shards: u32,
    /// Routes of a routed drain (0: one stream).
    routes: u32,
}

/// Seconds from starting the relay binary until the stream holds `events` entries.
async fn drain_with_relay(
    relay_bin: &std::path::Path,
    extra_args: &[String],
    db: &TestDb,
    redis: &RedisServer,
    target: RelayTarget<'_>,
    events: u64,
) -> anyhow::Result<(f64, DrainCpu)> {
    let RelayTarget {
        slot,
        stream,
        shards,
        routes,
    } = target;
    let admin: std::net::SocketAddr =
        format!("127.0.0.1:{}", testkit::http::free_port()).parse()?;
    let mut cmd = Command::new(relay_bin);
    cmd.arg("run")
        .args(["--database-url", &db.url("consumers_relay"), "--slot", slot])
        .args([
            "--publication",
            "consumers_outbox",
            "--outbox-table",
            "consumers.outbox",
        ])
        .args([
            "--redis-url",
            &redis.url(),
            "--stream",
            stream,
            "--stream-shards",
            &shards.to_string(),
            "--admin-addr",
            &admin.to_string(),
        ])
        .args(if routes > 0 {
            &["--outbox-route-column", "event"][..]
        } else {
            &[]
        })
        .args(extra_args)
        .env("RUST_LOG", "warn");
    let log = testkit::scratch_dir("lab-relay").join("relay.log");
    let started = Instant::now();
    let relay = ChildProcess::spawn("cdc-relay", cmd, &log)?;
    let mut conn = redis.connect().await?;
    let redis_cpu_start = crate::cpu::cpu_seconds(redis.pid().unwrap_or(0));
    wait_drained(
        &mut conn,
        &drain_keys(stream, shards, routes),
        events,
        &relay,
        started,
        Duration::from_secs(600),
    )
    .await?;
    let elapsed = started.elapsed().as_secs_f64();
    let client = db.connect().await?;
    let walsender: i32 = client
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .get(0);
    let cpu = DrainCpu {
        relay: crate::cpu::cpu_seconds(relay.pid()),
        redis: crate::cpu::cpu_seconds(redis.pid().unwrap_or(0)) - redis_cpu_start,
        walsender: crate::cpu::cpu_seconds(walsender as u32),
    };
    eprintln!(
        "[throughput]   CPU seconds: relay {:.2}, redis {:.2}, walsender {:.2}",
        cpu.relay, cpu.redis, cpu.walsender
    );
    let (_, metrics) = testkit::http::get(admin, "/metrics").await?;
    let value = |name: &str| testkit::http::metric_value(&metrics, name).unwrap_or(f64::NAN);
    let batches = value("cdc_relay_publish_batches_total");
    eprintln!(
        "[throughput]   {batches} batches, {:.0} entries and {:.2} ms per batch on average",
        value("cdc_relay_publish_batch_entries_sum") / batches,
        1000.0 * value("cdc_relay_publish_batch_duration_seconds_sum")
            / value("cdc_relay_publish_batch_duration_seconds_count"),
    );
    relay.stop_with(Signal::Term, Duration::from_secs(30))?;
    Ok((elapsed, cpu))
}

/// Poll the streams' lengths until they hold `events` between them, failing if the relay
/// exits or `limit` passes since `started`.
async fn wait_drained(
    conn: &mut redis::aio::MultiplexedConnection,
    streams: &[String],
    events: u64,
    relay: &ChildProcess,
    started: Instant,
    limit: Duration,
) -> anyhow::Result<()> {
    loop {
        let mut len = 0u64;
        for stream in streams {
            len += redis::cmd("XLEN")
                .arg(stream)
                .query_async::<u64>(conn)
                .await?;
        }
        if len >= events {
            return Ok(());
        }
        if !relay.is_running() {
            bail!("{} exited: {}", relay.name(), relay.log());
        }
        if started.elapsed() > limit {
            bail!(
                "{} drained only {len} of {events} in {limit:?}",
                relay.name()
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(relay: f64, redis: f64, walsender: f64) -> DrainCpu {
        DrainCpu {
            relay,
            redis,
            walsender,
        }
    }

    #[test]
    fn the_cpu_bound_uses_the_fastest_rounds_cpu_and_the_busiest_single_thread() {
        // Round 2 was fastest; its 3 CPU-s on 2 cores take at least 1.5 s: 100,000 events
        // in 1.5 s against a ceiling of 100,000/s is 66.7%.
        let bound = cpu_bound_percent(
            2,
            100_000,
            &[4.0, 2.0],
            &[cpu(1.0, 5.0, 1.0), cpu(0.5, 1.0, 1.5)],
            100_000.0,
        )
        .unwrap();
        assert!((bound - 100.0 / 1.5).abs() < 1e-9, "{bound}");
        // Redis's one thread needs 1.8 s, more than the 2.5 CPU-s spread over 2 cores.
        let bound = cpu_bound_percent(2, 90_000, &[3.0], &[cpu(0.3, 1.8, 0.4)], 100_000.0);
        assert!((bound.unwrap() - 50.0).abs() < 1e-9);
        assert_eq!(
            cpu_bound_percent(2, 1, &[1.0], &[cpu(0.0, 0.0, 0.0)], 1.0),
            None,
            "no CPU read, no bound"
        );
        assert_eq!(cpu_bound_percent(2, 1, &[], &[], 1.0), None);
    }
}
