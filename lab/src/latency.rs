//! Send→shown latency: messages POSTed on Consumers, timed until the SSE event of each
//! arrives at a client of Workers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use testkit::http::SseClient;

use crate::baseline::{RelayMode, SenderMode};
use crate::report;
use crate::stats::{histogram_quantile, summarize, Summary};
use crate::system::{Bins, Kind, Side, System};

/// What sends and relays the messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Variant {
    /// Ours: outbox, logical replication slot, cdc-relay.
    Cdc,
    /// Ours with identities, as in production: every send and the stream carry a bearer
    /// token (EdDSA), verified and checked for chat membership by the services.
    #[value(name = "cdc-tokens")]
    CdcTokens,
    /// Ours with every process exporting spans over OTLP (to a receiver in the lab
    /// process), each POST carrying a `traceparent`: what tracing costs.
    #[value(name = "cdc-traced")]
    CdcTraced,
    /// The second design: outbox + NOTIFY, a relay selecting FOR UPDATE batches.
    Notify,
    /// The same relay woken only by a 1 s timer.
    #[value(name = "poll-1s")]
    Poll1s,
    /// The first design: commit, then XADD from an in-memory retry queue.
    DualWrite,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Cdc => "cdc",
            Variant::CdcTokens => "cdc-tokens",
            Variant::CdcTraced => "cdc-traced",
            Variant::Notify => "notify",
            Variant::Poll1s => "poll-1s",
            Variant::DualWrite => "dual-write",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages per round.
    #[arg(long, default_value_t = 100)]
    messages: usize,
    /// Pause between messages.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "100ms")]
    interval: Duration,
    /// Rounds (each with its own system); the table shows all samples together.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Variants to measure, side by side (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    variants: Vec<Variant>,
    /// Postgres with fsync off (faster, not what production runs).
    #[arg(long)]
    no_fsync: bool,
}

