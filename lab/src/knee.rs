//! The end-to-end knee: messages per second through the HTTP API (POST on Consumers, shown
//! to SSE clients of Workers) at rising load, until send→shown p99 passes a limit. Latency
//! is measured from each message's scheduled send time, so a system falling behind its
//! schedule shows it (no coordinated omission).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use testkit::http::SseClient;

use crate::latency::summarize;
use crate::system::{Bins, Kind, Side, System};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Target rates of the climb (messages/s), in order.
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
}

#[derive(Debug, Clone, Serialize)]
pub struct Knee {
    pub p99_limit_ms: f64,
    pub steps: Vec<Step>,
    /// The highest rate sustained with p99 under the limit.
    pub knee_per_second: Option<u32>,
    pub instances: u8,
    pub shards: u32,
    /// CPU seconds each process used over the whole climb (warm-up included), and per
    /// 1,000 messages shown.
    pub cpu: Vec<ProcessCpu>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcessCpu {
    pub process: String,
    pub seconds: f64,
    pub per_1000_messages: f64,
}

pub async fn measure(args: &Args) -> anyhow::Result<Knee> {
    let system = System::new_sharded(true, Bins::beside_this()?, args.shards).await?;
    system.start("relay-consumers", Kind::Relay(Side::Consumers), &[])?;
    system
        .wait_relay("relay-consumers", Duration::from_secs(30))
        .await?;
    let instances = usize::from(args.instances);
    let mut names = vec!["relay-consumers".to_string(), "consumers".to_string()];
    system.start("consumers", Kind::Service(Side::Consumers), &[])?;
    for i in 0..instances {
        let name = format!("workers-{}", i + 1);
        let kind = match i {
            0 => Kind::Service(Side::Workers),
            _ => Kind::Instance(Side::Workers, i),
        };
        system.start(&name, kind, &[])?;
        names.push(name);
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
    let cpu_before: Vec<f64> = names.iter().map(|n| system.cpu_seconds(n)).collect();
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
    let mut steps = Vec::new();
    let mut knee = None;
    let warmup = args
        .e2e_rates
        .first()
        .filter(|_| args.e2e_warmup_seconds > 0)
        .map(|&rate| (rate, args.e2e_warmup_seconds, true));
    let climb = args
        .e2e_rates
        .iter()
        .map(|&rate| (rate, args.e2e_seconds, false));
    for (rate, seconds, warming_up) in warmup.into_iter().chain(climb) {
        eprintln!(
            "[e2e] {rate} messages/s for {seconds} s{}",
            if warming_up {
                " (warm-up, not reported)"
            } else {
                ""
            }
        );
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
                for i in 0..count {
                    let scheduled = start + offset + per_connection * i as u32;
                    tokio::time::sleep_until(scheduled).await;
                    let chat = 1 + ((c + i) as i64 % chats);
                    let body = serde_json::json!({ "body": format!("load {c}.{i}") });
                    match conn
                        .post_json(&format!("/chats/{chat}/messages"), &body)
                        .await
                    {
                        Ok(reply) if reply.status == 201 => {
                            let id = reply.json()["id"].as_str().unwrap_or_default().to_string();
                            sent.push((id, scheduled.into_std()));
                        }
                        _ => errors += 1,
                    }
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
        let settle = Instant::now() + Duration::from_secs(10);
        while Instant::now() < settle
            && sent
                .iter()
                .any(|(id, _)| !arrivals.lock().unwrap().contains_key(id))
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let arrived = arrivals.lock().unwrap().clone();
        let latencies: Vec<f64> = sent
            .iter()
            .filter_map(|(id, at)| {
                arrived
                    .get(id)
                    .map(|t| t.duration_since(*at).as_secs_f64() * 1000.0)
            })
            .collect();
        // Shown per second over the time it actually took, not the time it was meant to take.
        let first = start.into_std();
        let last = sent
            .iter()
            .filter_map(|(id, _)| arrived.get(id))
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
        let step = Step {
            target_per_second: rate,
            sent: sent.len(),
            shown,
            errors,
            achieved_per_second: shown as f64 / took,
            p50_ms: summary.p50_ms,
            p99_ms: summary.p99_ms,
        };
        eprintln!(
            "[e2e] {rate}/s: shown {} of {} ({} errors), p50 {:.1} ms, p99 {:.1} ms",
            step.shown, step.sent, step.errors, step.p50_ms, step.p99_ms
        );
        if warming_up {
            continue;
        }
        let held = step.p99_ms <= args.e2e_p99_limit_ms && step.shown == step.sent && errors == 0;
        steps.push(step);
        if !held {
            break;
        }
        knee = Some(rate);
    }
    for r in readers {
        r.abort();
    }
    let shown: usize = arrivals.lock().unwrap().len();
    let cpu = names
        .iter()
        .zip(cpu_before)
        .map(|(name, before)| {
            let seconds = system.cpu_seconds(name) - before;
            ProcessCpu {
                process: name.clone(),
                seconds,
                per_1000_messages: seconds * 1000.0 / shown.max(1) as f64,
            }
        })
        .collect();
    system.shutdown();
    Ok(Knee {
        p99_limit_ms: args.e2e_p99_limit_ms,
        steps,
        knee_per_second: knee,
        instances: args.instances,
        shards: args.shards,
        cpu,
    })
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

pub fn print(knee: &Knee) {
    println!();
    println!(
        "End-to-end, POST on Consumers → SSE at {} Workers instance(s), {} shard(s), rising load (latency from the scheduled send time; fsync on)",
        knee.instances, knee.shards
    );
    println!(
        "{:>10} {:>10} {:>8} {:>8} {:>10} {:>10}",
        "target/s", "shown/s", "sent", "errors", "p50 ms", "p99 ms"
    );
    for s in &knee.steps {
        println!(
            "{:>10} {:>10.0} {:>8} {:>8} {:>10.1} {:>10.1}",
            s.target_per_second, s.achieved_per_second, s.sent, s.errors, s.p50_ms, s.p99_ms
        );
    }
    match knee.knee_per_second {
        Some(rate) => println!(
            "knee: {rate} messages/s with p99 under {} ms",
            knee.p99_limit_ms
        ),
        None => println!("knee: below the first step ({} ms p99)", knee.p99_limit_ms),
    }
    println!("CPU over the climb (warm-up included):");
    for p in &knee.cpu {
        println!(
            "  {:<18} {:>8.2} s {:>8.3} s per 1,000 messages",
            p.process, p.seconds, p.per_1000_messages
        );
    }
}
