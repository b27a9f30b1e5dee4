//! Who may use the API: the identity provider's keys and the claims every token must carry,
//! validated into the token verifier (its key set read at start).

use std::path::PathBuf;
use std::time::Duration;

use outbox_core::ConfigError;

/// Who may use the API: bearer tokens of the team's identity provider (JWTs), verified
/// here against its published keys. One of `--jwks-file`, `--jwks-url` or
/// `--allow-anonymous` is needed.
#[allow(rustdoc::bare_urls)] // --help text: a URL is an example, not a link.
#[derive(Debug, Clone, clap::Args)]
pub struct AuthArgs {
    /// The identity provider's keys (a JWKS document, JSON) that bearer tokens are verified
    /// with; read again when a token names a key it does not hold (a rotation).
    #[arg(long, env = "CHAT_JWKS_FILE", conflicts_with = "jwks_url")]
    pub jwks_file: Option<PathBuf>,
    /// The identity provider's `jwks_uri` (https://): fetched at start, every
    /// --jwks-refresh, and when a token names a key the set does not hold (at most every
    /// 10 s). Instead of --jwks-file.
    #[arg(long, env = "CHAT_JWKS_URL")]
    pub jwks_url: Option<String>,
    /// The CA that signed the identity provider's certificate (PEM), for --jwks-url
    /// (default: the well-known public roots).
    #[arg(long, env = "CHAT_JWKS_CA_FILE")]
    pub jwks_ca_file: Option<PathBuf>,
    /// How often --jwks-url is fetched again.
    #[arg(long, env = "CHAT_JWKS_REFRESH", value_parser = humantime::parse_duration, default_value = "5m")]
    pub jwks_refresh: Duration,
    /// The issuer (`iss`) every token must name, e.g. https://id.example.com/.
    #[arg(long, env = "CHAT_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// The audience (`aud`) a token must name; comma-separated for several.
    #[arg(long, env = "CHAT_JWT_AUDIENCE", value_delimiter = ',')]
    pub jwt_audience: Vec<String>,
    /// Clock skew allowed when checking a token's `exp` and `nbf`.
    #[arg(long, env = "CHAT_JWT_LEEWAY", value_parser = humantime::parse_duration, default_value = "30s")]
    pub jwt_leeway: Duration,
    /// The longest a token may be valid from its issue (`exp` minus `iat`; without `iat`,
    /// from now); a longer one is refused. Bounds what a signing key stolen and withdrawn
    /// later can still sign for. The page signs in again when its token expires.
    #[arg(long, env = "CHAT_JWT_MAX_LIFETIME", value_parser = humantime::parse_duration, default_value = "24h")]
    pub jwt_max_lifetime: Duration,
    /// The scope (`scope` or `scp` claim) a token needs to manage chat members.
    #[arg(long, env = "CHAT_ADMIN_SCOPE", default_value = "chat:admin")]
    pub admin_scope: String,
    /// The audience (`aud`) an admin token must name besides --admin-scope, e.g.
    /// chat-consumers-admin: one of its own per side, so an admin token of one side is no
    /// admin on the other, and an identity provider that grants users the scopes they ask
    /// for does not make them admins of a resource it never issues them. A token naming only
    /// this audience may manage members and nothing else.
    #[arg(long, env = "CHAT_JWT_ADMIN_AUDIENCE")]
    pub jwt_admin_audience: Option<String>,
    /// The clients (`azp`, or `client_id`) whose tokens are accepted, comma-separated; a
    /// token of another client, or naming none, is refused. Empty: any client.
    #[arg(long, env = "CHAT_JWT_CLIENTS", value_delimiter = ',')]
    pub jwt_clients: Vec<String>,
    /// The clients whose tokens may carry admin rights (the team's backend), comma-separated.
    /// Empty: any accepted client.
    #[arg(long, env = "CHAT_JWT_ADMIN_CLIENTS", value_delimiter = ',')]
    pub jwt_admin_clients: Vec<String>,
    /// The `typ` header every token must carry, e.g. at+jwt (an OAuth access token, RFC
    /// 9068): an ID token of the same provider is then refused. Compared without
    /// `application/`, ignoring case. Empty: not checked.
    #[arg(long, env = "CHAT_JWT_TYPE")]
    pub jwt_type: Option<String>,
    /// Run without authentication: nobody is identified, every chat is open to anyone who
    /// reaches --listen, messages carry no sender. For a trusted test setup only; logged as
    /// a warning at every start.
    #[arg(long, env = "CHAT_ALLOW_ANONYMOUS", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub allow_anonymous: bool,
    /// The session cookie is `Secure` and named `__Host-chat_session_<side>`: browsers keep it
    /// for HTTPS (and localhost) only, for this host only, so no sibling subdomain can set
    /// one. `--cookie-secure=false` (named `chat_session_<side>`, no `Secure`) is for plain-HTTP
    /// development only (warned at start); over TLS (--tls-cert-file) it is always secure.
    #[arg(long, env = "CHAT_COOKIE_SECURE", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = true)]
    pub cookie_secure: bool,
    /// A file holding the secret (at least 32 bytes; surrounding whitespace ignored) the
    /// page's session cookies are signed with, the same for every instance of the side.
    /// Without it each instance makes one up at start (warned): a page's session is then
    /// known to that instance only, until it restarts.
    #[arg(long, env = "CHAT_SESSION_KEY_FILE")]
    pub session_key_file: Option<PathBuf>,
}

