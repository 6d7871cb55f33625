//! Who acts: the verified acting person of a data-plane request and the verified approver of
//! an admin-plane resolution (tool-turn contract §C; DESIGN.md §2).
//!
//! - Data plane: `Turnguard-Principal-Token: <JWT>` names the acting person (`sub`). No token:
//!   the principal is the agent itself and nobody can approve that request's held calls. A
//!   token that does not verify fails the request (401 `unauthenticated`): a misconfigured
//!   identity provider is never silently read as "no person".
//! - Admin plane: `Authorization: Bearer <JWT>`, verified the same way. A token carrying a
//!   delegation (`act`, RFC 8693) claim is refused for approvals: an approval is the person's
//!   own act, never a delegate's.
//! - Keys: a JWKS file (RS256, ES256, EdDSA keys), a PEM public key (RSA → RS256, P-256 →
//!   ES256, Ed25519 → EdDSA), or an HS256 shared secret (development). `iss`, `aud`, `exp` and
//!   `sub` are required; `nbf` is checked when present; 60 s of clock leeway.
//! - The agent holds the person's data-plane token, so that token must not approve: a token
//!   seen as `Turnguard-Principal-Token` is refused on the admin plane (403), and
//!   `identity_approval_audience` can require approver tokens to be minted for a different
//!   audience altogether (the robust setup; or give the agent an RFC 8693 delegated token,
//!   whose `act` claim the admin plane refuses).
//! - "The same token" means the same *claims*, not the same bytes: a token is known by its
//!   [`TokenId`], SHA-256 over the RFC 8785 form of its verified claims set. Another signature
//!   of the same claims (ECDSA signs with a fresh nonce; `s` and `n − s` both verify) is the
//!   same token. The fingerprint of every data-plane token is journaled durably (table
//!   `principal_tokens`) before its request goes on, so it stays refused after a restart; the
//!   admin plane checks it in the resolution's own compare-and-set.
//! - ECDSA signatures must be in low-S form (`s ≤ n/2`) on both planes: the high-S twin of a
//!   signature is refused outright (401), so each token has exactly one valid encoding.
//! - Development mode (`identity_dev_principal_header = true`): a plain `Turnguard-Principal`
//!   header is trusted as the verified person on both planes. It is logged loudly at start.
//!
//! Tokens are never logged, journaled or echoed in an error.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use http::HeaderMap;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use crate::config::Config;

/// The data-plane header carrying the acting person's JWT.
pub const PRINCIPAL_TOKEN_HEADER: http::HeaderName =
    http::HeaderName::from_static("turnguard-principal-token");
/// The development-only header naming the acting person in clear.
pub const DEV_PRINCIPAL_HEADER: &str = "turnguard-principal";

/// A verified person.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Person {
    /// The token's `sub`.
    pub sub: String,
    /// The token carries an `act` (delegation) claim.
    pub delegated: bool,
    /// What the token says, as a fingerprint; `None` for the development header.
    pub token: Option<TokenId>,
}

/// A verified token, known by what it says rather than by its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenId {
    /// SHA-256 (hex) of `turnguard/principal-token/v1\n` and the RFC 8785 form of the
    /// verified claims set: two signatures of the same claims have one fingerprint.
    pub fingerprint: String,
    /// The token's `exp`, milliseconds since the Unix epoch (when it stops verifying).
    pub expires_at_ms: i64,
}

/// Why the identity configuration cannot be used (start-up).
#[derive(Debug, thiserror::Error)]
pub enum IdentityConfigError {
    /// A key file could not be read or parsed.
    #[error("identity key file {file}: {reason}")]
    Key { file: PathBuf, reason: String },
    /// Keys are configured without an issuer or audience, or the other way round.
    #[error("identity: {0}")]
    Incomplete(String),
}

