//! The soak: both sides send at a steady rate while faults hit every part at random (SIGKILL
//! and restart of each service and each relay, a deploy, a rolling deploy of both sides, Redis
//! SIGKILL and restart on its AOF, Redis restarted without its data, a Postgres fast restart,
//! Postgres frozen, a relay handing over to a standby, a standby waiting beside a loaded relay
//! for seconds before the handover), with transactions that roll back mixed in. Then it
//! verifies: every committed message is in the other side's inbox exactly once, in the
//! sender's commit order per chat; no rolled-back message appears; every SSE client saw every
//! message of its chat exactly once; and none took longer than [`MAX_DELAY`] from commit to
//! shown on any tab, outside the windows where Postgres or Redis was down.
//!
//! The sender's commit order comes from a witness slot per side: a second pgoutput slot on
//! the same publication, created before anything is sent and only ever peeked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use cdc_relay::decode::{self as pgoutput, PgOutput, RelationCache, Row};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use testkit::Signal;
use tokio_util::sync::CancellationToken;

use crate::clients::{self, Watcher};
use crate::report;
use crate::system::{Bins, Kind, Side, System};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// How long faults are injected.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Seed of the fault schedule (printed; pass it again to replay the same choices).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Messages per second each side sends.
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Chats the messages are spread over.
    #[arg(long, default_value_t = 3)]
    pub chats: i64,
    /// Mean pause between faults.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "3s")]
    pub fault_every: Duration,
    /// Postgres with fsync off (faster; the faults kill processes, not the machine).
    #[arg(long)]
    pub no_fsync: bool,
    /// Instances of each service (1 or 2): sends alternate between them, every chat is
    /// watched on each, and service faults hit either.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub instances: u8,
    /// Shards of both sides' streams (the instances of a side share them).
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// Run on a Redis Cluster (3 masters, 1 replica each; needs --shards 2 or more), relays
    /// waiting for a replica on every batch. The Redis faults become a master SIGKILLed
    /// (its replica promoted, the node restarted as a replica after the outage) and the
    /// whole cluster stopped and started on its data.
    #[arg(long)]
    pub cluster: bool,
    /// How long the "Postgres frozen" fault stops every Postgres process (SIGSTOP).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
    pub freeze_for: Duration,
    /// Inject only these kinds of fault (comma-separated: service-kill, service-deploy,
    /// relay-kill, relay-handover, redis-kill, redis-wipe, standby-under-load,
    /// postgres-restart, rolling-deploy, postgres-freeze); every kind when empty.
    #[arg(long, value_delimiter = ',', value_parser = parse_fault_kind)]
    pub only: Vec<&'static str>,
}

/// Every fault kind's name (`--only`).
const FAULT_KINDS: [&str; 10] = [
    "service-kill",
    "service-deploy",
    "relay-kill",
    "relay-handover",
    "redis-kill",
    "redis-wipe",
    "standby-under-load",
    "postgres-restart",
    "rolling-deploy",
    "postgres-freeze",
];

fn parse_fault_kind(s: &str) -> Result<&'static str, String> {
    FAULT_KINDS
        .iter()
        .find(|k| **k == s)
        .copied()
        .ok_or_else(|| {
            format!(
                "'{s}' is not a fault kind (one of: {})",
                FAULT_KINDS.join(", ")
            )
        })
}

/// The longest a message may take from commit to shown on every tab, outside the windows
/// where Postgres or Redis is down.
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// One verified property: how many cases held, and the first few that did not.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub passed: usize,
    pub failed: usize,
    pub examples: Vec<String>,
}

impl Check {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            passed: 0,
            failed: 0,
            examples: Vec::new(),
        }
    }

    fn record(&mut self, ok: bool, example: impl FnOnce() -> String) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
            if self.examples.len() < 5 {
                self.examples.push(example());
            }
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub seed: u64,
    pub seconds: u64,
    pub faults: Vec<String>,
    pub sent: HashMap<String, usize>,
    pub send_failures: usize,
    pub rollbacks: u64,
    pub checks: Vec<Check>,
    /// The largest commit-to-shown delay of the messages each kind of fault touched.
    pub delays: Vec<Delays>,
}

/// Commit-to-shown delays of the messages (on every tab) whose way overlapped one kind of
/// fault, or no fault ("steady").
#[derive(Debug, Clone, Serialize)]
pub struct Delays {
    pub fault: &'static str,
    /// Messages shown, counted once per tab.
    pub shown: usize,
    /// The largest delay, outage windows included.
    pub max_ms: u64,
    /// The largest delay outside the windows where Postgres or Redis was down (the one
    /// [`MAX_DELAY`] bounds).
    pub max_outside_outages_ms: u64,
}

impl SoakReport {
    pub fn failures(&self) -> usize {
        self.checks.iter().map(|c| c.failed).sum()
    }
}

