//! Sign-in to the approval page: OpenID Connect authorization code flow with PKCE (OpenID
//! Connect Core §3.1, RFC 7636 S256) against `identity_issuer`'s discovery document (OpenID
//! Connect Discovery §4).
//!
//! The `oauth2` crate builds the authorization request (PKCE challenge, `state`) and runs
//! the token request; the ID token it returns is verified by turnguard's own
//! [`crate::identity::Identity::verify_id_token`] — the same keys, issuer, algorithm and
//! low-S rules as approver tokens on the admin plane, plus `aud` = the client id and the
//! `nonce` of this sign-in. (The `openidconnect` crate was not used: it verifies ID tokens
//! with keys fetched from the provider's `jwks_uri` at run time under its own rules, which
//! would give the page a second, different verifier of the same person.)
//!
//! The `state` is bound to the browser that started the sign-in by a `SameSite=Lax` login
//! cookie (the provider's redirect back is a cross-site navigation), single-use, and expires
//! after ten minutes. The callback only signs in: it resolves nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Extension, Query, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use http_body_util::Full;
use oauth2::basic::{
    BasicErrorResponse, BasicRevocationErrorResponse, BasicTokenIntrospectionResponse,
    BasicTokenType,
};
use oauth2::{
    AuthUrl, AuthorizationCode, ClientId, ClientSecret, CsrfToken, EndpointNotSet, EndpointSet,
    ExtraTokenFields, PkceCodeChallenge, PkceCodeVerifier, RedirectUrl, Scope,
    StandardRevocableToken, StandardTokenResponse, TokenUrl,
};
use serde::{Deserialize, Serialize};

use super::session::{self, LoginError};
use super::{page, UiSettings};
use crate::body::read_capped;
use crate::state::AppState;

/// Largest discovery document or token response read, bytes.
const MAX_IDP_BODY: usize = 256 << 10;
/// How long a fetched discovery document is used, seconds.
const DISCOVERY_TTL: Duration = Duration::from_secs(3600);
/// Timeout of one request to the identity provider.
const IDP_TIMEOUT: Duration = Duration::from_secs(10);

/// The endpoints of the discovery document turnguard uses.
#[derive(Debug, Clone, Deserialize)]
struct Discovery {
    issuer: String,
    authorization_endpoint: String,
    token_endpoint: String,
    #[serde(default)]
    code_challenge_methods_supported: Option<Vec<String>>,
}

/// The discovery document, fetched on first use and cached for an hour (a failed fetch is
/// not cached).
#[derive(Default)]
pub struct ProviderCache {
    cached: tokio::sync::Mutex<Option<(Instant, Discovery)>>,
}

/// The `id_token` of an OpenID Connect token response (OpenID Connect Core §3.1.3.3).
#[derive(Debug, Clone, Deserialize, Serialize)]
struct IdTokenFields {
    id_token: String,
}

impl ExtraTokenFields for IdTokenFields {}

type OidcClient = oauth2::Client<
    BasicErrorResponse,
    StandardTokenResponse<IdTokenFields, BasicTokenType>,
    BasicTokenIntrospectionResponse,
    StandardRevocableToken,
    BasicRevocationErrorResponse,
    EndpointSet,
    EndpointNotSet,
    EndpointNotSet,
    EndpointNotSet,
    EndpointSet,
>;

/// An HTTP exchange with the identity provider failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct IdpError(String);

/// One request to the identity provider over the shared client (no redirects are followed).
async fn exchange(
    state: &AppState,
    req: http::Request<Vec<u8>>,
) -> Result<http::Response<Vec<u8>>, IdpError> {
    let (parts, body) = req.into_parts();
    let req = http::Request::from_parts(parts, Full::new(Bytes::from(body)));
    let resp = tokio::time::timeout(IDP_TIMEOUT, state.client.request(req))
        .await
        .map_err(|_| IdpError("the identity provider did not answer in time".into()))?
        .map_err(|e| IdpError(format!("the identity provider could not be reached: {e}")))?;
    let (parts, body) = resp.into_parts();
    let body = read_capped(body, MAX_IDP_BODY)
        .await
        .map_err(|e| IdpError(format!("the identity provider's answer: {e}")))?;
    Ok(http::Response::from_parts(parts, body.to_vec()))
}

/// An endpoint must be https, or http on a loopback host.
fn endpoint_ok(url: &str) -> bool {
    match url.parse::<http::Uri>() {
        Ok(u) => match u.scheme_str() {
            Some("https") => true,
            Some("http") => super::is_loopback(u.host().unwrap_or_default()),
            _ => false,
        },
        Err(_) => false,
    }
}