/// Why a token was not accepted. The message never contains the token.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TokenError {
    /// No credentials were presented.
    #[error("no credentials: send `Authorization: Bearer <JWT>` of the acting person")]
    Missing,
    /// No identity provider is configured, so no token can be verified.
    #[error("no identity provider is configured (identity_issuer, identity_audience and keys)")]
    NotConfigured,
    /// The token does not verify (signature, issuer, audience, expiry, algorithm, key id).
    #[error("the token does not verify: {0}")]
    Invalid(String),
    /// The token was presented on the data plane, where the agent holds it: it cannot approve.
    #[error("this token was presented by the agent as its Turnguard-Principal-Token; an approval needs the person's own token")]
    HeldByAgent,
}

/// Data-plane token fingerprints cached in memory (the journal holds them all).
const MAX_SEEN: usize = 100_000;

/// Half the order of the P-256 group, big-endian: an ES256 `s` above it is the high-S twin
/// of a valid signature (SEC 2 §2.4.2; the low-S rule of BIP 62 / RFC 6979 practice).
const P256_HALF_N: [u8; 32] = [
    0x7f, 0xff, 0xff, 0xff, 0x80, 0x00, 0x00, 0x00, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xde, 0x73, 0x7d, 0x56, 0xd3, 0x8b, 0xcf, 0x42, 0x79, 0xdc, 0xe5, 0x61, 0x7e, 0x31, 0x92, 0xa8,
];

struct Key {
    kid: Option<String>,
    alg: Algorithm,
    key: DecodingKey,
}

/// The configured identity verifier.
pub struct Identity {
    issuer: String,
    audience: String,
    approval_audience: String,
    keys: Vec<Key>,
    dev_header: bool,
    /// Fingerprints of tokens seen on the data plane (and journaled) → their `exp` (ms): a
    /// cache of the journal's `principal_tokens`.
    seen: Mutex<HashMap<String, i64>>,
}

impl Identity {
    /// Builds the verifier from the configuration; reads the key files.
    ///
    /// Errors: [`IdentityConfigError`] naming the file, or what is missing.
    pub fn load(config: &Config) -> Result<Self, IdentityConfigError> {
        let mut keys = Vec::new();
        if let Some(file) = &config.identity_jwks {
            keys.extend(jwks_keys(file)?);
        }
        if let Some(file) = &config.identity_public_key {
            keys.push(pem_key(file)?);
        }
        if let Some(file) = &config.identity_hs256_secret_file {
            let secret = std::fs::read(file).map_err(|e| IdentityConfigError::Key {
                file: file.clone(),
                reason: e.to_string(),
            })?;
            let secret = trim_ascii(&secret);
            if secret.len() < 32 {
                return Err(IdentityConfigError::Key {
                    file: file.clone(),
                    reason: "an HS256 secret must be at least 32 bytes".into(),
                });
            }
            keys.push(Key {
                kid: None,
                alg: Algorithm::HS256,
                key: DecodingKey::from_secret(secret),
            });
        }
        let issuer = config.identity_issuer.clone().unwrap_or_default();
        let audience = config.identity_audience.clone().unwrap_or_default();
        if !keys.is_empty() && (issuer.is_empty() || audience.is_empty()) {
            return Err(IdentityConfigError::Incomplete(
                "keys are configured, so identity_issuer and identity_audience are required".into(),
            ));
        }
        if keys.is_empty() && (!issuer.is_empty() || !audience.is_empty()) {
            return Err(IdentityConfigError::Incomplete(
                "an issuer or audience is configured without keys (identity_jwks, identity_public_key or identity_hs256_secret_file)".into(),
            ));
        }
        let approval_audience = config
            .identity_approval_audience
            .clone()
            .unwrap_or_else(|| audience.clone());
        Ok(Self {
            issuer,
            audience,
            approval_audience,
            keys,
            dev_header: config.identity_dev_principal_header,
            seen: Mutex::new(HashMap::new()),
        })
    }

