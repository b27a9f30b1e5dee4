//! Who is asking: bearer tokens (JWTs signed by the team's identity provider) verified here
//! against its published keys (a JWKS file), and the session cookie the page signs in with.
//!
//! A token is accepted when its signature verifies with the key its header names (`kid`),
//! with that key's own algorithm (RS256, ES256 or EdDSA: never one the token picks), and
//! its issuer, audience, expiry and not-before hold, within the clock skew allowed. Its
//! subject (`sub`) is the user. The key set is read again when its file changes (looked at
//! at most once a second, so a key withdrawn after a compromise stops verifying within a
//! second) and when a token names a key it does not hold, so a rotation at the provider is
//! picked up without a restart.
//!
//! The page's session cookie never holds the provider's token: signing in turns a user's
//! token into a narrowed one this service signs (HS256 with `--session-key-file`, shared by
//! the side's instances), valid only as this side's session cookie, for the same user and
//! until the same expiry, and only while the provider's key that signed the original is
//! still published: a withdrawn key ends the sessions it opened as it ends its tokens.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper::header::{HeaderMap, AUTHORIZATION, COOKIE};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{errors::ErrorKind, Algorithm, DecodingKey, EncodingKey, Header, Validation};
use tracing::{error, info, warn};

use crate::model::check_new_user_id;
use outbox_core::ConfigError;

/// The cookie the page's session is kept in (a narrowed token, `HttpOnly`). With
/// `--cookie-secure` (the default) it is `__Host-` prefixed: the browser then takes it only
/// over HTTPS (or from localhost), from this host, for `/`, so no sibling subdomain can plant
/// one. Without, for plain-HTTP development, two cookies of this name are refused.
pub(crate) const SESSION_COOKIE: &str = "chat_session";
pub(crate) const SECURE_SESSION_COOKIE: &str = "__Host-chat_session";

/// The session cookie's name for `side`: cookies are kept per host, not per port, so two
/// sides served from one host (127.0.0.1 in development) would otherwise sign each other's
/// page out.
pub(crate) fn session_cookie_name(side: &str, secure: bool) -> String {
    let base = if secure {
        SECURE_SESSION_COOKIE
    } else {
        SESSION_COOKIE
    };
    format!("{base}_{side}")
}
/// The least time between two reads of the key set for tokens naming an unknown key: a
/// client sending made-up key ids costs one file read a second at most.
const RELOAD_AT_MOST_EVERY: Duration = Duration::from_secs(1);

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    /// The token's subject.
    pub user: String,
    /// When the token expires (its `exp`, seconds since the epoch).
    pub expires_at: u64,
    /// The first second this token is refused (its expiry past the clock skew allowed): an
    /// event stream opened with it ends then.
    pub refused_from: u64,
    /// The token carries the admin scope (and, where configured, the admin audience and an
    /// admin client): it may manage chat members.
    pub admin: bool,
    /// The token names one of `--jwt-audience`: it may read and post in its user's chats
    /// and sign a page in. A token naming only `--jwt-admin-audience` may manage members
    /// and nothing else.
    pub for_users: bool,
    /// SHA-256 of the provider's key (as published) that signed the token, or the token a
    /// session began with: a session lasts only while that key is published.
    pub key: [u8; 32],
}

impl Identity {
    /// The time left until the token is refused (zero if it is).
    pub(crate) fn remaining(&self) -> Duration {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Duration::from_secs(self.refused_from).saturating_sub(now)
    }
}

/// Tokens remembered as verified at most; past it the memory is emptied and refilled.
const VERIFIED_KEPT: usize = 4096;

/// Bytes a token may have; a longer one is refused before it is decoded.
const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Why a request has no identity (answered 401 with the reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AuthError {
    #[error("no credentials: send 'Authorization: Bearer <token>' (a JWT from the identity provider), or sign in with POST /session")]
    Missing,
    #[error("the Authorization header must be 'Bearer <token>'")]
    NotBearer,
    /// Refused before any signature was checked (malformed, too long, an unknown key).
    #[error("invalid token: {0}")]
    Invalid(String),
    /// Checked against its key and refused (a bad signature, expired, wrong audience, too
    /// long-lived): the check cost a signature verification, charged to the sender.
    #[error("invalid token: {0}")]
    Refused(String),
    /// With `--jwks-url`, before the provider's keys were first fetched: nothing about
    /// the token is known yet (503, retried).
    #[error("the identity provider's keys are not fetched yet; retry shortly")]
    NoKeys,
    /// Two session cookies of this service's name: one may have been planted by a
    /// neighbouring site (a parent domain's cookie), and which is whose cannot be told.
    #[error("the session cookie was sent more than once (one may have been set by another site of a parent domain): sign out (DELETE /session), clear this site's cookies, and sign in again")]
    DuplicateCookie,
}

/// Where a request's credential came from: an `Authorization: Bearer` header (a token of
/// the identity provider) or the session cookie (a session token this service signed).
/// Neither is accepted as the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Credential<'h> {
    Bearer(&'h str),
    Session(&'h str),
}

impl Credential<'_> {
    /// Kept by an event stream, to be verified again when the key set changes.
    pub(crate) fn to_owned(self) -> OwnedCredential {
        match self {
            Credential::Bearer(t) => OwnedCredential::Bearer(t.to_string()),
            Credential::Session(t) => OwnedCredential::Session(t.to_string()),
        }
    }
}

/// A [`Credential`] held beyond its request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OwnedCredential {
    Bearer(String),
    Session(String),
}

impl OwnedCredential {
    pub(crate) fn borrow(&self) -> Credential<'_> {
        match self {
            OwnedCredential::Bearer(t) => Credential::Bearer(t),
            OwnedCredential::Session(t) => Credential::Session(t),
        }
    }
}

/// The secret session cookies are signed with (HS256). Shared by a side's instances
/// (`--session-key-file`), so a page signed in at one is known at every other; changing it
/// signs every page out (each signs in again with its token).
#[derive(Clone)]
pub struct SessionKey {
    signing: Arc<EncodingKey>,
    verifying: Arc<DecodingKey>,
    /// Made up at start (no `--session-key-file`): known to this process only.
    pub generated: bool,
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionKey")
            .field("generated", &self.generated)
            .finish_non_exhaustive()
    }
}

impl SessionKey {
    /// Bytes a key must have at least (HS256's own strength).
    pub const MIN_BYTES: usize = 32;

