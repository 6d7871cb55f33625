//! turnguard: a sidecar proxy and tool-call firewall for LLM agents.
//!
//! It enforces the *tool-turn contract* (the RFC in `shared/seeds/000_…`, built on OpenWOP v2)
//! between an unchanged agent runtime and the model providers. Module map, in request order:
//!
//! | module | stage |
//! |---|---|
//! | [`config`] | layered configuration: defaults, TOML file, `TURNGUARD_*` env, flags |
//! | [`server`] | binds the data plane and admin plane, builds the shared state |
//! | [`state`] | `AppState`: the state both planes share, below the request path |
//! | [`request`] | one data-plane request: `RequestCtx`, `RunMode`, the `Session` struct |
//! | [`client`] | the pooled outbound HTTPS client |
//! | [`notify`] | the approval notifier (webhook, SSE fan-out) |
//! | [`edge`] | the data-plane edge layer: load shedding, request id, access log, timing |
//! | [`body`] | the capped body reader: the only place a request or response body is collected |
//! | [`proxy`] | the request path: parse → adapter → record tool results → upstream → admit → surface |
//! | [`mcp`] | the MCP front: the agent's MCP servers behind `/mcp/NAME`, the same decisions, tickets, exactly-once execution |
//! | [`sse`] | byte-faithful `text/event-stream` framing (raw bytes kept per event) |
//! | [`provider`] | one adapter per provider API (Chat Completions, Messages, Responses), into and out of the neutral [`model`] |
//! | [`model`] | the provider-neutral `Turn`, `ToolCall`, `Completion`, `Decision` |
//! | [`admission`] | the admission order of tool-turn contract §B (completion, name, arguments, …) |
//! | [`recipes`] | RFC 0150 recipes: semantic request digest v2, `logicalInvocationId` |
//! | [`clock`] | wall-clock milliseconds and the agent's actor id (imports nothing) |
//! | [`journal`] | the journal behind one store interface: SQLite (one writer thread, group commit) or PostgreSQL shared by replicas; insert-if-absent |
//! | [`metrics`] | every Prometheus metric, in one registry handle |
//! | [`logs`] | where log lines go: stderr through one buffer (warnings at once, the rest within `log_flush_ms`) |
//! | [`identity`] | who acts: the verified person (JWT) on the data plane and the approver on the admin plane |
//! | [`shutdown`] | graceful shutdown: readiness false, drain within a deadline, flush |
//! | [`approvals`] | held calls wait for the acting person: approval interrupts, admin resolution |
//! | [`approval_ui`] | the person in the loop: the approval page (OpenID Connect sign-in), webhook and SSE notifications, the `approvals` CLI |
//! | [`admin`] | the admin plane: `/metrics`, `/healthz`, `/readyz`, `/config`, approvals |
//! | [`error`] | the one boundary enum for errors turnguard authors on the wire |
//! | [`policy`] | the pure policy engine: bundle formats, catalog, Cedar rules, redaction |
//! | [`policy_cli`] | `turnguard policy check / test / explain / schema` |
//! | [`reload`] | bundle IO: reading, the embedded default, watch + SIGHUP hot reload |
//! | [`mock_provider`] | the scripted model used by tests and the offline demo |
//! | [`mock_mcp`] | the scripted MCP server used by tests and the offline demo |

pub mod admin;
pub mod admission;
pub mod approval_ui;
pub mod approvals;
pub mod body;
pub mod client;
pub mod clock;
pub mod config;
pub mod edge;
pub mod error;
pub mod identity;
pub mod jcs;
pub mod journal;
pub mod logs;
pub mod mcp;
pub mod metrics;
pub mod mock_mcp;
pub mod mock_provider;
pub mod model;
pub mod notify;
pub mod policy;
pub mod policy_cli;
pub mod provider;
pub mod proxy;
pub mod reason;
pub mod recipes;
pub mod reload;
pub mod request;
pub mod server;
pub mod shutdown;
mod source_lints;
pub mod sse;
pub mod state;
pub mod strict_json;
