//! The write-up's deploy/outage timeline, with our design and the dual-write baseline:
//! 10 messages, one every 400 ms; the receiving service is redeployed during messages 4–6;
//! Redis is stopped during messages 7–8 and the sending service redeployed at that moment;
//! the receiving service crashes right after recording message 2 in its inbox, before
//! acknowledging it (and is restarted, as an orchestrator would). An SSE client on the
//! receiving side, reconnecting with `Last-Event-ID` like a browser, counts what was shown.
//! Ours can run on sharded streams and on a Redis Cluster (`--shards`, `--cluster`), the
//! timeline unchanged.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use serde::Serialize;
use testkit::Signal;

use crate::baseline::SenderMode;
use crate::clients::{self, Watcher};
use crate::report;
use crate::system::{Bins, Kind, Side, System};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Variant {
    Cdc,
    DualWrite,
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Direction {
    C2w,
    W2c,
    Both,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long, value_enum, default_value_t = Variant::Both)]
    pub variant: Variant,
    #[arg(long, value_enum, default_value_t = Direction::Both)]
    pub direction: Direction,
    /// Pause between messages.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "400ms")]
    pub interval: Duration,
    /// Postgres with fsync off (faster, not what production runs).
    #[arg(long)]
    pub no_fsync: bool,
    /// Shards of both sides' streams (ours; the baseline has one stream).
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// Ours on a Redis Cluster (3 masters, 1 replica each; needs --shards 2 or more and
    /// --variant cdc): "Redis down" stops every node, "up" starts them on their data.
    #[arg(long)]
    pub cluster: bool,
}

/// Where our design's streams live.
#[derive(Debug, Clone, Copy)]
pub struct Topology {
    pub shards: u32,
    pub cluster: bool,
}

/// What one run counted.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub variant: &'static str,
    pub sender: Side,
    pub receiver: Side,
    pub saved: usize,
    pub received: usize,
    pub duplicates_skipped: usize,
    pub lost: Vec<String>,
    pub never_shown: Vec<String>,
    pub shown_twice: Vec<String>,
    pub unpublished: usize,
    pub log: Vec<String>,
}

impl Outcome {
    /// The four lines of the write-up's summary.
    pub fn summary(&self) -> String {
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(", ")
            }
        };
        let mut out = format!(
            "[{v}] saved by {}: {}   received by {}: {}   duplicates skipped: {}\n[{v}] lost: {}\n[{v}] never shown: {}\n[{v}] unpublished: {}",
            self.sender,
            self.saved,
            self.receiver,
            self.received,
            self.duplicates_skipped,
            list(&self.lost),
            list(&self.never_shown),
            self.unpublished,
            v = self.variant,
        );
        if !self.shown_twice.is_empty() {
            out.push_str(&format!(
                "\n[{}] shown twice: {}",
                self.variant,
                list(&self.shown_twice)
            ));
        }
        out
    }

    /// Nothing lost, nothing shown twice or never, nothing left unpublished.
    pub fn is_clean(&self) -> bool {
        self.lost.is_empty()
            && self.never_shown.is_empty()
            && self.shown_twice.is_empty()
            && self.unpublished == 0
    }
}

const CHAT: i64 = 1;
const MESSAGES: usize = 10;

struct Timeline {
    started: Instant,
    log: Vec<String>,
}

impl Timeline {
    fn note(&mut self, who: &str, what: impl std::fmt::Display) {
        let line = format!(
            "{:>5.1}s  {who:<10} {what}",
            self.started.elapsed().as_secs_f64()
        );
        eprintln!("  {line}");
        self.log.push(line);
    }
}

