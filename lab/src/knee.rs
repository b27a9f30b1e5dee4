//! The end-to-end knee: messages per second through the HTTP API (POST on Consumers, shown
//! to SSE clients of Workers) at rising load, until send→shown p99 passes a limit. Latency
//! is measured from each message's scheduled send time, so a system falling behind its
//! schedule shows it (no coordinated omission); only the timer's own lateness (≤ 1 ms) on a
//! free connection is not counted.

use std::collections::HashMap;

use inferno::collapse::Collapse;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use testkit::http::SseClient;

use crate::cpu;
use crate::stats::summarize;
use crate::system::{Bins, Kind, Side, System};

#[derive(Debug, Clone, clap::Args)]
// Its own group name: flattened into `throughput`'s arguments, the default ("Args") clashes,
// which clap refuses in debug builds.
#[group(id = "end_to_end")]
pub struct Args {
    /// Target rates of the climb (messages/s), in order; past the last, the climb goes on a
    /// quarter higher each step until p99 passes the limit.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "100,200,400,800,1200,1600,2000,2400,3200"
    )]
    pub e2e_rates: Vec<u32>,
    /// Seconds spent at each rate.
    #[arg(long, default_value_t = 5)]
    pub e2e_seconds: u64,
    /// Seconds of load at the first rate before measuring, not reported: connection pools,
    /// prepared statements and page caches fill here, not in the first step's p99.
    #[arg(long, default_value_t = 3)]
    pub e2e_warmup_seconds: u64,
    /// The send→shown p99 (ms) that ends the climb.
    #[arg(long, default_value_t = 50.0)]
    pub e2e_p99_limit_ms: f64,
    /// Concurrent kept-alive HTTP connections sending.
    #[arg(long, default_value_t = 16)]
    pub e2e_connections: usize,
    /// Chats the load is spread over (one SSE client each).
    #[arg(long, default_value_t = 8)]
    pub e2e_chats: i64,
    /// Receiving (Workers) instances; SSE clients are spread over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=crate::system::MAX_INSTANCES as i64))]
    pub instances: u8,
    /// Shards of both streams (each receiving instance holds its share).
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// Stop the climb after this rate even if p99 holds (none: climb until it breaks).
    #[arg(long)]
    pub e2e_max_rate: Option<u32>,
    /// Skip the send-only floor (the same climb with no relay or receiver running).
    #[arg(long)]
    pub skip_floor: bool,
    /// Profile the relay and the services (perf) at the knee's rate and write flame graphs
    /// to target/lab/.
    #[arg(long)]
    pub flamegraphs: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub target_per_second: u32,
    pub sent: usize,
    pub shown: usize,
    pub errors: usize,
    pub achieved_per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// CPU each process group used during this step.
    pub cpu: Vec<cpu::GroupCpu>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Knee {
    pub p99_limit_ms: f64,
    pub steps: Vec<Step>,
    /// The highest rate sustained with p99 under the limit.
    pub knee_per_second: Option<u32>,
    pub instances: u8,
    pub shards: u32,
    /// The same load with nothing but the sending service running.
    pub floor: Option<Floor>,
    /// Flame graphs written (SVG paths).
    pub flamegraphs: Vec<String>,
    /// Send→shown one message at a time on the same system, before the climb.
    pub sequential: crate::stats::Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    pub steps: Vec<Step>,
    pub knee_per_second: Option<u32>,
}

/// The rates of a climb: the listed ones, then on by a quarter each step (rounded up to a
/// hundred) until p99 passes the limit, however high that is.
fn rates(listed: &[u32], max: Option<u32>) -> impl Iterator<Item = u32> + '_ {
    let last = listed.last().copied().unwrap_or(100).max(100);
    let beyond = std::iter::successors(Some(last), |r| {
        let next = (u64::from(*r) * 5 / 4).div_ceil(100) * 100;
        u32::try_from(next).ok()
    })
    .skip(1);
    listed
        .iter()
        .copied()
        .chain(beyond)
        .take_while(move |r| max.is_none_or(|m| *r <= m))
}

