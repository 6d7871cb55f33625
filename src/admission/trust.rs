//! Stage 4, **trust** (tool-turn contract §C). A turn's `contentTrust` is the meet of its
//! inputs: system/developer and the acting person's messages are trusted; a tool result takes
//! the `contentTrust` its catalog descriptor declares (unknown tool: untrusted, fail closed);
//! provider-executed tool output is always untrusted; and every input the adapter could not
//! judge — a role or item type it does not recognise, content the provider fetches or holds
//! (a URL, a file id), a tool-call id used for two calls — is untrusted
//! ([`crate::model::Turn::untrusted_inputs`]; DESIGN.md §9). Any trust value inside model output or
//! tool arguments is ignored: trust is derived here, from the catalog, only.
//!
//! A Responses request that continues a stored response (`previous_response_id = P`) has
//! inputs the proxy cannot see: the provider holds every earlier turn of the chain. Their
//! trust comes from turnguard's own journal of that chain ([`chain_fault`]): the turn is
//! trusted only when the journal holds every response from `P` back to the start of the chain
//! and none of them had provider-executed output, came from an untrusted turn, or ended
//! without a final status. An unknown chain is untrusted (fail closed). The journal lookup is
//! [`crate::proxy::trust::response_chain`]; this module only judges what it read.

use crate::model::{ChainLink, Decision, Outcome, ResponseLink, Stage, Turn};
use crate::policy::bundle::ContentTrust;
use crate::policy::{CatalogTool, CompiledPolicy};

/// The turn's `contentTrust`: the meet of the request's own inputs and, when it continues a
/// stored response, of that chain as the journal has it (`history`: the links read from the
/// named response back, see [`chain_fault`]; empty when the journal was not asked — offline —
/// or knows nothing, which is untrusted).
pub fn of_turn(turn: &Turn, policy: &CompiledPolicy, history: &[ChainLink]) -> ContentTrust {
    if !turn.untrusted_inputs.is_empty() {
        return ContentTrust::Untrusted;
    }
    if let Some(previous) = &turn.previous_response_id {
        if chain_fault(previous, history).is_some() {
            return ContentTrust::Untrusted;
        }
    }
    let all_trusted = turn.tool_results.iter().all(|r| {
        r.tool_name
            .as_deref()
            .and_then(|n| policy.catalog.by_name(n))
            .is_some_and(|t| t.content_trust == ContentTrust::Trusted)
    });
    if all_trusted {
        ContentTrust::Trusted
    } else {
        ContentTrust::Untrusted
    }
}

/// One input that made a turn untrusted, named for the person asked to approve its calls
/// (tool-turn contract §C; the approval page shows why a call was held). Names and ids come
/// from the request and are sanitized ([`crate::admission::sanitize_label`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(
    tag = "kind",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum UntrustedInput {
    /// A tool result whose tool's output is untrusted, or whose tool the catalog does not
    /// know (fail closed).
    ToolResult {
        /// The provider's call id the result answers.
        tool_call_id: String,
        /// The tool's name, when the transcript names it.
        tool_name: Option<String>,
        /// The catalog `toolId` (`turnguard:unknown` when not catalogued).
        tool_id: String,
        /// The catalog declares this tool.
        catalogued: bool,
    },
    /// An input of the request the adapter could not vouch for
    /// ([`crate::model::UntrustedInput`]): provider-executed output in the transcript, content
    /// the provider fetches, a reused call id, an unrecognised role or item.
    Request {
        /// [`crate::model::UntrustedKind::as_str`] (`provider_output`, `unrecognised_input` …).
        reason: &'static str,
        /// Its request path (`messages[2].content[1]`), names sanitized.
        at: String,
    },
    /// Provider-executed tool output (a web search, a fetch …) in the same response
    /// (contract §F).
    ProviderOutput,
    /// The stored response chain the request continues (`previous_response_id`) is not
    /// known to be trusted ([`chain_fault`]).
    ResponseChain {
        /// [`ChainFault::reason`].
        reason: &'static str,
        /// The response it is about.
        response_id: String,
    },
    /// An earlier turn of the same run was untrusted (the sticky bit of §C).
    EarlierTurnOfRun {
        /// The run id.
        run_id: String,
    },
}

/// Most inputs named per turn.
const MAX_NAMED_INPUTS: usize = 32;