    /// A key from a secret's bytes (surrounding whitespace, such as a final newline, is
    /// not part of it), or why it is too weak.
    pub fn from_secret(secret: &[u8]) -> Result<Self, String> {
        let secret = secret.trim_ascii();
        if secret.len() < Self::MIN_BYTES {
            return Err(format!(
                "it holds {} bytes, fewer than {}: write at least {} random bytes (e.g. `head -c 48 /dev/urandom | base64`)",
                secret.len(),
                Self::MIN_BYTES,
                Self::MIN_BYTES
            ));
        }
        Ok(Self::of(secret, false))
    }

    fn of(secret: &[u8], generated: bool) -> Self {
        let expect = "an HMAC key of 32 bytes or more loads";
        Self {
            signing: Arc::new(EncodingKey::from_secret(secret).expect(expect)),
            verifying: Arc::new(DecodingKey::from_secret(secret).expect(expect)),
            generated,
        }
    }

    /// A key of this process only, from the operating system's random source.
    pub fn generate() -> Self {
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).expect("the operating system's random source works");
        Self::of(&secret, true)
    }
}

/// The issuer of session tokens: never a provider's (a session token is refused as a
/// bearer token, and the provider's tokens as session cookies).
const SESSION_ISSUER: &str = "chat-service-session";

/// What a session token says.
#[derive(serde::Serialize, serde::Deserialize)]
struct SessionClaims {
    iss: String,
    aud: String,
    sub: String,
    iat: u64,
    exp: u64,
    /// SHA-256 (hex) of the provider's key that signed the token signed in with.
    key: String,
}

/// How the service learns who is asking.
pub(crate) enum Auth {
    /// `--allow-anonymous`: nobody is identified, every chat is open to every caller.
    Anonymous,
    Tokens(Arc<Verifier>),
}

/// What `--jwks-file`, `--jwt-issuer`, `--jwt-audience` and friends configure.
#[derive(Debug, Clone)]
pub struct TokenConfig {
    pub jwks: KeySource,
    /// The session cookie is `Secure` (and `__Host-` prefixed).
    pub cookie_secure: bool,
    /// Its name: `chat_session_<side>`, `__Host-` prefixed when secure.
    pub cookie_name: String,
    pub issuer: String,
    pub audiences: Vec<String>,
    pub leeway: Duration,
    pub admin_scope: String,
    /// The audience an admin token must name besides the admin scope (`None`: the scope
    /// alone makes an admin).
    pub admin_audience: Option<String>,
    /// Clients (`azp`, or `client_id`) whose tokens are accepted; empty: any.
    pub clients: Vec<String>,
    /// Clients whose tokens may carry admin rights; empty: any accepted client.
    pub admin_clients: Vec<String>,
    /// The `typ` header every token must carry (e.g. `at+jwt`, an access token by RFC 9068:
    /// an ID token of the same provider is refused); `None`: not checked.
    pub token_type: Option<String>,
    /// The longest a token may be valid from its issue (`exp - iat`; without `iat`, from
    /// now): a key stolen and withdrawn later cannot have signed a token good for years.
    pub max_lifetime: Duration,
    /// Signs the page's session cookies.
    pub session_key: SessionKey,
}

/// Where the provider's keys are.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// A JWKS file, kept in sync by a job or a sidecar.
    File(PathBuf),
    /// The provider's `jwks_uri` (HTTPS), fetched at start, every `refresh`, and when a
    /// token names a key the set does not hold (at most every 10 s).
    Url {
        url: String,
        /// The CA that signed the provider's certificate (default: the well-known roots).
        ca_file: Option<PathBuf>,
        refresh: Duration,
    },
}

/// Verifies tokens against the provider's keys.
pub(crate) struct Verifier {
    config: TokenConfig,
    keys: RwLock<Arc<Keys>>,
    /// When the file was last read or looked at, and its modification time then.
    file: Mutex<FileState>,
    /// With a URL: wakes the fetcher for a key the set does not hold.
    wanted: tokio::sync::Notify,
    /// Bumped whenever the key set is replaced: open event streams verify their token again.
    changed: tokio::sync::watch::Sender<u64>,
    /// Held across reading the key set again and installing it: two reloads at once (a
    /// token's unknown key, the file watcher) cannot install an older read over a newer.
    reload: Mutex<()>,
    /// Tokens verified lately, by their SHA-256: one comes again (every request of a page)
    /// without a signature check, and is not held back by its address's failures, until it
    /// expires or the key set changes.
    verified: Mutex<Verified>,
}

/// Each entry with the key-set generation it was verified under.
#[derive(Default)]
struct Verified {
    by_digest: HashMap<[u8; 32], (u64, Identity)>,
}

struct FileState {
    read_at: Instant,
    looked_at: Instant,
    /// What the file was when last read well; `None` after a failed read, so the next look
    /// reads it again whatever it says.
    modified: Option<crate::stamp::Stamp>,
}

/// The usable keys of a key set, by `kid`.
struct Keys {
    by_kid: HashMap<String, Key>,
    /// Keys without a `kid`: used only when the set holds exactly one key.
    unnamed: Vec<Key>,
    /// Read from a document (false only before a `--jwks-url` was first fetched): an empty
    /// published set refuses every token; an unpublished one answers "not fetched yet".
    published: bool,
    /// SHA-256 of the usable keys as published (sorted): equal sets, equal fingerprints.
    fingerprint: [u8; 32],
}

struct Key {
    key: DecodingKey,
    alg: Algorithm,
    /// SHA-256 of the key as published.
    digest: [u8; 32],
}

/// The algorithm a key is used with: its `alg` if named (one of ours), else the one its
/// type implies.
fn key_algorithm(alg: Option<KeyAlgorithm>, params: &AlgorithmParameters) -> Option<Algorithm> {
    match (alg, params) {
        (Some(KeyAlgorithm::RS256), AlgorithmParameters::RSA(_)) => Some(Algorithm::RS256),
        (Some(KeyAlgorithm::ES256), AlgorithmParameters::EllipticCurve(ec))
            if ec.curve == EllipticCurve::P256 =>
        {
            Some(Algorithm::ES256)
        }
        (Some(KeyAlgorithm::EdDSA), AlgorithmParameters::OctetKeyPair(okp))
            if okp.curve == EllipticCurve::Ed25519 =>
        {
            Some(Algorithm::EdDSA)
        }
        (Some(_), _) => None,
        (None, AlgorithmParameters::RSA(_)) => Some(Algorithm::RS256),
        (None, AlgorithmParameters::EllipticCurve(ec)) if ec.curve == EllipticCurve::P256 => {
            Some(Algorithm::ES256)
        }
        (None, AlgorithmParameters::OctetKeyPair(okp)) if okp.curve == EllipticCurve::Ed25519 => {
            Some(Algorithm::EdDSA)
        }
        (None, _) => None,
    }
}

