//! Trust lookups in the journal (tool-turn contract §C), beside the pure rules of
//! [`crate::admission::trust`]:
//!
//! - [`response_chain`]: a Responses request that continues a stored response
//!   (`previous_response_id`) is judged by that response chain as turnguard journaled it
//!   (table `responses`); tool results answering calls of the stored response get their tool
//!   names from its journaled calls (the request itself does not echo them).
//! - [`sticky`]: with `Turnguard-Run`, once a turn of the run is untrusted, every later turn
//!   of the run is untrusted — across requests, attempts and restarts (journaled in
//!   `run_trust`, insert-if-absent).

use crate::model::{ChainLink, Turn, UntrustedKind};
use crate::policy::bundle::ContentTrust;
use crate::state::AppState;

use super::RequestCtx;

/// Links read back from `previous_response_id`: one. Chain trust is inductive (a stored
/// response is `trusted` only if its own chain was; [`crate::admission::trust::chain_fault`]),
/// so the last link stands for the chain.
pub const MAX_CHAIN: usize = 1;

/// The journal's links of the response chain `turn` continues, from its
/// `previous_response_id` back (empty when it continues none, when the journal does not know
/// the response, or when the journal cannot be read: all untrusted but the first, see
/// [`crate::admission::trust::of_turn`]). Tool results in `turn` whose call the request does
/// not show get the tool name journaled for that call in the response it continues (none
/// found: no name, so the result is untrusted). A result whose call the request shows
/// although the response it continues already holds a call with that id makes the turn
/// untrusted ([`UntrustedKind::DuplicateCallId`]): the model's transcript then has the id
/// twice, and which call — which tool's trust — the result answers is the agent's word.
pub async fn response_chain(state: &AppState, ctx: &RequestCtx, turn: &mut Turn) -> Vec<ChainLink> {
    let Some(previous) = turn.previous_response_id.clone() else {
        return Vec::new();
    };
    let results: Vec<(String, bool)> = turn
        .tool_results
        .iter()
        .map(|r| (r.tool_call_id.clone(), r.tool_name.is_some()))
        .collect();
    let reader = &state.reader;
    let found = async {
        let links = reader.response_chain(&previous, MAX_CHAIN).await?;
        // The outputs a continuing request carries answer the calls of the response it
        // continues (the provider refuses a request that leaves one unanswered).
        let (mut names, mut shown_again) = (Vec::new(), Vec::new());
        if let Some(link) = links.first().filter(|l| l.response_id == previous) {
            for (call_id, named_by_request) in results {
                if let Some(name) = reader.call_name(&link.request_id, &call_id).await? {
                    if named_by_request {
                        shown_again.push(call_id);
                    } else {
                        names.push((call_id, name));
                    }
                }
            }
        }
        Ok::<_, crate::journal::JournalError>((links, names, shown_again))
    }
    .await;
    let (links, names, shown_again) = match found {
        Ok(found) => found,
        Err(e) => {
            tracing::error!(error = %e, request_id = %ctx.request_id(), "response chain not readable; the turn is untrusted (fail closed)");
            return Vec::new();
        }
    };
    for (call_id, name) in names {
        for r in turn.tool_results.iter_mut() {
            if r.tool_call_id == call_id && r.tool_name.is_none() {
                r.tool_name = Some(name.clone());
            }
        }
    }
    for call_id in shown_again {
        turn.untrusted(
            UntrustedKind::DuplicateCallId,
            format!(
                "input: call `{}`, also a call of previous_response_id",
                crate::admission::sanitize_label(&call_id)
            ),
        );
    }
    if let Some(previous) = &turn.previous_response_id {
        if let Some(fault) = crate::admission::trust::chain_fault(previous, &links) {
            tracing::info!(
                request_id = %ctx.request_id(),
                previous_response_id = %previous,
                response_id = %fault.response_id,
                reason = fault.reason,
                links = links.len(),
                "the response chain this turn continues is untrusted"
            );
        }
    }
    links
}

/// Resolves the turn's Responses `item_reference`s against turnguard's journal: a reference
/// to an item turnguard relayed and recorded as trusted output
/// ([`crate::admission::trust::reference_fault`]) takes that trust; every other reference
/// (unknown, provider-executed, from an untrusted turn) stays untrusted, and so does every
/// reference when the journal cannot be read (fail closed).
pub async fn item_references(state: &AppState, ctx: &RequestCtx, turn: &mut Turn) {
    if turn.item_references.is_empty() {
        return;
    }
    let ids: Vec<String> = turn.item_references.iter().map(|r| r.id.clone()).collect();
    let rows = match state.reader.stored_items(&ids).await {
        Ok(rows) => rows,
        Err(e) => {
            tracing::error!(error = %e, request_id = %ctx.request_id(), "stored items not readable; item references stay untrusted (fail closed)");
            return;
        }
    };
    let mut trusted = std::collections::BTreeSet::new();
    for row in rows {
        match crate::admission::trust::reference_fault(&row) {
            None => {
                trusted.insert(row.item_id);
            }
            Some(reason) => tracing::info!(
                request_id = %ctx.request_id(),
                item_id = %crate::admission::sanitize_label(&row.item_id),
                response_id = %crate::admission::sanitize_label(&row.response_id),
                reason,
                "an item_reference names stored output that is not trusted"
            ),
        }
    }
    turn.resolve_references(&trusted);
}

/// The turn's effective `contentTrust`: `turn` (the meet of its inputs), made untrusted when
/// its run was untrusted before (read from the journal, never through its writer). An
/// untrusted turn is untrusted whatever the run was; its run's bit is set before the request
/// goes upstream ([`super::record::record_before_upstream`]). A journal failure fails closed
/// (untrusted).
pub async fn sticky(state: &AppState, ctx: &RequestCtx, turn: ContentTrust) -> ContentTrust {
    let Some(run) = &ctx.run.run_id else {
        return turn;
    };
    if turn == ContentTrust::Untrusted {
        return turn;
    }
    match state.reader.run_untrusted(run).await {
        Ok(true) => ContentTrust::Untrusted,
        Ok(false) => turn,
        Err(e) => {
            tracing::error!(error = %e, request_id = %ctx.request_id(), "run trust not readable; the turn is untrusted (fail closed)");
            ContentTrust::Untrusted
        }
    }
}