/// The inputs of the request that make [`of_turn`] untrusted, in transcript order (at most
/// 32). Empty when the request's own inputs are trusted (the run's sticky bit or a response's
/// own provider output may still make its calls untrusted: the caller adds those).
pub fn untrusted_inputs(
    turn: &Turn,
    policy: &CompiledPolicy,
    history: &[ChainLink],
) -> Vec<UntrustedInput> {
    use crate::admission::sanitize_label;
    let mut out = Vec::new();
    for input in &turn.untrusted_inputs {
        out.push(UntrustedInput::Request {
            reason: input.kind.as_str(),
            at: input.at.clone(),
        });
    }
    if let Some(previous) = &turn.previous_response_id {
        if let Some(f) = chain_fault(previous, history) {
            out.push(UntrustedInput::ResponseChain {
                reason: f.reason,
                response_id: sanitize_label(&f.response_id),
            });
        }
    }
    for r in &turn.tool_results {
        let tool = r
            .tool_name
            .as_deref()
            .and_then(|n| policy.catalog.by_name(n));
        if tool.is_some_and(|t| t.content_trust == ContentTrust::Trusted) {
            continue;
        }
        out.push(UntrustedInput::ToolResult {
            tool_call_id: sanitize_label(&r.tool_call_id),
            tool_name: r.tool_name.as_deref().map(sanitize_label),
            tool_id: tool.map_or(crate::policy::rules::UNKNOWN_TOOL_ID.to_owned(), |t| {
                t.descriptor.tool_id.clone()
            }),
            catalogued: tool.is_some(),
        });
    }
    out.truncate(MAX_NAMED_INPUTS);
    out
}

/// Why a response chain makes a turn untrusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainFault {
    /// `unknown_response` (the journal does not hold it: a response turnguard never saw, or
    /// a chain too long to follow), `provider_executed` (its output held provider-run tool
    /// items), `untrusted_turn` (the turn that produced it was untrusted, or was never
    /// judged), `not_completed` (its stream was cut or it ended `failed` / `cancelled` …: the
    /// provider may hold output turnguard never saw).
    pub reason: &'static str,
    /// The response it is about (as the provider named it).
    pub response_id: String,
}

/// Judges the chain a request continues from `previous` by its last link, inductively:
/// `links[0]` must be the journal's row for `previous`, completed, free of provider-executed
/// output and recorded `trusted`. A response is recorded `trusted` only when the turn that
/// produced it was trusted ([`of_response`]), and that turn was judged by this same rule on
/// the response it continued — so a trusted link stands for its whole chain back to a
/// response that continued nothing, and one link is read, not the chain (nor is a chain
/// whose old links were pruned judged unknown). Later entries of `links` are not consulted.
/// `None` means the chain is trusted.
pub fn chain_fault(previous: &str, links: &[ChainLink]) -> Option<ChainFault> {
    let fault = |reason| {
        Some(ChainFault {
            reason,
            response_id: previous.to_owned(),
        })
    };
    let Some(link) = links.first().filter(|l| l.response_id == previous) else {
        return fault("unknown_response");
    };
    if link.provider_executed {
        return fault("provider_executed");
    }
    if link.content_trust != Some(ContentTrust::Trusted) {
        return fault("untrusted_turn");
    }
    if !matches!(link.status.as_deref(), Some("completed" | "incomplete")) {
        return fault("not_completed");
    }
    None
}

/// Judges a stored output item a Responses `item_reference` names, from the journal's row
/// (`None`: the reference takes the trust of what it points to, which is trusted). The item
/// must be one turnguard itself relayed and journaled, not executed by the provider, in a
/// response that completed (or stopped `incomplete`) and was recorded trusted — the rule
/// [`chain_fault`] applies to each response of a `previous_response_id` chain. A reference
/// the journal does not hold stays untrusted (the caller never lifts it). Only items that
/// carry no call are lifted (`message`, `reasoning`): a referenced call puts a call id into
/// the model's transcript that turnguard did not journal, so which call a result in the
/// request answers — and which tool's trust it takes — cannot be told (a request could name
/// the referenced `read_email` call's id again as `get_weather`'s, and its result would read
/// as trusted).
pub fn reference_fault(row: &crate::model::StoredItemRow) -> Option<&'static str> {
    if row.provider_executed {
        return Some("provider_executed");
    }
    if !matches!(row.item_type.as_str(), "message" | "reasoning") {
        return Some("not_message_or_reasoning");
    }
    if row.content_trust != Some(ContentTrust::Trusted) {
        return Some("untrusted_turn");
    }
    if !matches!(row.status.as_deref(), Some("completed" | "incomplete")) {
        return Some("not_completed");
    }
    None
}