impl Keys {
    /// The signing keys of a JWKS document. Keys of other uses or algorithms, and keys
    /// that do not load, are skipped (named in a warning): the rest replace the set, so a
    /// key withdrawn beside a broken one is still withdrawn. None usable is an empty set
    /// (every token refused); only a document that does not parse is an error.
    fn parse(path: &Path, text: &str) -> Result<Self, String> {
        let set: JwkSet = serde_json::from_str(text)
            .map_err(|e| format!("{} is not a JWKS document: {e}", path.display()))?;
        let mut keys = Keys {
            by_kid: HashMap::new(),
            unnamed: Vec::new(),
            published: true,
            fingerprint: [0; 32],
        };
        let mut used: Vec<String> = Vec::new();
        for jwk in &set.keys {
            let kid = jwk.common.key_id.clone();
            let name = kid.as_deref().unwrap_or("(no kid)");
            if matches!(jwk.common.public_key_use, Some(ref u) if *u != PublicKeyUse::Signature) {
                warn!(kid = name, file = %path.display(), "JWKS key skipped: not a signing key");
                continue;
            }
            let Some(alg) = key_algorithm(jwk.common.key_algorithm, &jwk.algorithm) else {
                warn!(kid = name, file = %path.display(), "JWKS key skipped: only RS256, ES256 (P-256) and EdDSA (Ed25519) keys are used");
                continue;
            };
            let key = match DecodingKey::from_jwk(jwk) {
                Ok(key) => key,
                Err(e) => {
                    warn!(kid = name, file = %path.display(), error = %e, "JWKS key skipped: it does not load");
                    continue;
                }
            };
            let published = serde_json::to_string(jwk).unwrap_or_default();
            // The key itself (RFC 7638 thumbprint: its type and public numbers), not how it
            // is published: a provider renewing the certificate beside the same key, or
            // adding its `alg`, ends no session.
            let digest = {
                use sha2::Digest;
                let thumbprint = jwk
                    .thumbprint(jsonwebtoken::jwk::ThumbprintHash::SHA256)
                    .unwrap_or_else(|_| published.clone());
                sha2::Sha256::digest(thumbprint.as_bytes()).into()
            };
            used.push(published);
            let key = Key { key, alg, digest };
            match kid {
                Some(kid) => {
                    keys.by_kid.insert(kid, key);
                }
                None => keys.unnamed.push(key),
            }
        }
        if !keys.unnamed.is_empty() && keys.by_kid.len() + keys.unnamed.len() > 1 {
            warn!(file = %path.display(), unnamed = keys.unnamed.len(), "JWKS keys without a kid are not used: the set holds more than one key, so a token cannot say which");
        }
        used.sort();
        keys.fingerprint = {
            use sha2::Digest;
            sha2::Sha256::digest(used.join("\n").as_bytes()).into()
        };
        if keys.is_empty() {
            error!(file = %path.display(), "the key set holds no usable signing key (RS256, ES256 or EdDSA): every token is refused");
        }
        Ok(keys)
    }

    fn count(&self) -> usize {
        self.by_kid.len() + self.unnamed.len()
    }

    fn is_empty(&self) -> bool {
        self.by_kid.is_empty() && self.unnamed.is_empty()
    }

    fn unpublished() -> Self {
        Keys {
            by_kid: HashMap::new(),
            unnamed: Vec::new(),
            published: false,
            fingerprint: [0; 32],
        }
    }

    /// Whether the set still verifies tokens of the key with this digest (a key without a
    /// `kid` only while it is the set's one key, as [`Keys::find`] uses it).
    fn holds(&self, digest: &[u8; 32]) -> bool {
        self.by_kid.values().any(|k| k.digest == *digest)
            || (self.count() == 1 && self.unnamed.iter().any(|k| k.digest == *digest))
    }

    fn find(&self, kid: Option<&str>) -> Option<&Key> {
        match kid {
            Some(kid) => self.by_kid.get(kid),
            None if self.by_kid.len() + self.unnamed.len() == 1 => {
                self.unnamed.first().or_else(|| self.by_kid.values().next())
            }
            None => None,
        }
    }
}

/// The claims read from a verified token.
/// `sub` and `exp` are required, but checked by the validation (which names a missing one),
/// not by deserializing.
#[derive(serde::Deserialize)]
struct Claims {
    #[serde(default)]
    sub: Option<String>,
    #[serde(default)]
    exp: Option<u64>,
    #[serde(default)]
    iat: Option<u64>,
    /// OAuth 2 scopes, space-separated (`scope`), or a list (`scp`, as some providers send).
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    scp: Option<serde_json::Value>,
    /// One audience, or a list.
    #[serde(default)]
    aud: Option<serde_json::Value>,
    /// The client the token was issued to (OpenID Connect), or `client_id` (RFC 9068).
    #[serde(default)]
    azp: Option<String>,
    #[serde(default)]
    client_id: Option<String>,
}

impl Claims {
    /// Whether the token names `wanted` among its audiences.
    fn names_audience(&self, wanted: &str) -> bool {
        match &self.aud {
            Some(serde_json::Value::String(aud)) => aud == wanted,
            Some(serde_json::Value::Array(auds)) => auds.iter().any(|a| a == wanted),
            _ => false,
        }
    }

    /// The client the token was issued to, if it says.
    fn client(&self) -> Option<&str> {
        self.azp.as_deref().or(self.client_id.as_deref())
    }

    fn has_scope(&self, wanted: &str) -> bool {
        let in_scope = self
            .scope
            .as_deref()
            .is_some_and(|s| s.split(' ').any(|s| s == wanted));
        let in_scp = match &self.scp {
            Some(serde_json::Value::String(s)) => s.split(' ').any(|s| s == wanted),
            Some(serde_json::Value::Array(items)) => items.iter().any(|v| v == wanted),
            _ => false,
        };
        in_scope || in_scp
    }
}

