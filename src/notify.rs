//! Notifications of approval interrupts (issue 16), the sink every raised and resolved
//! interrupt is handed to ([`Notifier`], held in [`crate::state::AppState`]; it never waits):
//!
//!
//! - **Webhook** (`approval_webhook`): a POST per interrupt raised (`interrupt.requested`,
//!   the interrupt as `GET /approvals` serves it — redacted arguments only) and resolved
//!   (`interrupt.resolved`, no arguments). Body `{deliveryId, sentAt, type, interrupt}`;
//!   header `Turnguard-Signature: sha256=<hex HMAC-SHA256(key, body)>` with the key of
//!   `approval_webhook_secret_file`, and `Turnguard-Delivery: <deliveryId>`. Deliveries wait
//!   in a bounded queue (1024) drained by one background task: a full queue drops the
//!   notification (counted, logged), so the request path never waits on the webhook. A
//!   delivery is retried on a non-2xx answer or a failed connection, up to 5 attempts with
//!   exponential backoff from 250 ms (each attempt 10 s at most); every retry sends the same
//!   body and signature.
//! - **SSE** `GET /approvals/events`: the caller's own interrupts as `interrupt.requested`
//!   (first those pending now, then each new one) and `interrupt.resolved` events, with
//!   comment keep-alives; for a verified bearer token (as `GET /approvals`) or the approval
//!   page's session cookie. The stream ends when the token or session does.

//!   The SSE route itself is [`crate::approval_ui::notify::events`] (admin plane); this
//!   module is the fan-out below the request path, so `approvals` can notify without
//!   importing the admin plane (issue 13 item 1).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hmac::{Hmac, Mac};
use http::header;
use http_body_util::Full;
use serde_json::{json, Value};
use sha2::Sha256;
use tokio::sync::{broadcast, mpsc};

use crate::clock::now_ms;
use crate::config::Config;
use crate::journal::InterruptRow;
use crate::metrics::{Metrics, NotificationLabels, NotificationResult};

/// Why the approval page or the webhook cannot be configured as given (start-up).
#[derive(Debug, thiserror::Error)]
pub enum UiConfigError {
    /// A setting is missing or wrong; the message names the key.
    #[error("{0}")]
    Setting(String),
    /// A secret file could not be read.
    #[error("{file}: {reason}")]
    File {
        file: std::path::PathBuf,
        reason: String,
    },
}

/// Notifications waiting for the webhook task.
const WEBHOOK_QUEUE: usize = 1024;
/// Attempts per webhook delivery.
const WEBHOOK_ATTEMPTS: u32 = 5;
/// First retry delay; doubled per attempt.
const WEBHOOK_BACKOFF: Duration = Duration::from_millis(250);
/// Longest single attempt.
const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);
/// Events kept for a slow SSE subscriber before it lags.
const SSE_BUFFER: usize = 256;
/// The signature header.
pub const SIGNATURE_HEADER: &str = "turnguard-signature";
/// The delivery id header.
pub const DELIVERY_HEADER: &str = "turnguard-delivery";

/// One notification: whose interrupt, which event, the payload.
#[derive(Debug, Clone)]
pub struct Notice {
    /// The bound person (`sub`); `None`: nobody can approve (not sent to anyone's stream).
    pub principal: Option<String>,
    /// `interrupt.requested` or `interrupt.resolved`.
    pub event: &'static str,
    /// The event's payload (the interrupt, redacted).
    pub interrupt: Arc<Value>,
}

/// The webhook's fixed target and key (config).
pub struct Webhook {
    url: http::Uri,
    key: Vec<u8>,
}

impl Webhook {
    /// `approval_webhook` and its secret file, checked; `None` when no webhook is set.
    ///
    /// Errors: a URL that is not http(s), plain http to a host that is not loopback, a
    /// missing secret file, or a key under 32 bytes.
    pub fn load(config: &Config) -> Result<Option<Self>, UiConfigError> {
        let Some(url) = &config.approval_webhook else {
            return Ok(None);
        };
        // Messages show the URL without its userinfo (a password in it is a credential).
        let shown = crate::config::redact_url(url);
        let uri: http::Uri = url
            .parse()
            .map_err(|e| UiConfigError::Setting(format!("approval_webhook `{shown}`: {e}")))?;
        let loopback = is_loopback(uri.host().unwrap_or_default());
        match uri.scheme_str() {
            Some("https") => {}
            Some("http") if loopback => {}
            _ => {
                return Err(UiConfigError::Setting(format!(
                    "approval_webhook `{shown}` must be https (plain http only on a loopback host)"
                )))
            }
        }
        let file = config.approval_webhook_secret_file.as_ref().ok_or_else(|| {
            UiConfigError::Setting(
                "approval_webhook needs approval_webhook_secret_file (the HMAC-SHA256 key its receiver verifies)".into(),
            )
        })?;
        let key = read_secret(file, 32)?.into_bytes();
        Ok(Some(Self { url: uri, key }))
    }
}

