//! The round engine: one model round read, decided, surfaced and journaled the same way for
//! a stream and for a JSON answer (issue 13 item 1). The upstream body feeds a [`Pipeline`]
//! (SSE blocks, or the JSON body as one block); at each decision point the held calls are
//! admitted and released, replaced, repaired or refused; the round's end is committed with
//! what the agent received.
//!
//! What differs is only the agent's side ([`ToAgent`]): a stream's events leave as they are
//! admitted, and its effect claims are confirmed as its calls leave; a JSON answer is held
//! until the round's unit of work — the round, its events, its claims and the served record
//! — is committed, and then leaves whole, with the surfaced error's own status when it is
//! refused.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt as _;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::mpsc;

use super::pipeline::{Finish, Pipeline};
use super::record::{claims_of, has_secrets, join, round_record, RoundBase};
use crate::journal::{EventRecord, RoundCommit, RoundState};
use crate::metrics::{ApiLabels, EmissionLabels, ReasonLabels, UpstreamError};
use crate::model::{ChoiceEmissions, ChoiceVerdict, SurfacedError, Surfacing};
use crate::provider::Splice;
use crate::request::Session;

/// How one model round ended.
pub(super) enum RoundEnd {
    /// Ask the model again with this body; a stream splices its answer like this.
    Repair(crate::strict_json::RequestBody, Splice),
    /// An outcome surfaced as an error: the stream ended with its error event; a JSON
    /// answer is this error, with its status. The journal's note of why, if any.
    Refused(SurfacedError, Option<String>),
    /// The answer is complete (or failed): journal state and error.
    Done(RoundState, Option<String>),
    /// The agent went away.
    ClientGone,
}

/// What the engine does after a decision point.
enum Next {
    Continue,
    Repair(crate::strict_json::RequestBody, Splice),
    Stop(SurfacedError),
    /// The agent went away while the calls were decided: nothing is released.
    Gone,
}

/// Where what the agent receives goes.
enum To {
    /// A stream: each chunk leaves at once.
    Stream(mpsc::Sender<Result<Bytes, Infallible>>),
    /// A JSON answer: held until the round's unit of work is committed, with the events and
    /// effect claims that unit carries.
    Held {
        chunks: Vec<Bytes>,
        events: Vec<EventRecord>,
        claims: Vec<(String, String)>,
    },
}

/// The agent's side of a round: where its bytes go, and a digest and bounded copy of what
/// it was sent (the served record of a run node; `cap` bytes, 0 for a chat turn).
pub(super) struct ToAgent {
    to: To,
    sent: Vec<u8>,
    total: usize,
    cap: usize,
    /// A stream's digest of what it sent so far.
    hasher: sha2::Sha256,
}

impl ToAgent {
    /// A stream's agent, at the other end of `tx`.
    pub(super) fn stream(tx: mpsc::Sender<Result<Bytes, Infallible>>, cap: usize) -> Self {
        Self::new(To::Stream(tx), cap)
    }

    /// A JSON answer's agent: what it receives is held until the round is committed.
    pub(super) fn held(cap: usize) -> Self {
        Self::new(
            To::Held {
                chunks: Vec::new(),
                events: Vec::new(),
                claims: Vec::new(),
            },
            cap,
        )
    }

    fn new(to: To, cap: usize) -> Self {
        Self {
            to,
            sent: Vec::new(),
            total: 0,
            cap,
            hasher: <sha2::Sha256 as sha2::Digest>::new(),
        }
    }

    /// What is sent is held until the round's commit (a JSON answer).
    fn holds(&self) -> bool {
        matches!(self.to, To::Held { .. })
    }

    /// The held answer's body (a JSON answer; empty for a stream).
    pub(super) fn take_body(&mut self) -> Bytes {
        match &mut self.to {
            To::Held { chunks, .. } if chunks.len() == 1 => chunks.pop().unwrap_or_default(),
            To::Held { chunks, .. } => Bytes::from(std::mem::take(chunks).concat()),
            To::Stream(_) => Bytes::new(),
        }
    }

