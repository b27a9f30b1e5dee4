//! `chat-lab`: the project's experiments and benchmarks, run against real servers and the
//! real binaries. Each command prints a table and writes a JSON result to `target/lab/`.

mod report;
mod throughput;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "chat-lab", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay drain rate over a pre-filled outbox, beside pg_recvlogical on the same WAL.
    Throughput(throughput::Args),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Throughput(args) => throughput::run(args).await,
    }
}