/// Run the timeline once.
pub async fn run_once(
    bins: Bins,
    variant: Variant,
    sender: Side,
    interval: Duration,
    durable: bool,
    topology: Topology,
) -> anyhow::Result<Outcome> {
    let receiver = sender.other();
    let sender_kind = match variant {
        Variant::DualWrite => Kind::BaselineSender(sender, SenderMode::DualWrite),
        _ => Kind::Service(sender),
    };
    let system = start(bins, variant, sender, sender_kind, durable, topology).await?;
    let watcher = Watcher::start(system.service_addr(receiver), CHAT);
    let timeline = play(&system, sender, sender_kind, interval).await?;
    let db = system.db.connect().await?;
    let saved = messages_of(
        &db,
        &format!("SELECT id::text, body FROM {sender}.messages WHERE chat_id = $1"),
    )
    .await?;
    settle(&system, &db, &watcher, receiver, saved.len()).await?;
    let received = messages_of(
        &db,
        &format!("SELECT message_id::text, body FROM {receiver}.inbox WHERE chat_id = $1"),
    )
    .await?;
    let shown = watcher.stop().await;
    let duplicates_skipped = system
        .logs(receiver.as_str())
        .matches("redelivery of a message already in the inbox")
        .count();
    let unpublished = unpublished(&system, variant, sender, &saved, &received).await?;
    system.shutdown();
    let (lost, never_shown, shown_twice) = tally(&saved, &received, &shown);
    Ok(Outcome {
        variant: match variant {
            Variant::DualWrite => "dual-write",
            _ => "cdc",
        },
        sender,
        receiver,
        saved: saved.len(),
        received: received.len(),
        duplicates_skipped,
        lost,
        never_shown,
        shown_twice,
        unpublished,
        log: timeline.log,
    })
}

/// The system with the sender's relay (ours), the sender and the receiver (which crashes
/// after its second inbox commit, before acknowledging it) running and ready.
async fn start(
    bins: Bins,
    variant: Variant,
    sender: Side,
    sender_kind: Kind,
    durable: bool,
    topology: Topology,
) -> anyhow::Result<System> {
    let receiver = sender.other();
    let system = System::new_on(durable, bins, topology.shards, topology.cluster).await?;
    let crash_flag = vec!["--crash-after-inbox-commit".to_string(), "2".to_string()];
    if variant == Variant::Cdc {
        let relay = format!("relay-{sender}");
        system.start(&relay, Kind::Relay(sender), &[])?;
        system.wait_relay(&relay, Duration::from_secs(30)).await?;
    }
    system.start(sender.as_str(), sender_kind, &[])?;
    system.start(receiver.as_str(), Kind::Service(receiver), &crash_flag)?;
    system.wait_service(sender, Duration::from_secs(30)).await?;
    system
        .wait_service(receiver, Duration::from_secs(30))
        .await?;
    Ok(system)
}

