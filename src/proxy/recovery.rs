//! Same-attempt recovery and replay for run nodes (tool-turn contract §D; OpenWOP replay.md).
//!
//! - **Recovery** (`Turnguard-Mode: live`, the same run, node and attempt re-sending a round
//!   it already got an answer for, same semantic digest): the recorded answer is served and
//!   upstream is not called — but never with a call whose result is recorded: the agent ran
//!   it already, and handing it back makes an agent that retries run it twice. The answer is
//!   served with only the calls that have no recorded result; when none remain, the recorded
//!   continuation (the same attempt's next recorded round, by the same rule) is served, and
//!   without one the request goes live (effect claims keep a repeat from running again).
//!   Tools run sequentially, so of the calls without a recorded result only the *first* is
//!   *in doubt* (it may have run; the ones after it had not started): it is served again only
//!   if re-runnable (`safetyTier` pure/read or `replayPolicy` deterministic/idempotent);
//!   otherwise the request fails with `turnguard.tool_outcome_unknown` (409) naming it. A new
//!   attempt is new execution: it never matches a record (the attempt is part of the key), so
//!   a retry is not handed a recorded failure.
//! - **Replay** (`Turnguard-Mode: replay`): every round is served from the record and
//!   upstream is never called. Recorded calls are not released again: when every call of a
//!   recorded answer has a recorded result, turnguard continues to the next recorded round by
//!   itself, up to the first answer that needs the agent (a final answer, or re-runnable calls
//!   without a recorded result), served without the calls whose results are recorded. A
//!   side-effecting position without a record fails closed with `replay_source_missing`
//!   (404) — never a synthesized success. The rounds served without the agent are counted per
//!   (run, node) so the agent's next request lands on the right recorded round.
//! - A record kept only as a digest (over `journal_max_record_bytes`, or a secret in a call's
//!   arguments) or in redacted form is a miss.
//! - Removing calls from a recorded answer is the adapters' own rewrite: a JSON answer through
//!   [`provider::Provider::rewrite_response`], a recorded stream through the stream
//!   [`Pipeline`] (the removed calls' events dropped, indices renumbered), as if admission had
//!   withheld them.
//!
//! Chat turns (no `Turnguard-Run`) are out of scope for both (§D).

use std::collections::HashSet;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::StatusCode;

use super::pipeline::{Finish, Pipeline};
use super::{RunMode, Session};
use crate::error::WireError;
use crate::journal::{JournalError, JournalReader, RoundState, ServedRecord};
use crate::metrics::{ReplayLabels, ReplayMode, ReplayResult};
use crate::model::{ChoiceEmissions, ChoiceVerdict, Decision, Outcome, Stage, Surfacing};

/// Recorded rounds followed at most from one request (a continuation chain).
const MAX_CHAIN: u32 = 1000;

fn unavailable(e: JournalError) -> WireError {
    WireError::JournalUnavailable {
        reason: e.to_string(),
    }
}

