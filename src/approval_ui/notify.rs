//! Notifications of approval interrupts, so an app can tell the person at once:
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

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderValue, Request, StatusCode};
use serde_json::Value;
use tokio::sync::{broadcast, mpsc};

use super::ApprovalUi;
use crate::clock::now_ms;
use crate::metrics::NotificationResult;
use crate::notify::{count, served};
pub use crate::notify::{signature, Notice, Notifier, Webhook, DELIVERY_HEADER, SIGNATURE_HEADER};
use crate::state::AppState;

/// Who listens to `GET /approvals/events`, and until when: the approval page's session
/// (cookie), else a verified approver as for `GET /approvals` (bearer token; no query
/// string).
async fn listener(
    s: &AppState,
    ui: &ApprovalUi,
    req: &http::request::Parts,
) -> Result<(String, i64), Response> {
    if !req.headers.contains_key(header::AUTHORIZATION) && req.uri.query().is_none() {
        if let Some((_, session)) = super::page::session_of(ui, &req.headers) {
            return Ok((session.person.sub, session.expires_at_ms));
        }
    }
    let person = crate::approvals::verified_approver(s, req).await?;
    let until = person.token.as_ref().map_or(i64::MAX, |t| t.expires_at_ms);
    Ok((person.sub, until))
}

fn sse_event(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// `GET /approvals/events` (`text/event-stream`).
pub async fn events(
    State(s): State<Arc<AppState>>,
    Extension(ui): Extension<Arc<ApprovalUi>>,
    req: Request<Body>,
) -> Response {
    let (parts, _) = req.into_parts();
    let (sub, until) = match listener(&s, &ui, &parts).await {
        Ok(l) => l,
        Err(resp) => return resp,
    };
    // Subscribe before reading what is pending, so nothing raised in between is missed.
    let mut rx = s.notifier.subscribe();
    let pending = match s.journal.pending_interrupts(&sub, now_ms()).await {
        Ok(rows) => rows,
        Err(e) => {
            return crate::error::envelope(
                StatusCode::SERVICE_UNAVAILABLE,
                "turnguard.journal_unavailable",
                &format!("the journal could not answer: {e}"),
            )
        }
    };
    let keepalive = Duration::from_millis(s.config.approval_keepalive_ms);
    let metrics = Arc::clone(&s.metrics);
    let (tx, body_rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
    tokio::spawn(async move {
        let mut first = vec![Bytes::from_static(b": turnguard approval events\n\n")];
        first.extend(
            pending
                .iter()
                .map(|row| sse_event("interrupt.requested", &served(row))),
        );
        for b in first {
            if tx.send(Ok(b)).await.is_err() {
                return;
            }
        }
        let mut tick = tokio::time::interval(keepalive);
        tick.tick().await;
        loop {
            let left = until.saturating_sub(now_ms());
            if left <= 0 {
                return;
            }
            let frame = tokio::select! {
                () = tx.closed() => return,
                _ = tick.tick() => Bytes::from_static(b": keep-alive\n\n"),
                _ = tokio::time::sleep(Duration::from_millis(left.min(86_400_000) as u64)) => return,
                got = rx.recv() => match got {
                    Ok(n) if n.principal.as_deref() == Some(sub.as_str()) => {
                        count(&metrics, NotificationResult::Sent);
                        sse_event(n.event, &n.interrupt)
                    }
                    Ok(_) => continue,
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        count(&metrics, NotificationResult::Lagged);
                        Bytes::from_static(b"event: lagged\ndata: {}\n\n")
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            };
            if tx.send(Ok(frame)).await.is_err() {
                return;
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(body_rx);
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp.into_response()
}