/// What is measured per message: from the scheduled send to the SSE event at a Workers
/// client, or (the send-only floor) to the POST's reply.
#[derive(Clone)]
enum Until {
    Shown(Arc<Mutex<HashMap<String, Instant>>>),
    Replied,
}

/// One message sent: its id, when its latency counts from (see [`send_at`]), when the
/// reply came.
type Sent = (String, Instant, Instant);

/// Lateness of a wakeup that is the timer's own: tokio's timer has a resolution of 1 ms, so
/// a send scheduled at t goes out up to 1 ms later on an idle machine.
const TIMER_RESOLUTION: Duration = Duration::from_millis(1);

/// `rate` messages/s for `seconds` over `connections` kept-alive connections, each message
/// at its scheduled time. Latency counts from there (no coordinated omission: a connection
/// still waiting for its previous reply makes the next message late, and that counts),
/// except for the timer's own lateness when the connection was free: at most
/// [`TIMER_RESOLUTION`] after the schedule, it counts from the actual send.
async fn send_at(
    consumers: std::net::SocketAddr,
    args: &Args,
    rate: u32,
    seconds: u64,
) -> anyhow::Result<(Vec<Sent>, usize, tokio::time::Instant)> {
    let per_connection = Duration::from_secs_f64(args.e2e_connections as f64 / f64::from(rate));
    let count = (u64::from(rate) * seconds) as usize / args.e2e_connections;
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let mut senders = Vec::new();
    for c in 0..args.e2e_connections {
        let chats = args.e2e_chats;
        let connections = args.e2e_connections as f64;
        senders.push(tokio::spawn(async move {
            let mut sent = Vec::with_capacity(count);
            let mut errors = 0;
            let Ok(mut conn) = testkit::http::Connection::open(consumers).await else {
                return (sent, count);
            };
            // Connections start staggered within one interval.
            let offset = per_connection.mul_f64(c as f64 / connections);
            let mut free_since = tokio::time::Instant::now();
            for i in 0..count {
                let scheduled = start + offset + per_connection * i as u32;
                tokio::time::sleep_until(scheduled).await;
                let woke = tokio::time::Instant::now();
                let from = if free_since <= scheduled {
                    // (never before the schedule: the sleep ended there)
                    woke.min(scheduled + TIMER_RESOLUTION)
                } else {
                    scheduled
                };
                let chat = 1 + ((c + i) as i64 % chats);
                let body = serde_json::json!({ "body": format!("load {c}.{i}") });
                match conn
                    .post_json(&format!("/chats/{chat}/messages"), &body)
                    .await
                {
                    Ok(reply) if reply.status == 201 => {
                        let id = reply.json()["id"].as_str().unwrap_or_default().to_string();
                        sent.push((id, from.into_std(), Instant::now()));
                    }
                    _ => errors += 1,
                }
                free_since = tokio::time::Instant::now();
            }
            (sent, errors)
        }));
    }
    let mut sent = Vec::new();
    let mut errors = 0;
    for s in senders {
        let (ids, e) = s.await?;
        sent.extend(ids);
        errors += e;
    }
    Ok((sent, errors, start))
}