const SIDES: [Side; 2] = [Side::Consumers, Side::Workers];
const ROLLED_BACK: &str = "rolled-back";

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL instance `.1` of a side's service, then start it again.
    KillService(Side, usize),
    /// SIGTERM and start again (a deploy).
    DeployService(Side, usize),
    KillRelay(Side),
    RelayHandover(Side),
    KillRedis,
    /// Redis SIGKILLed and restarted with an empty data directory: the relays rebuild.
    WipeRedis,
    /// A standby beside the loaded active relay for a few seconds, then the handover; the
    /// standby must never decide a rebuild.
    StandbyUnderLoad(Side),
    RestartPostgres,
    /// Both sides, one instance after another: a new instance, ready, then the old one
    /// SIGTERMed and started again on the new binary, then the extra instance SIGTERMed
    /// (Kubernetes' maxSurge 1, maxUnavailable 0).
    RollingDeploy,
    /// Every Postgres process SIGSTOPped for `--freeze-for`: connections stay open and
    /// nothing answers, as on a frozen VM or a stalled disk.
    FreezePostgres,
}

impl Fault {
    /// Every kind once, in random order and on random sides: drawn first, so even a short
    /// soak meets each fault.
    fn deck(rng: &mut StdRng, instances: usize) -> Vec<Fault> {
        let (kill, deploy) = (
            (
                SIDES[rng.random_range(0..2)],
                rng.random_range(0..instances),
            ),
            (
                SIDES[rng.random_range(0..2)],
                rng.random_range(0..instances),
            ),
        );
        let mut side = || SIDES[rng.random_range(0..2)];
        let mut deck = vec![
            Fault::KillService(kill.0, kill.1),
            Fault::DeployService(deploy.0, deploy.1),
            Fault::KillRelay(side()),
            Fault::RelayHandover(side()),
            Fault::KillRedis,
            Fault::WipeRedis,
            Fault::StandbyUnderLoad(side()),
            Fault::RestartPostgres,
            Fault::RollingDeploy,
            Fault::FreezePostgres,
        ];
        rand::seq::SliceRandom::shuffle(&mut deck[..], rng);
        deck
    }

    fn pick(rng: &mut StdRng, instances: usize) -> Fault {
        let side = SIDES[rng.random_range(0..2)];
        let instance = rng.random_range(0..instances);
        // Redis losing everything is rarer than the rest: each one republishes the whole
        // retained outbox; so are the long ones (a rolling deploy, a frozen Postgres).
        match rng.random_range(0..17) {
            0 | 1 => Fault::KillService(side, instance),
            2 | 3 => Fault::DeployService(side, instance),
            4 | 5 => Fault::KillRelay(side),
            6 | 7 => Fault::RelayHandover(side),
            8 | 9 => Fault::KillRedis,
            10 => Fault::WipeRedis,
            11 | 12 => Fault::StandbyUnderLoad(side),
            13 => Fault::RollingDeploy,
            14 => Fault::FreezePostgres,
            _ => Fault::RestartPostgres,
        }
    }

    /// The kind, for the delays printed per kind and `--only`.
    fn kind(self) -> &'static str {
        let k = match self {
            Fault::KillService(..) => 0,
            Fault::DeployService(..) => 1,
            Fault::KillRelay(_) => 2,
            Fault::RelayHandover(_) => 3,
            Fault::KillRedis => 4,
            Fault::WipeRedis => 5,
            Fault::StandbyUnderLoad(_) => 6,
            Fault::RestartPostgres => 7,
            Fault::RollingDeploy => 8,
            Fault::FreezePostgres => 9,
        };
        FAULT_KINDS[k]
    }
}

/// One injected fault: its kind, when it began and ended, and the part of it (if any) during
/// which Postgres or Redis was down.
struct Injected {
    kind: &'static str,
    began: SystemTime,
    ended: SystemTime,
    outage: Option<(SystemTime, SystemTime)>,
}

/// How long after a fault ended its effects are still put down to it (a consumer taking a
/// shard over, a relay catching up).
const AFTERMATH: Duration = Duration::from_secs(5);

/// The relays currently active, by side (a handover alternates `-a` and `-b`).
struct Relays {
    active: HashMap<Side, String>,
}

pub async fn run_soak(bins: Bins, args: &Args) -> anyhow::Result<SoakReport> {
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    eprintln!("[soak] seed {seed}");
    anyhow::ensure!(
        !args.cluster || args.shards >= 2,
        "--cluster needs --shards 2 or more (a shard's keys share a hash tag; one plain stream has none)"
    );
    let instances = usize::from(args.instances);
    let (system, mut relays) = start_system(bins, args, instances).await?;
    let watchers = watch_every_chat(&system, args, instances);
    let started = Instant::now();
    let load = Load::start(&system, args, instances);
    let deadline = started + Duration::from_secs(args.seconds);
    let (faults, injected) =
        inject_until(&system, &mut relays, args, &mut rng, started, deadline).await?;
    tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)).await;
    let (sent, send_failures, rollbacks) = load.stop().await?;
    eprintln!("[soak] faults done; waiting for every message to arrive");
    let db = system.db.connect().await?;
    converge(&db, &watchers).await?;
    let [delivered, order, mut rolled] = check_inboxes(&db, args).await?;
    let (shown_once, timely, delays) = check_clients(&db, watchers, &injected, &mut rolled).await?;
    rolled.passed += rollbacks as usize;
    system.shutdown();
    Ok(SoakReport {
        seed,
        seconds: args.seconds,
        faults,
        sent,
        send_failures,
        rollbacks,
        checks: vec![delivered, order, rolled, shown_once, timely],
        delays,
    })
}