/// The `contentTrust` a response is recorded with: the turn's, or untrusted when its output
/// held provider-executed items (contract §F). A later turn continuing the response reads it.
pub fn of_response(turn: ContentTrust, link: &ResponseLink) -> ContentTrust {
    if link.provider_items.is_empty() {
        turn
    } else {
        ContentTrust::Untrusted
    }
}

/// `Some(held)` when the turn is untrusted, the tool is gated (`write`/`exec`, egress other
/// than `none`, or `approval = "always"`) and no approval covers the call.
pub fn check(trust: ContentTrust, tool: &CatalogTool, approved: bool) -> Option<Decision> {
    if trust == ContentTrust::Trusted || !tool.gated() || approved {
        return None;
    }
    Some(Decision::new(
        Outcome::Held,
        Stage::Trust,
        crate::reason::Reason::UntrustedTurn,
        format!(
            "this turn read untrusted content, and `{}` ({}) needs the acting person's approval",
            tool.descriptor.tool_id,
            gate_reason(tool)
        ),
    ))
}

fn gate_reason(tool: &CatalogTool) -> String {
    let d = &tool.descriptor;
    format!(
        "safetyTier {}, egress {}",
        d.safety_tier.as_str(),
        d.egress.map_or("unspecified", |e| e.as_str())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(id: &str, prev: Option<&str>) -> ChainLink {
        ChainLink {
            response_id: id.into(),
            request_id: format!("req-{id}"),
            previous_response_id: prev.map(str::to_owned),
            status: Some("completed".into()),
            provider_executed: false,
            content_trust: Some(ContentTrust::Trusted),
            next_round_index: None,
            calls_so_far: None,
        }
    }

    #[test]
    fn a_trusted_completed_last_link_stands_for_its_chain() {
        let chain = [
            link("r3", Some("r2")),
            link("r2", Some("r1")),
            link("r1", None),
        ];
        assert_eq!(chain_fault("r3", &chain), None);
        assert_eq!(
            chain_fault("r3", &chain[..1]),
            None,
            "one link is enough: its trust was judged on the link before it"
        );
        let mut incomplete = chain.clone();
        incomplete[0].status = Some("incomplete".into());
        assert_eq!(chain_fault("r3", &incomplete), None);
    }

    #[test]
    fn a_bad_or_missing_last_link_is_a_fault() {
        let chain = vec![link("r3", Some("r2")), link("r2", Some("r1"))];
        let reason = |c: &[ChainLink]| chain_fault("r3", c).map(|f| (f.reason, f.response_id));
        assert_eq!(reason(&[]), Some(("unknown_response", "r3".into())));
        let wrong_start = [link("r2", Some("r1")), link("r1", None)];
        assert_eq!(
            reason(&wrong_start),
            Some(("unknown_response", "r3".into()))
        );
        let mut c = chain.clone();
        c[0].provider_executed = true;
        assert_eq!(reason(&c), Some(("provider_executed", "r3".into())));
        let mut c = chain.clone();
        c[0].content_trust = Some(ContentTrust::Untrusted);
        assert_eq!(reason(&c), Some(("untrusted_turn", "r3".into())));
        let mut c = chain.clone();
        c[0].content_trust = None;
        assert_eq!(
            reason(&c),
            Some(("untrusted_turn", "r3".into())),
            "never judged"
        );
        let mut c = chain.clone();
        c[0].status = None;
        assert_eq!(reason(&c), Some(("not_completed", "r3".into())));
        let mut c = chain.clone();
        c[0].status = Some("failed".into());
        assert_eq!(reason(&c), Some(("not_completed", "r3".into())));
    }

    #[test]
    fn a_response_with_provider_output_is_recorded_untrusted() {
        let mut l = ResponseLink {
            items: Vec::new(),
            response_id: "r".into(),
            previous_response_id: None,
            status: Some("completed".into()),
            provider_items: Vec::new(),
            content_trust: None,
            next_round_index: None,
            calls_so_far: None,
        };
        assert_eq!(
            of_response(ContentTrust::Trusted, &l),
            ContentTrust::Trusted
        );
        assert_eq!(
            of_response(ContentTrust::Untrusted, &l),
            ContentTrust::Untrusted
        );
        l.provider_items.push("web_search_call".into());
        assert_eq!(
            of_response(ContentTrust::Trusted, &l),
            ContentTrust::Untrusted
        );
    }
}
