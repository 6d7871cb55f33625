//! Sessions of the approval page: opaque random cookies, each bound to a verified person and
//! a synchronizer CSRF token; and the sign-ins in progress (OAuth `state`, PKCE verifier,
//! `nonce`, bound to the browser that started them by a login cookie).
//!
//! Kept in memory (a restart signs everyone out), bounded, keyed by the SHA-256 of the cookie
//! value (the map never holds a usable cookie). Tokens are 256-bit random values from the
//! operating system's CSPRNG (`oauth2::CsrfToken::new_random_len`), base64url.

use std::collections::HashMap;
use std::sync::Mutex;

use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::clock::now_ms;
use crate::identity::Person;

/// Most sessions kept at once (expired ones are dropped first).
const MAX_SESSIONS: usize = 10_000;
/// Most sign-ins in progress at once.
const MAX_LOGINS: usize = 1_000;
/// How long a sign-in may take, milliseconds.
pub const LOGIN_TTL_MS: i64 = 10 * 60 * 1000;
/// Longest session, milliseconds (shorter when the ID token expires sooner).
pub const MAX_SESSION_MS: i64 = 12 * 60 * 60 * 1000;

/// A random 256-bit token, base64url.
pub fn random_token() -> String {
    oauth2::CsrfToken::new_random_len(32).secret().clone()
}

fn digest(v: &str) -> [u8; 32] {
    Sha256::digest(v.as_bytes()).into()
}

/// Compares two secrets by their SHA-256 digests, so the time taken says nothing useful
/// about the expected value.
pub fn same_secret(a: &str, b: &str) -> bool {
    digest(a) == digest(b)
}

/// A signed-in person.
#[derive(Debug, Clone)]
pub struct UiSession {
    /// The person the ID token named (with that token's claims fingerprint: a token the
    /// agent presented never resolves, checked in the resolution's compare-and-set).
    pub person: Person,
    /// The synchronizer CSRF token of this session.
    pub csrf: String,
    /// When the session ends, milliseconds since the Unix epoch.
    pub expires_at_ms: i64,
    /// A one-time message for the next page (what the last action did).
    pub flash: Option<String>,
}

/// A sign-in in progress.
#[derive(Debug, Clone)]
pub struct PendingLogin {
    /// The PKCE code verifier (RFC 7636).
    pub pkce_verifier: String,
    /// The OpenID Connect `nonce` sent in the authorization request.
    pub nonce: String,
    /// SHA-256 of the login cookie of the browser that started it.
    binding: [u8; 32],
    created_ms: i64,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<[u8; 32], UiSession>,
    logins: HashMap<[u8; 32], PendingLogin>,
}

/// The session and sign-in stores.
#[derive(Default)]
pub struct Sessions {
    inner: Mutex<Inner>,
}

/// Why a sign-in cannot be completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginError {
    /// Unknown or used `state`.
    UnknownState,
    /// The browser finishing the sign-in is not the one that started it.
    OtherBrowser,
    /// The sign-in took too long.
    Expired,
    /// Too many sessions or sign-ins at once.
    Full,
}

impl Sessions {
    /// Starts a sign-in: returns `(state, login cookie value)`.
    pub fn begin_login(
        &self,
        pkce_verifier: String,
        nonce: String,
        state: &str,
    ) -> Result<String, LoginError> {
        let cookie = random_token();
        let now = now_ms();
        let mut inner = self.inner.lock().map_err(|_| LoginError::Full)?;
        if inner.logins.len() >= MAX_LOGINS {
            inner
                .logins
                .retain(|_, l| now - l.created_ms < LOGIN_TTL_MS);
            if inner.logins.len() >= MAX_LOGINS {
                return Err(LoginError::Full);
            }
        }
        inner.logins.insert(
            digest(state),
            PendingLogin {
                pkce_verifier,
                nonce,
                binding: digest(&cookie),
                created_ms: now,
            },
        );
        Ok(cookie)
    }

    /// Takes the sign-in `state` names (once), if the browser's login cookie is the one
    /// that started it and it is not older than [`LOGIN_TTL_MS`].
    pub fn finish_login(
        &self,
        state: &str,
        cookie: Option<&str>,
    ) -> Result<PendingLogin, LoginError> {
        let mut inner = self.inner.lock().map_err(|_| LoginError::Full)?;
        let login = inner
            .logins
            .remove(&digest(state))
            .ok_or(LoginError::UnknownState)?;
        if cookie.map(digest) != Some(login.binding) {
            return Err(LoginError::OtherBrowser);
        }
        if now_ms() - login.created_ms >= LOGIN_TTL_MS {
            return Err(LoginError::Expired);
        }
        Ok(login)
    }

    /// Opens a session for `person` until `expires_at_ms`; returns the cookie value.
    pub fn open(&self, person: Person, expires_at_ms: i64) -> Result<String, LoginError> {
        let cookie = random_token();
        let now = now_ms();
        let mut inner = self.inner.lock().map_err(|_| LoginError::Full)?;
        if inner.sessions.len() >= MAX_SESSIONS {
            inner.sessions.retain(|_, s| s.expires_at_ms > now);
            if inner.sessions.len() >= MAX_SESSIONS {
                return Err(LoginError::Full);
            }
        }
        inner.sessions.insert(
            digest(&cookie),
            UiSession {
                person,
                csrf: random_token(),
                expires_at_ms: expires_at_ms.min(now + MAX_SESSION_MS),
                flash: None,
            },
        );
        Ok(cookie)
    }