fn hex(bytes: &[u8; 32]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A media type as a `typ` header compares (RFC 8725 §3.11): lowercase, without
/// `application/`.
pub(crate) fn media_type(typ: &str) -> String {
    let typ = typ.trim().to_ascii_lowercase();
    match typ.strip_prefix("application/") {
        Some(rest) => rest.to_string(),
        None => typ,
    }
}

fn reason(kind: &ErrorKind) -> String {
    match kind {
        ErrorKind::ExpiredSignature => "it has expired".into(),
        ErrorKind::ImmatureSignature => "it is not valid yet (nbf)".into(),
        ErrorKind::InvalidIssuer => "wrong issuer".into(),
        ErrorKind::InvalidAudience => "wrong audience".into(),
        ErrorKind::InvalidSignature => "the signature does not verify".into(),
        ErrorKind::InvalidAlgorithm => "its algorithm is not the key's".into(),
        ErrorKind::MissingRequiredClaim(claim) => format!("the '{claim}' claim is missing"),
        ErrorKind::InvalidClaimFormat(claim) => format!("the '{claim}' claim is malformed"),
        ErrorKind::InvalidToken
        | ErrorKind::Base64(_)
        | ErrorKind::Json(_)
        | ErrorKind::Utf8(_) => "not a JWT".into(),
        _ => "it cannot be verified".into(),
    }
}

impl Verifier {
    /// Read the key set (a file), or say what to change. With a URL the set starts empty
    /// and [`Verifier::fetch`] fills it.
    pub(crate) fn load(config: TokenConfig) -> Result<Self, ConfigError> {
        let (keys, modified) = match &config.jwks {
            KeySource::File(path) => {
                let modified = crate::stamp::Stamp::of(path);
                let keys = read_keys(path)
                    .and_then(|keys| match keys.is_empty() {
                        true => Err(format!(
                            "{} holds no usable signing key (RS256, ES256 or EdDSA)",
                            path.display()
                        )),
                        false => Ok(keys),
                    })
                    .map_err(|e| {
                        ConfigError(format!(
                            "--jwks-file: {e}; point it at the identity provider's JWKS document"
                        ))
                    })?;
                info!(
                    file = %path.display(),
                    keys = keys.by_kid.len() + keys.unnamed.len(),
                    issuer = %config.issuer,
                    "verifying bearer tokens"
                );
                (keys, modified)
            }
            KeySource::Url { url, .. } => {
                info!(%url, issuer = %config.issuer, "verifying bearer tokens; fetching the key set");
                (Keys::unpublished(), None)
            }
        };
        let now = Instant::now();
        Ok(Self {
            file: Mutex::new(FileState {
                read_at: now,
                looked_at: now,
                modified,
            }),
            config,
            keys: RwLock::new(Arc::new(keys)),
            wanted: tokio::sync::Notify::new(),
            changed: tokio::sync::watch::Sender::new(0),
            verified: Mutex::default(),
            reload: Mutex::default(),
        })
    }

    fn cookie_name(&self) -> &str {
        &self.config.cookie_name
    }

    /// The identity a token stands for.
    pub(crate) fn verify(&self, token: &str) -> Result<Identity, AuthError> {
        // Nothing longer is decoded: a provider's access token is 1–4 KB.
        if token.len() > MAX_TOKEN_BYTES {
            return Err(AuthError::Invalid(format!(
                "it is {} bytes, over {MAX_TOKEN_BYTES}",
                token.len()
            )));
        }
        let file = match &self.config.jwks {
            KeySource::File(path) => Some(path.as_path()),
            KeySource::Url { .. } => None,
        };
        if let Some(path) = file {
            self.reread_if_changed(path);
        }
        // Read before the keys are: a set replaced while this token is checked makes its
        // result one not to remember (it may have been checked with the old keys).
        let generation = *self.changed.borrow();
        if let Some(who) = self.remembered(token) {
            return Ok(who);
        }
        match self.verify_signed(token, file) {
            Ok(who) => {
                self.remember(token, &who, generation);
                Ok(who)
            }
            Err(e) => {
                // Refused now (its key withdrawn, say): no longer a token known to be good.
                self.forget(token);
                Err(e)
            }
        }
    }

    /// SHA-256 of a token: what the memory of verified tokens keeps.
    fn digest(token: &str) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(token.as_bytes()).into()
    }

    /// The identity of `token` if it was verified under the current key set and has not
    /// expired.
    fn remembered(&self, token: &str) -> Option<Identity> {
        let generation = *self.changed.borrow();
        self.lately(token)
            .filter(|(verified_under, _)| *verified_under == generation)
            .map(|(_, who)| who)
    }

    /// Whether `token` verified lately, under this key set or an earlier one, and has not
    /// expired: its holder was identified before (it is verified again all the same).
    pub(crate) fn verified_lately(&self, token: &str) -> bool {
        self.lately(token).is_some()
    }

    fn lately(&self, token: &str) -> Option<(u64, Identity)> {
        if token.len() > MAX_TOKEN_BYTES {
            return None;
        }
        let verified = self.verified.lock().expect("not poisoned");
        verified
            .by_digest
            .get(&Self::digest(token))
            .filter(|(_, who)| !who.remaining().is_zero())
            .cloned()
    }

    fn forget(&self, token: &str) {
        let digest = Self::digest(token);
        let mut verified = self.verified.lock().expect("not poisoned");
        verified.by_digest.remove(&digest);
    }

    fn remember(&self, token: &str, who: &Identity, generation: u64) {
        let mut verified = self.verified.lock().expect("not poisoned");
        if *self.changed.borrow() != generation {
            return;
        }
        if verified.by_digest.len() >= VERIFIED_KEPT {
            verified.by_digest.clear();
        }
        verified
            .by_digest
            .insert(Self::digest(token), (generation, who.clone()));
    }

    /// The full check: the token's key, signature, claims and lifetime.
    fn verify_signed(&self, token: &str, file: Option<&Path>) -> Result<Identity, AuthError> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| AuthError::Invalid(reason(e.kind())))?;
        if let Some(wanted) = &self.config.token_type {
            let typ = header.typ.as_deref().map(media_type);
            if typ.as_deref() != Some(wanted.as_str()) {
                return Err(AuthError::Invalid(format!(
                    "its type (typ) is {}, not {wanted}: only access tokens are accepted",
                    header
                        .typ
                        .as_deref()
                        .map_or("missing".into(), |t| format!("'{}'", t.escape_debug()))
                )));
            }
        }
        let kid = header.kid.as_deref();
        let keys = self.keys.read().expect("not poisoned").clone();
        if !keys.published {
            self.wanted.notify_one();
            return Err(AuthError::NoKeys);
        }
        let unknown = || {
            AuthError::Invalid(match kid {
                Some(kid) => format!("no key '{}' in the key set", kid.escape_debug()),
                None => "it names no key (kid)".into(),
            })
        };
        let keys = match (keys.find(kid), file) {
            (Some(_), _) => keys,
            (None, Some(path)) => self.reread(path, kid).ok_or_else(unknown)?,
            (None, None) => {
                // The fetcher looks (at most every 10 s); the client's retry may pass.
                self.wanted.notify_one();
                return Err(unknown());
            }
        };
        let key = keys.find(kid).expect("found above");
        let mut validation = Validation::new(key.alg);
        validation.leeway = self.config.leeway.as_secs();
        validation.validate_nbf = true;
        validation.set_issuer(&[&self.config.issuer]);
        let mut audiences = self.config.audiences.clone();
        audiences.extend(self.config.admin_audience.iter().cloned());
        validation.set_audience(&audiences);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        let data = jsonwebtoken::decode::<Claims>(token, &key.key, &validation)
            .map_err(|e| AuthError::Refused(reason(e.kind())))?;
        let claims = data.claims;
        let (Some(user), Some(exp)) = (claims.sub.clone(), claims.exp) else {
            return Err(AuthError::Refused(
                "the 'sub' and 'exp' claims are required".into(),
            ));
        };
        check_new_user_id(&user).map_err(|e| AuthError::Refused(format!("sub: {e}")))?;
        self.check_lifetime(claims.iat, exp)?;
        let client = claims.client();
        let listed = |clients: &[String]| {
            clients.is_empty() || client.is_some_and(|c| clients.iter().any(|k| k == c))
        };
        if !listed(&self.config.clients) {
            return Err(AuthError::Refused(format!(
                "its client (azp or client_id) {} is not one this service accepts",
                client.map_or("is missing".into(), |c| format!("'{}'", c.escape_debug()))
            )));
        }
        let admin = claims.has_scope(&self.config.admin_scope)
            && self
                .config
                .admin_audience
                .as_deref()
                .is_none_or(|aud| claims.names_audience(aud))
            && listed(&self.config.admin_clients);
        Ok(Identity {
            admin,
            for_users: self
                .config
                .audiences
                .iter()
                .any(|aud| claims.names_audience(aud)),
            user,
            expires_at: exp,
            refused_from: exp
                .saturating_add(self.config.leeway.as_secs())
                .saturating_add(1),
            key: key.digest,
        })
    }

    /// The audience of this side's session tokens: a session of the other side, or of
    /// another service sharing the key by mistake, is refused.
    fn session_audience(&self) -> String {
        format!("{}#session", self.config.audiences.join(" "))
    }

    /// The session token a page signed in with `who`'s token keeps in its cookie: the same
    /// user and expiry, a user's rights only, bound to the provider's key that signed it.
    pub(crate) fn session_token(&self, who: &Identity) -> String {
        let claims = SessionClaims {
            iss: SESSION_ISSUER.into(),
            aud: self.session_audience(),
            sub: who.user.clone(),
            iat: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
            exp: who.expires_at,
            key: hex(&who.key),
        };
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.config.session_key.signing,
        )
        .expect("signing claims with HS256 does not fail")
    }

    /// The identity a session cookie stands for: signed with the session key, for this
    /// side, not expired, and its provider's key still published. Costs one HMAC: a
    /// stranger's made-up cookie is cheap to refuse.
    pub(crate) fn verify_session(&self, token: &str) -> Result<Identity, AuthError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(AuthError::Invalid(format!(
                "the session cookie is {} bytes, over {MAX_TOKEN_BYTES}",
                token.len()
            )));
        }
        if let KeySource::File(path) = &self.config.jwks {
            self.reread_if_changed(path);
        }
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = self.config.leeway.as_secs();
        validation.set_issuer(&[SESSION_ISSUER]);
        validation.set_audience(&[self.session_audience()]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        let claims = jsonwebtoken::decode::<SessionClaims>(
            token,
            &self.config.session_key.verifying,
            &validation,
        )
        .map_err(|e| AuthError::Refused(format!("session cookie: {}", reason(e.kind()))))?
        .claims;
        let keys = self.keys.read().expect("not poisoned").clone();
        if !keys.published {
            return Err(AuthError::NoKeys);
        }
        let key = unhex(&claims.key).filter(|digest| keys.holds(digest)).ok_or_else(|| {
            AuthError::Refused(
                "the key that signed the token this session began with is no longer published: sign in again".into(),
            )
        })?;
        Ok(Identity {
            user: claims.sub,
            expires_at: claims.exp,
            refused_from: claims
                .exp
                .saturating_add(self.config.leeway.as_secs())
                .saturating_add(1),
            admin: false,
            for_users: true,
            key,
        })
    }

    /// The identity a credential stands for, each checked its own way.
    pub(crate) fn check(&self, credential: Credential<'_>) -> Result<Identity, AuthError> {
        match credential {
            Credential::Bearer(token) => self.verify(token),
            Credential::Session(token) => self.verify_session(token),
        }
    }

    /// Read the key set again for a key it did not have, unless it was read within the last
    /// second; the new set if it has the key.
    fn reread(&self, path: &Path, kid: Option<&str>) -> Option<Arc<Keys>> {
        {
            let mut file = self.file.lock().expect("not poisoned");
            if file.read_at.elapsed() < RELOAD_AT_MOST_EVERY {
                return None;
            }
            file.read_at = Instant::now();
            file.modified = crate::stamp::Stamp::of(path);
        }
        self.read_again(path)
            .filter(|keys| keys.find(kid).is_some())
    }

    /// Read the key set again if its file changed since it was last looked at (looked at
    /// at most once a second: one `stat`).
    fn reread_if_changed(&self, path: &Path) {
        {
            let mut file = self.file.lock().expect("not poisoned");
            if file.looked_at.elapsed() < RELOAD_AT_MOST_EVERY {
                return;
            }
            file.looked_at = Instant::now();
            let now = crate::stamp::Stamp::of(path);
            if now == file.modified {
                return;
            }
            file.modified = now;
            file.read_at = Instant::now();
        }
        self.read_again(path);
    }

    fn read_again(&self, path: &Path) -> Option<Arc<Keys>> {
        let _reload = self.reload.lock().expect("not poisoned");
        match read_keys(path) {
            Ok(keys) => {
                let keys = Arc::new(keys);
                info!(file = %path.display(), keys = keys.count(), "key set read again");
                self.replace_keys(keys.clone());
                Some(keys)
            }
            Err(e) => {
                // Keep the keys we have: a half-written file must not sign everyone out. And
                // look again next time, whatever the file's stamp says then.
                self.file.lock().expect("not poisoned").modified = None;
                warn!(error = %e, "key set could not be read again; keeping the previous keys");
                None
            }
        }
    }
}

