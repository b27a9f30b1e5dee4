//! `chat-lab stuck-shard`: one shard of the Consumers side's stream refuses every write for
//! minutes while messages flow into chats of every shard and another table writes WAL
//! steadily: the whole system, with the shipped defaults. What it shows: the chats of the
//! healthy shards are shown within 2 s throughout, the relay's slot keeps no WAL for the stuck
//! shard, and once it accepts again every message of every chat is shown once, in order.
//!
//! The shard refuses writes the way a Redis node that stopped accepting them does to the
//! relay: its record is swapped for a string (every call there fails, and is retried), and
//! put back as it was.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use clap::Args as ClapArgs;
use outbox_core::stream::{keys, shard_key, shard_of};
use serde::Serialize;
use testkit::TestDb;
use tokio_util::sync::CancellationToken;

use crate::clients::{self, Watcher};
use crate::report;
use crate::system::{Bins, Kind, Side, System};

#[derive(Debug, Clone, ClapArgs)]
pub struct Args {
    /// How long the shard refuses writes.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "120s")]
    pub fault: Duration,
    /// Messages per second, Consumers to Workers, over every chat in turn.
    #[arg(long, default_value_t = 40.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 16)]
    pub chats: i64,
    #[arg(long, default_value_t = 4)]
    pub shards: u32,
    /// Megabytes of WAL a second written into a table outside the publication.
    #[arg(long, default_value_t = 1)]
    pub noise_mb: usize,
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct StuckReport {
    pub fault_seconds: f64,
    pub sent: usize,
    pub stuck_shard: u32,
    pub healthy_shown: usize,
    pub healthy_p50_ms: f64,
    pub healthy_p99_ms: f64,
    pub healthy_max_ms: f64,
    /// The slot's lag behind the server (current WAL minus confirmed_flush_lsn), most seen
    /// while the shard was behind.
    pub slot_lag_max_bytes: i64,
    /// WAL the slot kept on disk (current minus restart_lsn), most seen meanwhile.
    pub slot_retained_max_bytes: i64,
    /// WAL written while the shard refused writes.
    pub wal_written_bytes: i64,
    /// Messages shown more than once, never, or out of their chat's order, on any tab.
    pub violations: Vec<String>,
}

impl StuckReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty() && self.healthy_max_ms <= 2000.0
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let report = run_stuck(Bins::beside_this()?, &args).await?;
    print(&report);
    report::write_json("stuck-shard", &report)?;
    anyhow::ensure!(report.passed(), "the run found violations");
    Ok(())
}

pub fn print(r: &StuckReport) {
    println!(
        "shard {} refused writes for {:.0} s; {} messages sent at a steady rate",
        r.stuck_shard, r.fault_seconds, r.sent
    );
    println!(
        "healthy shards' chats: {} shown, commit → shown p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        r.healthy_shown, r.healthy_p50_ms, r.healthy_p99_ms, r.healthy_max_ms
    );
    println!(
        "slot while the shard was behind: lag max {} KiB, retained WAL max {} KiB ({} KiB of WAL written meanwhile)",
        r.slot_lag_max_bytes / 1024,
        r.slot_retained_max_bytes / 1024,
        r.wal_written_bytes / 1024
    );
    if r.violations.is_empty() {
        println!("every message shown once, in its chat's order, on its tab");
    } else {
        for v in &r.violations {
            println!("VIOLATION: {v}");
        }
    }
}