/// Where the time goes over a run, from the components' own metrics: averages, and p50/p99
/// estimated from the histograms' buckets (as Prometheus's `histogram_quantile` does).
#[derive(Debug, Clone, Serialize)]
pub struct Stages {
    pub variant: String,
    /// Relay: from the transaction's commit timestamp to Redis confirming its entry.
    pub commit_to_published_ms: f64,
    /// Relay: one publish call to Redis (script + AOF fsync).
    pub publish_call_ms: f64,
    /// Workers: from the outbox row's created_at to the message shown (pushed to clients).
    pub outbox_write_to_shown_ms: f64,
    /// p50 and p99 (ms) of each stage histogram, in path order.
    pub quantiles: Vec<StageQuantiles>,
    /// CPU (user + system) of the relay and both services per message sent, in ms.
    pub cpu_ms_per_message: f64,
    /// Spans the OTLP receiver got (traced runs).
    pub spans_received: Option<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StageQuantiles {
    pub histogram: String,
    pub count: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Stages {
    async fn read(
        system: &System,
        variant: Variant,
        cpu_ms_per_message: f64,
        spans_received: Option<usize>,
    ) -> anyhow::Result<Self> {
        let avg = |text: &str, name: &str| {
            let sum = testkit::http::metric_value(text, &format!("{name}_sum")).unwrap_or(f64::NAN);
            let count =
                testkit::http::metric_value(text, &format!("{name}_count")).unwrap_or(f64::NAN);
            1000.0 * sum / count
        };
        let relay = system
            .relay_admin("relay-consumers")
            .expect("relay started");
        let (_, relay) = testkit::http::get(relay, "/metrics").await?;
        let (_, workers) =
            testkit::http::get(system.service_admin(Side::Workers), "/metrics").await?;
        let quantiles = [
            (&relay, "cdc_relay_commit_to_published_seconds"),
            (&workers, "chat_published_to_recorded_seconds"),
            (&workers, "chat_recorded_to_pushed_seconds"),
            (&workers, "chat_delivery_seconds"),
        ]
        .into_iter()
        .map(|(text, name)| StageQuantiles {
            histogram: name.to_string(),
            count: testkit::http::metric_value(text, &format!("{name}_count")).unwrap_or(0.0),
            p50_ms: 1000.0 * histogram_quantile(text, name, 0.50),
            p99_ms: 1000.0 * histogram_quantile(text, name, 0.99),
        })
        .collect();
        Ok(Self {
            variant: variant.name().to_string(),
            commit_to_published_ms: avg(&relay, "cdc_relay_commit_to_published_seconds"),
            publish_call_ms: avg(&relay, "cdc_relay_publish_batch_duration_seconds"),
            outbox_write_to_shown_ms: avg(&workers, "chat_delivery_seconds"),
            quantiles,
            cpu_ms_per_message,
            spans_received,
        })
    }
}

/// Latencies (ms) of `messages` sends on Consumers until shown at a Workers SSE client,
/// and (for `cdc`) where the time went.
pub async fn measure(
    variant: Variant,
    messages: usize,
    interval: Duration,
    durable: bool,
) -> anyhow::Result<(Vec<f64>, Option<Stages>)> {
    let system = System::new(durable, Bins::beside_this()?).await?;
    let ours = matches!(
        variant,
        Variant::Cdc | Variant::CdcTokens | Variant::CdcTraced
    );
    let receiver = match variant {
        Variant::CdcTraced => Some(testkit::otlp::OtlpReceiver::start().await?),
        _ => None,
    };
    let traced: Vec<String> = receiver
        .iter()
        .flat_map(|r| ["--otlp-endpoint".to_string(), r.endpoint()])
        .collect();
    let token = match variant {
        Variant::CdcTokens => Some(system.enable_tokens().await?),
        _ => None,
    };
    let bearer = token.as_ref().map(|t| format!("Bearer {t}"));
    let auth: Vec<(&str, &str)> = bearer
        .iter()
        .map(|b| ("authorization", b.as_str()))
        .collect();
    start_sender(&system, variant, &traced).await?;
    system.start("workers", Kind::Service(Side::Workers), &traced)?;
    for side in [Side::Consumers, Side::Workers] {
        system.wait_service(side, Duration::from_secs(30)).await?;
    }
    let consumers_addr = system.service_addr(Side::Consumers);
    let mut client =
        SseClient::connect_with(system.service_addr(Side::Workers), "/chats/1/events", &auth)
            .await?;
    // A kept-alive connection, as a browser sends with.
    let mut consumers = testkit::http::Connection::open(consumers_addr).await?;
    // Warm up connections and caches; not measured.
    for i in 0..5 {
        let sent = post(&mut consumers, &format!("warm-up {i}"), &auth).await?;
        wait_shown(&mut client, &sent).await?;
    }
    // Sends go out on schedule whatever the delivery does (as in the write-up); arrivals are
    // timed by a reader of their own and matched by message id.
    let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let reader = {
        let arrivals = arrivals.clone();
        tokio::spawn(async move {
            while let Some(event) = client.next(Duration::from_secs(30)).await {
                let at = Instant::now();
                if let Ok(data) = serde_json::from_str::<serde_json::Value>(&event.data) {
                    if let Some(id) = data["id"].as_str() {
                        arrivals.lock().unwrap().insert(id.to_string(), at);
                    }
                }
            }
        })
    };
    let mut sent = Vec::with_capacity(messages);
    let mut next = tokio::time::Instant::now();
    let ours_cpu = || {
        ["relay-consumers", "consumers", "workers"]
            .iter()
            .map(|name| system.cpu_seconds(name))
            .sum::<f64>()
    };
    let cpu_before = ours_cpu();
    for i in 0..messages {
        tokio::time::sleep_until(next).await;
        next += interval;
        // Traced runs continue a trace of the client's; made before the clock starts.
        let traceparent = (variant == Variant::CdcTraced).then(client_traceparent);
        let mut headers = auth.clone();
        headers.extend(traceparent.as_deref().map(|t| ("traceparent", t)));
        let started = Instant::now();
        sent.push((
            post(&mut consumers, &format!("message {i}"), &headers).await?,
            started,
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while sent
        .iter()
        .any(|(id, _)| !arrivals.lock().unwrap().contains_key(id))
    {
        anyhow::ensure!(Instant::now() < deadline, "messages not shown within 30 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    reader.abort();
    if ours {
        // The same settling time for every variant before CPU is read: a traced run's last
        // spans go out at the exporters' next tick (every 5 s), and that export belongs to
        // its cost; the idle work meanwhile is the same in both.
        tokio::time::sleep(Duration::from_secs(6)).await;
    }
    let cpu_ms_per_message = 1000.0 * (ours_cpu() - cpu_before) / messages as f64;
    let arrivals = arrivals.lock().unwrap().clone();
    let samples: Vec<f64> = sent
        .iter()
        .map(|(id, started)| arrivals[id].duration_since(*started).as_secs_f64() * 1000.0)
        .collect();
    let stages = if ours {
        Some(Stages::read(&system, variant, cpu_ms_per_message, None).await?)
    } else {
        None
    };
    system.shutdown();
    // Stopped services flush what their batch processors still held.
    let stages = stages.map(|s| Stages {
        spans_received: receiver.as_ref().map(|r| r.spans().len()),
        ..s
    });
    Ok((samples, stages))
}

/// The sending side of `variant` on Consumers: relay and service (ours, with `traced`
/// flags), or a baseline's sender and relay.
async fn start_sender(system: &System, variant: Variant, traced: &[String]) -> anyhow::Result<()> {
    let sender = Side::Consumers;
    match variant {
        Variant::Cdc | Variant::CdcTokens | Variant::CdcTraced => {
            system.start("relay-consumers", Kind::Relay(sender), traced)?;
            system
                .wait_relay("relay-consumers", Duration::from_secs(30))
                .await?;
            // Behind a front end whose traceparent it continues, as a traced deployment is.
            let mut flags = traced.to_vec();
            if variant == Variant::CdcTraced {
                flags.push("--trust-traceparent".into());
            }
            system.start("consumers", Kind::Service(sender), &flags)?;
        }
        Variant::Notify | Variant::Poll1s => {
            let mode = if variant == Variant::Notify {
                RelayMode::Notify
            } else {
                RelayMode::Poll
            };
            system.start("relay-consumers", Kind::BaselineRelay(sender, mode), &[])?;
            system.start(
                "consumers",
                Kind::BaselineSender(sender, SenderMode::Notify),
                &[],
            )?;
        }
        Variant::DualWrite => {
            system.start(
                "consumers",
                Kind::BaselineSender(sender, SenderMode::DualWrite),
                &[],
            )?;
        }
    }
    Ok(())
}

/// A client's fresh `traceparent` (sampled), as a traced front end sends.
fn client_traceparent() -> String {
    format!(
        "00-{:032x}-{:016x}-01",
        rand::random::<u128>() | 1,
        rand::random::<u64>() | 1
    )
}

/// POST one message (with these headers: credentials); its id.
pub(crate) async fn post(
    consumers: &mut testkit::http::Connection,
    body: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<String> {
    let reply = consumers
        .post_json_with(
            "/chats/1/messages",
            &serde_json::json!({"body": body}),
            headers,
        )
        .await?;
    anyhow::ensure!(reply.status == 201, "send failed: {}", reply.body);
    Ok(reply.json()["id"].as_str().unwrap_or_default().to_string())
}

/// Wait for the SSE event of message `id`.
async fn wait_shown(client: &mut SseClient, id: &str) -> anyhow::Result<()> {
    loop {
        let event = client
            .next(Duration::from_secs(10))
            .await
            .ok_or_else(|| anyhow::anyhow!("message not shown within 10 s"))?;
        let data: serde_json::Value = serde_json::from_str(&event.data)?;
        if data["id"] == id {
            return Ok(());
        }
    }
}

#[derive(Debug, Serialize)]
struct Report {
    command: String,
    machine: report::Machine,
    messages_per_round: usize,
    interval_ms: u128,
    rounds: usize,
    fsync: bool,
    results: Vec<Summary>,
    cdc_stages: Vec<Stages>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let variants = if args.variants.is_empty() {
        vec![
            Variant::Cdc,
            Variant::CdcTokens,
            Variant::CdcTraced,
            Variant::Notify,
            Variant::Poll1s,
            Variant::DualWrite,
        ]
    } else {
        args.variants.clone()
    };
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut cdc_stages = Vec::new();
    // Rounds interleave the variants, so a slow moment of the machine hits them alike.
    for round in 0..args.rounds {
        for (i, variant) in variants.iter().enumerate() {
            eprintln!("[latency] {} round {}", variant.name(), round + 1);
            let (round_samples, stages) =
                measure(*variant, args.messages, args.interval, !args.no_fsync).await?;
            samples[i].extend(round_samples);
            cdc_stages.extend(stages);
        }
    }
    let results: Vec<Summary> = variants
        .iter()
        .zip(samples)
        .map(|(v, s)| summarize(v.name(), s))
        .collect();
    print_table(&results, args.messages, args.interval, !args.no_fsync);
    for s in &cdc_stages {
        println!(
            "{} stages (averages): commit→published {:.2} ms (of which the Redis call {:.2} ms), outbox write→shown {:.2} ms; relay + services CPU {:.3} ms per message{}",
            s.variant,
            s.commit_to_published_ms,
            s.publish_call_ms,
            s.outbox_write_to_shown_ms,
            s.cpu_ms_per_message,
            s.spans_received
                .map(|n| format!("; {n} spans exported"))
                .unwrap_or_default()
        );
        for q in &s.quantiles {
            println!(
                "  {:<42} count {:>6}  p50 {:>7.2} ms  p99 {:>7.2} ms",
                q.histogram, q.count, q.p50_ms, q.p99_ms
            );
        }
    }
    let machine = report::machine();
    println!("machine: {}", machine.describe());
    let path = report::write_json(
        "latency",
        &Report {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            machine,
            messages_per_round: args.messages,
            interval_ms: args.interval.as_millis(),
            rounds: args.rounds,
            fsync: !args.no_fsync,
            results,
            cdc_stages,
        },
    )?;
    println!("\nwritten to {}", path.display());
    Ok(())
}

pub fn print_table(results: &[Summary], messages: usize, interval: Duration, fsync: bool) {
    println!();
    println!(
        "Send→shown latency, {messages} messages one every {} ms (POST on Consumers → SSE event at a Workers client; Postgres fsync {})",
        interval.as_millis(),
        if fsync { "on" } else { "off" }
    );
    println!(
        "{:<12} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "variant", "samples", "p50 ms", "p95 ms", "p99 ms", "max ms"
    );
    for r in results {
        println!(
            "{:<12} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            r.variant, r.samples, r.p50_ms, r.p95_ms, r.p99_ms, r.max_ms
        );
    }
}
