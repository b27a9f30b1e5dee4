//! `cdc-relay`: parse the command line, set up logging, run the library.

use std::process::ExitCode;

use cdc_relay::cli::{Cli, Command};
use clap::Parser;
use tokio_util::sync::CancellationToken;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // One TLS implementation for every connection (Postgres, replication, Redis).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    // pgwire-replication logs every failed session at ERROR; the relay reports (and
    // classifies) the same errors itself, so its own lines are noise by default.
    outbox_core::logging::init(cli.log_format, "info,pgwire_replication=off");
    let result = match cli.command {
        Command::Run(args) => match args.validate() {
            Ok(config) => match outbox_core::telemetry::init(&args.trace, "cdc-relay") {
                // Dropped after the relay stopped: the spans still queued are flushed.
                Ok(_telemetry) => {
                    let shutdown = CancellationToken::new();
                    outbox_core::shutdown::cancel_on_signal(shutdown.clone());
                    cdc_relay::run(config, shutdown).await
                }
                Err(e) => Err(e.into()),
            },
            Err(e) => Err(e),
        },
        Command::Slots(args) => cdc_relay::slots(&args).await.map(|out| print!("{out}")),
        Command::Streams(args) => cdc_relay::streams(&args).await.map(|out| print!("{out}")),
        Command::Functions(args) => cdc_relay::functions(&args).await.map(|out| print!("{out}")),
        Command::Check(args) => {
            let (status, line) = cdc_relay::check(&args).await;
            println!("{line}");
            return ExitCode::from(status as u8);
        }
        Command::DropSlot(args) => cdc_relay::drop_slot(&args)
            .await
            .map(|out| println!("{out}")),
        Command::Setup(args) => cdc_relay::setup_command(&args, &mut std::io::stdout()).await,
        Command::Reshard(args) => match args.validate() {
            Ok(config) => cdc_relay::reshard(&config)
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