/// What recovery found for a re-sent round.
enum Recovery {
    /// Serve this record without these calls (their results are recorded).
    Serve(Box<ServedRecord>, HashSet<String>),
    /// The first call without a recorded result may have run and is not re-runnable.
    OutcomeUnknown(String),
    /// Nothing to serve (a digest-only or redacted record, or no recorded continuation).
    Miss,
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
    // A record is served only to who recorded it (`ServedRecord::reader`): the run id is a
    // name any client can send.
    let mine = session.reader();
    let readable = |r: &ServedRecord| r.reader.as_deref() == Some(mine.as_str());
    let (run_id, node) = (run_id.clone(), node.clone());
    let round = session.turn.round_index;
    let digest = session.agent_digest.clone();
    let count = |mode: ReplayMode, result: ReplayResult| {
        session
            .state
            .metrics
            .replay
            .get_or_create(&ReplayLabels { mode, result })
            .inc();
    };
    match mode {
        RunMode::Live => {
            let found = async {
                let Some(rec) = reader
                    .served(&run_id, &node, attempt, round)
                    .await?
                    .filter(|r| r.request_digest == digest && readable(r))
                else {
                    return Ok(None);
                };
                recover(&reader, &run_id, &node, attempt, rec)
                    .await
                    .map(Some)
            }
            .await
            .map_err(unavailable)?;
            match found {
                None => Ok(None),
                Some(Recovery::OutcomeUnknown(name)) => {
                    count(ReplayMode::Recovery, ReplayResult::OutcomeUnknown);
                    Err(WireError::ToolOutcomeUnknown { calls: name })
                }
                Some(Recovery::Miss) => {
                    count(ReplayMode::Recovery, ReplayResult::Miss);
                    Ok(None)
                }
                Some(Recovery::Serve(rec, recorded)) => match serve(session, &rec, &recorded) {
                    Some(resp) => {
                        count(ReplayMode::Recovery, ReplayResult::Hit);
                        Ok(Some(resp))
                    }
                    None => {
                        count(ReplayMode::Recovery, ReplayResult::Miss);
                        Ok(None)
                    }
                },
            }
        }
        RunMode::Replay => {
            let (run2, node2) = (run_id.clone(), node.clone());
            let result = replay_chain(&reader, &run2, &node2, round).await;
            match result {
                Ok((rec, ..)) if !readable(&rec) => {
                    count(ReplayMode::Replay, ReplayResult::Miss);
                    Err(WireError::ReplaySourceMissing {
                        reason: "this run node's recorded rounds were recorded by another principal (or before turnguard kept who); a record is served only to who recorded it".into(),
                    })
                }
                Ok((rec, recorded, skipped_before, skipped_now)) => {
                    let Some(resp) = serve(session, &rec, &recorded) else {
                        count(ReplayMode::Replay, ReplayResult::Miss);
                        return Err(WireError::ReplaySourceMissing {
                            reason: format!(
                                "round {} could not be served without its recorded calls",
                                rec.round_index
                            ),
                        });
                    };
                    if skipped_now > 0 {
                        session
                            .state
                            .journal
                            .set_replay_cursor(&run_id, &node, skipped_before + skipped_now)
                            .await
                            .map_err(unavailable)?;
                    }
                    count(ReplayMode::Replay, ReplayResult::Hit);
                    Ok(Some(resp))
                }
                Err(e) => {
                    count(ReplayMode::Replay, ReplayResult::Miss);
                    Err(e)
                }
            }
        }
    }
}

/// The calls of a served record, split by whether their results are recorded.
struct Split {
    /// Ids of the calls whose results are recorded (a result kept only as a digest counts as
    /// absent).
    recorded: HashSet<String>,
    /// The others, in order: `(tool name, re-runnable)`.
    unrecorded: Vec<(String, bool)>,
}

async fn partition(
    reader: &JournalReader,
    run: &str,
    rec: &ServedRecord,
) -> Result<Split, JournalError> {
    let mut split = Split {
        recorded: HashSet::new(),
        unrecorded: Vec::new(),
    };
    for c in &rec.calls {
        if matches!(reader.tool_result(run, &c.call_id).await?, Some(Some(_))) {
            split.recorded.insert(c.call_id.clone());
        } else {
            split.unrecorded.push((c.tool_name.clone(), c.rerunnable));
        }
    }
    Ok(split)
}

/// Same-attempt recovery from the record `first` of the re-sent round (see the module docs).
async fn recover(
    reader: &JournalReader,
    run: &str,
    node: &str,
    attempt: u32,
    first: ServedRecord,
) -> Result<Recovery, JournalError> {
    let mut rec = first;
    for _ in 0..MAX_CHAIN {
        let Split {
            recorded,
            unrecorded,
        } = partition(reader, run, &rec).await?;
        if !rec.calls.is_empty() && unrecorded.is_empty() {
            // Every call of this answer ran: the answer that followed them is the one to serve.
            match reader
                .served(run, node, attempt, rec.round_index + 1)
                .await?
            {
                Some(next) => {
                    rec = next;
                    continue;
                }
                None => return Ok(Recovery::Miss),
            }
        }
        // Tools run sequentially: only the first call without a recorded result is in doubt.
        if let Some((name, false)) = unrecorded.first() {
            return Ok(Recovery::OutcomeUnknown(crate::admission::sanitize_label(
                name,
            )));
        }
        if !rec.body.servable() {
            return Ok(Recovery::Miss);
        }
        return Ok(Recovery::Serve(Box::new(rec), recorded));
    }
    Ok(Recovery::Miss)
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
/// agent. Returns the answer, its calls whose results are recorded, the rounds skipped
/// before, and the rounds skipped now.
async fn replay_chain(
    reader: &JournalReader,
    run: &str,
    node: &str,
    agent_round: u32,
) -> Result<(ServedRecord, HashSet<String>, u32, u32), WireError> {
    let missing = |reason: String| WireError::ReplaySourceMissing { reason };
    let skipped_before = reader.replay_cursor(run, node).await.map_err(unavailable)?;
    let mut k = agent_round + skipped_before;
    let mut skipped_now = 0;
    loop {
        let attempt = reader
            .latest_attempt(run, node, k)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| {
                missing(format!(
                    "run `{run}` node `{node}` has no recorded round {k}"
                ))
            })?;
        let rec = reader
            .served(run, node, attempt, k)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| {
                missing(format!(
                    "run `{run}` node `{node}` has no recorded round {k}"
                ))
            })?;
        if !rec.body.servable() {
            return Err(missing(format!(
                "round {k} was recorded only as a digest or in redacted form (over the record size limit, or it carried a secret turnguard redacts)"
            )));
        }
        if rec.calls.is_empty() {
            return Ok((rec, HashSet::new(), skipped_before, skipped_now));
        }
        let Split {
            recorded,
            unrecorded,
        } = partition(reader, run, &rec).await.map_err(unavailable)?;
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
        return Ok((rec, recorded, skipped_before, skipped_now));
    }
}

