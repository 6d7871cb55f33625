//! Low-level vocabulary shared by every layer: wall-clock milliseconds and the agent's actor
//! id. It imports nothing from turnguard, so the journal and identity layers need nothing from
//! the request path ([`crate::proxy`] re-exports both; issue 13 item 1).

use std::time::{SystemTime, UNIX_EPOCH};

/// The OpenWOP `agentId` of events turnguard writes for the agent it fronts.
pub const AGENT_ID: &str = "agent";

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