impl ProviderCache {
    async fn get(&self, state: &AppState, settings: &UiSettings) -> Result<Discovery, String> {
        let mut cached = self.cached.lock().await;
        if let Some((at, d)) = cached.as_ref() {
            if at.elapsed() < DISCOVERY_TTL {
                return Ok(d.clone());
            }
        }
        let url = format!(
            "{}/.well-known/openid-configuration",
            settings.issuer.trim_end_matches('/')
        );
        let req = http::Request::get(&url)
            .header(header::ACCEPT, "application/json")
            .body(Vec::new())
            .map_err(|e| format!("discovery URL `{url}`: {e}"))?;
        let resp = exchange(state, req).await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("the discovery document answered {}", resp.status()));
        }
        let d: Discovery = serde_json::from_slice(resp.body())
            .map_err(|e| format!("the discovery document is not valid: {e}"))?;
        if d.issuer != settings.issuer {
            return Err(format!(
                "the discovery document names the issuer `{}`, not identity_issuer (OpenID Connect Discovery §4.3)",
                crate::admission::sanitize_label(&d.issuer)
            ));
        }
        if !endpoint_ok(&d.authorization_endpoint) || !endpoint_ok(&d.token_endpoint) {
            return Err(
                "the provider's endpoints must be https (http only on a loopback host)".into(),
            );
        }
        if let Some(m) = &d.code_challenge_methods_supported {
            if !m.iter().any(|x| x == "S256") {
                return Err("the provider does not support PKCE S256".into());
            }
        }
        *cached = Some((Instant::now(), d.clone()));
        Ok(d)
    }
}

fn client(settings: &UiSettings, d: &Discovery) -> Result<OidcClient, String> {
    let mut c = oauth2::Client::new(ClientId::new(settings.client_id.clone()))
        .set_auth_uri(AuthUrl::new(d.authorization_endpoint.clone()).map_err(|e| e.to_string())?)
        .set_token_uri(TokenUrl::new(d.token_endpoint.clone()).map_err(|e| e.to_string())?)
        .set_redirect_uri(
            RedirectUrl::new(settings.redirect_uri.clone()).map_err(|e| e.to_string())?,
        );
    if let Some(secret) = &settings.client_secret {
        c = c.set_client_secret(ClientSecret::new(secret.clone()));
    }
    Ok(c)
}

fn unavailable(why: &str) -> Response {
    tracing::warn!(reason = %why, "approval page sign-in unavailable");
    page::message(
        StatusCode::SERVICE_UNAVAILABLE,
        "Sign-in is unavailable",
        &format!("The identity provider cannot be used right now: {why}"),
    )
}

/// `GET /ui/login`: starts a sign-in and redirects (303) to the provider's authorization
/// endpoint with `response_type=code`, `scope=openid`, `state`, `nonce` and the PKCE S256
/// challenge; sets the login-binding cookie.
pub async fn login(
    State(s): State<Arc<AppState>>,
    Extension(ui): Extension<Arc<super::ApprovalUi>>,
) -> Response {
    let Some(settings) = &ui.settings else {
        return page::not_found();
    };
    let d = match ui.provider.get(&s, settings).await {
        Ok(d) => d,
        Err(e) => return unavailable(&e),
    };
    let c = match client(settings, &d) {
        Ok(c) => c,
        Err(e) => return unavailable(&e),
    };
    let (challenge, verifier) = PkceCodeChallenge::new_random_sha256();
    let nonce = session::random_token();
    let (url, csrf) = c
        .authorize_url(CsrfToken::new_random)
        .add_scope(Scope::new("openid".into()))
        .add_extra_param("nonce", nonce.clone())
        .set_pkce_challenge(challenge)
        .url();
    let binding = match ui
        .sessions
        .begin_login(verifier.secret().clone(), nonce, csrf.secret())
    {
        Ok(b) => b,
        Err(_) => return unavailable("too many sign-ins at once"),
    };
    let mut resp = StatusCode::SEE_OTHER.into_response();
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(url.as_str()) {
        h.insert(header::LOCATION, v);
    }
    let cookie = session::set_cookie(
        session::login_cookie(settings.secure),
        binding,
        cookie::SameSite::Lax,
        settings.secure,
        session::LOGIN_TTL_MS / 1000,
    );
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        h.insert(header::SET_COOKIE, v);
    }
    page::secure_headers(h);
    resp
}

/// The provider's redirect back (RFC 6749 §4.1.2).
#[derive(Debug, Deserialize)]
pub struct CallbackQuery {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
}