impl Verifier {
    /// Replace the key set, and tell open event streams to verify their token again.
    /// Only a set that differs counts as a change: a stranger's unknown key, which makes
    /// the set be read again, must not make every open stream verify its token again.
    fn replace_keys(&self, keys: Arc<Keys>) {
        let mut current = self.keys.write().expect("not poisoned");
        let differs =
            current.fingerprint != keys.fingerprint || current.published != keys.published;
        *current = keys;
        drop(current);
        if differs {
            self.changed.send_modify(|generation| *generation += 1);
        }
    }

    /// Changes of the key set (a generation number).
    pub(crate) fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Usable keys in the set now.
    pub(crate) fn key_count(&self) -> usize {
        self.keys.read().expect("not poisoned").count()
    }

    /// A token valid for longer than `--jwt-max-lifetime` from its issue, or issued in the
    /// future, is refused.
    fn check_lifetime(&self, iat: Option<u64>, exp: u64) -> Result<(), AuthError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let leeway = self.config.leeway.as_secs();
        if iat.is_some_and(|iat| iat > now.saturating_add(leeway)) {
            return Err(AuthError::Refused(
                "it was issued in the future (iat)".into(),
            ));
        }
        let from = iat.unwrap_or(now);
        let lifetime = Duration::from_secs(exp.saturating_sub(from));
        if lifetime > self.config.max_lifetime {
            return Err(AuthError::Refused(format!(
                "it is valid for {} from {}, over the {} allowed (--jwt-max-lifetime)",
                humantime::format_duration(lifetime),
                if iat.is_some() { "its issue" } else { "now" },
                humantime::format_duration(self.config.max_lifetime),
            )));
        }
        Ok(())
    }

    /// With a key file: look at it every second and read it again when it changed, so a
    /// key withdrawn ends the streams it signed even while no request arrives. (With a URL,
    /// [`Verifier::fetch`] keeps the set.)
    pub(crate) async fn watch_file(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let KeySource::File(path) = self.config.jwks.clone() else {
            return;
        };
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(RELOAD_AT_MOST_EVERY) => self.reread_if_changed(&path),
            }
        }
    }
}