    /// An identity that verifies nothing (every request acts as the agent).
    pub fn none() -> Self {
        Self {
            issuer: String::new(),
            audience: String::new(),
            approval_audience: String::new(),
            keys: Vec::new(),
            dev_header: false,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// Whether tokens can be verified.
    pub fn configured(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether the development header is trusted.
    pub fn dev_header(&self) -> bool {
        self.dev_header
    }

    /// The algorithms keys are configured for (for the start-up log).
    pub fn algorithms(&self) -> Vec<String> {
        let mut algs: Vec<String> = self.keys.iter().map(|k| format!("{:?}", k.alg)).collect();
        algs.sort();
        algs.dedup();
        algs
    }

    /// Verifies a data-plane JWT (audience `identity_audience`): signature with a configured
    /// key of the token's algorithm (and `kid`, when both name one), `iss`, `aud`, `exp`,
    /// `nbf`, and a non-empty `sub`.
    pub fn verify(&self, token: &str) -> Result<Person, TokenError> {
        self.verify_for(token, &self.audience)
    }

    fn verify_for(&self, token: &str, audience: &str) -> Result<Person, TokenError> {
        if self.keys.is_empty() {
            return Err(TokenError::NotConfigured);
        }
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| TokenError::Invalid("malformed token header".into()))?;
        if header.alg == Algorithm::ES256 {
            low_s(token)?;
        }
        let candidates: Vec<&Key> = self
            .keys
            .iter()
            .filter(|k| k.alg == header.alg)
            .filter(|k| match (&header.kid, &k.kid) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            })
            .collect();
        if candidates.is_empty() {
            return Err(TokenError::Invalid(format!(
                "no configured key for algorithm {:?}{}",
                header.alg,
                header
                    .kid
                    .as_deref()
                    .map(|k| format!(" and key id `{}`", crate::admission::sanitize_label(k)))
                    .unwrap_or_default()
            )));
        }
        let mut validation = Validation::new(header.alg);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.validate_nbf = true;
        let mut last = String::from("signature");
        for k in candidates {
            match jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, &k.key, &validation)
            {
                Ok(data) => return person_of_claims(&data.claims),
                Err(e) => last = describe(&e),
            }
        }
        Err(TokenError::Invalid(last))
    }

    /// Verifies an OpenID Connect ID token the approval page received from the identity
    /// provider's token endpoint (OpenID Connect Core §3.1.3.7) with the same keys, issuer
    /// and rules as approver tokens: signature, `iss` = `identity_issuer`, `aud` containing
    /// `client_id` (and `azp` = `client_id` when it names several audiences), `exp`, `nbf`,
    /// `sub`, and `nonce` equal to the one the sign-in sent. A delegated (`act`) token is
    /// refused: the page acts as the person.
    ///
    /// Errors: [`TokenError::Invalid`] naming what failed (never the token).
    pub fn verify_id_token(
        &self,
        token: &str,
        client_id: &str,
        nonce: &str,
    ) -> Result<Person, TokenError> {
        let person = self.verify_for(token, client_id)?;
        // The signature verified: the claims are the identity provider's.
        let claims = verified_claims(token)?;
        if claims.get("nonce").and_then(Value::as_str) != Some(nonce) {
            return Err(TokenError::Invalid(
                "the ID token's `nonce` is not the one this sign-in sent".into(),
            ));
        }
        if let Some(Value::Array(auds)) = claims.get("aud") {
            if auds.len() > 1 && claims.get("azp").and_then(Value::as_str) != Some(client_id) {
                return Err(TokenError::Invalid(
                    "the ID token names several audiences and its `azp` is not this client".into(),
                ));
            }
        }
        if person.delegated {
            return Err(TokenError::Invalid(
                "the ID token carries a delegation (`act`) claim".into(),
            ));
        }
        Ok(person)
    }