/// One step of a climb.
async fn step(
    consumers: std::net::SocketAddr,
    args: &Args,
    until: &Until,
    rate: u32,
    seconds: u64,
) -> anyhow::Result<Step> {
    let (sent, errors, start) = send_at(consumers, args, rate, seconds).await?;
    let done: HashMap<String, Instant> = match until {
        Until::Shown(arrivals) => {
            let settle = Instant::now() + Duration::from_secs(10);
            while Instant::now() < settle
                && sent
                    .iter()
                    .any(|(id, _, _)| !arrivals.lock().unwrap().contains_key(id))
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            arrivals.lock().unwrap().clone()
        }
        Until::Replied => sent
            .iter()
            .map(|(id, _, replied)| (id.clone(), *replied))
            .collect(),
    };
    let latencies: Vec<f64> = sent
        .iter()
        .filter_map(|(id, at, _)| {
            done.get(id)
                .map(|t| t.duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect();
    // Done per second over the time it actually took, not the time it was meant to take.
    let first = start.into_std();
    let last = sent
        .iter()
        .filter_map(|(id, _, _)| done.get(id))
        .max()
        .copied()
        .unwrap_or(first);
    let took = last.duration_since(first).as_secs_f64().max(seconds as f64);
    let shown = latencies.len();
    let summary = summarize(
        "cdc",
        if latencies.is_empty() {
            vec![f64::INFINITY]
        } else {
            latencies
        },
    );
    Ok(Step {
        target_per_second: rate,
        sent: sent.len(),
        shown,
        errors,
        achieved_per_second: shown as f64 / took,
        p50_ms: summary.p50_ms,
        p99_ms: summary.p99_ms,
        cpu: Vec::new(),
    })
}

/// Warm up at the first rate, then climb until p99 passes the limit (or a message is
/// lost or refused) twice in a row at one rate. Each step reports its own CPU.
async fn climb(
    label: &str,
    consumers: std::net::SocketAddr,
    args: &Args,
    until: &Until,
    sampler: &cpu::Sampler,
) -> anyhow::Result<(Vec<Step>, Option<u32>)> {
    let first = rates(&args.e2e_rates, args.e2e_max_rate)
        .next()
        .unwrap_or(100);
    if args.e2e_warmup_seconds > 0 {
        eprintln!(
            "[{label}] {first} messages/s for {} s (warm-up, not reported)",
            args.e2e_warmup_seconds
        );
        step(consumers, args, until, first, args.e2e_warmup_seconds).await?;
    }
    let mut steps = Vec::new();
    let mut knee = None;
    'climb: for rate in rates(&args.e2e_rates, args.e2e_max_rate) {
        // A step that breaks is run once more: one stall of the machine (a checkpoint, the
        // previous system's files being removed) must not end the climb; two in a row do.
        for attempt in 1..=2 {
            eprintln!("[{label}] {rate} messages/s for {} s", args.e2e_seconds);
            let before = sampler.snapshot();
            let mut s = step(consumers, args, until, rate, args.e2e_seconds).await?;
            s.cpu = sampler.snapshot().since(&before, s.shown);
            eprintln!(
                "[{label}] {rate}/s: done {} of {} ({} errors), p50 {:.1} ms, p99 {:.1} ms",
                s.shown, s.sent, s.errors, s.p50_ms, s.p99_ms
            );
            let held = s.p99_ms <= args.e2e_p99_limit_ms && s.shown == s.sent && s.errors == 0;
            steps.push(s);
            if held {
                knee = Some(rate);
                continue 'climb;
            }
            if attempt == 2 {
                break 'climb;
            }
        }
    }
    Ok((steps, knee))
}

pub async fn measure(args: &Args) -> anyhow::Result<Knee> {
    measure_with(args, Bins::beside_this()?).await
}

/// [`measure`] with the binaries `bins`.
pub async fn measure_with(args: &Args, bins: Bins) -> anyhow::Result<Knee> {
    let floor = if args.skip_floor {
        None
    } else {
        Some(measure_floor(args, bins.clone()).await?)
    };
    let system = System::new_sharded(true, bins, args.shards).await?;
    system.start("relay-consumers", Kind::Relay(Side::Consumers), &[])?;
    system
        .wait_relay("relay-consumers", Duration::from_secs(30))
        .await?;
    let instances = usize::from(args.instances);
    system.start("consumers", Kind::Service(Side::Consumers), &[])?;
    for i in 0..instances {
        let name = format!("workers-{}", i + 1);
        let kind = match i {
            0 => Kind::Service(Side::Workers),
            _ => Kind::Instance(Side::Workers, i),
        };
        system.start(&name, kind, &[])?;
    }
    system
        .wait_service(Side::Consumers, Duration::from_secs(30))
        .await?;
    for i in 0..instances {
        system
            .wait_instance(Side::Workers, i, Duration::from_secs(30))
            .await?;
    }
    wait_shards_held(&system, instances, args.shards).await?;
    let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut readers = Vec::new();
    for chat in 1..=args.e2e_chats {
        let mut client = SseClient::connect(
            system.instance_addr(Side::Workers, chat as usize % instances),
            &format!("/chats/{chat}/events"),
            None,
        )
        .await?;
        let arrivals = arrivals.clone();
        readers.push(tokio::spawn(async move {
            while let Some(event) = client.next(Duration::from_secs(600)).await {
                let at = Instant::now();
                if let Ok(data) = serde_json::from_str::<serde_json::Value>(&event.data) {
                    if let Some(id) = data["id"].as_str() {
                        arrivals.lock().unwrap().insert(id.to_string(), at);
                    }
                }
            }
        }));
    }
    let consumers = system.service_addr(Side::Consumers);
    let sequential = one_at_a_time(consumers, &arrivals).await?;
    eprintln!(
        "[e2e] one at a time: p50 {:.2} ms, p99 {:.2} ms",
        sequential.p50_ms, sequential.p99_ms
    );
    let sampler = system.cpu_sampler();
    let until = Until::Shown(arrivals);
    let (steps, knee) = climb("e2e", consumers, args, &until, &sampler).await?;
    let flamegraphs = match (args.flamegraphs, knee) {
        // Best effort: a machine where perf may not record still gets its figures.
        (true, Some(rate)) => match flamegraphs(&system, consumers, args, &until, rate).await {
            Ok(written) => written,
            Err(e) => {
                eprintln!("[e2e] no flame graphs: {e:#}");
                Vec::new()
            }
        },
        _ => Vec::new(),
    };
    for r in readers {
        r.abort();
    }
    system.shutdown();
    Ok(Knee {
        p99_limit_ms: args.e2e_p99_limit_ms,
        steps,
        knee_per_second: knee,
        instances: args.instances,
        shards: args.shards,
        floor,
        flamegraphs,
        sequential,
    })
}

/// Messages sent one at a time before the climb.
const SEQUENTIAL_MESSAGES: usize = 200;

/// Send→shown of messages sent one at a time, each once the previous one was shown and the
/// system idle again (10 ms later), from the POST going out: the latency of a quiet system,
/// to hold the climb's lowest steps against.
async fn one_at_a_time(
    consumers: std::net::SocketAddr,
    arrivals: &Arc<Mutex<HashMap<String, Instant>>>,
) -> anyhow::Result<crate::stats::Summary> {
    let mut conn = testkit::http::Connection::open(consumers).await?;
    let mut samples = Vec::with_capacity(SEQUENTIAL_MESSAGES);
    for i in 0..SEQUENTIAL_MESSAGES + 5 {
        let started = Instant::now();
        let id = crate::latency::post(&mut conn, &format!("one {i}"), &[]).await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let shown = loop {
            if let Some(at) = arrivals.lock().unwrap().get(&id) {
                break *at;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "message {id} not shown within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        // The first few warm connections and caches.
        if i >= 5 {
            samples.push(shown.duration_since(started).as_secs_f64() * 1000.0);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(crate::stats::summarize("one at a time", samples))
}

/// The send-only floor: the same HTTP load on Consumers with no relay and no receiver
/// running (the slots exist, nobody reads them), latency to the POST's reply.
async fn measure_floor(args: &Args, bins: Bins) -> anyhow::Result<Floor> {
    let system = System::new_sharded(true, bins, args.shards).await?;
    system.start("consumers", Kind::Service(Side::Consumers), &[])?;
    system
        .wait_service(Side::Consumers, Duration::from_secs(30))
        .await?;
    let sampler = system.cpu_sampler();
    let (steps, knee) = climb(
        "send-only",
        system.service_addr(Side::Consumers),
        args,
        &Until::Replied,
        &sampler,
    )
    .await?;
    system.shutdown();
    Ok(Floor {
        steps,
        knee_per_second: knee,
    })
}

/// Profiles (perf, DWARF call graphs) of the relay and the services while the knee's rate
/// runs again, as flame graphs in target/lab/.
async fn flamegraphs(
    system: &System,
    consumers: std::net::SocketAddr,
    args: &Args,
    until: &Until,
    rate: u32,
) -> anyhow::Result<Vec<String>> {
    let targets: Vec<(String, u32)> = system
        .pids()
        .into_iter()
        .filter(|(name, _)| {
            name.starts_with("relay")
                || name.starts_with("consumers")
                || name.starts_with("workers")
        })
        .collect();
    let dir = crate::report::lab_dir();
    let data = dir.join("perf.data");
    let pids: Vec<String> = targets.iter().map(|(_, p)| p.to_string()).collect();
    eprintln!(
        "[e2e] profiling {} at {rate}/s",
        targets
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut record = std::process::Command::new("perf");
    record
        .args([
            "record",
            "-q",
            "-F",
            "499",
            "--call-graph",
            "dwarf,16384",
            "-o",
        ])
        .arg(&data)
        .args(["-p", &pids.join(",")]);
    let perf = testkit::ChildProcess::spawn("perf", record, &dir.join("perf.log"))
        .map_err(|e| anyhow::anyhow!("perf (Debian's linux-perf) could not start: {e}"))?;
    let profiled = step(consumers, args, until, rate, args.e2e_seconds).await;
    // SIGINT makes perf write its data and exit.
    perf.stop_with(testkit::Signal::Int, Duration::from_secs(120))?;
    profiled?;
    let mut written = Vec::new();
    for (name, pid) in &targets {
        let script = std::process::Command::new("perf")
            .arg("script")
            .arg("-i")
            .arg(&data)
            .args(["--pid", &pid.to_string()])
            .output()?;
        if !script.status.success() || script.stdout.is_empty() {
            anyhow::bail!(
                "perf script found no samples of {name}: {}",
                String::from_utf8_lossy(&script.stderr).trim()
            );
        }
        let mut folded = Vec::new();
        inferno::collapse::perf::Folder::from(inferno::collapse::perf::Options::default())
            .collapse(&script.stdout[..], &mut folded)?;
        std::fs::write(dir.join(format!("flamegraph-{name}.folded")), &folded)?;
        for (share, frame) in hottest_frames(&folded, 8) {
            eprintln!("[e2e]   {name}: {share:5.1}% self in {frame}");
        }
        let path = dir.join(format!("flamegraph-{name}.svg"));
        let mut options = inferno::flamegraph::Options::default();
        options.title = format!("{name} at {rate} messages/s");
        inferno::flamegraph::from_reader(&mut options, &folded[..], std::fs::File::create(&path)?)?;
        eprintln!("[e2e] flame graph: {}", path.display());
        written.push(path.display().to_string());
    }
    let _ = std::fs::remove_file(&data);
    Ok(written)
}

/// The frames with the most samples of their own (leaf frames) in folded stacks, as
/// percentages of all samples: what the flame graph's widest tips are.
fn hottest_frames(folded: &[u8], n: usize) -> Vec<(f64, String)> {
    let mut own: HashMap<String, u64> = HashMap::new();
    let mut total = 0u64;
    for line in String::from_utf8_lossy(folded).lines() {
        let Some((stack, count)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(count) = count.parse::<u64>() else {
            continue;
        };
        total += count;
        let leaf = stack.rsplit(';').next().unwrap_or(stack);
        *own.entry(leaf.to_string()).or_default() += count;
    }
    let mut frames: Vec<(f64, String)> = own
        .into_iter()
        .map(|(frame, count)| (count as f64 * 100.0 / total.max(1) as f64, frame))
        .collect();
    frames.sort_by(|a, b| b.0.total_cmp(&a.0));
    frames.truncate(n);
    frames
}

/// Until the receiving instances hold every shard between them (each at least one when
/// there are enough shards), so the climb measures the split, not a handover.
async fn wait_shards_held(system: &System, instances: usize, shards: u32) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut held = Vec::new();
        let mut busy = 0;
        for i in 0..instances {
            if let Ok((200, body)) =
                testkit::http::get(system.instance_admin(Side::Workers, i), "/readyz").await
            {
                let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let mine = json["shards"].as_array().map_or(0, Vec::len);
                busy += usize::from(mine > 0);
                held.extend(json["shards"].as_array().cloned().unwrap_or_default());
            }
        }
        if held.len() == shards as usize && busy == instances.min(shards as usize) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!("shards not split over {instances} instances: held {held:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn print_steps(steps: &[Step], done: &str) {
    println!(
        "{:>10} {:>10} {:>8} {:>8} {:>10} {:>10}",
        "target/s", done, "sent", "errors", "p50 ms", "p99 ms"
    );
    for s in steps {
        println!(
            "{:>10} {:>10.0} {:>8} {:>8} {:>10.1} {:>10.1}",
            s.target_per_second, s.achieved_per_second, s.sent, s.errors, s.p50_ms, s.p99_ms
        );
    }
}

/// CPU at the first step (a moderate rate) and at the knee's step.
fn print_cpu(steps: &[Step], knee: Option<u32>) {
    let mut shown = Vec::new();
    if let Some(first) = steps.first() {
        shown.push(first);
    }
    if let Some(at_knee) = steps
        .iter()
        .rfind(|s| Some(s.target_per_second) == knee)
        .filter(|s| {
            shown
                .first()
                .is_none_or(|f| f.target_per_second != s.target_per_second)
        })
    {
        shown.push(at_knee);
    }
    for s in shown {
        cpu::print(
            &format!(
                "CPU at {} messages/s ({} done):",
                s.target_per_second, s.shown
            ),
            &s.cpu,
        );
    }
}

pub fn print(knee: &Knee) {
    if let Some(floor) = &knee.floor {
        println!();
        println!("Send-only floor: the same POST load on Consumers, no relay or receiver running (latency to the reply)");
        print_steps(&floor.steps, "sent/s");
        match floor.knee_per_second {
            Some(rate) => println!(
                "floor: {rate} messages/s with p99 under {} ms",
                knee.p99_limit_ms
            ),
            None => println!("floor: below the first step"),
        }
        print_cpu(&floor.steps, floor.knee_per_second);
    }
    println!();
    println!(
        "End-to-end, POST on Consumers → SSE at {} Workers instance(s), {} shard(s), rising load (latency from the scheduled send, less the timer's own ≤ 1 ms; fsync on)",
        knee.instances, knee.shards
    );
    println!(
        "  one at a time (each after the previous was shown): p50 {:.2} ms, p99 {:.2} ms",
        knee.sequential.p50_ms, knee.sequential.p99_ms
    );
    print_steps(&knee.steps, "shown/s");
    if let Some(first) = knee.steps.first() {
        println!(
            "  at {}/s p50 is {:+.0}% of one at a time",
            first.target_per_second,
            (first.p50_ms / knee.sequential.p50_ms - 1.0) * 100.0
        );
    }
    match knee.knee_per_second {
        Some(rate) => {
            print!(
                "knee: {rate} messages/s with p99 under {} ms",
                knee.p99_limit_ms
            );
            // Only a floor whose climb broke is a floor (not one stopped by --e2e-max-rate).
            let floor = knee
                .floor
                .as_ref()
                .filter(|f| f.steps.last().map(|s| s.target_per_second) != f.knee_per_second);
            match floor.and_then(|f| f.knee_per_second) {
                Some(floor) => println!(
                    " ({:.0}% of the send-only floor)",
                    f64::from(rate) * 100.0 / f64::from(floor)
                ),
                None => println!(" (the send-only floor was not reached)"),
            }
        }
        None => println!("knee: below the first step ({} ms p99)", knee.p99_limit_ms),
    }
    print_cpu(&knee.steps, knee.knee_per_second);
    for path in &knee.flamegraphs {
        println!("flame graph: {path}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_climb_goes_on_past_the_listed_rates_until_told_to_stop() {
        let climbed: Vec<u32> = rates(&[100, 400], None).take(8).collect();
        assert_eq!(climbed, [100, 400, 500, 700, 900, 1200, 1500, 1900]);
        let capped: Vec<u32> = rates(&[100, 400], Some(700)).collect();
        assert_eq!(capped, [100, 400, 500, 700]);
    }

    #[test]
    fn the_hottest_frames_are_the_leaves_with_most_samples() {
        let folded = b"main;a;b 3\nmain;a 1\nmain;c;b 4\n";
        let frames = hottest_frames(folded, 2);
        assert_eq!(frames[0], (87.5, "b".to_string()));
        assert_eq!(frames[1], (12.5, "a".to_string()));
    }
}
