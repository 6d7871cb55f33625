//! Relaying an SSE response: upstream bytes → framer → provider stream adapter → agent.
//!
//! Text is forwarded the moment its event is complete; tool-call events are held by the
//! adapter until the completion state is known, then admitted and released, replaced, or —
//! for a repair — dropped while turnguard asks the model again and splices the new round's
//! stream into the agent's (one message for the SDK). A stream that ends before its terminal
//! event is a cut: nothing held is released and the agent's stream ends with a
//! provider-shaped error event. Each round is journaled with the upstream bytes as decoded
//! (after `Content-Encoding`, so redaction reads them).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::engine::{finish_round, read_round, RelayCtx, RoundEnd, ToAgent};
use super::pipeline::Pipeline;
use super::{upstream, RoundBase, Session};
use crate::metrics::{ReasonLabels, UpstreamError};

/// Chunks buffered toward a slow agent before the relay waits (back-pressure).
const OUT_QUEUE: usize = 64;

/// Starts relaying `resp` (whose body is coded as `coding`) to the agent and returns the
/// agent's response at once.
pub fn relay(
    session: Session,
    base: RoundBase,
    resp: http::Response<Incoming>,
    coding: upstream::ContentCoding,
) -> Response {
    let (parts, body) = resp.into_parts();
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(OUT_QUEUE);
    // The edge's timing lives in this (the handler's) task; the relay runs in its own.
    let timing = crate::edge::current();
    tokio::spawn(run(session, base, body, coding, tx, timing));
    let mut out = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    *out.status_mut() = parts.status;
    *out.headers_mut() = upstream::response_headers(&parts.headers, false);
    out
}

async fn run(
    mut session: Session,
    mut base: RoundBase,
    mut body: Incoming,
    mut coding: upstream::ContentCoding,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
    timing: Option<Arc<crate::edge::Timing>>,
) {
    // Counts the relay in `turnguard_inflight_streams` for as long as it lives.
    let _inflight = crate::metrics::GaugeGuard::new(&session.state.metrics.inflight_streams);
    let mut relay = RelayCtx {
        timing,
        cut: session.state.lifecycle.cut_signal(),
        first_byte: true,
        deadline: None,
    };
    let mut splice = None;
    // A body the journal does not keep (a chat turn's, `journal_bodies`) is not copied:
    // only its digest and size are taken.
    let cap = if super::record::keeps_body(&session.state, &session.ctx.run) {
        session.state.config.journal_max_record_bytes
    } else {
        0
    };
    let mut agent = ToAgent::stream(tx, cap);
    loop {
        let mut pipeline =
            Pipeline::new(&session.turn, session.state.config.max_event_bytes, splice)
                .with_coding(coding)
                .with_hold_cap(session.state.config.max_response_bytes)
                .with_capture(cap)
                .with_channel(
                    session.channel.clone(),
                    std::sync::Arc::clone(&session.state.schemas),
                );
        let end = read_round(&session, &mut pipeline, &mut body, &mut agent, &mut relay).await;
        // Its claims were confirmed when the calls left: nothing to fence here.
        let _ = finish_round(
            &session,
            &base,
            &mut pipeline,
            &end,
            &mut agent,
            (200, "text/event-stream"),
        )
        .await;
        let RoundEnd::Repair(next, how) = end else {
            return;
        };
        session.body = next;
        session.agent_bytes = None;
        session.count_repair();
        let Some((next_base, next_body, next_coding)) =
            repair_round(&mut session, &mut agent).await
        else {
            return;
        };
        base = next_base;
        body = next_body;
        coding = next_coding;
        splice = Some(how);
    }
}

/// Sends the repair round upstream: its base, body and coding when it answers with an event
/// stream turnguard can decode; otherwise the agent's stream ends with the provider-shaped
/// `turnguard.repair_failed` error and `None`.
async fn repair_round(
    session: &mut Session,
    agent: &mut ToAgent,
) -> Option<(RoundBase, Incoming, upstream::ContentCoding)> {
    let sent = session.send().await;
    let next_coding = sent
        .as_ref()
        .ok()
        .map(|r| upstream::content_coding(r.headers()));
    let why = match sent {
        Ok(resp)
            if resp.status().is_success()
                && super::is_event_stream(resp.headers())
                && matches!(next_coding, Some(Ok(_))) =>
        {
            let base = session.base(resp.status().as_u16());
            let coding = match next_coding {
                Some(Ok(c)) => c,
                _ => upstream::ContentCoding::Identity,
            };
            return Some((base, resp.into_body(), coding));
        }
        Ok(resp) => {
            let status = resp.status().as_u16();
            let content_type = resp
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .chars()
                .take(80)
                .collect::<String>();
            if let Some(Err(e)) = &next_coding {
                e.clone()
            } else if resp.status().is_success() {
                format!("the repair round's answer is not an event stream (HTTP {status}, content-type {content_type})")
            } else {
                format!("the repair round failed upstream with HTTP {status}")
            }
        }
        Err(e) => e.to_string(),
    };
    session
        .state
        .metrics
        .upstream_errors
        .get_or_create(&ReasonLabels {
            reason: UpstreamError::RepairRoundFailed,
        })
        .inc();
    let mut out = Vec::new();
    let mut p = Pipeline::new(&session.turn, session.state.config.max_event_bytes, None);
    p.end_with("turnguard.repair_failed", &why, &mut out);
    agent.send_all(&mut out).await;
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::RoundState;
    use crate::proxy::pipeline::Finish;
    use crate::sse::SseFramer;
    use std::io::Write;

    #[test]
    fn a_gzip_stream_is_decoded_to_its_end() {
        let turn = crate::provider::adapter(crate::model::Api::OpenAiChat)
            .parse_request(&serde_json::json!({"model": "m", "stream": true, "messages": []}))
            .unwrap();
        let sse = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(sse).unwrap();
        let coded = enc.finish().unwrap();
        let mut p = Pipeline::new(&turn, 1 << 20, None).with_coding(upstream::ContentCoding::Gzip);
        let mut out = Vec::new();
        // Split as the mock provider serves a file: by what looks like SSE blocks.
        let mut f = SseFramer::new(usize::MAX);
        let mut pieces: Vec<Bytes> = f.push(&coded).unwrap().into_iter().map(|b| b.raw).collect();
        let (blocks, rest) = f.finish();
        pieces.extend(blocks.into_iter().map(|b| b.raw));
        pieces.push(rest);
        eprintln!("{} pieces", pieces.len());
        for piece in pieces {
            p.feed(&piece).unwrap();
            assert!(p.advance(&mut out).is_none());
        }
        assert!(matches!(
            p.finish(None, &mut out),
            Finish::Ended(RoundState::Ok, None)
        ));
        let joined: Vec<u8> = out.iter().flat_map(|b| b.to_vec()).collect();
        assert_eq!(
            String::from_utf8_lossy(&joined),
            String::from_utf8_lossy(sse)
        );
    }
}