    /// The acting person of a data-plane request: `Turnguard-Principal-Token` verified, or
    /// (development mode only) the plain `Turnguard-Principal` header. `Ok(None)`: no person,
    /// the agent acts. The caller records the token with [`Identity::remember`] before the
    /// request goes on.
    pub fn person_of(&self, headers: &HeaderMap) -> Result<Option<Person>, TokenError> {
        if let Some(v) = headers.get(PRINCIPAL_TOKEN_HEADER) {
            let token = v
                .to_str()
                .map_err(|_| TokenError::Invalid("the token is not ASCII".into()))?;
            return self.verify_for(token.trim(), &self.audience).map(Some);
        }
        Ok(self.dev_person(headers))
    }

    /// Records a token presented on the data plane (the agent holds it) so it never
    /// approves: durably in the journal (table `principal_tokens`) the first time this
    /// process sees it, then in memory.
    ///
    /// Errors: the journal could not record it; the request must then fail (fail closed: an
    /// unrecorded token could approve after a restart).
    pub async fn remember(
        &self,
        journal: &crate::journal::Journal,
        token: &TokenId,
    ) -> Result<(), crate::journal::JournalError> {
        if self.held_by_agent(token) {
            return Ok(());
        }
        journal
            .remember_token(&token.fingerprint, token.expires_at_ms)
            .await?;
        let Ok(mut seen) = self.seen.lock() else {
            return Ok(());
        };
        if seen.len() >= MAX_SEEN {
            let now = crate::clock::now_ms();
            seen.retain(|_, e| *e > now);
            if seen.len() >= MAX_SEEN {
                // Only a cache: the journal still holds every fingerprint.
                seen.clear();
            }
        }
        seen.insert(token.fingerprint.clone(), token.expires_at_ms);
        Ok(())
    }

    /// Whether this process saw the token on the data plane (the journal is the authority:
    /// [`crate::journal::JournalReader::token_seen`]).
    pub fn held_by_agent(&self, token: &TokenId) -> bool {
        self.seen
            .lock()
            .map(|m| m.contains_key(&token.fingerprint))
            .unwrap_or(true)
    }

    /// The approver of an admin-plane request: `Authorization: Bearer <JWT>` verified, or
    /// (development mode only) the plain `Turnguard-Principal` header.
    pub fn approver_of(&self, headers: &HeaderMap) -> Result<Person, TokenError> {
        if let Some(v) = headers.get(http::header::AUTHORIZATION) {
            let v = v
                .to_str()
                .map_err(|_| TokenError::Invalid("the Authorization header is not ASCII".into()))?;
            let token = v
                .strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
                .ok_or_else(|| {
                    TokenError::Invalid("the Authorization scheme is not Bearer".into())
                })?;
            let person = self.verify_for(token.trim(), &self.approval_audience)?;
            if person.token.as_ref().is_some_and(|t| self.held_by_agent(t)) {
                return Err(TokenError::HeldByAgent);
            }
            return Ok(person);
        }
        self.dev_person(headers).ok_or(TokenError::Missing)
    }

    fn dev_person(&self, headers: &HeaderMap) -> Option<Person> {
        if !self.dev_header {
            return None;
        }
        let sub = headers.get(DEV_PRINCIPAL_HEADER)?.to_str().ok()?.trim();
        (!sub.is_empty() && sub.len() <= 256).then(|| Person {
            sub: sub.to_owned(),
            delegated: false,
            token: None,
        })
    }
}

/// The claims of a token whose signature [`Identity::verify_for`] already verified.
fn verified_claims(token: &str) -> Result<serde_json::Map<String, Value>, TokenError> {
    use base64::Engine;
    let payload = token.split('.').nth(1).unwrap_or_default();
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .map_err(|_| TokenError::Invalid("malformed token payload".into()))?;
    serde_json::from_slice(&bytes)
        .map_err(|_| TokenError::Invalid("malformed token payload".into()))
}