/// The least time between two fetches of the key set for unknown keys: a client sending
/// made-up key ids costs the provider one request every 10 s at most.
const FETCH_AT_MOST_EVERY: Duration = Duration::from_secs(10);
/// The largest key set accepted.
const MAX_JWKS_BYTES: usize = 1024 * 1024;

impl Verifier {
    /// With a URL: fetch the key set now, then every `refresh` and when a token names a
    /// key it does not hold (at most every 10 s), until `shutdown`. A fetch that fails keeps
    /// the keys there are and is tried again, sooner while there are none.
    pub(crate) async fn fetch(
        self: Arc<Self>,
        failures: prometheus::IntCounter,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        let KeySource::Url {
            url,
            ca_file,
            refresh,
        } = self.config.jwks.clone()
        else {
            return;
        };
        let tls = match provider_tls(ca_file.as_deref()) {
            Ok(tls) => tls,
            Err(e) => {
                warn!(error = %e, "--jwks-ca-file: cannot verify the identity provider; no token can be verified");
                return;
            }
        };
        // Up to 30 s between failed fetches: every replica of every side asks the provider.
        let mut backoff =
            outbox_core::backoff::Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        loop {
            let next = match fetch_jwks(&url, &tls)
                .await
                .and_then(|text| Keys::parse(Path::new(&url), &text))
            {
                Ok(keys) => {
                    info!(%url, keys = keys.count(), "key set fetched");
                    self.replace_keys(Arc::new(keys));
                    backoff.reset();
                    refresh
                }
                Err(e) => {
                    failures.inc();
                    let pause = backoff.next_delay();
                    warn!(%url, error = %e, "key set not fetched; keeping the keys there are");
                    if self.keys.read().expect("not poisoned").is_empty() {
                        pause
                    } else {
                        pause.max(FETCH_AT_MOST_EVERY)
                    }
                }
            };
            let started = tokio::time::Instant::now();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(next) => {}
                _ = self.wanted.notified() => {
                    // Asked for an unknown key: not sooner than 10 s after the last fetch.
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep_until(started + FETCH_AT_MOST_EVERY.min(next)) => {}
                    }
                }
            }
        }
    }
}

impl Verifier {
    /// Fetch the key set once now (a command that verifies one token); a file's was read
    /// at load.
    pub(crate) async fn fetch_once(&self) -> Result<(), String> {
        let KeySource::Url { url, ca_file, .. } = &self.config.jwks else {
            return Ok(());
        };
        let tls = provider_tls(ca_file.as_deref())?;
        let keys = fetch_jwks(url, &tls)
            .await
            .and_then(|text| Keys::parse(Path::new(url), &text))?;
        self.replace_keys(Arc::new(keys));
        Ok(())
    }
}

/// TLS to the identity provider, verified against `ca_file` (default: the well-known roots).
fn provider_tls(ca_file: Option<&Path>) -> Result<tokio_rustls::TlsConnector, String> {
    outbox_core::connect::client_config(outbox_core::connect::SslMode::VerifyFull, ca_file)
        .map(|config| tokio_rustls::TlsConnector::from(Arc::new(config)))
        .map_err(|e| e.to_string())
}

