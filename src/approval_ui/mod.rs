//! The person in the loop (issue 16; tool-turn contract §C): the approval page on the admin
//! plane, notifications, and the client of the `turnguard approvals` CLI.
//!
//! - **Approval page** `/ui/approvals` ([`page`]), off unless `approval_ui = true`. The
//!   person signs in with OpenID Connect (authorization code + PKCE, [`oidc`]) against
//!   `identity_issuer`'s discovery document; the ID token is verified with the same keys,
//!   issuer and rules as approver tokens ([`crate::identity::Identity::verify_id_token`]).
//!   The session ([`session`]) is an opaque random cookie (`HttpOnly`, `SameSite=Strict`,
//!   `Secure` unless the redirect URI is on a loopback host) bound to a synchronizer CSRF
//!   token that every state-changing request carries. The page lists only the signed-in
//!   person's pending interrupts and resolves through the same compare-and-set as the
//!   admin API ([`crate::approvals::resolve_as`]). Nothing is resolved by a GET, a link or
//!   a query string.
//! - **Notifications** ([`notify`]): a signed webhook (`approval_webhook`, HMAC-SHA256 over
//!   the body, retried with backoff from a bounded queue by a background task — never on the
//!   request path) and the SSE stream `GET /approvals/events` of the caller's own interrupts
//!   (bearer token, or the page's session cookie).
//! - **CLI** ([`cli`]): `turnguard approvals list|accept|reject` against the admin plane
//!   with the person's own token.

pub mod cli;
pub mod notify;
mod oidc;
mod page;
mod session;

use std::sync::Arc;

use axum::routing::{get, post};
use axum::{Extension, Router};

use crate::notify::{is_loopback, read_secret};
pub use crate::notify::{Notifier, UiConfigError};

use crate::config::Config;
use crate::state::AppState;

/// The approval page's settings, checked at start.
pub(crate) struct UiSettings {
    /// The OAuth client id (the ID token's audience).
    client_id: String,
    /// The client secret (confidential client), if configured.
    client_secret: Option<String>,
    /// The registered redirect URI (`…/ui/callback`).
    redirect_uri: String,
    /// `identity_issuer`: the discovery document is `{issuer}/.well-known/openid-configuration`
    /// and must name the same issuer.
    issuer: String,
    /// Cookies carry `Secure` (the redirect URI is not plain HTTP on a loopback host).
    secure: bool,
    /// `scheme://host[:port]` of the page (from the redirect URI): a POST from any other
    /// `Origin` is refused.
    origin: String,
}

/// The approval page's settings, sessions and identity-provider cache: admin-plane state,
/// handed to the page's routes as an axum `Extension` (the notifier is in [`AppState`]).
pub struct ApprovalUi {
    settings: Option<UiSettings>,
    sessions: session::Sessions,
    provider: oidc::ProviderCache,
}

impl ApprovalUi {
    /// Nothing enabled: no page (SSE still works with a bearer token).
    pub fn disabled() -> Self {
        Self {
            settings: None,
            sessions: session::Sessions::default(),
            provider: oidc::ProviderCache::default(),
        }
    }

    /// Builds the page's settings from the configuration, reading the secret files.
    ///
    /// Errors: [`UiConfigError`] naming the key or file: the page needs an identity
    /// provider with keys, `approval_ui_client_id` and an `approval_ui_redirect_uri` ending
    /// in `/ui/callback` (https, or http on a loopback host).
    pub fn load(
        config: &Config,
        identity: &crate::identity::Identity,
    ) -> Result<Self, UiConfigError> {
        let settings = if config.approval_ui {
            Some(settings(config, identity)?)
        } else {
            None
        };
        Ok(Self {
            settings,
            sessions: session::Sessions::default(),
            provider: oidc::ProviderCache::default(),
        })
    }

    /// Whether the approval page is served.
    pub fn enabled(&self) -> bool {
        self.settings.is_some()
    }
}

fn setting(m: impl Into<String>) -> UiConfigError {
    UiConfigError::Setting(m.into())
}

fn settings(
    config: &Config,
    identity: &crate::identity::Identity,
) -> Result<UiSettings, UiConfigError> {
    if !identity.configured() {
        return Err(setting(
            "approval_ui needs an identity provider: identity_issuer, identity_audience and keys (identity_jwks, identity_public_key or identity_hs256_secret_file) verify the ID token",
        ));
    }
    let issuer = config
        .identity_issuer
        .clone()
        .ok_or_else(|| setting("approval_ui needs identity_issuer"))?;
    let client_id = config
        .approval_ui_client_id
        .clone()
        .filter(|c| !c.trim().is_empty())
        .ok_or_else(|| setting("approval_ui needs approval_ui_client_id (the page's OAuth client id at the identity provider)"))?;
    let redirect_uri = config.approval_ui_redirect_uri.clone().ok_or_else(|| {
        setting("approval_ui needs approval_ui_redirect_uri (for example https://turnguard-admin.example/ui/callback)")
    })?;
    let uri: http::Uri = redirect_uri
        .parse()
        .map_err(|e| setting(format!("approval_ui_redirect_uri `{redirect_uri}`: {e}")))?;
    let host = uri.host().unwrap_or_default();
    let loopback = is_loopback(host);
    let secure = match uri.scheme_str() {
        Some("https") => true,
        Some("http") if loopback => false,
        _ => {
            return Err(setting(format!(
                "approval_ui_redirect_uri `{redirect_uri}` must be https (plain http only on a loopback host)"
            )))
        }
    };
    if uri.path() != "/ui/callback" || uri.query().is_some() {
        return Err(setting(format!(
            "approval_ui_redirect_uri `{redirect_uri}` must end in /ui/callback, without a query"
        )));
    }
    let authority = uri
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_default();
    let origin = format!("{}://{authority}", uri.scheme_str().unwrap_or("https"));
    let client_secret = match &config.approval_ui_client_secret_file {
        Some(file) => Some(read_secret(file, 1)?),
        None => None,
    };
    Ok(UiSettings {
        client_id,
        client_secret,
        redirect_uri,
        issuer,
        secure,
        origin,
    })
}

/// The approval page's `Content-Security-Policy`.
pub fn page_csp() -> &'static str {
    page::CSP
}

/// The admin-plane routes of this module, with `ui` as their `Extension`: `GET /approvals/events` always (bearer token; the
/// page's session too when it is on), and the approval page when it is on:
/// `GET /ui/approvals`, `POST /ui/approvals/{interruptId}`, `GET /ui/login`,
/// `GET /ui/callback`, `POST /ui/logout`, `GET /ui/assets/{app.js,app.css}`.
pub fn routes(ui: Arc<ApprovalUi>) -> Router<Arc<AppState>> {
    let enabled = ui.enabled();
    let r = Router::new().route("/approvals/events", get(notify::events));
    let r = if enabled {
        r.route("/ui/approvals", get(page::list))
            .route("/ui/approvals/{interrupt_id}", post(page::resolve))
            .route("/ui/login", get(oidc::login))
            .route("/ui/callback", get(oidc::callback))
            .route("/ui/logout", post(page::logout))
            .route("/ui/assets/app.js", get(page::script))
            .route("/ui/assets/app.css", get(page::style))
    } else {
        r
    };
    r.layer(Extension(ui))
}
