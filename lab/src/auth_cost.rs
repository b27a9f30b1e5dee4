//! What verifying a bearer token costs a request: tokens signed with each algorithm the
//! services accept (keys made by openssl, as an identity provider's would be), verified as
//! the services verify them; microseconds per token, on one core.

use std::time::{Duration, Instant};

use chat_services::token::{jwks, SigningKey};
use chat_services::{KeySource, TokenConfig, TokenVerifier};
use serde::Serialize;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Tokens verified per algorithm (each a distinct token).
    #[arg(long, default_value_t = 2000)]
    tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct Cost {
    pub algorithm: &'static str,
    pub tokens: usize,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

const ISSUER: &str = "https://id.lab.invalid/";
const AUDIENCE: &str = "chat";

pub async fn run(args: Args) -> anyhow::Result<()> {
    let dir = testkit::scratch_dir("lab-auth-cost");
    let algorithms: [(&'static str, &[&str]); 3] = [
        ("EdDSA (Ed25519)", &["-algorithm", "ed25519"]),
        (
            "ES256 (P-256)",
            &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
        ),
        (
            "RS256 (2048)",
            &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
        ),
    ];
    let mut costs = Vec::new();
    for (i, (algorithm, openssl_args)) in algorithms.into_iter().enumerate() {
        let pem = crate::report::openssl_key(&dir, &format!("key-{i}"), openssl_args)?;
        let key = SigningKey::from_pem(&pem, &format!("kid-{i}"))?;
        let jwks_file = dir.join(format!("jwks-{i}.json"));
        std::fs::write(&jwks_file, jwks(&[&key])?)?;
        let verifier = TokenVerifier::load(TokenConfig {
            jwks: KeySource::File(jwks_file),
            cookie_secure: false,
            cookie_name: "chat_session_lab".into(),
            issuer: ISSUER.into(),
            audiences: vec![AUDIENCE.into()],
            leeway: Duration::from_secs(30),
            admin_scope: "chat:admin".into(),
            admin_audience: None,
            clients: Vec::new(),
            admin_clients: Vec::new(),
            token_type: None,
            max_lifetime: Duration::from_secs(24 * 3600),
            session_key: chat_services::SessionKey::generate(),
        })
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let tokens: Vec<String> = (0..args.tokens)
            .map(|n| {
                key.mint(
                    ISSUER,
                    AUDIENCE,
                    &format!("user-{n}"),
                    Duration::from_secs(3600),
                    None,
                )
            })
            .collect::<Result<_, _>>()?;
        let mut samples = Vec::with_capacity(tokens.len());
        for token in &tokens {
            let started = Instant::now();
            let user = verifier.verify(token).map_err(|e| anyhow::anyhow!(e))?;
            samples.push(started.elapsed().as_secs_f64() * 1e6);
            std::hint::black_box(user);
        }
        let mean_us = samples.iter().sum::<f64>() / samples.len() as f64;
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
        costs.push(Cost {
            algorithm,
            tokens: samples.len(),
            mean_us,
            p50_us: at(0.50),
            p99_us: at(0.99),
        });
    }
    println!(
        "bearer token verification, per request ({}):",
        crate::report::machine().describe()
    );
    println!(
        "  {:<18} {:>8} {:>10} {:>10} {:>10}",
        "algorithm", "tokens", "mean µs", "p50 µs", "p99 µs"
    );
    for c in &costs {
        println!(
            "  {:<18} {:>8} {:>10.1} {:>10.1} {:>10.1}",
            c.algorithm, c.tokens, c.mean_us, c.p50_us, c.p99_us
        );
    }
    let path = crate::report::write_json("auth-cost", &costs)?;
    println!("written to {}", path.display());
    Ok(())
}
