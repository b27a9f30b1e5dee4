//! `cdc-relay`: parse the command line, set up logging, run the library.

use std::process::ExitCode;

use cdc_relay::config::{Cli, Command, LogFormat};
use cdc_relay::setup::{setup, RecordOutcome, SetupOutcome};
use clap::Parser;
use tokio_util::sync::CancellationToken;

fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    // pgwire-replication logs every failed session at ERROR; the relay reports (and
    // classifies) the same errors itself, so its own lines are noise by default.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,pgwire_replication=off".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// `setup`: the slot, and with --redis-url and --stream the stream's starting record.
async fn run_setup(args: &cdc_relay::config::SetupArgs) -> Result<(), cdc_relay::RelayError> {
    let timeout = std::time::Duration::from_secs(10);
    let pg = args.postgres.validate()?;
    let outcome = setup(&pg, timeout).await?;
    match &outcome {
        SetupOutcome::Created { consistent_point } => println!(
            "created replication slot {} (pgoutput) at {consistent_point}",
            pg.slot
        ),
        SetupOutcome::AlreadyExists => println!("replication slot {} already exists", pg.slot),
        SetupOutcome::MadeFailover => println!(
            "replication slot {} already existed; it is a failover slot now",
            pg.slot
        ),
    }
    if let (Some(url), Some(stream)) = (&args.redis_url, &args.stream) {
        let redis = args
            .redis_secrets
            .target(url, args.redis_cluster, timeout)?;
        let shards = cdc_relay::shard::validate_count("--stream-shards", args.stream_shards)
            .map_err(cdc_relay::RelayError::Config)?;
        cdc_relay::shard::check_cluster(args.redis_cluster, shards)
            .and_then(|()| {
                cdc_relay::shard::check_cluster_key(args.redis_cluster, "--stream", stream)
            })
            .map_err(cdc_relay::RelayError::Config)?;
        match cdc_relay::setup::init_stream_record(&pg, &outcome, redis, stream, shards, timeout)
            .await?
        {
            RecordOutcome::Written => println!("stream {stream} starts at the slot's position"),
            RecordOutcome::LeftAlone(why) => {
                println!("stream {stream}: record left alone ({why}); `run` checks it")
            }
        }
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // One TLS implementation for every connection (Postgres, replication, Redis).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let result = match cli.command {
        Command::Run(args) => match args.validate() {
            Ok(config) => {
                let shutdown = CancellationToken::new();
                cdc_relay::shutdown::cancel_on_signal(shutdown.clone());
                cdc_relay::run(config, shutdown).await
            }
            Err(e) => Err(e),
        },
        Command::Slots(args) => cdc_relay::slots::slots(&args)
            .await
            .map(|out| print!("{out}")),
        Command::Check(args) => {
            let (status, line) = cdc_relay::slots::check(&args).await;
            println!("{line}");
            return ExitCode::from(status as u8);
        }
        Command::DropSlot(args) => cdc_relay::slots::drop_slot(&args)
            .await
            .map(|out| println!("{out}")),
        Command::Setup(args) => run_setup(&args).await,
        Command::Reshard(args) => match args.validate() {
            Ok(config) => cdc_relay::reshard::reshard(&config)
                .await
                .map(|out| println!("{out}")),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cdc-relay: {e}");
            ExitCode::FAILURE
        }
    }
}