/// The person a verified claims set names, with the token's fingerprint.
fn person_of_claims(claims: &serde_json::Map<String, Value>) -> Result<Person, TokenError> {
    let sub = claims
        .get("sub")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .trim()
        .to_owned();
    if sub.is_empty() || sub.len() > 256 {
        return Err(TokenError::Invalid("`sub` is empty or too long".into()));
    }
    let exp = claims.get("exp").and_then(Value::as_i64).unwrap_or(0);
    let fingerprint = {
        use sha2::{Digest, Sha256};
        let canonical = serde_jcs::to_vec(claims)
            .map_err(|_| TokenError::Invalid("the claims cannot be canonicalized".into()))?;
        let mut h = Sha256::new();
        h.update(b"turnguard/principal-token/v1\n");
        h.update(&canonical);
        hex::encode(h.finalize())
    };
    Ok(Person {
        sub,
        delegated: claims.get("act").is_some_and(|a| !a.is_null()),
        token: Some(TokenId {
            fingerprint,
            expires_at_ms: exp.saturating_mul(1000),
        }),
    })
}

/// Refuses an ES256 signature whose `s` is in the upper half of the group order: `(r, s)`
/// and `(r, n − s)` both verify, so only the low-S form is accepted and each token has one
/// valid encoding (both planes).
fn low_s(token: &str) -> Result<(), TokenError> {
    use base64::Engine;
    let sig = token.rsplit('.').next().unwrap_or_default();
    let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(sig)
        .map_err(|_| TokenError::Invalid("malformed signature".into()))?;
    if sig.len() != 64 {
        return Err(TokenError::Invalid("an ES256 signature is 64 bytes".into()));
    }
    if sig[32..] > P256_HALF_N[..] {
        return Err(TokenError::Invalid(
            "ES256 signature not in low-S form (high-S): `s` and `n − s` both verify, so only s ≤ n/2 is accepted".into(),
        ));
    }
    Ok(())
}

fn describe(e: &jsonwebtoken::errors::Error) -> String {
    use jsonwebtoken::errors::ErrorKind;
    match e.kind() {
        ErrorKind::InvalidSignature => "bad signature".into(),
        ErrorKind::ExpiredSignature => "expired".into(),
        ErrorKind::ImmatureSignature => "not valid yet (nbf)".into(),
        ErrorKind::InvalidIssuer => "wrong issuer".into(),
        ErrorKind::InvalidAudience => "wrong audience".into(),
        ErrorKind::MissingRequiredClaim(c) => format!("missing claim `{c}`"),
        ErrorKind::InvalidAlgorithm => "algorithm not allowed".into(),
        _ => "malformed token".into(),
    }
}

fn trim_ascii(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &b[start..end]
}

fn key_err(file: &Path, reason: impl Into<String>) -> IdentityConfigError {
    IdentityConfigError::Key {
        file: file.to_owned(),
        reason: reason.into(),
    }
}

fn pem_key(file: &Path) -> Result<Key, IdentityConfigError> {
    let pem = std::fs::read(file).map_err(|e| key_err(file, e.to_string()))?;
    if let Ok(key) = DecodingKey::from_rsa_pem(&pem) {
        return Ok(Key {
            kid: None,
            alg: Algorithm::RS256,
            key,
        });
    }
    if let Ok(key) = DecodingKey::from_ec_pem(&pem) {
        return Ok(Key {
            kid: None,
            alg: Algorithm::ES256,
            key,
        });
    }
    if let Ok(key) = DecodingKey::from_ed_pem(&pem) {
        return Ok(Key {
            kid: None,
            alg: Algorithm::EdDSA,
            key,
        });
    }
    Err(key_err(
        file,
        "not a PEM public key of RSA, EC P-256 or Ed25519",
    ))
}