/// GET an `https://` URL (10 s), its body (at most 1 MiB) if it answers 200.
async fn fetch_jwks(url: &str, tls: &tokio_rustls::TlsConnector) -> Result<String, String> {
    use http_body_util::BodyExt;
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let host = uri
        .host()
        .ok_or_else(|| format!("{url}: no host"))?
        .to_string();
    // Host:port as the URL says it (HTTP/1.1's Host carries a port that is not the default).
    let authority = uri
        .authority()
        .map(|a| a.as_str().to_string())
        .unwrap_or_else(|| host.clone());
    let port = uri.port_u16().unwrap_or(443);
    let path = uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("connect {host}:{port}: {e}"))?;
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| format!("{host}: {e}"))?;
        let stream = tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {host}: {e}"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, authority.as_str())
            .header(hyper::header::ACCEPT, "application/json")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        if response.status() != hyper::StatusCode::OK {
            return Err(format!("{url} answered {}", response.status()));
        }
        let body = http_body_util::Limited::new(response.into_body(), MAX_JWKS_BYTES)
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        String::from_utf8(body.to_vec()).map_err(|_| format!("{url}: not UTF-8"))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| format!("{url}: no answer within 10 s"))?
}

/// Token verification exactly as the services do it, for tools and benchmarks.
pub struct TokenVerifier(Verifier);

impl TokenVerifier {
    /// Read the key set, or say what to change.
    pub fn load(config: TokenConfig) -> Result<Self, ConfigError> {
        Verifier::load(config).map(Self)
    }

    /// The user a token stands for, or why it is refused.
    pub fn verify(&self, token: &str) -> Result<String, String> {
        self.0
            .verify(token)
            .map(|who| who.user)
            .map_err(|e| e.to_string())
    }
}

fn read_keys(path: &Path) -> Result<Keys, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Keys::parse(path, &text)
}

impl Auth {
    /// Who sent these headers: the bearer token, else the session cookie. `Ok(None)` only
    /// with `--allow-anonymous`.
    pub(crate) fn identify(&self, headers: &HeaderMap) -> Result<Option<Identity>, AuthError> {
        let Auth::Tokens(verifier) = self else {
            return Ok(None);
        };
        let credential = match bearer(headers)? {
            Some(token) => Credential::Bearer(token),
            None => session_cookie(headers, verifier.cookie_name())?
                .map(Credential::Session)
                .ok_or(AuthError::Missing)?,
        };
        verifier.check(credential).map(Some)
    }

    /// Who a bearer token says the caller is; a session cookie is not enough (the calls
    /// that manage members come from backends, never from the page).
    pub(crate) fn identify_bearer(
        &self,
        headers: &HeaderMap,
    ) -> Result<Option<Identity>, AuthError> {
        Ok(self.sign_in(headers)?.map(|(who, _)| who))
    }

    /// The session cookie's name.
    pub(crate) fn cookie_name(&self) -> &str {
        match self {
            Auth::Tokens(verifier) => verifier.cookie_name(),
            Auth::Anonymous => SESSION_COOKIE,
        }
    }

    /// The bearer token itself (signing in with it), verified.
    pub(crate) fn sign_in<'h>(
        &self,
        headers: &'h HeaderMap,
    ) -> Result<Option<(Identity, &'h str)>, AuthError> {
        let Auth::Tokens(verifier) = self else {
            return Ok(None);
        };
        let token = bearer(headers)?.ok_or(AuthError::Missing)?;
        Ok(Some((verifier.verify(token)?, token)))
    }

    /// The verifier, unless anonymous.
    pub(crate) fn verifier(&self) -> Option<Arc<Verifier>> {
        match self {
            Auth::Tokens(v) => Some(v.clone()),
            Auth::Anonymous => None,
        }
    }

    /// Whether these headers carry a credential (a bearer token or the session cookie, by
    /// its name) that was not verified lately: a stranger's guess, which the per-address
    /// failure limiter may hold back. One verified lately, under these keys or earlier ones,
    /// is its holder's, and passes.
    /// A session cookie costs one HMAC to refuse: never held back.
    pub(crate) fn carries_unknown_credential(&self, headers: &HeaderMap) -> bool {
        match (self, self.credential(headers)) {
            (Auth::Tokens(verifier), Some(Credential::Bearer(token))) => {
                !verifier.verified_lately(token)
            }
            _ => false,
        }
    }

    /// The credential `identify` reads from these headers: the bearer token, else the
    /// session cookie.
    pub(crate) fn credential<'h>(&self, headers: &'h HeaderMap) -> Option<Credential<'h>> {
        let Auth::Tokens(verifier) = self else {
            return None;
        };
        match bearer(headers) {
            Ok(Some(token)) => Some(Credential::Bearer(token)),
            _ => session_cookie(headers, verifier.cookie_name())
                .ok()
                .flatten()
                .map(Credential::Session),
        }
    }

    /// The session token for a page signing in as `who` (`None` when anonymous).
    pub(crate) fn session_token(&self, who: &Identity) -> Option<String> {
        match self {
            Auth::Tokens(verifier) => Some(verifier.session_token(who)),
            Auth::Anonymous => None,
        }
    }

    /// Whether tokens can be verified now: with `--jwks-url`, once the keys were fetched.
    pub(crate) fn has_keys(&self) -> bool {
        match self {
            Auth::Anonymous => true,
            Auth::Tokens(v) => v.keys.read().expect("not poisoned").published,
        }
    }

    pub(crate) fn is_anonymous(&self) -> bool {
        matches!(self, Auth::Anonymous)
    }

    /// What a token needs to manage members, in words: the scope, and the audience and
    /// clients where configured.
    pub(crate) fn admin_needs(&self) -> String {
        let Auth::Tokens(verifier) = self else {
            return String::new();
        };
        let config = &verifier.config;
        let mut needs = format!("scope '{}'", config.admin_scope);
        if let Some(audience) = &config.admin_audience {
            needs.push_str(&format!(" and audience '{audience}'"));
        }
        // Which clients are the admin ones is not said: no need to tell a caller whom to
        // pose as.
        if !config.admin_clients.is_empty() {
            needs.push_str(", issued to an admin client");
        }
        needs
    }

    /// Session cookies are signed with a key made up at start.
    pub(crate) fn session_key_generated(&self) -> bool {
        match self {
            Auth::Tokens(verifier) => verifier.config.session_key.generated,
            Auth::Anonymous => false,
        }
    }

    /// Admin rights need an admin audience, but any client granted it is trusted (no
    /// `--jwt-admin-clients`): worth a warning, since some providers let any client ask for
    /// any audience.
    pub(crate) fn admin_trusts_any_client(&self) -> bool {
        match self {
            Auth::Tokens(verifier) => {
                verifier.config.admin_audience.is_some() && verifier.config.admin_clients.is_empty()
            }
            Auth::Anonymous => false,
        }
    }
}