/// The system, with a witness slot per side, a relay per side, and every service instance
/// running and ready.
async fn start_system(
    bins: Bins,
    args: &Args,
    instances: usize,
) -> anyhow::Result<(Arc<System>, Relays)> {
    let system = Arc::new(System::new_on(!args.no_fsync, bins, args.shards, args.cluster).await?);
    eprintln!(
        "[soak] process logs in {} (kept after exit with TESTKIT_KEEP_SCRATCH=1)",
        system.logs_dir().display()
    );
    let admin = system.db.connect().await?;
    for side in SIDES {
        admin
            .query_one(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&witness(side)],
            )
            .await?;
    }
    let mut relays = Relays {
        active: HashMap::new(),
    };
    for side in SIDES {
        let name = format!("relay-{side}-a");
        system.start(&name, Kind::Relay(side), &[])?;
        system.wait_relay(&name, Duration::from_secs(30)).await?;
        relays.active.insert(side, name);
    }
    for side in SIDES {
        system.start(side.as_str(), Kind::Service(side), &[])?;
    }
    for side in SIDES {
        system.wait_service(side, Duration::from_secs(30)).await?;
    }
    for side in SIDES.into_iter().filter(|_| instances > 1) {
        system.start(&instance_name(side, 1), Kind::Replica(side), &[])?;
        system
            .wait_instance(side, 1, Duration::from_secs(30))
            .await?;
    }
    Ok((system, relays))
}

/// A tab on every instance of every chat, each reconnecting through the side's other
/// instances (and the rolling deploy's extra one) when its own goes, as behind a load
/// balancer.
fn watch_every_chat(system: &System, args: &Args, instances: usize) -> Vec<(Side, i64, Watcher)> {
    let mut watchers = Vec::new();
    for side in SIDES {
        for chat in 1..=args.chats {
            for i in 0..instances {
                let addrs = (0..=instances)
                    .map(|k| system.instance_addr(side, (i + k) % (instances + 1)))
                    .collect();
                watchers.push((side, chat, Watcher::start_any(addrs, chat)));
            }
        }
    }
    watchers
}

/// Senders on both sides at the steady rate, and transactions that roll back, until
/// stopped.
struct Load {
    stop: CancellationToken,
    senders: Vec<tokio::task::JoinHandle<(Side, usize, usize)>>,
    rollers: Vec<tokio::task::JoinHandle<()>>,
    rollbacks: Arc<AtomicU64>,
}

impl Load {
    fn start(system: &System, args: &Args, instances: usize) -> Self {
        let stop = CancellationToken::new();
        let mut senders = Vec::new();
        for side in SIDES {
            let addrs: Vec<_> = (0..instances)
                .map(|i| system.instance_addr(side, i))
                .collect();
            let chats = args.chats;
            let traffic = clients::Traffic {
                addrs,
                rate: args.rate,
                chat: move |n| 1 + n % chats,
                body: move |n| format!("{side}-{n}"),
                give_up: Duration::from_secs(90),
            };
            let stop = stop.clone();
            senders.push(tokio::spawn(async move {
                let (ok, failed) = clients::send_steadily(traffic, stop).await;
                (side, ok, failed)
            }));
        }
        let rollbacks = Arc::new(AtomicU64::new(0));
        let mut rollers = Vec::new();
        for side in SIDES {
            rollers.push(tokio::spawn(roll_back_now_and_then(
                system.db.url(side.as_str()),
                side,
                args.chats,
                stop.clone(),
                rollbacks.clone(),
            )));
        }
        Self {
            stop,
            senders,
            rollers,
            rollbacks,
        }
    }

    /// Stop, and wait for every send's answer: messages sent per side, sends that failed,
    /// transactions rolled back.
    async fn stop(self) -> anyhow::Result<(HashMap<String, usize>, usize, u64)> {
        self.stop.cancel();
        let mut sent = HashMap::new();
        let mut send_failures = 0;
        for s in self.senders {
            let (side, ok, failed) = s.await?;
            sent.insert(side.to_string(), ok);
            send_failures += failed;
        }
        for r in self.rollers {
            r.await?;
        }
        Ok((sent, send_failures, self.rollbacks.load(Ordering::Relaxed)))
    }
}

