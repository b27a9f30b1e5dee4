//! `chat-service`: parse the command line, set up logging, run one side of the chat.

use std::process::ExitCode;

use chat_services::{dead_letters, Cli, Command, Service};
use clap::Parser;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> ExitCode {
    // One TLS implementation for every connection (Postgres, Redis).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    outbox_core::logging::init(cli.log_format, "info");
    let config = match cli.validate() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("chat-service: invalid configuration: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(Command::DeadLetters(command)) = cli.command {
        return match dead_letters(&config, command, &mut std::io::stdout()).await {
            Ok(outcome) if outcome.left == 0 => ExitCode::SUCCESS,
            Ok(outcome) => {
                eprintln!(
                    "chat-service: {} left as dead letters (see not_replayed above)",
                    outcome.left
                );
                ExitCode::FAILURE
            }
            Err(e) => {
                eprintln!("chat-service: {e}");
                ExitCode::FAILURE
            }
        };
    }
    // Dropped at the end of main, after the service stopped: queued spans are flushed.
    let _telemetry =
        match outbox_core::telemetry::init(&cli.trace, &format!("chat-{}", cli.side.as_str())) {
            Ok(telemetry) => telemetry,
            Err(e) => {
                eprintln!("chat-service: invalid configuration: {e}");
                return ExitCode::FAILURE;
            }
        };
    let shutdown = CancellationToken::new();
    let service = match Service::bind(config, shutdown.clone()).await {
        Ok(service) => service,
        Err(e) => {
            eprintln!("chat-service: {e}");
            return ExitCode::FAILURE;
        }
    };
    outbox_core::shutdown::cancel_on_signal(shutdown);
    service.run().await;
    ExitCode::SUCCESS
}