fn jwks_keys(file: &Path) -> Result<Vec<Key>, IdentityConfigError> {
    let text = std::fs::read_to_string(file).map_err(|e| key_err(file, e.to_string()))?;
    let set: JwkSet =
        serde_json::from_str(&text).map_err(|e| key_err(file, format!("not a JWKS: {e}")))?;
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        let alg = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => Algorithm::RS256,
            AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => {
                Algorithm::ES256
            }
            AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
                Algorithm::EdDSA
            }
            _ => {
                return Err(key_err(
                    file,
                    format!("keys[{i}]: only RSA (RS256), EC P-256 (ES256) and Ed25519 (EdDSA) keys are accepted"),
                ))
            }
        };
        if let Some(declared) = jwk.common.key_algorithm {
            let declared = format!("{declared:?}");
            if declared != format!("{alg:?}") {
                return Err(key_err(
                    file,
                    format!("keys[{i}]: `alg` {declared} does not match the key type ({alg:?})"),
                ));
            }
        }
        let key =
            DecodingKey::from_jwk(jwk).map_err(|e| key_err(file, format!("keys[{i}]: {e}")))?;
        keys.push(Key {
            kid: jwk.common.key_id.clone(),
            alg,
            key,
        });
    }
    if keys.is_empty() {
        return Err(key_err(file, "the JWKS has no keys"));
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef-test";

    fn config(dir: &Path) -> Config {
        let secret = dir.join("secret");
        std::fs::write(&secret, SECRET).unwrap();
        Config {
            identity_issuer: Some("https://idp.test".into()),
            identity_audience: Some("turnguard".into()),
            identity_hs256_secret_file: Some(secret),
            ..Config::default()
        }
    }

    fn token(claims: serde_json::Value) -> String {
        encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(SECRET),
        )
        .unwrap()
    }

    fn exp() -> i64 {
        crate::clock::now_ms() / 1000 + 600
    }

    #[test]
    fn verifies_issuer_audience_expiry_and_delegation() {
        let dir = tempfile::tempdir().unwrap();
        let id = Identity::load(&config(dir.path())).unwrap();
        let ok = token(
            json!({"sub": "alice", "iss": "https://idp.test", "aud": "turnguard", "exp": exp()}),
        );
        let person = id.verify(&ok).unwrap();
        assert_eq!((person.sub.as_str(), person.delegated), ("alice", false));
        assert_eq!(
            person.token,
            id.verify(&ok).unwrap().token,
            "one token, one fingerprint"
        );
        let act = token(
            json!({"sub": "alice", "iss": "https://idp.test", "aud": "turnguard", "exp": exp(), "act": {"sub": "agent"}}),
        );
        assert!(id.verify(&act).unwrap().delegated);
        for (claims, why) in [
            (
                json!({"sub": "a", "iss": "https://evil", "aud": "turnguard", "exp": exp()}),
                "wrong issuer",
            ),
            (
                json!({"sub": "a", "iss": "https://idp.test", "aud": "other", "exp": exp()}),
                "wrong audience",
            ),
            (
                json!({"sub": "a", "iss": "https://idp.test", "aud": "turnguard", "exp": 1000}),
                "expired",
            ),
            (
                json!({"iss": "https://idp.test", "aud": "turnguard", "exp": exp()}),
                "missing claim `sub`",
            ),
        ] {
            let err = id.verify(&token(claims)).unwrap_err().to_string();
            assert!(err.contains(why), "{err} / {why}");
        }
        let forged = encode(
            &Header::new(Algorithm::HS256),
            &json!({"sub": "a", "iss": "https://idp.test", "aud": "turnguard", "exp": exp()}),
            &EncodingKey::from_secret(b"another secret of at least thirty-two bytes"),
        )
        .unwrap();
        assert!(id
            .verify(&forged)
            .unwrap_err()
            .to_string()
            .contains("bad signature"));
        assert!(id.verify("not.a.jwt").is_err());
    }

    #[test]
    fn pem_and_jwks_keys_verify_eddsa_and_refuse_algorithm_confusion() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/identity");
        let private = std::fs::read(fixtures.join("ed25519-private.pem")).unwrap();
        let signed = encode(
            &Header::new(Algorithm::EdDSA),
            &json!({"sub": "bob", "iss": "https://idp.test", "aud": "turnguard", "exp": exp()}),
            &EncodingKey::from_ed_pem(&private).unwrap(),
        )
        .unwrap();
        for c in [
            Config {
                identity_issuer: Some("https://idp.test".into()),
                identity_audience: Some("turnguard".into()),
                identity_public_key: Some(fixtures.join("ed25519-public.pem")),
                ..Config::default()
            },
            Config {
                identity_issuer: Some("https://idp.test".into()),
                identity_audience: Some("turnguard".into()),
                identity_jwks: Some(fixtures.join("jwks.json")),
                ..Config::default()
            },
        ] {
            let id = Identity::load(&c).unwrap();
            assert_eq!(id.verify(&signed).unwrap().sub, "bob");
            // An HS256 token must not verify against an asymmetric key's bytes.
            let hs = token(
                json!({"sub": "bob", "iss": "https://idp.test", "aud": "turnguard", "exp": exp()}),
            );
            assert!(id.verify(&hs).is_err());
        }
    }

    #[test]
    fn headers_on_both_planes() {
        let dir = tempfile::tempdir().unwrap();
        let id = Identity::load(&config(dir.path())).unwrap();
        let mut h = HeaderMap::new();
        assert_eq!(id.person_of(&h).unwrap(), None, "no token: the agent acts");
        assert!(matches!(id.approver_of(&h), Err(TokenError::Missing)));
        h.insert(DEV_PRINCIPAL_HEADER, "mallory".parse().unwrap());
        assert_eq!(
            id.person_of(&h).unwrap(),
            None,
            "the plain header is ignored outside dev mode"
        );
        let t = token(
            json!({"sub": "alice", "iss": "https://idp.test", "aud": "turnguard", "exp": exp()}),
        );
        h.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {t}").parse().unwrap(),
        );
        h.insert(PRINCIPAL_TOKEN_HEADER, t.parse().unwrap());
        assert_eq!(id.approver_of(&h).unwrap().sub, "alice");
        let seen = id.person_of(&h).unwrap().unwrap();
        assert_eq!(seen.sub, "alice");
        let (journal, writer) = crate::journal::Journal::open_sqlite(
            &dir.path().join("journal.db"),
            std::sync::Arc::new(crate::metrics::Metrics::new()),
        )
        .unwrap();
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(id.remember(&journal, seen.token.as_ref().unwrap()))
            .unwrap();
        drop(journal);
        writer.join();
        let mut admin = HeaderMap::new();
        admin.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {t}").parse().unwrap(),
        );
        assert!(
            matches!(id.approver_of(&admin), Err(TokenError::HeldByAgent)),
            "the token the agent presented cannot approve"
        );
        h.insert(PRINCIPAL_TOKEN_HEADER, "garbage".parse().unwrap());
        assert!(
            id.person_of(&h).is_err(),
            "a bad token fails, never reads as no person"
        );
        let mut dev = config(dir.path());
        dev.identity_dev_principal_header = true;
        let id = Identity::load(&dev).unwrap();
        let mut h = HeaderMap::new();
        h.insert(DEV_PRINCIPAL_HEADER, "dora".parse().unwrap());
        assert_eq!(id.person_of(&h).unwrap().unwrap().sub, "dora");
        assert_eq!(id.approver_of(&h).unwrap().sub, "dora");
    }

    #[test]
    fn incomplete_configuration_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path());
        c.identity_issuer = None;
        assert!(Identity::load(&c).is_err());
        let c = Config {
            identity_issuer: Some("x".into()),
            ..Config::default()
        };
        assert!(Identity::load(&c).is_err());
        assert!(!Identity::load(&Config::default()).unwrap().configured());
    }
}