pub async fn run_stuck(bins: Bins, args: &Args) -> anyhow::Result<StuckReport> {
    let system = Arc::new(System::new_sharded(true, bins, args.shards).await?);
    for side in [Side::Consumers, Side::Workers] {
        let name = format!("relay-{side}");
        system.start(&name, Kind::Relay(side), &[])?;
        system.wait_relay(&name, Duration::from_secs(30)).await?;
    }
    for side in [Side::Consumers, Side::Workers] {
        system.start(side.as_str(), Kind::Service(side), &[])?;
    }
    for side in [Side::Consumers, Side::Workers] {
        system.wait_service(side, Duration::from_secs(30)).await?;
    }
    let receiver = system.service_addr(Side::Workers);
    let watchers: Vec<(i64, Watcher)> = (1..=args.chats)
        .map(|chat| (chat, Watcher::start(receiver, chat)))
        .collect();
    // Steady traffic and WAL from elsewhere.
    let stop = CancellationToken::new();
    let chats = args.chats;
    let sender = tokio::spawn(clients::send_steadily(
        clients::Traffic {
            addrs: vec![system.service_addr(Side::Consumers)],
            rate: args.rate,
            chat: move |n| 1 + n % chats,
            body: |n| format!("m{n}"),
            give_up: Duration::from_secs(60),
        },
        stop.clone(),
    ));
    let noise = tokio::spawn(write_noise(system.db.clone(), args.noise_mb, stop.clone()));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let fault = refuse_writes(&system, args).await?;
    // Traffic goes on a while, then everything sent must be shown.
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.cancel();
    let (sent, _) = sender.await?;
    noise.await??;
    let admin = system.db.connect().await?;
    let expected = feeds(&admin, args.chats).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let shown: usize = watchers.iter().map(|(_, w)| w.shown().len()).sum();
        let want: usize = expected.values().map(Vec::len).sum();
        if shown >= want || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (violations, mut healthy) =
        check_shown(watchers, &expected, system.shards(), fault.shard).await;
    healthy.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let at = |p: f64| {
        healthy
            .get(((healthy.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    system.shutdown();
    Ok(StuckReport {
        fault_seconds: fault.seconds,
        sent,
        stuck_shard: fault.shard,
        healthy_shown: healthy.len(),
        healthy_p50_ms: ms(at(0.5)),
        healthy_p99_ms: ms(at(0.99)),
        healthy_max_ms: ms(healthy.last().copied().unwrap_or_default()),
        slot_lag_max_bytes: fault.lag_max,
        slot_retained_max_bytes: fault.retained_max,
        wal_written_bytes: fault.wal_written,
        violations,
    })
}

/// `mb` MB of WAL a second from a table nobody publishes, until `stop`.
async fn write_noise(db: TestDb, mb: usize, stop: CancellationToken) -> anyhow::Result<()> {
    let admin = db.connect().await?;
    admin
        .batch_execute("CREATE TABLE IF NOT EXISTS public.noise (pad text)")
        .await?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.is_cancelled() {
        tick.tick().await;
        admin
            .execute(
                "INSERT INTO public.noise SELECT repeat('x', 1000) FROM generate_series(1, $1::int)",
                &[&((mb * 1000) as i32)],
            )
            .await?;
    }
    Ok(())
}

/// What the fault did to the slot.
struct Fault {
    shard: u32,
    seconds: f64,
    lag_max: i64,
    retained_max: i64,
    wal_written: i64,
}

/// The fault: the shard of chat 1 refuses every write (its record made a string) for
/// `--fault`, while the slot's lag and retained WAL are sampled; then the record is back.
async fn refuse_writes(system: &System, args: &Args) -> anyhow::Result<Fault> {
    let shards = system.shards();
    let stuck = shard_of(Some(b"1"), shards);
    let record = keys::origin_key(&shard_key(&Side::Consumers.outbox_stream(), stuck, shards));
    let mut redis = system.redis.connect().await?;
    let dump: Vec<u8> = redis::cmd("DUMP")
        .arg(&record)
        .query_async(&mut redis)
        .await?;
    let () = redis::cmd("SET")
        .arg(&record)
        .arg("refusing writes")
        .query_async(&mut redis)
        .await?;
    let admin = system.db.connect().await?;
    let slot = format!("consumers_relay_{}", system.db.name);
    let began = Instant::now();
    let (wal_start, _, _) = slot_wal(&admin, &slot).await?;
    let (mut lag_max, mut retained_max) = (0i64, 0i64);
    while began.elapsed() < args.fault {
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Once it fell behind (--shard-detach-after, 5 s, and a call's timeout).
        if began.elapsed() > Duration::from_secs(12) {
            let (_, lag, retained) = slot_wal(&admin, &slot).await?;
            lag_max = lag_max.max(lag);
            retained_max = retained_max.max(retained);
        }
    }
    let (wal_end, _, _) = slot_wal(&admin, &slot).await?;
    let () = redis::cmd("RESTORE")
        .arg(&record)
        .arg(0)
        .arg(&dump)
        .arg("REPLACE")
        .query_async(&mut redis)
        .await?;
    Ok(Fault {
        shard: stuck,
        seconds: began.elapsed().as_secs_f64(),
        lag_max,
        retained_max,
        wal_written: wal_end - wal_start,
    })
}

/// Each chat's tab against its feed (every message once, in order), and the delays of the
/// chats outside the stuck shard.
async fn check_shown(
    watchers: Vec<(i64, Watcher)>,
    expected: &HashMap<i64, Vec<String>>,
    shards: u32,
    stuck: u32,
) -> (Vec<String>, Vec<Duration>) {
    let mut violations = Vec::new();
    let mut healthy: Vec<Duration> = Vec::new();
    for (chat, watcher) in watchers {
        let shown = watcher.stop().await;
        let ids: Vec<String> = shown
            .iter()
            .map(|s| s.message["id"].as_str().unwrap_or_default().to_string())
            .collect();
        let want = expected.get(&chat).cloned().unwrap_or_default();
        if ids != want {
            violations.push(format!(
                "chat {chat}: shown {} for {} in the feed (twice, never, or out of order)",
                ids.len(),
                want.len()
            ));
        }
        if shard_of(Some(chat.to_string().as_bytes()), shards) != stuck {
            healthy.extend(shown.iter().filter_map(delay));
        }
    }
    (violations, healthy)
}

/// The WAL position, and the slot's lag and retained WAL behind it.
async fn slot_wal(admin: &tokio_postgres::Client, slot: &str) -> anyhow::Result<(i64, i64, i64)> {
    let row = admin
        .query_one(
            "SELECT (pg_current_wal_lsn() - '0/0')::bigint,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok((row.get(0), row.get(1), row.get(2)))
}

/// Each chat's feed on the receiving side, in feed order (message ids).
async fn feeds(
    admin: &tokio_postgres::Client,
    chats: i64,
) -> anyhow::Result<HashMap<i64, Vec<String>>> {
    let mut feeds = HashMap::new();
    for chat in 1..=chats {
        let rows = admin
            .query(
                "SELECT message_id::text FROM workers.inbox WHERE chat_id = $1 ORDER BY pos",
                &[&chat],
            )
            .await?;
        feeds.insert(chat, rows.iter().map(|r| r.get(0)).collect());
    }
    Ok(feeds)
}

/// From a message's creation (taken at its commit or just before) to its tab.
fn delay(shown: &clients::Shown) -> Option<Duration> {
    let created = shown.message["created_at"].as_str().and_then(|t| {
        time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
    })?;
    shown.at.duration_since(SystemTime::from(created)).ok()
}
