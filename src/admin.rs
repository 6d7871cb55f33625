//! The admin plane (DESIGN.md §6), on its own listener (default `127.0.0.1:8788`, never the
//! data-plane port): `/metrics`, `/healthz`, `/readyz`, `/config`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::{header, StatusCode};
use serde_json::json;

use crate::error::envelope;
use crate::server::AppState;

/// The admin router.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/config", get(config))
        .fallback(not_found)
        .with_state(state)
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

async fn healthz() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

async fn readyz(State(s): State<Arc<AppState>>) -> Response {
    if s.ready.load(Ordering::SeqCst) {
        Json(json!({ "status": "ready" })).into_response()
    } else {
        envelope(
            StatusCode::SERVICE_UNAVAILABLE,
            "runner_unavailable",
            "turnguard is not ready (starting or shutting down)",
        )
    }
}

async fn config(State(s): State<Arc<AppState>>) -> Response {
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "config": s.config,
    }))
    .into_response()
}

async fn not_found() -> Response {
    envelope(StatusCode::NOT_FOUND, "not_found", "no such admin endpoint")
}
