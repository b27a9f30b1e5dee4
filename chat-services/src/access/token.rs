//! Tokens as an identity provider issues them, for the local stack, the lab and the tests:
//! a JWT signed with a private key (PEM, PKCS#8: Ed25519, P-256 or RSA) and the JWKS
//! document that publishes its public half. The services only ever verify (`auth`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};

/// Why a key or token could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("the key is not a PKCS#8 PEM private key of Ed25519, P-256 or RSA")]
    Key,
    #[error("signing failed: {0}")]
    Sign(#[from] jsonwebtoken::errors::Error),
}

/// A signing key of the provider.
pub struct SigningKey {
    key: EncodingKey,
    alg: Algorithm,
    kid: String,
}

impl SigningKey {
    /// A PEM private key, published under `kid`; its algorithm follows from its type.
    pub fn from_pem(pem: &[u8], kid: &str) -> Result<Self, TokenError> {
        let (key, alg) = if let Ok(key) = EncodingKey::from_ed_pem(pem) {
            (key, Algorithm::EdDSA)
        } else if let Ok(key) = EncodingKey::from_ec_pem(pem) {
            (key, Algorithm::ES256)
        } else if let Ok(key) = EncodingKey::from_rsa_pem(pem) {
            (key, Algorithm::RS256)
        } else {
            return Err(TokenError::Key);
        };
        Ok(Self {
            key,
            alg,
            kid: kid.to_string(),
        })
    }

    /// The public key as a JWK (with `kid`, `alg` and `use: sig`).
    pub fn jwk(&self) -> Result<Jwk, TokenError> {
        let mut jwk = Jwk::from_encoding_key(&self.key, self.alg)?;
        jwk.common.key_id = Some(self.kid.clone());
        jwk.common.public_key_use = Some(jsonwebtoken::jwk::PublicKeyUse::Signature);
        Ok(jwk)
    }

    /// A token for `claims` (which should hold `sub`, `iss`, `aud`, `exp`).
    pub fn sign(&self, claims: &serde_json::Value) -> Result<String, TokenError> {
        self.sign_typed(claims, ACCESS_TOKEN_TYPE)
    }

    /// `claims` signed with this `typ` header (an ID token's is `JWT`).
    pub fn sign_typed(&self, claims: &serde_json::Value, typ: &str) -> Result<String, TokenError> {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        header.typ = Some(typ.to_string());
        Ok(jsonwebtoken::encode(&header, claims, &self.key)?)
    }

    /// A token for user `sub`, valid for `ttl` from now, with the space-separated `scope`.
    pub fn mint(
        &self,
        issuer: &str,
        audience: &str,
        sub: &str,
        ttl: Duration,
        scope: Option<&str>,
    ) -> Result<String, TokenError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let mut claims = serde_json::json!({
            "iss": issuer,
            "aud": audience,
            "sub": sub,
            "iat": now,
            "exp": now + ttl.as_secs(),
        });
        if let Some(scope) = scope {
            claims["scope"] = scope.into();
        }
        self.sign(&claims)
    }
}

/// The `typ` of the tokens signed here: OAuth access tokens (RFC 9068), what the shipped
/// configurations require (`--jwt-type at+jwt`).
pub const ACCESS_TOKEN_TYPE: &str = "at+jwt";

/// A JWKS document publishing these keys.
pub fn jwks(keys: &[&SigningKey]) -> Result<String, TokenError> {
    let set = JwkSet {
        keys: keys.iter().map(|k| k.jwk()).collect::<Result<_, _>>()?,
    };
    Ok(serde_json::to_string_pretty(&set).expect("a key set serializes"))
}
