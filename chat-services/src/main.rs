//! `chat-service`: parse the command line, set up logging, run one side of the chat.

use std::process::ExitCode;

use chat_services::config::{Command, LogFormat};
use chat_services::dead_letters;
use chat_services::{Cli, Service};
use clap::Parser;
use tokio_util::sync::CancellationToken;

fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // One TLS implementation for every connection (Postgres, Redis).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let config = match cli.validate() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("chat-service: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(Command::DeadLetters(command)) = cli.command {
        return match dead_letters::run(&config, command, &mut std::io::stdout()).await {
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
    let shutdown = CancellationToken::new();
    let service = match Service::bind(config, shutdown.clone()).await {
        Ok(service) => service,
        Err(e) => {
            eprintln!("chat-service: {e}");
            return ExitCode::FAILURE;
        }
    };
    cdc_relay::shutdown::cancel_on_signal(shutdown);
    service.run().await;
    ExitCode::SUCCESS
}
