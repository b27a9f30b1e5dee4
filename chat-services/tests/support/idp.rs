//! The team's identity provider for tests: signing keys, the JWKS file the services read,
//! tokens for any user, key rotation and withdrawal.

use std::time::Duration;

/// The team's identity provider, as the services see it: a signing key (P-256, from
/// rcgen), the JWKS file the services verify with, and tokens for any user.
pub(crate) struct Idp {
    keys: Vec<chat_services::token::SigningKey>,
    minted: usize,
    pub(crate) jwks: std::path::PathBuf,
}

pub(crate) const ISSUER: &str = "https://id.test.invalid/";
pub(crate) const AUDIENCE: &str = "chat";

impl Idp {
    pub(crate) fn new() -> Self {
        let jwks = testkit::scratch_dir("idp").join("jwks.json");
        let mut idp = Self {
            keys: Vec::new(),
            minted: 0,
            jwks,
        };
        idp.rotate();
        idp
    }

    /// A new signing key (the newest signs from now on), published beside the old ones.
    pub(crate) fn rotate(&mut self) {
        let pem = rcgen::KeyPair::generate().unwrap().serialize_pem();
        self.minted += 1;
        let kid = format!("key-{}", self.minted);
        self.keys
            .push(chat_services::token::SigningKey::from_pem(pem.as_bytes(), &kid).unwrap());
        self.publish();
    }

    /// Stop publishing the oldest key (as after a compromise), written over the file in
    /// place (as an editor or `kubectl cp` would), not renamed.
    pub(crate) fn withdraw_oldest(&mut self) {
        self.keys.remove(0);
        let keys: Vec<_> = self.keys.iter().collect();
        std::fs::write(&self.jwks, chat_services::token::jwks(&keys).unwrap()).unwrap();
    }

    fn publish(&self) {
        let keys: Vec<_> = self.keys.iter().collect();
        // Written whole, then renamed, as a provider's sync job would.
        let tmp = self.jwks.with_extension("tmp");
        std::fs::write(&tmp, chat_services::token::jwks(&keys).unwrap()).unwrap();
        std::fs::rename(&tmp, &self.jwks).unwrap();
    }

    fn newest(&self) -> &chat_services::token::SigningKey {
        self.keys.last().unwrap()
    }

    /// A token for `user`, valid for an hour.
    pub(crate) fn token(&self, user: &str) -> String {
        self.token_for(user, Duration::from_secs(3600), None)
    }

    pub(crate) fn token_for(&self, user: &str, ttl: Duration, scope: Option<&str>) -> String {
        self.newest()
            .mint(ISSUER, AUDIENCE, user, ttl, scope)
            .unwrap()
    }

    /// A token that may manage members.
    pub(crate) fn admin(&self) -> String {
        self.token_for("admin", Duration::from_secs(3600), Some("chat:admin"))
    }

    /// Token claims signed as given (for expired, foreign and malformed tokens).
    pub(crate) fn sign(&self, claims: serde_json::Value) -> String {
        self.newest().sign(&claims).unwrap()
    }

    /// Token claims signed with this `typ` header (`JWT`: an ID token's).
    pub(crate) fn sign_typed(&self, claims: serde_json::Value, typ: &str) -> String {
        self.newest().sign_typed(&claims, typ).unwrap()
    }

    /// The service flags that verify this provider's tokens.
    pub(crate) fn flags(&self) -> Vec<String> {
        vec![
            "--jwks-file".into(),
            self.jwks.display().to_string(),
            "--jwt-issuer".into(),
            ISSUER.into(),
            "--jwt-audience".into(),
            AUDIENCE.into(),
            "--jwt-leeway".into(),
            "0s".into(),
            // Tests poll history and open streams on a condition (every 50 ms) far faster
            // than a person: budgets they do not test are generous (the tests of budgets
            // give their own).
            "--history-rate".into(),
            "100".into(),
            "--history-burst".into(),
            "1000".into(),
            "--stream-open-rate".into(),
            "100".into(),
            "--stream-open-burst".into(),
            "1000".into(),
            "--sign-in-rate".into(),
            "100".into(),
            "--sign-in-burst".into(),
            "1000".into(),
        ]
    }
}