/// The recorded answer as a response, without the calls in `recorded`; `None` when it cannot
/// be rewritten (the record is then a miss).
fn serve(session: &Session, rec: &ServedRecord, recorded: &HashSet<String>) -> Option<Response> {
    let body = if recorded.is_empty() {
        Bytes::from(rec.body.bytes.clone())
    } else {
        let stream = super::is_event_content_type(&rec.content_type);
        without_calls(session, &rec.body.bytes, recorded, stream)?
    };
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = StatusCode::from_u16(rec.status).unwrap_or(StatusCode::OK);
    if let Ok(v) = HeaderValue::from_str(&rec.content_type) {
        resp.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    resp.headers_mut()
        .insert("turnguard-served", HeaderValue::from_static("recorded"));
    Some(resp)
}

/// Verdicts that withhold (drop) the calls in `recorded` and release the others.
fn verdicts_without(round: &[ChoiceEmissions], recorded: &HashSet<String>) -> Vec<ChoiceVerdict> {
    round
        .iter()
        .map(|choice| {
            let decisions: Vec<Decision> = choice
                .calls
                .iter()
                .map(|c| {
                    if recorded.contains(&c.id) {
                        Decision::new(
                            Outcome::SuppressedRepeat,
                            Stage::Dispatch,
                            crate::reason::Reason::ResultRecorded,
                            "the call's result is recorded: it is not handed back".into(),
                        )
                    } else {
                        Decision::new(
                            Outcome::Executed,
                            Stage::Dispatch,
                            crate::reason::Reason::ServedFromRecord,
                            String::new(),
                        )
                    }
                })
                .collect();
            let surfacing = if decisions.iter().all(Decision::released) {
                Surfacing::Release
            } else {
                Surfacing::Drop
            };
            ChoiceVerdict {
                choice: choice.choice,
                decisions,
                surfacing,
                claims: Vec::new(),
            }
        })
        .collect()
}

/// A recorded answer (an event stream when `stream`, else one JSON body) re-read by the
/// round engine's pipeline with the calls in `recorded` dropped; `None` when it no longer
/// reads (the record is then a miss: fail closed).
fn without_calls(
    session: &Session,
    body: &[u8],
    recorded: &HashSet<String>,
    stream: bool,
) -> Option<Bytes> {
    let mut pipeline = if stream {
        Pipeline::new(&session.turn, session.state.config.max_event_bytes, None)
    } else {
        Pipeline::block(&session.turn, usize::MAX)
    };
    let mut out = Vec::new();
    pipeline.feed(body).ok()?;
    while let Some(round) = pipeline.advance(&mut out) {
        let verdicts = verdicts_without(&round, recorded);
        pipeline.release(round, verdicts, &mut out);
    }
    loop {
        match pipeline.finish(None, &mut out) {
            Finish::Decide(round) => {
                let verdicts = verdicts_without(&round, recorded);
                pipeline.release(round, verdicts, &mut out);
            }
            Finish::Ended(RoundState::Ok, _) => break,
            Finish::Ended(..) | Finish::Refused { .. } => return None,
        }
    }
    Some(out.concat().into())
}
