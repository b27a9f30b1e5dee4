//! `chat-lab backlog`: the receiving side comes back to a large backlog (Workers down while
//! Consumers wrote `--backlog` messages into a few busy chats), with live traffic into
//! other chats of the same shards from the moment it is back. What it shows: the live chats
//! are shown within seconds while the backlog is still being caught up (the inbox consumer
//! looks ahead past it), the backlog's catch-up rate, and that every message of every chat
//! is recorded once, in its chat's order.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use clap::Args as ClapArgs;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::clients::{self, Watcher};
use crate::report;
use crate::system::{Bins, Kind, Side, System};

#[derive(Debug, Clone, ClapArgs)]
pub struct Args {
    /// Messages written while Workers is down.
    #[arg(long, default_value_t = 200_000)]
    pub backlog: i64,
    /// Chats the backlog is spread over (chats 1..=N).
    #[arg(long, default_value_t = 4)]
    pub backlog_chats: i64,
    /// Live chats (numbered after the backlog's), each watched on a tab.
    #[arg(long, default_value_t = 8)]
    pub live_chats: i64,
    /// Live messages per second, over the live chats in turn, from Workers' return until
    /// the backlog is caught up.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BacklogReport {
    pub backlog: i64,
    /// From Workers' start until every backlog message was in its inbox.
    pub catch_up_seconds: f64,
    pub catch_up_per_second: f64,
    /// Live messages shown while the backlog was being caught up (each counted once).
    pub live_shown: usize,
    /// Backlog messages recorded when the first live message was shown.
    pub backlog_recorded_at_first_live: i64,
    pub live_p50_ms: f64,
    pub live_p99_ms: f64,
    pub live_max_ms: f64,
    /// Messages recorded more than once, never, or out of their chat's order.
    pub violations: Vec<String>,
}

impl BacklogReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let report = run_backlog(Bins::beside_this()?, &args).await?;
    print(&report);
    report::write_json("backlog", &report)?;
    anyhow::ensure!(report.passed(), "the run found violations");
    Ok(())
}

pub fn print(r: &BacklogReport) {
    println!(
        "backlog of {} messages caught up in {:.1} s ({:.0} messages/s)",
        r.backlog, r.catch_up_seconds, r.catch_up_per_second
    );
    println!(
        "live chats meanwhile: {} shown, send → shown p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; the first with {} of the backlog recorded",
        r.live_shown, r.live_p50_ms, r.live_p99_ms, r.live_max_ms, r.backlog_recorded_at_first_live
    );
    if r.violations.is_empty() {
        println!("every message recorded once, in its chat's order");
    } else {
        for v in &r.violations {
            println!("VIOLATION: {v}");
        }
    }
}

