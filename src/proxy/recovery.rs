//! Same-attempt recovery and replay for run nodes (tool-turn contract §D; OpenWOP replay.md).
//!
//! - **Recovery** (`Turnguard-Mode: live`, the same run, node and attempt re-sending a round
//!   it already got an answer for, same semantic digest): the recorded answer is served and
//!   upstream is not called. A call released in that answer with no recorded result is *in
//!   doubt*: it is released again only if re-runnable (`safetyTier` pure/read or
//!   `replayPolicy` deterministic/idempotent); otherwise the request fails with
//!   `turnguard.tool_outcome_unknown` (409). A new attempt is new execution: it never matches
//!   a record (the attempt is part of the key), so a retry is not handed a recorded failure.
//! - **Replay** (`Turnguard-Mode: replay`): every round is served from the record and
//!   upstream is never called. Recorded calls are not released again: when every call of a
//!   recorded answer has a recorded result, turnguard continues to the next recorded round by
//!   itself, up to the first answer that needs the agent (a final answer, or re-runnable calls
//!   without a recorded result). A side-effecting position without a record fails closed with
//!   `replay_source_missing` (404) — never a synthesized success. The rounds served without
//!   the agent are counted per (run, node) so the agent's next request lands on the right
//!   recorded round.
//! - A record kept only as a digest (over `journal_max_record_bytes`) is a miss.
//!
//! Chat turns (no `Turnguard-Run`) are out of scope for both (§D).

use axum::body::Body;
use axum::response::Response;
use http::header::{self, HeaderValue};
use http::StatusCode;

use super::{RunMode, Session};
use crate::error::WireError;
use crate::journal::{JournalError, ServedRecord};
use crate::metrics::ReplayLabels;

fn unavailable(e: JournalError) -> WireError {
    WireError::JournalUnavailable {
        reason: e.to_string(),
    }
}

/// Serves the recorded answer when recovery or replay applies; `None` means go live.
pub async fn serve_recorded(
    session: &Session,
    mode: RunMode,
) -> Result<Option<Response>, WireError> {
    let run = &session.ctx.run;
    let (Some(run_id), Some(node), Some(attempt)) = (&run.run_id, &run.node_id, run.attempt) else {
        if mode == RunMode::Replay {
            return Err(WireError::InvalidRequest {
                reason: "`Turnguard-Mode: replay` needs `Turnguard-Run`".into(),
            });
        }
        return Ok(None);
    };
    let reader = session.state.reader.clone();
    let (run_id, node) = (run_id.clone(), node.clone());
    let round = session.turn.round_index;
    let digest = session.agent_digest.clone();
    let count = |mode: &str, result: &str| {
        session
            .state
            .metrics
            .replay
            .get_or_create(&ReplayLabels {
                mode: mode.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    };
    match mode {
        RunMode::Live => {
            let found = tokio::task::spawn_blocking({
                let (reader, run_id, node) = (reader.clone(), run_id.clone(), node.clone());
                move || reader.served(&run_id, &node, attempt, round)
            })
            .await
            .map_err(|e| WireError::Internal {
                reason: e.to_string(),
            })?
            .map_err(unavailable)?;
            let Some(rec) = found.filter(|r| r.request_digest == digest) else {
                return Ok(None);
            };
            let in_doubt = in_doubt(&reader, &run_id, &rec).await?;
            if let Some(names) = non_rerunnable(&in_doubt) {
                count("recovery", "outcome_unknown");
                return Err(WireError::ToolOutcomeUnknown { calls: names });
            }
            if rec.body.truncated {
                count("recovery", "miss");
                return Ok(None);
            }
            count("recovery", "hit");
            Ok(Some(serve(&rec)))
        }
        RunMode::Replay => {
            let reader2 = reader.clone();
            let (run2, node2) = (run_id.clone(), node.clone());
            let result =
                tokio::task::spawn_blocking(move || replay_chain(&reader2, &run2, &node2, round))
                    .await
                    .map_err(|e| WireError::Internal {
                        reason: e.to_string(),
                    })?;
            match result {
                Ok((rec, skipped_before, skipped_now)) => {
                    if skipped_now > 0 {
                        session
                            .state
                            .journal
                            .set_replay_cursor(&run_id, &node, skipped_before + skipped_now)
                            .await
                            .map_err(unavailable)?;
                    }
                    count("replay", "hit");
                    Ok(Some(serve(&rec)))
                }
                Err(e) => {
                    count("replay", "miss");
                    Err(e)
                }
            }
        }
    }
}

/// Released calls of `rec` with no recorded result (a result kept only as a digest counts
/// as absent).
async fn in_doubt(
    reader: &std::sync::Arc<crate::journal::JournalReader>,
    run: &str,
    rec: &ServedRecord,
) -> Result<Vec<(String, bool)>, WireError> {
    let reader = reader.clone();
    let run = run.to_owned();
    let calls = rec.calls.clone();
    tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for c in calls {
            if !matches!(reader.tool_result(&run, &c.call_id)?, Some(Some(_))) {
                out.push((c.tool_name, c.rerunnable));
            }
        }
        Ok::<_, JournalError>(out)
    })
    .await
    .map_err(|e| WireError::Internal {
        reason: e.to_string(),
    })?
    .map_err(unavailable)
}

