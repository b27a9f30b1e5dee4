//! The experiments as CI runs them: the write-up's chaos timeline for both designs in both
//! directions, and a 60-second fault soak. Ours must lose, hide, duplicate and reorder
//! nothing; the dual-write baseline must reproduce the write-up's loss (messages 7 and 8).

use std::time::Duration;

use crate::bins;
use lab::chaos::{self, Direction, Topology, Variant};
use lab::soak;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_timeline_both_designs_both_directions() {
    let outcomes = chaos::run_all(
        bins(),
        Variant::Both,
        Direction::Both,
        Duration::from_millis(400),
        false,
        Topology {
            shards: 1,
            cluster: false,
        },
    )
    .await
    .unwrap();
    assert_eq!(outcomes.len(), 4);
    for o in &outcomes {
        println!("{}", o.summary());
        assert_eq!(o.saved, 10, "{}", o.summary());
        // The crash between the inbox commit and the acknowledgement: redelivered, skipped.
        assert_eq!(o.duplicates_skipped, 1, "{}", o.summary());
        assert!(
            o.never_shown.is_empty() && o.shown_twice.is_empty(),
            "{}",
            o.summary()
        );
        match o.variant {
            "cdc" => {
                assert!(o.is_clean(), "{}", o.summary());
                assert_eq!(o.received, 10);
            }
            _ => {
                assert_eq!(o.lost, ["msg 7", "msg 8"], "{}", o.summary());
                assert_eq!(o.unpublished, 2);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sixty_second_fault_soak_with_two_instances_per_side_on_four_shards_finds_no_violation() {
    // Four shards, so the two instances of a side share them and the faults hit handovers
    // of shards as well as of the relay.
    let args = soak::Args {
        seconds: 60,
        seed: None,
        rate: 10.0,
        chats: 6,
        fault_every: Duration::from_secs(3),
        no_fsync: true,
        instances: 2,
        shards: 4,
        cluster: false,
        // Longer than the services' 5 s store deadline (they answer 503); the lab's 20 s
        // would leave too few of the 60 s for the other faults.
        freeze_for: Duration::from_secs(6),
        only: Vec::new(),
    };
    let report = soak::run_soak(bins(), &args).await.unwrap();
    soak::print(&report);
    assert!(report.faults.len() >= 10, "{} faults", report.faults.len());
    assert!(
        report.checks.iter().all(|c| c.passed > 0),
        "every check saw cases"
    );
    assert_eq!(
        report.failures(),
        0,
        "violations; replay with --seed {}",
        report.seed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_timeline_on_a_redis_cluster_with_eight_shards_both_directions() {
    // The same timeline; "Redis down" stops every node of the cluster.
    let outcomes = chaos::run_all(
        bins(),
        Variant::Cdc,
        Direction::Both,
        Duration::from_millis(400),
        false,
        Topology {
            shards: 8,
            cluster: true,
        },
    )
    .await
    .unwrap();
    assert_eq!(outcomes.len(), 2);
    for o in &outcomes {
        println!("{}", o.summary());
        assert_eq!(o.saved, 10, "{}", o.summary());
        assert_eq!(o.duplicates_skipped, 1, "{}", o.summary());
        assert!(o.is_clean(), "{}", o.summary());
        assert_eq!(o.received, 10);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_fault_soak_on_a_redis_cluster_with_master_failovers_finds_no_violation() {
    // Eight shards on a cluster, relays waiting for a replica: the Redis faults are a
    // master SIGKILLed (its replica promoted) and the whole cluster stopped and started.
    let args = soak::Args {
        seconds: 60,
        seed: None,
        rate: 10.0,
        chats: 6,
        fault_every: Duration::from_secs(3),
        no_fsync: true,
        instances: 2,
        shards: 8,
        cluster: true,
        freeze_for: Duration::from_secs(6),
        only: Vec::new(),
    };
    let report = soak::run_soak(bins(), &args).await.unwrap();
    soak::print(&report);
    assert!(
        report.faults.iter().any(|f| f.contains("replica promoted")),
        "a master failover among the faults: {:?}",
        report.faults
    );
    assert_eq!(
        report.failures(),
        0,
        "violations; replay with --seed {}",
        report.seed
    );
}

/// `chat-lab throughput`'s end-to-end part, briefly: the send-only floor, the latency one
/// message at a time and the climb all run, and every step says where its CPU went, process
/// group by process group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_end_to_end_climb_reports_the_floor_and_each_steps_cpu_by_process() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        knee: lab::knee::Args,
    }
    let cli = <Cli as clap::Parser>::parse_from([
        "knee",
        "--e2e-rates",
        "50,100",
        "--e2e-max-rate",
        "100",
        "--e2e-seconds",
        "2",
        "--e2e-warmup-seconds",
        "1",
        "--e2e-p99-limit-ms",
        "1000",
    ]);
    let knee = lab::knee::measure_with(&cli.knee, bins()).await.unwrap();
    lab::knee::print(&knee);
    let floor = knee.floor.as_ref().expect("the floor was measured");
    assert_eq!(floor.knee_per_second, Some(100));
    assert_eq!(knee.knee_per_second, Some(100));
    assert_eq!(knee.steps.len(), 2, "the climb stopped at the cap");
    // One at a time on the same system, to hold the lowest step against.
    assert_eq!(knee.sequential.samples, 200);
    assert!(knee.sequential.p50_ms > 0.0 && knee.sequential.p50_ms <= knee.sequential.p99_ms);
    for step in &knee.steps {
        assert_eq!(step.shown, step.sent);
        let groups: Vec<&str> = step.cpu.iter().map(|g| g.group.as_str()).collect();
        for expected in [
            "consumers",
            "workers-1",
            "relay-consumers",
            "postgres backends",
            "postgres walsenders",
            "redis",
            "load generator (chat-lab)",
        ] {
            assert!(
                groups.contains(&expected),
                "{expected} missing from {groups:?}"
            );
        }
        let backends = step
            .cpu
            .iter()
            .find(|g| g.group == "postgres backends")
            .unwrap();
        assert!(backends.seconds > 0.0, "Postgres did work: {backends:?}");
    }
    // The floor ran nothing but the sending service.
    let floor_groups: Vec<&str> = floor.steps[0]
        .cpu
        .iter()
        .map(|g| g.group.as_str())
        .collect();
    assert!(!floor_groups
        .iter()
        .any(|g| g.starts_with("relay") || g.starts_with("workers")));
}

/// `chat-lab throughput`'s drains, briefly: the relay and pg_recvlogical each drain both
/// shapes, and the report says what the relay's drain cost in CPU per process and the rate
/// the machine's cores allow at that cost (the bound the issue asks to show where the drain
/// falls short).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_reports_its_cpu_by_process_and_the_rate_the_cores_allow() {
    // As chat-lab parses it, a subcommand: clap's debug checks then see the same command
    // the binary builds (they caught two argument groups sharing one name).
    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Lab,
    }
    #[derive(clap::Subcommand)]
    enum Lab {
        Throughput(lab::throughput::Args),
    }
    let cli = <Cli as clap::Parser>::parse_from([
        "chat-lab",
        "throughput",
        // Enough that the walsender's share is several 10 ms ticks: with 2,000 it read 0
        // once (a 0.05 s drain).
        "--single-row-txns",
        "20000",
        "--batch-txns",
        "20",
        "--rounds",
        "1",
        "--skip-notify",
        "--skip-e2e",
    ]);
    let Lab::Throughput(args) = cli.command;
    let shapes = lab::throughput::drains(&args, &bins().relay).await.unwrap();
    assert_eq!(shapes.len(), 2);
    for shape in &shapes {
        println!("{shape:?}");
        assert_eq!(shape.relay_seconds.len(), 1);
        assert_eq!(shape.relay_cpu.len(), 1);
        let cpu = shape.relay_cpu[0];
        // /proc counts CPU in 10 ms ticks, so a small share may read 0; the relay and the
        // walsender decode every event and cannot.
        assert!(
            cpu.relay > 0.0 && cpu.walsender > 0.0,
            "the drain's processes did work: {cpu:?}"
        );
        // What the processes spent fits in what the cores had during the drain (one tick
        // of rounding per process): the figures are CPU seconds of this drain.
        let cores = lab::report::cpus() as f64;
        assert!(
            cpu.total() <= cores * shape.relay_seconds[0] + 0.03,
            "{cpu:?} in {} s",
            shape.relay_seconds[0]
        );
        let bound = shape.cpu_bound_percent_of_ceiling.expect("a bound");
        assert!(bound.is_finite() && bound > 0.0, "{bound}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_refusing_writes_delays_only_its_own_chats_and_keeps_no_wal() {
    // The whole system with the shipped defaults: one shard of the Consumers stream refuses
    // every write for four times --shard-detach-after while messages go to chats of every
    // shard and another table writes WAL (`chat-lab stuck-shard` holds it for 2 minutes).
    let args = lab::stuck::Args {
        fault: Duration::from_secs(20),
        rate: 20.0,
        chats: 8,
        shards: 4,
        noise_mb: 1,
    };
    let report = lab::stuck::run_stuck(bins(), &args).await.unwrap();
    lab::stuck::print(&report);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert!(
        report.healthy_max_ms <= 2000.0,
        "a healthy shard's message took {} ms",
        report.healthy_max_ms
    );
    assert!(
        report.slot_lag_max_bytes < 8 << 20,
        "the slot lagged {} bytes while the shard was behind",
        report.slot_lag_max_bytes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_chats_are_shown_while_the_receiving_side_catches_up_a_backlog() {
    // The receiving side comes back to a backlog in two chats, with live traffic into four
    // others of the same shard (`chat-lab backlog` writes 200,000).
    let args = lab::backlog::Args {
        backlog: 20_000,
        backlog_chats: 2,
        live_chats: 4,
        rate: 10.0,
        shards: 1,
    };
    let report = lab::backlog::run_backlog(bins(), &args).await.unwrap();
    lab::backlog::print(&report);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert!(report.live_shown > 0, "no live message shown");
    assert!(
        report.backlog_recorded_at_first_live < args.backlog / 2,
        "the first live message waited for the backlog: shown with {} of {} recorded",
        report.backlog_recorded_at_first_live,
        args.backlog
    );
}