/// Faults at random intervals around `--fault-every` until `deadline`: the deck first (every
/// kind once), then drawn at random. Returns the log lines and when each was in effect.
async fn inject_until(
    system: &Arc<System>,
    relays: &mut Relays,
    args: &Args,
    rng: &mut StdRng,
    started: Instant,
    deadline: Instant,
) -> anyhow::Result<(Vec<String>, Vec<Injected>)> {
    let instances = usize::from(args.instances);
    let mut faults = Vec::new();
    let mut injected = Vec::new();
    let allowed = |f: &Fault| args.only.is_empty() || args.only.contains(&f.kind());
    let mut deck = Fault::deck(rng, instances);
    deck.retain(allowed);
    if args.cluster {
        // A master failover first (the deck is drawn from its end): the cluster soak asserts
        // one, and a short run may not reach the whole deck.
        deck.sort_by_key(|f| matches!(f, Fault::KillRedis));
    }
    loop {
        let pause = args.fault_every.mul_f64(rng.random_range(0.5..1.5));
        if Instant::now() + pause >= deadline {
            break;
        }
        tokio::time::sleep(pause).await;
        let fault = match deck.pop() {
            Some(fault) => fault,
            None => loop {
                let fault = Fault::pick(rng, instances);
                if allowed(&fault) {
                    break fault;
                }
            },
        };
        let outage = Duration::from_millis(rng.random_range(200..1500));
        let target = rng.random_range(0..args.shards);
        let began = SystemTime::now();
        let shot = Shot {
            outage,
            target,
            instances,
            freeze: args.freeze_for,
        };
        let (line, down) = inject(system, relays, fault, shot).await?;
        injected.push(Injected {
            kind: fault.kind(),
            began,
            ended: SystemTime::now(),
            outage: down,
        });
        let line = format!("{:>6.1}s  {line}", started.elapsed().as_secs_f64());
        eprintln!("  {line}");
        faults.push(line);
    }
    Ok((faults, injected))
}

