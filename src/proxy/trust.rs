//! The run's sticky trust bit (tool-turn contract §C): with `Turnguard-Run`, once a turn of
//! the run is untrusted, every later turn of the run is untrusted — across requests, attempts
//! and restarts (journaled in `run_trust`, insert-if-absent).

use crate::policy::bundle::ContentTrust;
use crate::server::AppState;

use super::RequestCtx;

/// The turn's effective `contentTrust`: `turn` (the meet of its inputs), made untrusted when
/// its run was untrusted before. A journal failure fails closed (untrusted).
pub async fn sticky(state: &AppState, ctx: &RequestCtx, turn: ContentTrust) -> ContentTrust {
    let Some(run) = &ctx.run.run_id else {
        return turn;
    };
    let untrusted = turn == ContentTrust::Untrusted;
    match state
        .journal
        .run_untrusted(run, untrusted, &ctx.request_id, ctx.at_ms)
        .await
    {
        Ok(true) => ContentTrust::Untrusted,
        Ok(false) => turn,
        Err(e) => {
            tracing::error!(error = %e, request_id = %ctx.request_id, "run trust not readable; the turn is untrusted (fail closed)");
            ContentTrust::Untrusted
        }
    }
}
