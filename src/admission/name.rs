//! Stage 2, **name** (tool-turn contract §B): the called tool must be declared in the
//! request's `tools`, and known to (or allowed unknown by) the catalog (`unknown_tools`).
//!
//! A call's identity is its tool's name, qualified `namespace.name` when it names a Responses
//! namespace ([`crate::model::qualified_name`]): a call to `exec` in namespace `functions`
//! matches a tool declared as `exec` inside the namespace tool `functions` (whether at the
//! top level or in an `additional_tools` input item), and the catalog knows it as
//! `functions.exec`. An unqualified catalog name never matches a namespaced call, so a tool
//! of another namespace (an MCP server's, say) cannot borrow a catalogued tool's
//! classification by sharing its short name.

use crate::model::{Decision, Outcome, Stage, ToolCall, Turn};
use crate::policy::bundle::UnknownTools;
use crate::policy::CompiledPolicy;

/// `Some(invalid)` when the tool is not declared in the request; `Some(refused)` when the
/// catalog does not know it and the bundle refuses unknown tools.
pub fn check(turn: &Turn, call: &ToolCall, policy: &CompiledPolicy) -> Option<Decision> {
    let name = super::sanitize_label(&call.name);
    if turn.declared(&call.name).is_none() {
        return Some(Decision::new(
            Outcome::Invalid,
            Stage::Name,
            crate::reason::Reason::UndeclaredTool,
            format!("the tool `{name}` is not declared in this request's tools"),
        ));
    }
    if policy.catalog.by_name(&call.name).is_none()
        && policy.settings.unknown_tools == UnknownTools::Refuse
    {
        return Some(Decision::new(
            Outcome::Refused,
            Stage::Name,
            crate::reason::Reason::UnknownTool,
            format!("the tool `{name}` is not in the tool catalog, and this bundle refuses unknown tools"),
        ));
    }
    None
}