/// Wait (up to two minutes) until every committed message is in the other side's inbox and
/// every client shows its whole feed.
async fn converge(
    db: &tokio_postgres::Client,
    watchers: &[(Side, i64, Watcher)],
) -> anyhow::Result<()> {
    let converge = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let mut missing = 0;
        for side in SIDES {
            missing += missing_in_inbox(db, side).await?;
        }
        let mut lagging = 0;
        for (side, chat, watcher) in watchers {
            let feed = feed_order(db, *side, *chat).await?;
            if watcher.shown().len() < feed.len() {
                lagging += 1;
            }
        }
        if (missing == 0 && lagging == 0) || tokio::time::Instant::now() >= converge {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the inboxes hold: every committed message once, in the sender's commit order per
/// chat, and no rolled-back one.
async fn check_inboxes(db: &tokio_postgres::Client, args: &Args) -> anyhow::Result<[Check; 3]> {
    let mut delivered = Check::new("every committed message in the other side's inbox, once");
    let mut order = Check::new("per chat, inbox order = sender's commit order");
    let mut rolled = Check::new("rolled-back messages never recorded or shown");
    for side in SIDES {
        let receiver = side.other();
        let committed: Vec<String> = db
            .query(&format!("SELECT id::text FROM {side}.messages"), &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let received: HashMap<String, i64> = db
            .query(
                &format!("SELECT message_id::text, chat_id FROM {receiver}.inbox"),
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        for id in &committed {
            delivered.record(received.contains_key(id), || {
                format!("{side} message {id} not in {receiver}'s inbox")
            });
        }
        let committed_set: std::collections::HashSet<&String> = committed.iter().collect();
        for id in received.keys().filter(|id| !committed_set.contains(id)) {
            delivered.record(false, || {
                format!("{receiver}'s inbox holds {id}, which {side} never committed")
            });
        }
        let bad: i64 = db
            .query_one(
                &format!("SELECT count(*) FROM {receiver}.inbox WHERE body LIKE '{ROLLED_BACK}%'"),
                &[],
            )
            .await?
            .get(0);
        rolled.record(bad == 0, || {
            format!("{bad} rolled-back messages in {receiver}'s inbox")
        });
        let commit_order = witness_order(db, side).await?;
        for chat in 1..=args.chats {
            let expected: Vec<String> = commit_order
                .iter()
                .filter(|(c, _)| *c == chat)
                .map(|(_, id)| id.clone())
                .collect();
            let actual = inbox_order(db, receiver, chat).await?;
            order.record(actual == expected, || {
                let at = actual.iter().zip(&expected).position(|(a, e)| a != e).unwrap_or(actual.len().min(expected.len()));
                format!("{receiver} chat {chat}: {} recorded vs {} committed, first difference at #{at}", actual.len(), expected.len())
            });
        }
    }
    Ok([delivered, order, rolled])
}

/// What every client showed: its chat's feed, each message once and in order, none rolled
/// back, each within [`MAX_DELAY`] outside outages (with the delays by fault kind).
async fn check_clients(
    db: &tokio_postgres::Client,
    watchers: Vec<(Side, i64, Watcher)>,
    injected: &[Injected],
    rolled: &mut Check,
) -> anyhow::Result<(Check, Check, Vec<Delays>)> {
    let mut shown_once = Check::new(
        "each SSE client showed its chat's feed (both sides): each message once, in feed order",
    );
    let mut timely = Check::new(
        "every message shown on every tab within 2 s of its commit, outside Postgres and Redis outages",
    );
    let mut delays: HashMap<&'static str, Delays> = HashMap::new();
    for (side, chat, watcher) in watchers {
        let shown = watcher.stop().await;
        measure_delays(&shown, injected, &mut timely, &mut delays, || {
            format!("{side} chat {chat}")
        });
        let feed = feed_order(db, side, chat).await?;
        let ids: Vec<String> = shown
            .iter()
            .map(|s| s.message["id"].as_str().unwrap_or_default().to_string())
            .collect();
        let any_rolled_back = shown.iter().any(|s| {
            s.message["body"]
                .as_str()
                .unwrap_or_default()
                .starts_with(ROLLED_BACK)
        });
        rolled.record(!any_rolled_back, || {
            format!("a {side} client was shown a rolled-back message")
        });
        shown_once.record(ids == feed, || {
            let mut counts: HashMap<&String, usize> = HashMap::new();
            for id in &ids {
                *counts.entry(id).or_default() += 1;
            }
            let twice = counts.values().filter(|n| **n > 1).count();
            let missing = feed.iter().filter(|id| !counts.contains_key(id)).count();
            format!(
                "{side} chat {chat}: shown {} for {} in the feed ({twice} twice, {missing} never, or out of order)",
                ids.len(),
                feed.len()
            )
        });
    }
    let mut delays: Vec<Delays> = delays.into_values().collect();
    delays.sort_by_key(|d| std::cmp::Reverse(d.max_outside_outages_ms));
    Ok((shown_once, timely, delays))
}

/// The process name of instance `i` of `side`'s service.
fn instance_name(side: Side, i: usize) -> String {
    match i {
        0 => side.as_str().to_string(),
        _ => format!("{side}-{}", i + 1),
    }
}

fn instance_kind(side: Side, i: usize) -> Kind {
    match i {
        0 => Kind::Service(side),
        1 => Kind::Replica(side),
        _ => Kind::Instance(side, i),
    }
}

fn witness(side: Side) -> String {
    format!("soak_witness_{side}")
}

/// The dice of one fault beside its kind.
struct Shot {
    /// How long a server stays down.
    outage: Duration,
    /// The shard whose master a cluster fault hits.
    target: u32,
    /// Instances of each side's service.
    instances: usize,
    /// How long Postgres stays frozen.
    freeze: Duration,
}

/// Inject `fault`. Returns its line for the report and the window (if any) in which
/// Postgres or Redis was down.
async fn inject(
    system: &Arc<System>,
    relays: &mut Relays,
    fault: Fault,
    shot: Shot,
) -> anyhow::Result<(String, Option<(SystemTime, SystemTime)>)> {
    let Shot {
        outage,
        target,
        instances,
        freeze,
    } = shot;
    let down_from = SystemTime::now();
    let line = match fault {
        Fault::KillService(side, i) => restart_service(system, side, i, Signal::Kill).await?,
        Fault::DeployService(side, i) => restart_service(system, side, i, Signal::Term).await?,
        Fault::RollingDeploy => rolling_deploy(system, instances).await?,
        Fault::FreezePostgres => {
            system.pg.freeze()?;
            tokio::time::sleep(freeze).await;
            system.pg.thaw()?;
            return Ok((
                format!("postgres: frozen (SIGSTOP) for {} ms", freeze.as_millis()),
                Some((down_from, SystemTime::now())),
            ));
        }
        Fault::KillRelay(side) => {
            let name = relays.active[&side].clone();
            stop(system, &name, Signal::Kill).await?;
            system.start(&name, Kind::Relay(side), &[])?;
            format!("{name}: SIGKILL, restarted")
        }
        Fault::RelayHandover(side) => handover(system, relays, side, Duration::ZERO).await?,
        Fault::StandbyUnderLoad(side) => {
            handover(system, relays, side, Duration::from_secs(3)).await?
        }
        Fault::KillRedis if system.cluster.is_some() => {
            fail_over_cluster_master(system, target, outage).await?
        }
        Fault::WipeRedis if system.cluster.is_some() => restart_cluster(system, outage).await?,
        Fault::KillRedis => restart_redis(system, outage, false).await?,
        Fault::WipeRedis => restart_redis(system, outage, true).await?,
        Fault::RestartPostgres => {
            let system = system.clone();
            let took = tokio::task::spawn_blocking(move || {
                let t = Instant::now();
                system.pg.restart_fast().map(|_| t.elapsed())
            })
            .await??;
            format!("postgres: fast restart ({} ms)", took.as_millis())
        }
    };
    let down = matches!(
        fault,
        Fault::KillRedis | Fault::WipeRedis | Fault::RestartPostgres
    )
    .then(|| (down_from, SystemTime::now()));
    Ok((line, down))
}

/// Instance `i` of `side`'s service stopped by `signal` (SIGKILL: a crash, SIGTERM: a
/// deploy) and started again.
async fn restart_service(
    system: &Arc<System>,
    side: Side,
    i: usize,
    signal: Signal,
) -> anyhow::Result<String> {
    let name = instance_name(side, i);
    stop(system, &name, signal).await?;
    system.start(&name, instance_kind(side, i), &[])?;
    Ok(match signal {
        Signal::Kill => format!("{name}: SIGKILL, restarted"),
        _ => format!("{name}: deployed (SIGTERM, started)"),
    })
}

/// Both sides deployed instance by instance: an extra instance started and ready, the old
/// one stopped and started again, the extra one stopped.
async fn rolling_deploy(system: &Arc<System>, instances: usize) -> anyhow::Result<String> {
    let t = Instant::now();
    let mut steps = Vec::new();
    for side in SIDES {
        let extra = instance_name(side, instances);
        for i in 0..instances {
            let step = Instant::now();
            system.start(&extra, instance_kind(side, instances), &[])?;
            system
                .wait_instance(side, instances, Duration::from_secs(30))
                .await?;
            let name = instance_name(side, i);
            stop(system, &name, Signal::Term).await?;
            system.start(&name, instance_kind(side, i), &[])?;
            system
                .wait_instance(side, i, Duration::from_secs(30))
                .await?;
            stop(system, &extra, Signal::Term).await?;
            steps.push(format!("{name} {} ms", step.elapsed().as_millis()));
        }
    }
    Ok(format!(
        "rolling deploy of both sides ({}), {} ms",
        steps.join(", "),
        t.elapsed().as_millis()
    ))
}

/// The Redis Cluster master of shard `target` SIGKILLed (its replica is promoted) and
/// started again after `outage`, as a replica.
async fn fail_over_cluster_master(
    system: &Arc<System>,
    target: u32,
    outage: Duration,
) -> anyhow::Result<String> {
    let system = system.clone();
    tokio::task::spawn_blocking(move || {
        let cluster = system.cluster.as_ref().expect("a cluster");
        let key = outbox_core::stream::shard_key(
            &Side::Consumers.outbox_stream(),
            target,
            system.shards(),
        );
        let node = cluster.master_of(&key)?;
        let t = Instant::now();
        cluster.kill_node(node)?;
        let failover = t.elapsed();
        std::thread::sleep(outage);
        cluster.restart_node(node)?;
        anyhow::Ok(format!(
            "redis cluster: master {node} (of {key}) SIGKILLed, replica promoted in {} ms, node back as a replica after {} ms",
            failover.as_millis(),
            outage.as_millis()
        ))
    })
    .await?
}

/// Every Redis Cluster node stopped and started on its data after `outage`.
async fn restart_cluster(system: &Arc<System>, outage: Duration) -> anyhow::Result<String> {
    let system = system.clone();
    tokio::task::spawn_blocking(move || {
        let cluster = system.cluster.as_ref().expect("a cluster");
        cluster.stop_all()?;
        std::thread::sleep(outage);
        cluster.start_all()?;
        anyhow::Ok(format!(
            "redis cluster: every node stopped, started on its data after {} ms",
            outage.as_millis()
        ))
    })
    .await?
}

/// Redis SIGKILLed and started again after `outage`, on its AOF or (`wipe`) without its
/// data.
async fn restart_redis(
    system: &Arc<System>,
    outage: Duration,
    wipe: bool,
) -> anyhow::Result<String> {
    system.redis.kill()?;
    if wipe {
        system.redis.wipe_data()?;
    }
    tokio::time::sleep(outage).await;
    system.redis.start_again()?;
    Ok(format!(
        "redis: SIGKILL, restarted {} after {} ms",
        if wipe {
            "without its data"
        } else {
            "on its AOF"
        },
        outage.as_millis()
    ))
}

/// Send `signal` to process `name` and wait for it to exit, off the runtime's threads (the
/// tabs keep reading meanwhile, so their times stay true).
async fn stop(system: &Arc<System>, name: &str, signal: Signal) -> anyhow::Result<()> {
    let (system, name) = (system.clone(), name.to_string());
    tokio::task::spawn_blocking(move || system.stop(&name, signal)).await?
}

/// Record, for each message `shown` on one tab (the first time), how long it took from its
/// `created_at` (taken just before its transaction, so at or before the commit) to the tab,
/// in all and outside the outage windows, under each fault whose span (plus its aftermath)
/// it overlapped.
fn measure_delays(
    shown: &[crate::clients::Shown],
    injected: &[Injected],
    timely: &mut Check,
    delays: &mut HashMap<&'static str, Delays>,
    tab: impl Fn() -> String,
) {
    let mut seen = std::collections::HashSet::new();
    for s in shown {
        let id = s.message["id"].as_str().unwrap_or_default();
        if !seen.insert(id.to_string()) {
            continue;
        }
        let Some(committed) = s.message["created_at"]
            .as_str()
            .and_then(|t| {
                time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
            })
            .map(SystemTime::from)
        else {
            timely.record(false, || format!("{}: {id} has no created_at", tab()));
            continue;
        };
        let total = s.at.duration_since(committed).unwrap_or_default();
        let in_outages: Duration = injected
            .iter()
            .filter_map(|f| f.outage)
            .map(|(from, to)| overlap((committed, s.at), (from, to)))
            .sum();
        let outside = total.saturating_sub(in_outages);
        timely.record(outside <= MAX_DELAY, || {
            format!(
                "{}: {id} shown {} ms after its commit ({} ms of it outside outages)",
                tab(),
                total.as_millis(),
                outside.as_millis()
            )
        });
        let mut kinds: Vec<&'static str> = injected
            .iter()
            .filter(|f| f.began <= s.at && f.ended + AFTERMATH >= committed)
            .map(|f| f.kind)
            .collect();
        kinds.dedup();
        if kinds.is_empty() {
            kinds.push("steady");
        }
        for kind in kinds {
            let d = delays.entry(kind).or_insert(Delays {
                fault: kind,
                shown: 0,
                max_ms: 0,
                max_outside_outages_ms: 0,
            });
            d.shown += 1;
            d.max_ms = d.max_ms.max(total.as_millis() as u64);
            d.max_outside_outages_ms = d.max_outside_outages_ms.max(outside.as_millis() as u64);
        }
    }
}

/// How long two spans of wall-clock time overlap.
fn overlap(a: (SystemTime, SystemTime), b: (SystemTime, SystemTime)) -> Duration {
    let from = a.0.max(b.0);
    let to = a.1.min(b.1);
    to.duration_since(from).unwrap_or_default()
}

/// Start a second relay for `side`, let it stand by for `beside` under the soak's load, then
/// SIGTERM the active one. Fails if the newcomer decided Redis lost data: it did not.
async fn handover(
    system: &Arc<System>,
    relays: &mut Relays,
    side: Side,
    beside: Duration,
) -> anyhow::Result<String> {
    let old = relays.active[&side].clone();
    let new = if old.ends_with("-a") {
        format!("relay-{side}-b")
    } else {
        format!("relay-{side}-a")
    };
    system.start(&new, Kind::Relay(side), &[])?;
    // The newcomer stands by while the old one holds the slot...
    let admin = system.relay_admin(&new).expect("just started");
    let standby = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < standby {
        if let Ok((503, body)) = testkit::http::get(admin, "/readyz").await {
            if body.contains("standby") {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // (the scenario: standing by under load for a while)
    tokio::time::sleep(beside).await;
    // ... and takes over when it is deployed away.
    let handover = Instant::now();
    stop(system, &old, Signal::Term).await?;
    system.wait_relay(&new, Duration::from_secs(30)).await?;
    relays.active.insert(side, new.clone());
    let took = handover.elapsed();
    if let Ok((_, body)) = testkit::http::get(admin, "/metrics").await {
        let rebuilds: f64 = testkit::http::metric_samples(&body)
            .iter()
            // After a Redis wipe a rebuild (no_record) is due whoever holds the slot; Redis
            // "losing data" while it lost nothing is what a standby must never conclude.
            .filter(|(k, _)| k.starts_with("cdc_relay_rebuilds_total{reason=\"lost_redis_data\""))
            .map(|(_, v)| v)
            .sum();
        anyhow::ensure!(
            rebuilds == 0.0,
            "{new} rebuilt the stream for lost Redis data at a handover, while Redis lost nothing"
        );
    }
    Ok(format!(
        "{old} → {new}: SIGTERM with a standby waiting {} s, took over in {:.0} ms",
        beside.as_secs(),
        took.as_secs_f64() * 1000.0
    ))
}

/// Transactions that write a message and its event, then roll back: they must never show.
async fn roll_back_now_and_then(
    url: String,
    side: Side,
    chats: i64,
    stop: CancellationToken,
    count: Arc<AtomicU64>,
) {
    let mut n = 0;
    while !stop.is_cancelled() {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(700)) => {}
        }
        let Ok((mut client, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await
        else {
            continue;
        };
        tokio::spawn(conn);
        n += 1;
        let id = uuid::Uuid::now_v7();
        let payload = serde_json::json!({
            "id": id, "chat_id": 1 + n % chats, "body": format!("{ROLLED_BACK}-{n}"),
            "created_at": "2026-01-01T00:00:00Z", "side": side.as_str(),
        });
        let s = side.schema();
        let done = async {
            let tx = client.transaction().await?;
            tx.execute(
                &format!("INSERT INTO {s}.messages (id, chat_id, body) VALUES ($1, $2, $3)"),
                &[&id, &(1 + n % chats), &format!("{ROLLED_BACK}-{n}")],
            )
            .await?;
            tx.execute(
                &format!("INSERT INTO {s}.outbox (event, payload) VALUES ('message.created', $1)"),
                &[&payload],
            )
            .await?;
            tx.rollback().await
        }
        .await;
        if done.is_ok() {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Committed messages of `side` missing from the other side's inbox.
async fn missing_in_inbox(db: &tokio_postgres::Client, side: Side) -> anyhow::Result<i64> {
    Ok(db
        .query_one(
            &format!(
                "SELECT count(*) FROM {side}.messages m
                  WHERE NOT EXISTS (SELECT 1 FROM {}.inbox i WHERE i.message_id = m.id)",
                side.other()
            ),
            &[],
        )
        .await?
        .get(0))
}

/// Message ids recorded in `side`'s inbox for `chat`, in inbox order.
/// The chat's feed on `side` (sent and received), in the order its clients must show it.
async fn feed_order(
    db: &tokio_postgres::Client,
    side: Side,
    chat: i64,
) -> anyhow::Result<Vec<String>> {
    ids(
        db,
        &format!(
            "SELECT id::text FROM (
               SELECT id, pos FROM {side}.messages WHERE chat_id = $1
               UNION ALL
               SELECT message_id, pos FROM {side}.inbox WHERE chat_id = $1) f
             ORDER BY pos"
        ),
        chat,
    )
    .await
}

async fn inbox_order(
    db: &tokio_postgres::Client,
    side: Side,
    chat: i64,
) -> anyhow::Result<Vec<String>> {
    ids(
        db,
        &format!("SELECT message_id::text FROM {side}.inbox WHERE chat_id = $1 ORDER BY pos"),
        chat,
    )
    .await
}

/// The message ids a query of one chat returns, in its order.
async fn ids(db: &tokio_postgres::Client, sql: &str, chat: i64) -> anyhow::Result<Vec<String>> {
    Ok(db
        .query(sql, &[&chat])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// (chat, message id) of every outbox event `side` committed, in commit order, from the
/// witness slot.
async fn witness_order(
    db: &tokio_postgres::Client,
    side: Side,
) -> anyhow::Result<Vec<(i64, String)>> {
    let rows = db
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                 'proto_version', '1', 'publication_names', $2)",
            &[&witness(side), &format!("{side}_outbox")],
        )
        .await?;
    let mut relations = RelationCache::new(
        format!("{side}.outbox")
            .parse()
            .map_err(anyhow::Error::msg)?,
    );
    let mut order = Vec::new();
    for row in rows {
        let data: Vec<u8> = row.get(0);
        if matches!(data.first(), Some(b'B' | b'C')) {
            continue;
        }
        match pgoutput::decode(&bytes::Bytes::from(data))? {
            PgOutput::Relation(rel) => relations.on_relation(&rel)?,
            PgOutput::Insert(insert) => {
                if let Row::Outbox(event) = relations.on_insert(insert)? {
                    let message: serde_json::Value = serde_json::from_slice(&event.payload)?;
                    order.push((
                        message["chat_id"].as_i64().unwrap_or(0),
                        message["id"].as_str().unwrap_or_default().to_string(),
                    ));
                }
            }
            PgOutput::Skipped(_) => {}
        }
    }
    Ok(order)
}

pub fn print(report: &SoakReport) {
    println!(
        "soak: seed {}, {} s, {} faults",
        report.seed,
        report.seconds,
        report.faults.len()
    );
    for line in &report.faults {
        println!("  {line}");
    }
    let sent: Vec<String> = report
        .sent
        .iter()
        .map(|(side, n)| format!("{side} {n}"))
        .collect();
    println!(
        "sent: {} (gave up on {}); rolled back: {}",
        sent.join(", "),
        report.send_failures,
        report.rollbacks
    );
    for check in &report.checks {
        println!(
            "{}: {} passed, {} failed",
            check.name, check.passed, check.failed
        );
        for example in &check.examples {
            println!("    {example}");
        }
    }
    println!("largest commit-to-shown delay per fault kind (messages on every tab):");
    for d in &report.delays {
        println!(
            "  {:<20} {:>6} shown, max {:>6} ms, {:>5} ms outside Postgres/Redis outages",
            d.fault, d.shown, d.max_ms, d.max_outside_outages_ms
        );
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let report = run_soak(Bins::beside_this()?, &args).await?;
    print(&report);
    let path = report::write_json(
        "soak",
        &serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "machine": report::machine(),
            "report": report,
        }),
    )?;
    println!("\nwritten to {}", path.display());
    anyhow::ensure!(report.failures() == 0, "{} violations", report.failures());
    Ok(())
}
