//! Attacks, organised by leg (issue 10): each module is one attacker position's home, so the
//! next attack found has an obvious place. Every test is black-box over real sockets and
//! names the defect it pins.
//!
//! | module | attacker | the rule the code enforces |
//! |---|---|---|
//! | [`approvals`] | the agent, an admin-plane client | only the bound, verified person resolves exactly the interrupt they reviewed |
//! | [`trust`] | tool content, the agent's transcript | a turn's trust is the meet of every input; an input turnguard does not recognise is untrusted |
//! | [`upstream_bytes`] | the upstream's bytes, the model's output | an event reaches the agent only after it parsed and its calls were admitted |
//! | [`http_layer`] | the agent's HTTP, the upstream's HTTP | nothing is relayed that turnguard did not read whole within its bounds; no status sends the agent elsewhere; a client that stops reading holds no permit |
//! | [`chat_release_timing`] | the agent's results, the model's call ids (and their size) | a chat result's `durationMs` is exactly the time since the chat round that released its call (none for a call never released in a chat turn, or released in a run), on every API, streamed or not, and timing one costs the writer one search whatever the round holds |
//! | [`seen_results`] | the agent's transcript (results sent again, changed, as another principal), tool content | a result the journal's unique key holds apart is recorded; a repeat is written once, returns once, completes its effect once; a skip never tells one principal about another's results |
//! | [`journal_views`] | the model's output, the agent's transcript | a chat turn's folded records read back through the views exactly as decided, once each, under unique ids, with no secret in clear |
//! | [`records`] | the agent, tool content | the journal's keys are turnguard's own; no secret is written in clear (journal, logs, metric labels); no principal reads another's result; only a user message's own `tool_result` is recorded (tool content cannot forge another call's record) |
//! | [`admin_plane`] | an admin-plane client | no run data without the admin token; no credential shown; malformed input never takes the plane down |
//! | [`host_text`] | the model's output | text turnguard writes as its own carries no model-chosen prose and no secret |
//! | [`mcp_front`] | the agent's JSON-RPC, the MCP server's bytes | a `tools/call` is decided before it goes; nothing the front did not read is relayed, either way |

mod admin_plane;
mod approvals;
mod chat_release_timing;
mod host_text;
mod http_layer;
mod journal_views;
mod mcp_front;
mod records;
mod seen_results;
mod trust;
mod upstream_bytes;