pub async fn run_backlog(bins: Bins, args: &Args) -> anyhow::Result<BacklogReport> {
    let system = Arc::new(System::new_sharded(true, bins, args.shards).await?);
    for side in [Side::Consumers, Side::Workers] {
        let name = format!("relay-{side}");
        system.start(&name, Kind::Relay(side), &[])?;
        system.wait_relay(&name, Duration::from_secs(30)).await?;
    }
    system.start("consumers", Kind::Service(Side::Consumers), &[])?;
    system
        .wait_service(Side::Consumers, Duration::from_secs(30))
        .await?;
    let admin = system.db.connect().await?;

    // The backlog, written as the sends write it, while Workers is not running.
    let mut written = 0;
    while written < args.backlog {
        let n = (args.backlog - written).min(10_000);
        write_messages(&admin, written, n, args.backlog_chats).await?;
        written += n;
    }
    wait_published(&system, args.backlog).await?;

    // Workers comes back; live traffic starts at once.
    let started = Instant::now();
    system.start("workers", Kind::Service(Side::Workers), &[])?;
    system
        .wait_service(Side::Workers, Duration::from_secs(60))
        .await?;
    let receiver = system.service_addr(Side::Workers);
    let live: Vec<i64> = (1..=args.live_chats)
        .map(|n| args.backlog_chats + n)
        .collect();
    let watchers: Vec<(i64, Watcher)> = live
        .iter()
        .map(|&chat| (chat, Watcher::start(receiver, chat)))
        .collect();
    let stop = CancellationToken::new();
    let sender = tokio::spawn(clients::send_steadily(
        clients::Traffic {
            addrs: vec![system.service_addr(Side::Consumers)],
            rate: args.rate,
            chat: {
                let live = live.clone();
                move |n| live[(n - 1) as usize % live.len()]
            },
            body: |n| format!("live {n}"),
            give_up: Duration::from_secs(60),
        },
        stop.clone(),
    ));

    let (catch_up, at_first_live) = wait_caught_up(&admin, &watchers, args, started).await?;
    stop.cancel();
    sender.await?;

    let (violations, mut delays) = check(&admin, watchers, live, args).await?;
    delays.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let at = |p: f64| {
        delays
            .get(((delays.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    system.shutdown();
    Ok(BacklogReport {
        backlog: args.backlog,
        catch_up_seconds: catch_up.as_secs_f64(),
        catch_up_per_second: args.backlog as f64 / catch_up.as_secs_f64(),
        live_shown: delays.len(),
        backlog_recorded_at_first_live: at_first_live.unwrap_or(args.backlog),
        live_p50_ms: ms(at(0.5)),
        live_p99_ms: ms(at(0.99)),
        live_max_ms: ms(delays.last().copied().unwrap_or_default()),
        violations,
    })
}

/// Until the backlog is in (30 minutes at most): how long it took from `started`, and the
/// backlog's count when the first live message showed.
async fn wait_caught_up(
    admin: &tokio_postgres::Client,
    watchers: &[(i64, Watcher)],
    args: &Args,
    started: Instant,
) -> anyhow::Result<(Duration, Option<i64>)> {
    let mut at_first_live = None;
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let recorded: i64 = admin
            .query_one(
                "SELECT count(*) FROM workers.inbox WHERE chat_id <= $1",
                &[&args.backlog_chats],
            )
            .await?
            .get(0);
        if at_first_live.is_none() && watchers.iter().any(|(_, w)| !w.shown().is_empty()) {
            at_first_live = Some(recorded);
        }
        if recorded >= args.backlog {
            return Ok((started.elapsed(), at_first_live));
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "backlog not caught up in 30 minutes: {recorded} of {}",
            args.backlog
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every live message shown (within a minute), then every chat checked against what was
/// sent: the violations, and the live messages' delays.
async fn check(
    admin: &tokio_postgres::Client,
    watchers: Vec<(i64, Watcher)>,
    live: Vec<i64>,
    args: &Args,
) -> anyhow::Result<(Vec<String>, Vec<Duration>)> {
    let sent_live = feeds(admin, "consumers.messages", "id", &live).await?;
    let want: usize = sent_live.values().map(Vec::len).sum();
    let shown_by = Instant::now() + Duration::from_secs(60);
    while watchers.iter().map(|(_, w)| w.shown().len()).sum::<usize>() < want
        && Instant::now() < shown_by
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut violations = Vec::new();
    let mut delays = Vec::new();
    for (chat, watcher) in watchers {
        let shown = watcher.stop().await;
        let ids: Vec<String> = shown
            .iter()
            .map(|s| s.message["id"].as_str().unwrap_or_default().to_string())
            .collect();
        if ids != sent_live[&chat] {
            violations.push(format!(
                "live chat {chat}: shown {} of {} sent (twice, never, or out of order)",
                ids.len(),
                sent_live[&chat].len()
            ));
        }
        delays.extend(shown.iter().filter_map(delay));
    }
    let all: Vec<i64> = (1..=args.backlog_chats).chain(live).collect();
    let sent = feeds(admin, "consumers.messages", "id", &all).await?;
    let recorded = feeds(admin, "workers.inbox", "message_id", &all).await?;
    for chat in &all {
        if sent[chat] != recorded[chat] {
            violations.push(format!(
                "chat {chat}: {} recorded for {} sent (twice, never, or out of order)",
                recorded[chat].len(),
                sent[chat].len()
            ));
        }
    }
    Ok((violations, delays))
}

/// `count` messages over chats `1..=chats`, numbered from `from`, each with its outbox
/// event in the same statement (as a send writes them).
async fn write_messages(
    admin: &tokio_postgres::Client,
    from: i64,
    count: i64,
    chats: i64,
) -> anyhow::Result<()> {
    admin
        .execute(
            "WITH m AS (
               INSERT INTO consumers.messages (id, chat_id, body, created_at, idempotency_key)
               SELECT gen_random_uuid(), 1 + g % $3, 'backlog ' || g, date_trunc('milliseconds', now()), 'backlog-' || g
                 FROM generate_series($1::bigint, $1::bigint + $2::bigint - 1) g
               RETURNING id, chat_id, body, created_at, pos)
             INSERT INTO consumers.outbox (event, payload, partition_key)
             SELECT 'message.created',
                    jsonb_build_object('id', id, 'chat_id', chat_id, 'body', body,
                                       'created_at', to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
                                       'side', 'consumers'),
                    chat_id::text
               FROM m ORDER BY pos, chat_id",
            &[&from, &count, &chats],
        )
        .await?;
    Ok(())
}

/// Until the relay has published `count` entries over the Consumers stream's shards.
async fn wait_published(system: &System, count: i64) -> anyhow::Result<()> {
    let mut redis = system.redis.connect().await?;
    let shards = system.shards();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let mut len = 0i64;
        for shard in 0..shards {
            let key =
                outbox_core::stream::shard_key(&Side::Consumers.outbox_stream(), shard, shards);
            len += redis::cmd("XLEN")
                .arg(&key)
                .query_async::<i64>(&mut redis)
                .await?;
        }
        if len >= count {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "only {len} of {count} published");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Each chat's messages in `table` (ids from `column`), in feed order.
async fn feeds(
    admin: &tokio_postgres::Client,
    table: &str,
    column: &str,
    chats: &[i64],
) -> anyhow::Result<HashMap<i64, Vec<String>>> {
    let mut feeds = HashMap::new();
    for &chat in chats {
        let rows = admin
            .query(
                &format!("SELECT {column}::text FROM {table} WHERE chat_id = $1 ORDER BY pos"),
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