/// The token of an `Authorization: Bearer` header, if there is one.
fn bearer(headers: &HeaderMap) -> Result<Option<&str>, AuthError> {
    let Some(value) = headers.get(AUTHORIZATION) else {
        return Ok(None);
    };
    let value = value.to_str().map_err(|_| AuthError::NotBearer)?;
    match value.split_once(' ') {
        Some((scheme, token))
            if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() =>
        {
            Ok(Some(token.trim()))
        }
        _ => Err(AuthError::NotBearer),
    }
}

/// The value of the session cookie `name`, if sent; sent twice, refused (a browser sends
/// a parent domain's cookie of the same name beside this host's, first or second by
/// whichever path is longer: taking either would let a neighbouring site pick the session).
fn session_cookie<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, AuthError> {
    // Split as bytes: one cookie of another name with a non-ASCII value (a neighbour's) must
    // not hide ours. Our own must be ASCII (a session token is).
    let mut values = headers
        .get_all(COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b';'))
        .filter_map(|pair| {
            let pair = pair.trim_ascii();
            let at = pair.iter().position(|b| *b == b'=')?;
            (&pair[..at] == name.as_bytes()).then(|| std::str::from_utf8(&pair[at + 1..]).ok())
        })
        .map(|value| value.filter(|v| v.is_ascii()).unwrap_or(""));
    let first = values.next();
    if values.next().is_some() {
        return Err(AuthError::DuplicateCookie);
    }
    Ok(first.filter(|value| !value.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    #[test]
    fn credentials_come_from_the_header_or_the_cookie() {
        let mut headers = HeaderMap::new();
        assert_eq!(bearer(&headers), Ok(None));
        headers.insert(
            AUTHORIZATION,
            HeaderValue::from_static("Bearer abc.def.ghi"),
        );
        assert_eq!(bearer(&headers), Ok(Some("abc.def.ghi")));
        headers.insert(
            AUTHORIZATION,
            HeaderValue::from_static("Basic dXNlcjpwdw=="),
        );
        assert_eq!(bearer(&headers), Err(AuthError::NotBearer));
        headers.insert(AUTHORIZATION, HeaderValue::from_static("Bearer "));
        assert_eq!(bearer(&headers), Err(AuthError::NotBearer));
        headers.insert(
            COOKIE,
            HeaderValue::from_static("theme=dark; chat_session=t.o.k; other=1"),
        );
        assert_eq!(session_cookie(&headers, SESSION_COOKIE), Ok(Some("t.o.k")));
        assert_eq!(session_cookie(&headers, SECURE_SESSION_COOKIE), Ok(None));
        headers.insert(COOKIE, HeaderValue::from_static("chat_session_x=1"));
        assert_eq!(session_cookie(&headers, SESSION_COOKIE), Ok(None));
        // A second one, in the same header or another (a parent domain's): refused.
        headers.insert(
            COOKIE,
            HeaderValue::from_static("chat_session=mine; chat_session=planted"),
        );
        assert_eq!(
            session_cookie(&headers, SESSION_COOKIE),
            Err(AuthError::DuplicateCookie)
        );
        // Another cookie's non-ASCII value hides nothing.
        headers.insert(
            COOKIE,
            HeaderValue::from_bytes(b"theme=caf\xc3\xa9; chat_session=mine").unwrap(),
        );
        assert_eq!(session_cookie(&headers, SESSION_COOKIE), Ok(Some("mine")));
        headers.insert(COOKIE, HeaderValue::from_static("chat_session=mine"));
        headers.append(COOKIE, HeaderValue::from_static("chat_session=planted"));
        assert_eq!(
            session_cookie(&headers, SESSION_COOKIE),
            Err(AuthError::DuplicateCookie)
        );
    }

    #[test]
    fn a_session_key_is_long_enough_and_never_shown() {
        assert!(SessionKey::from_secret(b"short\n").is_err());
        let key = SessionKey::from_secret(&[b'k'; 40]).unwrap();
        assert!(!key.generated);
        assert!(!format!("{key:?}").contains("kkkk"));
        assert!(SessionKey::generate().generated);
        assert_eq!(unhex(&hex(&[7; 32])), Some([7; 32]));
        assert_eq!(unhex("zz"), None);
    }

    #[test]
    fn scopes_are_read_from_scope_or_scp() {
        let claims = |json: &str| serde_json::from_str::<Claims>(json).unwrap();
        assert!(claims(r#"{"sub":"a","exp":1,"scope":"read chat:admin"}"#).has_scope("chat:admin"));
        assert!(
            !claims(r#"{"sub":"a","exp":1,"scope":"chat:administrator"}"#).has_scope("chat:admin")
        );
        assert!(claims(r#"{"sub":"a","exp":1,"scp":["chat:admin"]}"#).has_scope("chat:admin"));
        assert!(!claims(r#"{"sub":"a","exp":1}"#).has_scope("chat:admin"));
    }

    #[test]
    fn a_key_is_used_only_with_its_own_algorithm() {
        let set = r#"{"keys":[
            {"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"ed"},
            {"kty":"oct","k":"c2VjcmV0","kid":"hmac"},
            {"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"enc","use":"enc"}
        ]}"#;
        let keys = Keys::parse(Path::new("jwks.json"), set).unwrap();
        assert_eq!(
            keys.by_kid.len(),
            1,
            "HMAC and encryption keys are never used"
        );
        assert_eq!(keys.find(Some("ed")).unwrap().alg, Algorithm::EdDSA);
        assert!(keys.find(Some("hmac")).is_none());
        // One key: a token without kid may use it.
        assert!(keys.find(None).is_some());
        // No usable key: an empty published set (every token refused), not the old keys.
        let none = r#"{"keys":[{"kty":"oct","k":"c2VjcmV0"}]}"#;
        let none = Keys::parse(Path::new("jwks.json"), none).unwrap();
        assert!(none.is_empty() && none.published);
        // A key that does not load is skipped; the others still form the set.
        let partly = r#"{"keys":[
            {"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"ed"},
            {"kty":"OKP","crv":"Ed25519","x":"@@ not base64 @@","kid":"broken"}
        ]}"#;
        let partly = Keys::parse(Path::new("jwks.json"), partly).unwrap();
        assert_eq!(partly.count(), 1);
        assert!(partly.find(Some("ed")).is_some());
        // Only a document that does not parse is an error (the previous keys are kept).
        assert!(Keys::parse(Path::new("jwks.json"), "{\"keys\": [").is_err());
    }
}
