//! What a rebuild costs at scale: an outbox of `--rows` retained rows, a relay whose Redis
//! lost everything (no record: every row goes out again), then the same stream with its
//! record set back (Redis "lost" only its acknowledged position: every row is compared and
//! none republished). Reports rows/s and the relay's peak memory for each.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde::Serialize;
use testkit::{unique_name, ChildProcess, PgOptions, PgServer, RedisServer, Signal, TestDb};

use crate::report;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Retained outbox rows.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u32,
}

#[derive(Debug, Serialize)]
struct Case {
    case: &'static str,
    rows: u32,
    republished: f64,
    seconds: f64,
    rows_per_second: f64,
    relay_peak_rss_mib: f64,
}

#[derive(Debug, Serialize)]
struct Result {
    command: String,
    machine: report::Machine,
    cases: Vec<Case>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let relay_bin = report::workspace_binary("cdc-relay")?;
    let pg = PgServer::start_with(PgOptions {
        durable: true,
        ..Default::default()
    })?;
    let redis = RedisServer::start()?;
    let db = pg.create_database().await?;
    let admin = db.connect().await?;
    let slot = unique_name("lab");
    let stream = format!("lab:{}", unique_name("stream"));
    let connection = |db: &TestDb| {
        vec![
            "--database-url".to_string(),
            db.url("consumers_relay"),
            "--slot".into(),
            slot.clone(),
            "--publication".into(),
            "consumers_outbox".into(),
            "--outbox-table".into(),
            "consumers.outbox".into(),
        ]
    };
    // The slot, with no stream record: as if Redis had lost everything.
    let out = Command::new(&relay_bin)
        .arg("setup")
        .args(connection(&db))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "setup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("[rebuild] filling {} outbox rows", args.rows);
    admin
        .execute(
            "INSERT INTO consumers.outbox (event, payload)
             SELECT 'message.created', jsonb_build_object(
                      'id', gen_random_uuid(), 'chat_id', r % 1000, 'side', 'consumers',
                      'body', 'hello from the lab, message ' || r, 'created_at', now())
               FROM generate_series(1, $1) AS r",
            &[&(args.rows as i32)],
        )
        .await?;

    let mut cases = Vec::new();
    let run_relay = |case: &'static str| {
        let mut argv = vec!["run".to_string()];
        argv.extend(connection(&db));
        let admin = format!("127.0.0.1:{}", testkit::http::free_port());
        argv.extend([
            "--redis-url".into(),
            redis.url(),
            "--stream".into(),
            stream.clone(),
            "--admin-addr".into(),
            admin.clone(),
        ]);
        let mut cmd = Command::new(&relay_bin);
        cmd.args(argv).env("RUST_LOG", "info");
        let log = testkit::scratch_dir("lab-rebuild").join(format!("{case}.log"));
        (ChildProcess::spawn(case, cmd, &log), admin)
    };

    for case in ["redis lost everything", "every row compared"] {
        if case == "every row compared" {
            // Redis keeps the stream but "forgot" how far it acknowledged.
            let mut conn = redis.connect().await?;
            let _: i64 = redis::cmd("HSET")
                .arg(outbox_core::stream::keys::origin_key(&stream))
                .arg("acked_through")
                .arg(0)
                .query_async(&mut conn)
                .await?;
        }
        let started = Instant::now();
        let (relay, admin) = run_relay(case);
        let relay = relay?;
        let admin: std::net::SocketAddr = admin.parse()?;
        let metrics = wait_rebuilt(&relay, admin, started).await?;
        let seconds = started.elapsed().as_secs_f64();
        let peak = peak_rss_mib(relay.pid());
        let republished =
            testkit::http::metric_value(&metrics, "cdc_relay_republished_events_total")
                .unwrap_or(f64::NAN);
        relay.stop_with(Signal::Term, Duration::from_secs(30))?;
        eprintln!(
            "[rebuild] {case}: {republished} republished in {seconds:.1} s, peak RSS {peak:.0} MiB"
        );
        cases.push(Case {
            case,
            rows: args.rows,
            republished,
            seconds,
            rows_per_second: f64::from(args.rows) / seconds,
            relay_peak_rss_mib: peak,
        });
    }

    print_cases(args.rows, &cases);
    let result = Result {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: report::machine(),
        cases,
    };
    let path = report::write_json("rebuild", &result)?;
    println!("\nwritten to {}", path.display());
    Ok(())
}

/// The relay's metrics once it streams and no shard is behind any more (it caught the
/// stream up from the outbox table); an error if it exits or takes 30 minutes.
async fn wait_rebuilt(
    relay: &ChildProcess,
    admin: std::net::SocketAddr,
    started: Instant,
) -> anyhow::Result<String> {
    loop {
        if !relay.is_running() {
            bail!("relay exited: {}", relay.log());
        }
        if started.elapsed() > Duration::from_secs(1800) {
            bail!("rebuild not done within 30 minutes");
        }
        if let Ok((200, _)) = testkit::http::get(admin, "/readyz").await {
            let metrics = testkit::http::get(admin, "/metrics").await?.1;
            if caught_up(&metrics) {
                return Ok(metrics);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The cases as a table.
fn print_cases(rows: u32, cases: &[Case]) {
    println!();
    println!(
        "Rebuild of a stream from {} retained outbox rows (fsync on, Redis appendfsync always)",
        rows
    );
    println!(
        "{:<24} {:>12} {:>10} {:>12} {:>14}",
        "case", "republished", "seconds", "rows/s", "relay peak MiB"
    );
    for c in cases {
        println!(
            "{:<24} {:>12} {:>10.1} {:>12.0} {:>14.0}",
            c.case, c.republished, c.seconds, c.rows_per_second, c.relay_peak_rss_mib
        );
    }
}

/// The process's peak resident set (VmHWM), in MiB.
/// Whether the relay's metrics say it caught the stream up: a catch-up ran and no shard
/// is behind any more.
fn caught_up(metrics: &str) -> bool {
    let samples = testkit::http::metric_samples(metrics);
    let sum = |prefix: &str| -> f64 {
        samples
            .iter()
            .filter(|(series, _)| series.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    };
    sum("cdc_relay_catch_ups_total") >= 1.0 && sum("cdc_relay_shard_behind{") == 0.0
}

fn peak_rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}
