//! The conformance suite's long variant (`docs/contract/conformance.md`): every short case
//! `--rounds` times and the soak case (three instances, four shards, a fault every 5 s of
//! rows, for `--minutes`) against each implementation, side by side: pass or the failure,
//! rows recorded, dead letters, commit → recorded p50/p99, burst throughput. Rare
//! interleavings the short variant in `cargo test` can miss show here.

use std::time::Duration;

use conformance::{cases, Driver, Outcome};
use serde::Serialize;

use crate::report;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Implementations to run: `rust`, `typescript`, or `NAME=COMMAND` (a driver speaking
    /// the suite's process protocol, e.g. `py=python3 driver.py`).
    #[arg(long = "implementation", default_values_t = ["rust".to_string(), "typescript".to_string()])]
    implementations: Vec<String>,
    /// Rounds of every short case.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Minutes of the soak case per implementation (0: none).
    #[arg(long, default_value_t = 10)]
    minutes: u64,
}

#[derive(Debug, Serialize)]
struct Run {
    implementation: String,
    case: String,
    round: u32,
    passed: bool,
    failure: Option<String>,
    recorded: usize,
    dead_lettered: usize,
    p50_ms: f64,
    p99_ms: f64,
    rows_per_second: f64,
}

#[derive(Debug, Serialize)]
struct Result {
    command: String,
    machine: report::Machine,
    runs: Vec<Run>,
}

fn driver(spec: &str) -> anyhow::Result<Driver> {
    match spec {
        "rust" => Ok(Driver {
            name: "rust".into(),
            program: report::workspace_binary("conformance-driver")?,
            args: Vec::new(),
        }),
        "typescript" => conformance::typescript_driver(),
        other => {
            let (name, command) = other.split_once('=').ok_or_else(|| {
                anyhow::anyhow!("--implementation '{other}': rust, typescript or NAME=COMMAND")
            })?;
            Driver::from_command(name, command)
        }
    }
}

const SHORT: [&str; 8] = [
    "sigkill_and_poison",
    "frozen_in_commit",
    "sigstop_past_the_lease",
    "redis_restart",
    "three_instances_rolling_restart",
    "database_outage_across_a_restart",
    "steady",
    "burst",
];

async fn short_case(case: &str, d: Driver, relay: &std::path::Path) -> anyhow::Result<Outcome> {
    match case {
        "sigkill_and_poison" => cases::sigkill_and_poison(d, relay).await,
        "frozen_in_commit" => cases::frozen_in_commit(d, relay).await,
        "sigstop_past_the_lease" => cases::sigstop_past_the_lease(d, relay).await,
        "redis_restart" => cases::redis_restart(d, relay).await,
        "three_instances_rolling_restart" => cases::three_instances_rolling_restart(d, relay).await,
        "database_outage_across_a_restart" => {
            cases::database_outage_across_a_restart(d, relay).await
        }
        "steady" => cases::steady(d, relay).await,
        "burst" => cases::burst(d, relay).await,
        other => anyhow::bail!("no case {other}"),
    }
}

fn run_of(implementation: &str, case: &str, round: u32, outcome: anyhow::Result<Outcome>) -> Run {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    match outcome {
        Ok(o) => Run {
            implementation: implementation.into(),
            case: case.into(),
            round,
            passed: true,
            failure: None,
            recorded: o.recorded,
            dead_lettered: o.dead_lettered,
            p50_ms: ms(o.latency_p50),
            p99_ms: ms(o.latency_p99),
            rows_per_second: o.throughput,
        },
        Err(e) => Run {
            implementation: implementation.into(),
            case: case.into(),
            round,
            passed: false,
            failure: Some(format!("{e:#}")),
            recorded: 0,
            dead_lettered: 0,
            p50_ms: 0.0,
            p99_ms: 0.0,
            rows_per_second: 0.0,
        },
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let relay = report::workspace_binary("cdc-relay")?;
    let drivers: Vec<Driver> = args
        .implementations
        .iter()
        .map(|s| driver(s))
        .collect::<anyhow::Result<_>>()?;
    let mut runs = Vec::new();
    for d in &drivers {
        for round in 1..=args.rounds {
            for case in SHORT {
                eprintln!("[conformance] {} {case} round {round}", d.name);
                let outcome = short_case(case, d.clone(), &relay).await;
                let run = run_of(&d.name, case, round, outcome);
                print_run(&run);
                runs.push(run);
            }
        }
        if args.minutes > 0 {
            eprintln!("[conformance] {} soak for {} min", d.name, args.minutes);
            let outcome =
                cases::soak(d.clone(), &relay, Duration::from_secs(args.minutes * 60)).await;
            let run = run_of(&d.name, "soak", 1, outcome);
            print_run(&run);
            runs.push(run);
        }
    }
    println!();
    println!(
        "{:<12} {:<34} {:>6} {:>9} {:>5} {:>9} {:>9} {:>9}",
        "impl", "case", "passed", "recorded", "dead", "p50 ms", "p99 ms", "rows/s"
    );
    for d in &drivers {
        let mut cases: Vec<&str> = SHORT.to_vec();
        cases.push("soak");
        for case in cases {
            let mine: Vec<&Run> = runs
                .iter()
                .filter(|r| r.implementation == d.name && r.case == case)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let passed = mine.iter().filter(|r| r.passed).count();
            let ok: Vec<&&Run> = mine.iter().filter(|r| r.passed).collect();
            let worst = |f: fn(&Run) -> f64| ok.iter().map(|r| f(r)).fold(0.0, f64::max);
            let median_p50 = {
                let mut v: Vec<f64> = ok.iter().map(|r| r.p50_ms).collect();
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied().unwrap_or(0.0)
            };
            println!(
                "{:<12} {:<34} {:>3}/{:<2} {:>9} {:>5} {:>9.1} {:>9.1} {:>9.0}",
                d.name,
                case,
                passed,
                mine.len(),
                ok.iter().map(|r| r.recorded).max().unwrap_or(0),
                ok.iter().map(|r| r.dead_lettered).max().unwrap_or(0),
                median_p50,
                worst(|r| r.p99_ms),
                worst(|r| r.rows_per_second),
            );
        }
    }
    let failed = runs.iter().filter(|r| !r.passed).count();
    let path = report::write_json(
        "conformance",
        &Result {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            machine: report::machine(),
            runs,
        },
    )?;
    println!(
        "\n(p50: the median round's; p99 and rows/s: the worst and best round's) {}",
        path.display()
    );
    anyhow::ensure!(failed == 0, "{failed} run(s) failed (see above)");
    Ok(())
}

fn print_run(run: &Run) {
    match &run.failure {
        None => eprintln!(
            "[conformance] {} {} round {}: pass ({} recorded, {} dead-lettered, p50 {:.1} ms, p99 {:.1} ms{})",
            run.implementation,
            run.case,
            run.round,
            run.recorded,
            run.dead_lettered,
            run.p50_ms,
            run.p99_ms,
            if run.rows_per_second > 0.0 {
                format!(", {:.0} rows/s", run.rows_per_second)
            } else {
                String::new()
            }
        ),
        Some(e) => eprintln!(
            "[conformance] {} {} round {}: FAIL: {e}",
            run.implementation, run.case, run.round
        ),
    }
}