fn non_rerunnable(in_doubt: &[(String, bool)]) -> Option<String> {
    let names: Vec<&str> = in_doubt
        .iter()
        .filter(|(_, r)| !r)
        .map(|(n, _)| n.as_str())
        .collect();
    (!names.is_empty()).then(|| {
        names
            .iter()
            .map(|n| crate::admission::sanitize_label(n))
            .collect::<Vec<_>>()
            .join(", ")
    })
}

/// Follows recorded rounds from the agent's position to the first answer that needs the
/// agent. Returns the answer, the rounds skipped before, and the rounds skipped now.
fn replay_chain(
    reader: &crate::journal::JournalReader,
    run: &str,
    node: &str,
    agent_round: u32,
) -> Result<(ServedRecord, u32, u32), WireError> {
    let missing = |reason: String| WireError::ReplaySourceMissing { reason };
    let skipped_before = reader.replay_cursor(run, node).map_err(unavailable)?;
    let mut k = agent_round + skipped_before;
    let mut skipped_now = 0;
    loop {
        let attempt = reader
            .latest_attempt(run, node, k)
            .map_err(unavailable)?
            .ok_or_else(|| {
                missing(format!(
                    "run `{run}` node `{node}` has no recorded round {k}"
                ))
            })?;
        let rec = reader
            .served(run, node, attempt, k)
            .map_err(unavailable)?
            .ok_or_else(|| {
                missing(format!(
                    "run `{run}` node `{node}` has no recorded round {k}"
                ))
            })?;
        if rec.body.truncated {
            return Err(missing(format!(
                "round {k} was recorded only as a digest (over the record size limit, or its tool-call arguments carried a secret turnguard redacts)"
            )));
        }
        if rec.calls.is_empty() {
            return Ok((rec, skipped_before, skipped_now));
        }
        let mut unrecorded = Vec::new();
        for c in &rec.calls {
            if !matches!(
                reader.tool_result(run, &c.call_id).map_err(unavailable)?,
                Some(Some(_))
            ) {
                unrecorded.push((c.tool_name.clone(), c.rerunnable));
            }
        }
        if unrecorded.is_empty() {
            // Every call of this answer has a recorded result: not released again.
            k += 1;
            skipped_now += 1;
            continue;
        }
        if let Some(names) = non_rerunnable(&unrecorded) {
            return Err(missing(format!(
                "round {k} released side-effecting call(s) with no recorded result: {names}"
            )));
        }
        return Ok((rec, skipped_before, skipped_now));
    }
}

fn serve(rec: &ServedRecord) -> Response {
    let mut resp = Response::new(Body::from(rec.body.bytes.clone()));
    *resp.status_mut() = StatusCode::from_u16(rec.status).unwrap_or(StatusCode::OK);
    if let Ok(v) = HeaderValue::from_str(&rec.content_type) {
        resp.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    resp.headers_mut()
        .insert("turnguard-served", HeaderValue::from_static("recorded"));
    resp
}