    /// What was sent, as a journal record, redacted (a digest only past the cap).
    /// A held answer is digested here, from its chunks (a chat turn never asks, so never pays
    /// for it); a stream's digest is taken as it goes, since its bytes are not kept.
    fn recorded(&self, redactor: &crate::policy::Redactor) -> crate::journal::Recorded {
        use sha2::Digest;
        let truncated = self.total > self.cap;
        let (kept, digest) = match &self.to {
            To::Held { chunks, .. } => {
                let mut hasher = sha2::Sha256::new();
                chunks.iter().for_each(|c| hasher.update(c));
                ((!truncated).then(|| chunks.concat()), hasher.finalize())
            }
            To::Stream(_) => (
                (!truncated).then(|| self.sent.clone()),
                self.hasher.clone().finalize(),
            ),
        };
        crate::journal::Recorded::redacted_parts(
            kept,
            self.total as u64,
            hex::encode(digest),
            redactor,
        )
    }

    /// Sends (or holds) every chunk of `out`; `false` once the agent has gone.
    pub(super) async fn send_all(&mut self, out: &mut Vec<Bytes>) -> bool {
        for chunk in out.drain(..) {
            self.total += chunk.len();
            match &mut self.to {
                To::Held { chunks, .. } => chunks.push(chunk),
                To::Stream(tx) => {
                    sha2::Digest::update(&mut self.hasher, &chunk);
                    if self.sent.len() + chunk.len() <= self.cap {
                        self.sent.extend_from_slice(&chunk);
                    }
                    if tx.send(Ok(chunk)).await.is_err() {
                        return false;
                    }
                }
            }
        }
        true
    }

    fn is_gone(&self) -> bool {
        match &self.to {
            To::Stream(tx) => tx.is_closed(),
            To::Held { .. } => false,
        }
    }
}

/// What the engine carries across rounds for the edge and for shutdown (issue 6).
pub(super) struct RelayCtx {
    /// The edge's timing of this request.
    pub timing: Option<Arc<crate::edge::Timing>>,
    /// Turns true when the drain deadline passed: the answer is cut.
    pub cut: tokio::sync::watch::Receiver<bool>,
    /// No upstream body byte seen yet (`turnguard_upstream_ttfb_seconds`, streams).
    pub first_byte: bool,
    /// When the whole answer must have arrived (a JSON answer: `upstream_response_timeout_ms`
    /// after the request was sent); a stream has none.
    pub deadline: Option<tokio::time::Instant>,
}

/// Why the upstream body stopped before its end.
struct Cut {
    reason: String,
    /// What a JSON answer counts in `turnguard_upstream_errors_total` (a stream counts
    /// every cut as `stream_cut`).
    counted: Option<UpstreamError>,
}

impl Cut {
    fn new(reason: String, counted: Option<UpstreamError>) -> Self {
        Self { reason, counted }
    }
}

