//! The integration suite: one test binary (one link of the crate) with a module per area.
//! Every test drives turnguard over real sockets: a scripted mock provider plays the model,
//! real clients (the official SDKs where parsing matters) play the agent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

mod admission_order;
mod approval_ui;
mod attacks;
mod channels;
mod compat;
mod crash_recovery;
mod deploy_files;
mod dispatch;
mod dropin;
mod faults;
mod field_inputs;
mod fuzz;
mod journal_bodies;
mod journal_postgres;
mod journal_units;
mod mcp;
mod ops_edge;
mod ops_shutdown;
mod policy_bundle;
mod proxy_behaviour;
mod redaction_strip;
mod repair_shapes;
mod replay_recovery;
mod responses_contract;
mod responses_sdk;
mod responses_surface;
mod responses_tool_kinds;
mod sdk_equivalence;
mod serve_cli;
mod shipped_catalogs;
mod source_lints;
mod stream_chunking;
mod support;
mod trust_approvals;
mod upstream_pool;
