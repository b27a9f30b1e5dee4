//! `chat-token`: the local stand-in for the team's identity provider. It publishes a
//! signing key's JWKS and mints tokens with it, for `deploy/local.sh` and for trying the
//! API by hand. Never the way to issue tokens to real users.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use chat_services::token::{jwks, SigningKey};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "chat-token", version)]
struct Cli {
    /// The private key (PKCS#8 PEM: Ed25519, P-256 or RSA), e.g. from
    /// `openssl genpkey -algorithm ed25519`.
    #[arg(long, env = "CHAT_TOKEN_KEY")]
    key: PathBuf,
    /// The key id published in the JWKS and named by every token.
    #[arg(long, env = "CHAT_TOKEN_KID", default_value = "local-1")]
    kid: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the JWKS document the services verify with (--jwks-file).
    Jwks,
    /// Print a token for one user.
    Mint {
        /// The user (the token's subject).
        #[arg(long)]
        sub: String,
        #[arg(long, env = "CHAT_JWT_ISSUER")]
        issuer: String,
        /// The audience; with the services' comma-separated list, the first.
        #[arg(
            long,
            env = "CHAT_JWT_AUDIENCE",
            value_delimiter = ',',
            required = true
        )]
        audience: Vec<String>,
        /// How long the token is valid.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "8h")]
        ttl: Duration,
        /// Space-separated scopes, e.g. `chat:admin` for managing members.
        #[arg(long)]
        scope: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let pem = match std::fs::read(&cli.key) {
        Ok(pem) => pem,
        Err(e) => {
            eprintln!("chat-token: cannot read --key {}: {e}", cli.key.display());
            return ExitCode::from(2);
        }
    };
    let printed = SigningKey::from_pem(&pem, &cli.kid).and_then(|key| match &cli.command {
        Cmd::Jwks => jwks(&[&key]),
        Cmd::Mint {
            sub,
            issuer,
            audience,
            ttl,
            scope,
        } => key.mint(issuer, &audience[0], sub, *ttl, scope.as_deref()),
    });
    match printed {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("chat-token: {e}");
            ExitCode::FAILURE
        }
    }
}
