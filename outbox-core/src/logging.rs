//! Log set-up for every binary: structured lines to stderr, text or JSON, filtered by
//! `RUST_LOG` (or the binary's default directives).

use std::io::IsTerminal;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Install the global subscriber. `default_directives` apply unless `RUST_LOG` is set
/// (e.g. `info,pgwire_replication=off`).
pub fn init(format: LogFormat, default_directives: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_directives.into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
