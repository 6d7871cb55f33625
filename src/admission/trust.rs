//! Stage 4, **trust** (tool-turn contract §C). A turn's `contentTrust` is the meet of its
//! inputs: system/developer and the acting person's messages are trusted; a tool result takes
//! the `contentTrust` its catalog descriptor declares (unknown tool: untrusted, fail closed);
//! provider-executed tool output is always untrusted. Any trust value inside model output or
//! tool arguments is ignored: trust is derived here, from the catalog, only.

use crate::model::{Decision, Outcome, Stage, Turn};
use crate::policy::bundle::ContentTrust;
use crate::policy::{CatalogTool, CompiledPolicy};

/// The turn's `contentTrust`.
pub fn of_turn(turn: &Turn, policy: &CompiledPolicy) -> ContentTrust {
    if turn.provider_output_seen {
        return ContentTrust::Untrusted;
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

/// `Some(held)` when the turn is untrusted, the tool is gated (`write`/`exec`, egress other
/// than `none`, or `approval = "always"`) and no approval covers the call.
pub fn check(trust: ContentTrust, tool: &CatalogTool, approved: bool) -> Option<Decision> {
    if trust == ContentTrust::Trusted || !tool.gated() || approved {
        return None;
    }
    Some(Decision::new(
        Outcome::Held,
        Stage::Trust,
        "untrusted_turn",
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