/// `GET /ui/callback?code&state`: finishes the sign-in — the `state` of this browser's
/// sign-in, the code exchanged with the PKCE verifier, the ID token verified — opens the
/// session and sends the browser on to `/ui/approvals` from a page of this origin (so the
/// `SameSite=Strict` session cookie goes with it).
pub async fn callback(
    State(s): State<Arc<AppState>>,
    Extension(ui): Extension<Arc<super::ApprovalUi>>,
    Query(q): Query<CallbackQuery>,
    req: http::Request<Body>,
) -> Response {
    let Some(settings) = &ui.settings else {
        return page::not_found();
    };
    let refused = |why: &str| {
        tracing::warn!(reason = %why, "approval page sign-in refused");
        page::message(
            StatusCode::UNAUTHORIZED,
            "Sign-in failed",
            &format!("{why} Start again from the approval page."),
        )
    };
    if let Some(e) = &q.error {
        return refused(&format!(
            "The identity provider answered `{}`.",
            crate::admission::sanitize_label(e)
        ));
    }
    let (Some(code), Some(state_param)) = (&q.code, &q.state) else {
        return refused("The identity provider's answer has no code or state.");
    };
    let binding = session::cookie_value(req.headers(), session::login_cookie(settings.secure));
    let login = match ui.sessions.finish_login(state_param, binding.as_deref()) {
        Ok(l) => l,
        Err(LoginError::OtherBrowser) => {
            return refused("This sign-in was started in another browser.")
        }
        Err(LoginError::Expired) => return refused("The sign-in took too long."),
        Err(LoginError::UnknownState | LoginError::Full) => {
            return refused("This sign-in is unknown or was used already.")
        }
    };
    let d = match ui.provider.get(&s, settings).await {
        Ok(d) => d,
        Err(e) => return unavailable(&e),
    };
    let c = match client(settings, &d) {
        Ok(c) => c,
        Err(e) => return unavailable(&e),
    };
    let http = |r: http::Request<Vec<u8>>| {
        let s = Arc::clone(&s);
        async move { exchange(&s, r).await }
    };
    let token = match c
        .exchange_code(AuthorizationCode::new(code.clone()))
        .set_pkce_verifier(PkceCodeVerifier::new(login.pkce_verifier.clone()))
        .request_async(&http)
        .await
    {
        Ok(t) => t,
        Err(e) => {
            return refused(&format!(
                "The identity provider did not issue tokens for this sign-in ({}).",
                describe_token_error(&e)
            ))
        }
    };
    let id_token = &token.extra_fields().id_token;
    let person = match s
        .identity
        .verify_id_token(id_token, &settings.client_id, &login.nonce)
    {
        Ok(p) => p,
        Err(e) => return refused(&format!("The ID token was not accepted: {e}.")),
    };
    // A token the agent presented on the data plane never approves, not even as an ID token.
    if let Some(t) = &person.token {
        let seen = s.reader.token_seen(&t.fingerprint).await;
        if s.identity.held_by_agent(t) || !matches!(seen, Ok(false)) {
            return refused("This token was presented by the agent; it cannot sign in to approve.");
        }
    }
    let expires = person
        .token
        .as_ref()
        .map_or(crate::clock::now_ms() + session::MAX_SESSION_MS, |t| {
            t.expires_at_ms
        });
    let sub = person.sub.clone();
    let cookie = match ui.sessions.open(person, expires) {
        Ok(c) => c,
        Err(_) => return unavailable("too many sessions at once"),
    };
    tracing::info!(sub = %sub, "approval page: signed in");
    let max_age =
        ((expires - crate::clock::now_ms()) / 1000).clamp(0, session::MAX_SESSION_MS / 1000);
    let mut resp = page::signed_in(&sub);
    let h = resp.headers_mut();
    for c in [
        session::set_cookie(
            session::session_cookie(settings.secure),
            cookie,
            cookie::SameSite::Strict,
            settings.secure,
            max_age,
        ),
        session::set_cookie(
            session::login_cookie(settings.secure),
            String::new(),
            cookie::SameSite::Lax,
            settings.secure,
            0,
        ),
    ] {
        if let Ok(v) = HeaderValue::from_str(&c) {
            h.append(header::SET_COOKIE, v);
        }
    }
    resp
}

fn describe_token_error<E: std::error::Error + 'static>(
    e: &oauth2::RequestTokenError<E, BasicErrorResponse>,
) -> String {
    match e {
        oauth2::RequestTokenError::ServerResponse(r) => {
            format!(
                "error `{}`",
                crate::admission::sanitize_label(r.error().as_ref())
            )
        }
        oauth2::RequestTokenError::Request(e) => e.to_string(),
        oauth2::RequestTokenError::Parse(e, _) => format!("unreadable token response: {e}"),
        oauth2::RequestTokenError::Other(m) => crate::admission::sanitize_label(m),
    }
}
