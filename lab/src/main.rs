//! `chat-lab`: parse the command line and run one experiment.

use clap::{Parser, Subcommand};
use lab::{
    auth_cost, backlog, baseline, chaos, conformance, latency, rebuild, soak, stuck, throughput,
};

#[derive(Debug, Parser)]
#[command(name = "chat-lab", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The original deploy/outage timeline: 10 messages through redeploys, a Redis outage and
    /// a crash between the inbox commit and its acknowledgement.
    Chaos(chaos::Args),
    /// Random faults at a steady send rate, then verify: once, in order, nothing rolled back.
    Soak(soak::Args),
    /// One shard refusing writes for minutes under traffic on every shard: the others' chats
    /// shown within 2 s, no WAL kept for it, everything shown once it accepts again.
    StuckShard(stuck::Args),
    /// The receiving side back to a large backlog, with live chats beside it: the live
    /// ones shown within seconds while the backlog is caught up, everything once, in order.
    Backlog(backlog::Args),
    /// Send→shown latency, side by side with the baselines.
    Latency(latency::Args),
    /// Relay drain rate (beside pg_recvlogical and the NOTIFY relay) and the end-to-end knee.
    Throughput(throughput::Args),
    /// A rebuild's cost at scale: rows/s and the relay's peak memory.
    Rebuild(rebuild::Args),
    /// What verifying a bearer token costs a request, per algorithm the services accept.
    AuthCost(auth_cost::Args),
    /// The stream contract's conformance suite, long: every case in rounds and a soak with
    /// faults, for each consumer implementation (Rust, TypeScript, or any driver).
    Conformance(conformance::Args),
    /// The baselines the experiments compare against (started by the lab itself).
    #[command(subcommand, hide = true)]
    Baseline(baseline::Command),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        match cli.command {
            Command::Chaos(args) => chaos::run(args).await,
            Command::Soak(args) => soak::run(args).await,
            Command::StuckShard(args) => stuck::run(args).await,
            Command::Backlog(args) => backlog::run(args).await,
            Command::Latency(args) => latency::run(args).await,
            Command::Throughput(args) => throughput::run(args).await,
            Command::Rebuild(args) => rebuild::run(args).await,
            Command::AuthCost(args) => auth_cost::run(args).await,
            Command::Conformance(args) => conformance::run(args).await,
            Command::Baseline(command) => baseline::run(command).await,
        }
    })
}