/// Reads one model round from `body` into `pipeline`, deciding at each decision point, and
/// sends what the agent may receive as it goes (a stream) or holds it (a JSON answer). The
/// upstream body is bounded in time: `upstream_idle_timeout_ms` between chunks, the
/// relay's deadline for the whole, and the drain deadline at shutdown.
pub(super) async fn read_round(
    session: &Session,
    pipeline: &mut Pipeline,
    body: &mut Incoming,
    agent: &mut ToAgent,
    relay: &mut RelayCtx,
) -> RoundEnd {
    let idle = Duration::from_millis(session.state.config.upstream_idle_timeout_ms);
    let whole = session.state.config.upstream_response_timeout_ms;
    let held = agent.holds();
    let mut out: Vec<Bytes> = Vec::new();
    let cut = loop {
        // A frame that is already here (a JSON answer comes with its headers) is taken as
        // the biased select below would take it, without arming the idle timer or timing a
        // wait that did not happen (four clock reads a frame, issue 13's profile).
        let next = match body.frame().now_or_never() {
            Some(frame) => Ok(frame),
            None => {
                let waited = Instant::now();
                let deadline = async {
                    match relay.deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                };
                let next = tokio::select! {
                    biased;
                    next = tokio::time::timeout(idle, body.frame()) => next,
                    _ = relay.cut.wait_for(|c| *c) => {
                        break Some(Cut::new("turnguard is shutting down: the drain deadline passed".to_owned(), None))
                    }
                    () = deadline => break Some(Cut::new(format!(
                        "the upstream's response did not complete within {whole} ms (upstream_response_timeout_ms; raise it with --upstream-response-timeout-ms)"
                    ), Some(UpstreamError::ResponseTimeout))),
                };
                if held {
                    crate::edge::upstream_waited(waited, waited.elapsed());
                }
                next
            }
        };
        let frame = match next {
            Err(_) => break Some(Cut::new(format!(
                "the upstream sent no data for {} ms (upstream_idle_timeout_ms; raise it with --upstream-idle-timeout-ms)",
                idle.as_millis()
            ), Some(UpstreamError::IdleTimeout))),
            Ok(None) => break None,
            Ok(Some(Err(e))) => break Some(Cut::new(format!("upstream body failed: {e}"), None)),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        // A JSON answer's work is the handler's own time; a stream's runs after the headers.
        let work = (!held).then(Instant::now);
        if relay.first_byte && !held {
            relay.first_byte = false;
            if let Some(sent) = relay.timing.as_ref().and_then(|t| t.upstream_sent()) {
                session
                    .state
                    .metrics
                    .upstream_ttfb
                    .get_or_create(&ApiLabels {
                        api: session.turn.api.into(),
                    })
                    .observe(sent.elapsed().as_secs_f64());
            }
        }
        let fed = pipeline.feed(&data);
        if let (Some(t), Some(work)) = (relay.timing.as_ref(), work) {
            t.add_work(work.elapsed());
        }
        if let Err(reason) = fed {
            break Some(Cut::new(reason, None));
        }
        while let Some(round) = pipeline.advance(&mut out) {
            if let Some(end) = at_decision(session, pipeline, round, &mut out, agent).await {
                return end;
            }
        }
        if let Some(why) = pipeline.broken() {
            // Nothing more of this upstream body is read or forwarded: `finish` ends the
            // agent's answer with the provider-shaped error.
            break Some(Cut::new(why.to_owned(), None));
        }
        if !agent.send_all(&mut out).await {
            return RoundEnd::ClientGone;
        }
    };
    if let Some(c) = &cut {
        let counted = if held {
            c.counted
        } else {
            Some(UpstreamError::StreamCut)
        };
        if let Some(reason) = counted {
            count(session, reason);
        }
    }
    let cut = cut.map(|c| c.reason);
    loop {
        match pipeline.finish(cut.clone(), &mut out) {
            Finish::Decide(round) => {
                if let Some(end) = at_decision(session, pipeline, round, &mut out, agent).await {
                    return end;
                }
            }
            Finish::Refused { reason, message } => {
                return refused_answer(session, pipeline, reason, &message, &mut out, agent).await;
            }
            Finish::Ended(state, error) => {
                if !agent.send_all(&mut out).await {
                    return RoundEnd::ClientGone;
                }
                return RoundEnd::Done(state, error);
            }
        }
    }
}

/// Decides a decision point; `Some` when the round ends there.
async fn at_decision(
    session: &Session,
    pipeline: &mut Pipeline,
    round: Vec<ChoiceEmissions>,
    out: &mut Vec<Bytes>,
    agent: &mut ToAgent,
) -> Option<RoundEnd> {
    match decide(session, pipeline, round, out, agent).await {
        Next::Continue => None,
        Next::Repair(body, splice) => {
            agent.send_all(out).await;
            Some(RoundEnd::Repair(body, splice))
        }
        Next::Stop(e) => Some(if agent.send_all(out).await {
            RoundEnd::Refused(e, None)
        } else {
            RoundEnd::ClientGone
        }),
        Next::Gone => Some(RoundEnd::ClientGone),
    }
}

/// A text answer that did not meet its channel's schema (tool-turn contract §A): a JSON
/// answer, of which nothing has left, is repaired once more when the reason is repairable,
/// repairs are left and one choice was asked for; otherwise the answer ends with the
/// channel's error (422 for a JSON answer).
async fn refused_answer(
    session: &Session,
    pipeline: &mut Pipeline,
    reason: &'static str,
    message: &str,
    out: &mut Vec<Bytes>,
    agent: &mut ToAgent,
) -> RoundEnd {
    let adapter = crate::provider::adapter(session.turn.api);
    // Context exhaustion is not repaired: a longer transcript cannot fit either.
    if agent.holds()
        && crate::admission::completion::repairable(reason)
        && session.repairs_left > 0
        && adapter.choices_requested(session.body.tree()) == 1
    {
        let spec_name = session.channel.as_ref().map_or("", |c| c.name.as_str());
        let feedback = format!(
            "turnguard: {message}. Answer again with only a JSON document valid against the schema `{}`.",
            crate::admission::sanitize_label(spec_name)
        );
        let mut next = session.body.clone();
        adapter.append_text_repair(next.tree_mut(), pipeline.answer_text(), &feedback);
        return RoundEnd::Repair(next, pipeline.abandon_answer());
    }
    let channel = session
        .channel
        .as_ref()
        .map_or("text", |c| c.channel.as_str());
    let e = SurfacedError {
        status: 422,
        code: crate::admission::completion::channel_error_code(reason),
        message: format!("the {channel} answer was not accepted: {message}"),
        retry_after_secs: None,
    };
    pipeline.end_with(e.code, &e.message, out);
    if agent.send_all(out).await {
        RoundEnd::Refused(
            e,
            Some("the text answer did not meet its channel's schema".to_owned()),
        )
    } else {
        RoundEnd::ClientGone
    }
}

/// Admits `round`; while a stream's held calls wait for an approval, SSE comment
/// keep-alives go out (`: keep-alive`), which every SSE client ignores.
async fn admit(
    session: &Session,
    round: &[ChoiceEmissions],
    agent: &ToAgent,
) -> (Vec<ChoiceVerdict>, Vec<EventRecord>) {
    let To::Stream(tx) = &agent.to else {
        return session.admit(round, &crate::approvals::InRequest).await;
    };
    let every = Duration::from_millis(session.state.config.approval_keepalive_ms.max(10));
    let mut keepalive = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    // The approval of a held round is used only while the agent is there (its channel
    // open): a stream whose agent left stops waiting and uses nothing.
    let admit = session.admit(round, tx);
    tokio::pin!(admit);
    loop {
        tokio::select! {
            v = &mut admit => break v,
            _ = keepalive.tick() => {
                // Never blocks the wait: a full queue already keeps the connection busy,
                // and an agent that left does not end the wait (a re-sent request meets
                // the same interrupt).
                let _ = tx.try_send(Ok(Bytes::from_static(b": keep-alive\n\n")));
            }
        }
    }
}

/// Admits one decision point and applies how it surfaces. What the agent may already have
/// (text before the held calls) is sent first.
async fn decide(
    session: &Session,
    pipeline: &mut Pipeline,
    round: Vec<ChoiceEmissions>,
    out: &mut Vec<Bytes>,
    agent: &mut ToAgent,
) -> Next {
    agent.send_all(out).await;
    let started = Instant::now();
    let (verdicts, events) = admit(session, &round, agent).await;
    match &mut agent.to {
        // A JSON answer's events go in its round's unit of work.
        To::Held { events: held, .. } => held.extend(events),
        To::Stream(_) => {
            session
                .state
                .metrics
                .hold_latency
                .get_or_create(&ApiLabels {
                    api: session.turn.api.into(),
                })
                .observe(started.elapsed().as_secs_f64());
            // A stream's round is recorded when it ends; its decisions' events are
            // journaled now, so the run's event feed shows them while the stream goes on.
            if let Err(e) = session.state.journal.record_events(events).await {
                tracing::error!(error = %e, request_id = %session.ctx.request_id(), "events not journaled");
            }
        }
    }
    if agent.is_gone() {
        // Nothing leaves: the claims of calls that would have been released are given back.
        for (effect_id, call_id) in claims_of(&verdicts) {
            if let Err(e) = session
                .state
                .journal
                .release_claim(&effect_id, &call_id)
                .await
            {
                tracing::error!(error = %e, "an effect claim could not be given back");
            }
        }
        pipeline.fail(
            round,
            verdicts,
            "turnguard.agent_gone",
            "the agent left",
            out,
        );
        out.clear();
        return Next::Gone;
    }
    if let Some(e) = verdicts.iter().find_map(|v| match &v.surfacing {
        Surfacing::Error(e) => Some(e.clone()),
        _ => None,
    }) {
        pipeline.fail(round, verdicts, e.code, &e.message, out);
        return Next::Stop(e);
    }
    let repair = round
        .iter()
        .zip(&verdicts)
        .find_map(|(c, v)| match &v.surfacing {
            Surfacing::Repair(items) => Some(session.repaired(c, items)),
            _ => None,
        });
    if let Some(body) = repair {
        let splice = pipeline.abandon(round, verdicts);
        return Next::Repair(body, splice);
    }
    if let To::Held { claims, .. } = &mut agent.to {
        // Confirmed in the round's commit, before the answer leaves.
        claims.extend(claims_of(&verdicts));
    } else if let Err(e) = confirm_claims(session, &verdicts).await {
        pipeline.fail(round, verdicts, e.code, &e.message, out);
        return Next::Stop(e);
    }
    pipeline.release(round, verdicts, out);
    Next::Continue
}

/// A stream's calls are about to leave: their effect claims are confirmed first. A claim
/// taken over by another owner since (PostgreSQL, `JournalError::Fenced`) is no longer ours:
/// nothing of the round leaves (fail closed); any other failure is logged.
async fn confirm_claims(
    session: &Session,
    verdicts: &[ChoiceVerdict],
) -> Result<(), SurfacedError> {
    match session
        .state
        .journal
        .confirm_claims(claims_of(verdicts))
        .await
    {
        Ok(()) => Ok(()),
        Err(e @ crate::journal::JournalError::Fenced(_)) => {
            tracing::error!(error = %e, request_id = %session.ctx.request_id(), "effect claim taken over; the round is withheld");
            Err(SurfacedError {
                status: 503,
                code: "turnguard.journal_unavailable",
                message: e.to_string(),
                retry_after_secs: None,
            })
        }
        Err(e) => {
            tracing::error!(error = %e, request_id = %session.ctx.request_id(), "effect claims not confirmed");
            Ok(())
        }
    }
}

/// Journals a round that ended: the round itself, and for a clean end the served record of
/// what the agent received (over the record cap the body is kept as a digest only, but the
/// released calls are still recorded, so a re-sent round finds them in doubt), in one
/// commit. A JSON answer's unit also carries its events and claims.
///
/// Errors: a claim of the answer was taken over by another owner since
/// (`JournalError::Fenced`, PostgreSQL): the answer must not leave.
pub(super) async fn finish_round(
    session: &Session,
    base: &RoundBase,
    pipeline: &mut Pipeline,
    end: &RoundEnd,
    agent: &mut ToAgent,
    (status, content_type): (u16, &str),
) -> Result<(), crate::journal::JournalError> {
    let (state, error) = match end {
        RoundEnd::Repair(..) => (RoundState::Repaired, None),
        RoundEnd::Refused(_, why) => (RoundState::SurfacedError, why.clone()),
        RoundEnd::Done(s, e) => (*s, e.clone()),
        RoundEnd::ClientGone => (
            RoundState::ClientGone,
            Some("the agent closed the stream".to_owned()),
        ),
    };
    let secrets = pipeline.decided.iter().any(|(_, v)| has_secrets(v));
    let (events, claims) = match &mut agent.to {
        To::Held { events, claims, .. } => (std::mem::take(events), std::mem::take(claims)),
        To::Stream(_) => (Vec::new(), Vec::new()),
    };
    let unit = Box::new(RoundCommit {
        round: Some(round_of(session, base, pipeline, state, error, secrets)),
        events,
        ..RoundCommit::default()
    });
    if state != RoundState::Ok {
        if let Err(e) = super::record::commit_round(session, unit).await {
            tracing::error!(request_id = %session.ctx.request_id(), error = %e, "round not journaled");
        }
        return Ok(());
    }
    let calls: Vec<_> = pipeline
        .decided
        .iter()
        .flat_map(|(r, v)| session.served_calls(r, v))
        .collect();
    let agent = &*agent;
    let body = || {
        let body = agent.recorded(&session.policy.redactor);
        if secrets {
            body.withheld()
        } else {
            body
        }
    };
    // The round and what the agent received, in one commit.
    session
        .commit_answer(base, unit, status, content_type, body, calls, claims)
        .await
}

/// The round record of a round that ended.
fn round_of(
    session: &Session,
    base: &RoundBase,
    pipeline: &mut Pipeline,
    state: RoundState,
    error: Option<String>,
    secrets: bool,
) -> crate::journal::RoundRecord {
    let mut rec = round_record(session, base, state, &[]);
    let received = pipeline.received(&session.policy.redactor);
    rec.response = if secrets {
        received.withheld()
    } else {
        received
    };
    rec.error = error;
    let completions = pipeline.completions();
    if !completions.is_empty() {
        rec.completion = Some(join(completions.iter().map(|c| c.state.as_str())));
        rec.finish_reason = Some(join(completions.iter().map(|c| c.reason.as_str())));
    }
    if let Some((channel, result)) = pipeline.channel_result() {
        session
            .state
            .metrics
            .emissions
            .get_or_create(&EmissionLabels { channel, result })
            .inc();
        rec.channel = Some(channel.as_str());
        rec.channel_result = Some(result.to_owned());
    }
    rec.calls = pipeline.call_records(&session.call_ids());
    rec.response_link = session.judged(pipeline.response_link(), &rec.calls);
    rec
}

fn count(session: &Session, reason: UpstreamError) {
    session
        .state
        .metrics
        .upstream_errors
        .get_or_create(&ReasonLabels { reason })
        .inc();
}