    /// The live session of a cookie value (its flash message left in place).
    pub fn get(&self, cookie: &str) -> Option<UiSession> {
        self.session(cookie, false)
    }

    /// The live session of a cookie value, taking its flash message (the list page).
    pub fn take(&self, cookie: &str) -> Option<UiSession> {
        self.session(cookie, true)
    }

    fn session(&self, cookie: &str, take_flash: bool) -> Option<UiSession> {
        let mut inner = self.inner.lock().ok()?;
        let key = digest(cookie);
        let s = inner.sessions.get_mut(&key)?;
        if s.expires_at_ms <= now_ms() {
            inner.sessions.remove(&key);
            return None;
        }
        let out = s.clone();
        if take_flash {
            s.flash = None;
        }
        Some(out)
    }

    /// Sets the flash message of a session.
    pub fn flash(&self, cookie: &str, message: String) {
        if let Ok(mut inner) = self.inner.lock() {
            if let Some(s) = inner.sessions.get_mut(&digest(cookie)) {
                s.flash = Some(message);
            }
        }
    }

    /// Ends a session.
    pub fn close(&self, cookie: &str) {
        if let Ok(mut inner) = self.inner.lock() {
            inner.sessions.remove(&digest(cookie));
        }
    }
}

/// The session cookie's name: `__Host-` prefixed when it is `Secure` (RFC 6265bis §4.1.3.2).
pub fn session_cookie(secure: bool) -> &'static str {
    if secure {
        "__Host-turnguard_approvals"
    } else {
        "turnguard_approvals"
    }
}

/// The login-binding cookie's name.
pub fn login_cookie(secure: bool) -> &'static str {
    if secure {
        "__Host-turnguard_login"
    } else {
        "turnguard_login"
    }
}

/// The value of cookie `name` in the request's `Cookie` headers.
pub fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(cookie::Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == name)
        .map(|c| c.value().to_owned())
}

/// A `Set-Cookie` value: `HttpOnly`, `Path=/`, `SameSite` as given, `Secure` when asked,
/// `Max-Age` in seconds (0 deletes).
pub fn set_cookie(
    name: &'static str,
    value: String,
    same_site: cookie::SameSite,
    secure: bool,
    max_age_s: i64,
) -> String {
    cookie::Cookie::build((name, value))
        .http_only(true)
        .secure(secure)
        .same_site(same_site)
        .path("/")
        .max_age(cookie::time::Duration::seconds(max_age_s))
        .build()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alice() -> Person {
        Person {
            sub: "alice".into(),
            delegated: false,
            token: None,
        }
    }

    #[test]
    fn a_login_finishes_once_and_only_in_the_browser_that_started_it() {
        let s = Sessions::default();
        let cookie = s.begin_login("v".into(), "n".into(), "state-1").unwrap();
        assert_eq!(
            s.finish_login("state-1", Some("another browser"))
                .unwrap_err(),
            LoginError::OtherBrowser
        );
        assert_eq!(
            s.finish_login("state-1", Some(&cookie)).unwrap_err(),
            LoginError::UnknownState,
            "a failed finish used the state up"
        );
        let cookie = s.begin_login("v".into(), "n".into(), "state-2").unwrap();
        assert_eq!(s.finish_login("state-2", Some(&cookie)).unwrap().nonce, "n");
        assert!(
            s.finish_login("state-2", Some(&cookie)).is_err(),
            "single use"
        );
    }

    #[test]
    fn sessions_expire_and_close() {
        let s = Sessions::default();
        let c = s.open(alice(), now_ms() + 60_000).unwrap();
        let got = s.get(&c).unwrap();
        assert_eq!(got.person.sub, "alice");
        assert_eq!(got.csrf.len(), 43, "256 bits, base64url");
        s.flash(&c, "done".into());
        assert_eq!(s.get(&c).unwrap().flash.as_deref(), Some("done"));
        assert_eq!(s.take(&c).unwrap().flash.as_deref(), Some("done"));
        assert_eq!(s.take(&c).unwrap().flash, None, "a flash shows once");
        s.close(&c);
        assert!(s.get(&c).is_none());
        let old = s.open(alice(), now_ms() - 1).unwrap();
        assert!(s.get(&old).is_none(), "expired");
        assert!(s.get("forged").is_none());
    }

    #[test]
    fn cookies_are_http_only_strict_and_secure_when_asked() {
        let c = set_cookie(
            session_cookie(true),
            "v".into(),
            cookie::SameSite::Strict,
            true,
            60,
        );
        for part in [
            "__Host-turnguard_approvals=v",
            "HttpOnly",
            "SameSite=Strict",
            "Secure",
            "Path=/",
            "Max-Age=60",
        ] {
            assert!(c.contains(part), "{c} lacks {part}");
        }
        let c = set_cookie(
            session_cookie(false),
            "v".into(),
            cookie::SameSite::Strict,
            false,
            60,
        );
        assert!(!c.contains("Secure") && c.contains("HttpOnly"), "{c}");
        let mut h = HeaderMap::new();
        h.insert(
            http::header::COOKIE,
            "a=1; turnguard_approvals=xyz".parse().unwrap(),
        );
        assert_eq!(
            cookie_value(&h, "turnguard_approvals").as_deref(),
            Some("xyz")
        );
        assert_eq!(cookie_value(&h, "b"), None);
    }
}