/// `sha256=<hex>` of HMAC-SHA256 over `body` with `key`.
pub fn signature(key: &[u8], body: &[u8]) -> String {
    // HMAC takes a key of any length (RFC 2104), so `new_from_slice` cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

/// Fans interrupts out to the SSE subscribers and the webhook queue; never waits.
pub struct Notifier {
    events: broadcast::Sender<Notice>,
    webhook: Option<mpsc::Sender<Value>>,
    metrics: Arc<Metrics>,
}

impl Notifier {
    /// A notifier; with a webhook, starts its delivery task (inside the runtime).
    pub fn new(webhook: Option<Webhook>, metrics: Arc<Metrics>) -> Self {
        let (events, _) = broadcast::channel(SSE_BUFFER);
        let webhook = webhook.map(|w| {
            let (tx, rx) = mpsc::channel(WEBHOOK_QUEUE);
            tokio::spawn(deliver(w, rx, Arc::clone(&metrics)));
            tx
        });
        Self {
            events,
            webhook,
            metrics,
        }
    }

    fn count(&self, result: NotificationResult) {
        count(&self.metrics, result);
    }

    /// An interrupt was raised.
    pub fn requested(&self, row: &InterruptRow) {
        self.send(row, "interrupt.requested", served(row));
    }

    /// An interrupt was resolved (by the person or the host).
    pub fn resolved(&self, row: &InterruptRow) {
        let v = json!({
            "interruptId": row.record.interrupt_id,
            "runId": row.record.run.run_id,
            "nodeId": row.record.run.node_id,
            "state": row.state,
            "resolvedBy": row.resolved_by,
            "resolvedAt": row.resolved_at_ms,
            "edited": row.edits.is_some(),
        });
        self.send(row, "interrupt.resolved", v);
    }

    fn send(&self, row: &InterruptRow, event: &'static str, interrupt: Value) {
        if let Some(tx) = &self.webhook {
            let body = json!({
                "deliveryId": uuid::Uuid::new_v4().to_string(),
                "sentAt": now_ms(),
                "type": event,
                "interrupt": interrupt,
            });
            if tx.try_send(body).is_err() {
                self.count(NotificationResult::Dropped);
                tracing::warn!(interrupt = %row.record.interrupt_id, "approval webhook queue full; notification dropped");
            }
        }
        let _ = self.events.send(Notice {
            principal: row.record.principal.clone(),
            event,
            interrupt: Arc::new(interrupt),
        });
    }

    /// A subscription to every notice (filter by principal).
    pub fn subscribe(&self) -> broadcast::Receiver<Notice> {
        self.events.subscribe()
    }
}

/// Counts one notification outcome.
pub(crate) fn count(metrics: &Metrics, result: NotificationResult) {
    metrics
        .approval_notifications
        .get_or_create(&NotificationLabels::of(result))
        .inc();
}

/// The webhook task: one delivery at a time, in order, each retried with backoff.
async fn deliver(w: Webhook, mut rx: mpsc::Receiver<Value>, metrics: Arc<Metrics>) {
    let client = crate::client::client(&Config::default());
    while let Some(body) = rx.recv().await {
        let bytes = Bytes::from(body.to_string());
        let sig = signature(&w.key, &bytes);
        let delivery = body
            .get("deliveryId")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let mut delivered = false;
        for attempt in 0..WEBHOOK_ATTEMPTS {
            if attempt > 0 {
                count(&metrics, NotificationResult::Retried);
                tokio::time::sleep(WEBHOOK_BACKOFF * 2u32.pow(attempt - 1)).await;
            }
            let req = http::Request::post(w.url.clone())
                .header(header::CONTENT_TYPE, "application/json")
                .header(
                    header::USER_AGENT,
                    concat!("turnguard/", env!("CARGO_PKG_VERSION")),
                )
                .header(SIGNATURE_HEADER, &sig)
                .header(DELIVERY_HEADER, &delivery)
                .body(Full::new(bytes.clone()));
            let Ok(req) = req else { break };
            match tokio::time::timeout(WEBHOOK_TIMEOUT, client.request(req)).await {
                Ok(Ok(resp)) if resp.status().is_success() => {
                    delivered = true;
                    break;
                }
                Ok(Ok(resp)) => {
                    tracing::warn!(status = resp.status().as_u16(), attempt = attempt + 1, delivery = %delivery, "approval webhook answered with an error");
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, attempt = attempt + 1, delivery = %delivery, "approval webhook unreachable");
                }
                Err(_) => {
                    tracing::warn!(attempt = attempt + 1, delivery = %delivery, "approval webhook timed out");
                }
            }
        }
        count(
            &metrics,
            if delivered {
                NotificationResult::Delivered
            } else {
                NotificationResult::Failed
            },
        );
    }
}

/// An interrupt as the admin plane, the approval page, the SSE stream and the webhook show
/// it: ids, run and node, times, policy revision, state, the held calls with their redacted
/// arguments and why each was held, the interrupt payload's `data`, and — after an
/// `edit-accept` — the person's edited calls (redacted).
pub fn served(row: &InterruptRow) -> Value {
    let mut v = json!({
        "interruptId": row.record.interrupt_id,
        "key": row.record.key,
        "kind": row.record.kind,
        "runId": row.record.run.run_id,
        "nodeId": row.record.run.node_id,
        "attempt": row.record.run.attempt,
        "requestedAt": row.record.requested_at_ms,
        "expiresAt": row.record.expires_at_ms,
        "timeoutMs": row.record.payload.get("timeoutMs"),
        "policyRevision": row.record.policy_revision,
        "state": row.state,
        "calls": row.record.calls,
        "data": row.record.payload.get("data"),
    });
    if let Some(e) = &row.edits {
        if let Some(o) = v.as_object_mut() {
            o.insert("edits".into(), e.clone());
        }
    }
    v
}

/// `localhost`, `127.0.0.0/8`, `[::1]`.
pub(crate) fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Reads a secret file (trimmed), at least `min` bytes.
pub(crate) fn read_secret(file: &std::path::Path, min: usize) -> Result<String, UiConfigError> {
    let text = std::fs::read_to_string(file).map_err(|e| UiConfigError::File {
        file: file.to_owned(),
        reason: e.to_string(),
    })?;
    let text = text.trim().to_owned();
    if text.len() < min {
        return Err(UiConfigError::File {
            file: file.to_owned(),
            reason: format!("the secret must be at least {min} bytes"),
        });
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_over_the_body() {
        // RFC 4231 test case 2.
        let sig = signature(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            sig,
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