/// The write-up's timeline: ten messages `interval` apart; the receiver crashes after
/// recording msg 2 (restarted as an orchestrator would), is deployed across msgs 4 to 6;
/// Redis goes down before msg 7, and the sender is redeployed after msg 8 before Redis comes
/// back.
async fn play(
    system: &System,
    sender: Side,
    sender_kind: Kind,
    interval: Duration,
) -> anyhow::Result<Timeline> {
    let receiver = sender.other();
    let (sender_name, receiver_name) = (sender.as_str(), receiver.as_str());
    let mut timeline = Timeline {
        started: Instant::now(),
        log: Vec::new(),
    };
    let mut sends = Vec::new();
    let mut receiver_deploying = false;
    let mut crashed_once = false;
    let start = tokio::time::Instant::now();
    for i in 1..=MESSAGES {
        let due = start + interval * i as u32;
        // Between messages: restart the receiver if it crashed (as an orchestrator would).
        while tokio::time::Instant::now() < due {
            if !receiver_deploying && !system.is_running(receiver_name) {
                if !crashed_once {
                    timeline.note(
                        receiver_name,
                        "crashed after recording msg 2, before acknowledging it",
                    );
                    crashed_once = true;
                }
                system.start(receiver_name, Kind::Service(receiver), &[])?;
                timeline.note(receiver_name, "restarted");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        match i {
            4 => {
                system.stop(receiver_name, Signal::Term)?;
                receiver_deploying = true;
                timeline.note("deploy:", format!("{receiver_name} stopped"));
            }
            7 => {
                match &system.cluster {
                    Some(cluster) => tokio::task::block_in_place(|| cluster.stop_all())?,
                    None => system.redis.stop()?,
                }
                timeline.note("redis:", "down");
            }
            _ => {}
        }
        let addr = system.service_addr(sender);
        sends.push(tokio::spawn(async move {
            clients::send(addr, CHAT, &format!("msg {i}"), Duration::from_secs(30)).await
        }));
        timeline.note(sender_name, format!("msg {i} sent"));
        match i {
            6 => {
                system.start(receiver_name, Kind::Service(receiver), &[])?;
                receiver_deploying = false;
                timeline.note("deploy:", format!("{receiver_name} started"));
            }
            8 => {
                // Let msg 8 be saved, then redeploy the sender while Redis is still down.
                let waiting = sends.pop().expect("msg 8 sent");
                let _ = waiting.await;
                system.stop(sender_name, Signal::Term)?;
                timeline.note("deploy:", format!("{sender_name} stopped"));
                system.start(sender_name, sender_kind, &[])?;
                system
                    .wait_accepting(sender, Duration::from_secs(30))
                    .await?;
                timeline.note("deploy:", format!("{sender_name} started"));
                match &system.cluster {
                    Some(cluster) => tokio::task::block_in_place(|| cluster.start_all())?,
                    None => system.redis.start_again()?,
                }
                timeline.note("redis:", "up");
            }
            _ => {}
        }
    }
    for send in sends {
        if let Ok(Err(e)) = send.await {
            timeline.note(sender_name, format!("a send failed: {e}"));
        }
    }
    Ok(timeline)
}

/// Let everything that can arrive arrive: the receiver has every saved message, the watcher
/// has seen every received one (bounded: the baseline loses some for good).
async fn settle(
    system: &System,
    db: &tokio_postgres::Client,
    watcher: &Watcher,
    receiver: Side,
    saved: usize,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        if !system.is_running(receiver.as_str()) {
            system.start(receiver.as_str(), Kind::Service(receiver), &[])?;
        }
        let received = messages_of(
            db,
            &format!("SELECT message_id::text, body FROM {receiver}.inbox WHERE chat_id = $1"),
        )
        .await?;
        let shown: HashSet<String> = watcher
            .shown()
            .iter()
            .map(|s| s.message["id"].as_str().unwrap_or_default().to_string())
            .collect();
        let settled = received.len() == saved && received.keys().all(|id| shown.contains(id));
        if settled || tokio::time::Instant::now() >= deadline {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The messages (bodies, in number order) saved and never received, received and never
/// shown, and shown more than once.
fn tally(
    saved: &HashMap<String, String>,
    received: &HashMap<String, String>,
    shown: &[clients::Shown],
) -> (Vec<String>, Vec<String>, Vec<String>) {
    let mut times_shown: HashMap<String, usize> = HashMap::new();
    for s in shown {
        *times_shown
            .entry(s.message["id"].as_str().unwrap_or_default().to_string())
            .or_default() += 1;
    }
    let by_number = |ids: Vec<&String>, of: &HashMap<String, String>| {
        let mut bodies: Vec<String> = ids
            .into_iter()
            .filter_map(|id| of.get(id).cloned())
            .collect();
        bodies.sort_by_key(|b| b.trim_start_matches("msg ").parse::<u32>().unwrap_or(0));
        bodies
    };
    let lost = by_number(
        saved
            .keys()
            .filter(|id| !received.contains_key(*id))
            .collect(),
        saved,
    );
    let never_shown = by_number(
        received
            .keys()
            .filter(|id| !times_shown.contains_key(*id))
            .collect(),
        received,
    );
    let shown_twice = by_number(
        times_shown
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(id, _)| id)
            .collect(),
        received,
    );
    (lost, never_shown, shown_twice)
}

/// id → body of the chat's rows selected by `sql` (`$1` = chat).
async fn messages_of(
    db: &tokio_postgres::Client,
    sql: &str,
) -> anyhow::Result<HashMap<String, String>> {
    Ok(db
        .query(sql, &[&CHAT])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// Saved messages whose event never reached the stream: for ours, outbox rows the relay has
/// not published (the slot's lag, in events); for dual write, events that never reached
/// Redis. An event the receiver recorded went through the stream, though the relay trims
/// it once every consumer group acknowledged it.
async fn unpublished(
    system: &System,
    variant: Variant,
    sender: Side,
    saved: &HashMap<String, String>,
    received: &HashMap<String, String>,
) -> anyhow::Result<usize> {
    let mut conn = match &system.cluster {
        Some(cluster) => {
            outbox_core::connect::RedisConn::Cluster(outbox_core::connect::SharedCluster::of(
                redis::cluster::ClusterClient::new(cluster.urls())?
                    .get_async_connection()
                    .await?,
            ))
        }
        None => outbox_core::connect::RedisConn::Single(
            redis::aio::ConnectionManager::new(redis::Client::open(system.redis.url())?).await?,
        ),
    };
    let mut entries = Vec::new();
    for stream in outbox_core::stream::shard_keys(&sender.outbox_stream(), system.shards()) {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await?;
        entries.extend(reply.ids);
    }
    let mut in_stream = HashSet::new();
    for entry in entries {
        if let Some(payload) = entry
            .map
            .get("payload")
            .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
        {
            if let Ok(message) = serde_json::from_str::<serde_json::Value>(&payload) {
                in_stream.insert(message["id"].as_str().unwrap_or_default().to_string());
            }
        }
    }
    let _ = variant;
    Ok(saved
        .keys()
        .filter(|id| !in_stream.contains(*id) && !received.contains_key(*id))
        .count())
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.cluster || (args.shards >= 2 && args.variant == Variant::Cdc),
        "--cluster needs --shards 2 or more and --variant cdc (the baseline knows one Redis)"
    );
    let outcomes = run_all(
        Bins::beside_this()?,
        args.variant,
        args.direction,
        args.interval,
        !args.no_fsync,
        Topology {
            shards: args.shards,
            cluster: args.cluster,
        },
    )
    .await?;
    let path = report::write_json(
        "chaos",
        &serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "machine": report::machine(),
            "outcomes": outcomes,
        }),
    )?;
    println!("\nwritten to {}", path.display());
    let failed: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.variant == "cdc" && !o.is_clean())
        .collect();
    anyhow::ensure!(
        failed.is_empty(),
        "the cdc variant lost, hid or duplicated messages"
    );
    Ok(())
}

/// Run the chosen variants and directions, printing each summary as it completes.
pub async fn run_all(
    bins: Bins,
    variant: Variant,
    direction: Direction,
    interval: Duration,
    durable: bool,
    topology: Topology,
) -> anyhow::Result<Vec<Outcome>> {
    let variants: &[Variant] = match variant {
        Variant::Both => &[Variant::Cdc, Variant::DualWrite],
        Variant::Cdc => &[Variant::Cdc],
        Variant::DualWrite => &[Variant::DualWrite],
    };
    let senders: &[Side] = match direction {
        Direction::Both => &[Side::Consumers, Side::Workers],
        Direction::C2w => &[Side::Consumers],
        Direction::W2c => &[Side::Workers],
    };
    let mut outcomes = Vec::new();
    for &v in variants {
        for &sender in senders {
            eprintln!("[chaos] {v:?}, {} → {}", sender, sender.other());
            let outcome = run_once(bins.clone(), v, sender, interval, durable, topology).await?;
            println!("{}", outcome.summary());
            outcomes.push(outcome);
        }
    }
    Ok(outcomes)
}