impl AuthArgs {
    /// The token verifier, its key set read now (so a missing or malformed one refuses the
    /// start with its reason); `None` with `--allow-anonymous`.
    pub(crate) fn validate(
        &self,
        cookie_secure: bool,
        side: &str,
    ) -> Result<Option<crate::access::auth::Verifier>, ConfigError> {
        let refuse = |message: String| Err(ConfigError(message));
        let jwks = match (&self.jwks_file, &self.jwks_url) {
            (Some(file), _) => crate::access::auth::KeySource::File(file.clone()),
            (None, Some(url)) => {
                let uri = url.parse::<hyper::Uri>().ok();
                let authority = uri.as_ref().and_then(|u| u.authority()).map(|a| a.as_str());
                if !url.starts_with("https://")
                    || authority.is_none_or(|a| a.contains('@') || a.starts_with('['))
                {
                    return refuse(format!(
                        "--jwks-url '{url}' must be an https:// URL of a host name or IPv4 address, without credentials (the provider's jwks_uri)"
                    ));
                }
                if self.jwks_refresh < Duration::from_secs(10) {
                    return refuse("--jwks-refresh must be at least 10s".into());
                }
                if let Some(ca) = &self.jwks_ca_file {
                    outbox_core::connect::root_store(Some(ca))?;
                }
                crate::access::auth::KeySource::Url {
                    url: url.clone(),
                    ca_file: self.jwks_ca_file.clone(),
                    refresh: self.jwks_refresh,
                }
            }
            (None, None) => {
                if self.allow_anonymous {
                    return Ok(None);
                }
                return refuse("no authentication configured: set --jwks-file (CHAT_JWKS_FILE) or --jwks-url (CHAT_JWKS_URL) to the identity provider's keys, with --jwt-issuer and --jwt-audience, or --allow-anonymous (CHAT_ALLOW_ANONYMOUS=true) for a trusted test setup where anyone may read and post".into());
            }
        };
        if self.allow_anonymous {
            return refuse(
                "--allow-anonymous and --jwks-file/--jwks-url exclude each other: choose one"
                    .into(),
            );
        }
        let Some(issuer) = self.jwt_issuer.clone().filter(|i| !i.is_empty()) else {
            return refuse("--jwks-file needs --jwt-issuer (CHAT_JWT_ISSUER): the `iss` the provider's tokens carry".into());
        };
        let audiences: Vec<String> = self
            .jwt_audience
            .iter()
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .collect();
        if audiences.is_empty() {
            return refuse("--jwks-file needs --jwt-audience (CHAT_JWT_AUDIENCE): the `aud` tokens meant for this service carry".into());
        }
        if self.jwt_leeway > Duration::from_secs(300) {
            return refuse(format!(
                "--jwt-leeway {:?} is over 5m: a clock that far off needs fixing, not tolerating",
                self.jwt_leeway
            ));
        }
        if self.jwt_max_lifetime < Duration::from_secs(60) {
            return refuse("--jwt-max-lifetime must be at least 1m".into());
        }
        if self.admin_scope.is_empty() || self.admin_scope.contains(' ') {
            return refuse("--admin-scope must be one scope, without spaces".into());
        }
        let listed = |given: &[String]| -> Vec<String> {
            given
                .iter()
                .map(|c| c.trim().to_string())
                .filter(|c| !c.is_empty())
                .collect()
        };
        let admin_audience = self
            .jwt_admin_audience
            .as_deref()
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string);
        if admin_audience
            .as_ref()
            .is_some_and(|admin| audiences.contains(admin))
        {
            return refuse("--jwt-admin-audience must differ from every --jwt-audience: a user's token would be an admin's".into());
        }
        let session_key = match &self.session_key_file {
            Some(path) => std::fs::read(path)
                .map_err(|e| format!("cannot read it: {e}"))
                .and_then(|secret| crate::access::auth::SessionKey::from_secret(&secret))
                .map_err(|e| ConfigError(format!("--session-key-file {}: {e}", path.display())))?,
            None => crate::access::auth::SessionKey::generate(),
        };
        let config = crate::access::auth::TokenConfig {
            session_key,
            admin_audience,
            clients: listed(&self.jwt_clients),
            admin_clients: listed(&self.jwt_admin_clients),
            token_type: self
                .jwt_type
                .as_deref()
                .filter(|t| !t.trim().is_empty())
                .map(crate::access::auth::media_type),
            jwks,
            cookie_secure,
            cookie_name: crate::access::auth::session_cookie_name(side, cookie_secure),
            issuer,
            audiences,
            leeway: self.jwt_leeway,
            admin_scope: self.admin_scope.clone(),
            max_lifetime: self.jwt_max_lifetime,
        };
        crate::access::auth::Verifier::load(config).map(Some)
    }
}
