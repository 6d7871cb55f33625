-- turnguard's journal on PostgreSQL (issue 15): the SQLite schema at its v9 (src/journal/schema.rs)
-- with the same table and column names. Integers (0/1 flags too) are BIGINT, text TEXT, bodies
-- BYTEA, JSON TEXT. Two additions of its own: effects.epoch (the fencing token of a claim taken
-- over from a dead owner) and instances (each replica's heartbeat, which says whether the owner
-- of a claim is alive).
CREATE TABLE rounds (
    id BIGSERIAL PRIMARY KEY,
    request_id TEXT NOT NULL UNIQUE,
    at_ms BIGINT NOT NULL,
    api TEXT NOT NULL,
    model TEXT,
    stream BIGINT NOT NULL,
    run_id TEXT,
    node_id TEXT,
    attempt BIGINT,
    round_index BIGINT NOT NULL,
    request_digest TEXT NOT NULL,
    completion TEXT,
    finish_reason TEXT,
    upstream_status BIGINT,
    latency_ms BIGINT NOT NULL,
    state TEXT NOT NULL,
    error TEXT,
    response BYTEA,
    response_bytes BIGINT NOT NULL,
    response_digest TEXT NOT NULL,
    response_truncated BIGINT NOT NULL,
    channel TEXT,
    channel_result TEXT,
    content_trust TEXT,
    client_request_id TEXT,
    response_redacted BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX rounds_run ON rounds (run_id, node_id, attempt, round_index);
CREATE INDEX rounds_client ON rounds (client_request_id);

CREATE TABLE tool_calls (
    id BIGSERIAL PRIMARY KEY,
    request_id TEXT NOT NULL REFERENCES rounds (request_id),
    choice BIGINT NOT NULL,
    ordinal BIGINT NOT NULL,
    call_id TEXT NOT NULL,
    name TEXT NOT NULL,
    outcome TEXT NOT NULL,
    stage TEXT NOT NULL,
    reason TEXT NOT NULL,
    args_hash TEXT,
    tool_id TEXT,
    logical_invocation_id TEXT,
    node_ordinal BIGINT,
    enforced BIGINT NOT NULL DEFAULT 1,
    rules TEXT,
    redacted_args TEXT,
    UNIQUE (request_id, choice, ordinal)
);
CREATE INDEX tool_calls_args_hash ON tool_calls (args_hash);
CREATE INDEX tool_calls_call ON tool_calls (call_id);

CREATE TABLE tool_results (
    id BIGSERIAL PRIMARY KEY,
    scope TEXT NOT NULL,
    run_id TEXT,
    node_id TEXT,
    attempt BIGINT,
    tool_call_id TEXT NOT NULL,
    tool_name TEXT,
    is_error BIGINT NOT NULL,
    content BYTEA,
    content_bytes BIGINT NOT NULL,
    content_digest TEXT NOT NULL,
    truncated BIGINT NOT NULL,
    first_request_id TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    UNIQUE (scope, tool_call_id, content_digest)
);

CREATE TABLE effects (
    effect_id TEXT PRIMARY KEY,
    tool_id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    run_id TEXT,
    node_id TEXT,
    attempt BIGINT,
    keying TEXT NOT NULL,
    state TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    released BIGINT NOT NULL DEFAULT 0,
    instance TEXT NOT NULL DEFAULT '',
    reader TEXT,
    epoch BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX effects_run ON effects (run_id);
CREATE INDEX effects_call ON effects (call_id);

CREATE TABLE instances (
    instance TEXT PRIMARY KEY,
    heartbeat_ms BIGINT NOT NULL
);

CREATE TABLE events (
    id BIGSERIAL PRIMARY KEY,
    scope TEXT NOT NULL,
    run_id TEXT,
    node_id TEXT,
    request_id TEXT NOT NULL,
    sequence BIGINT NOT NULL,
    type TEXT NOT NULL,
    payload TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    UNIQUE (scope, sequence)
);

CREATE TABLE served (
    id BIGSERIAL PRIMARY KEY,
    run_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    attempt BIGINT NOT NULL,
    round_index BIGINT NOT NULL,
    request_digest TEXT NOT NULL,
    request_id TEXT NOT NULL,
    status BIGINT NOT NULL,
    content_type TEXT NOT NULL,
    body BYTEA,
    body_bytes BIGINT NOT NULL,
    body_digest TEXT NOT NULL,
    truncated BIGINT NOT NULL,
    calls TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    redacted BIGINT NOT NULL DEFAULT 0,
    UNIQUE (run_id, node_id, attempt, round_index)
);

CREATE TABLE replay_cursor (
    run_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    skipped BIGINT NOT NULL,
    PRIMARY KEY (run_id, node_id)
);

CREATE TABLE responses (
    response_id TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    previous_response_id TEXT,
    run_id TEXT,
    node_id TEXT,
    attempt BIGINT,
    api TEXT NOT NULL,
    status TEXT,
    provider_executed BIGINT NOT NULL,
    provider_items TEXT NOT NULL,
    content_trust TEXT,
    at_ms BIGINT NOT NULL,
    next_round_index BIGINT,
    calls_so_far TEXT
);
CREATE INDEX responses_previous ON responses (previous_response_id);

CREATE TABLE response_items (
    item_id TEXT PRIMARY KEY,
    response_id TEXT NOT NULL,
    item_type TEXT NOT NULL,
    provider_executed BIGINT NOT NULL
);

CREATE TABLE interrupts (
    interrupt_id TEXT PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    run_id TEXT,
    node_id TEXT,
    attempt BIGINT,
    request_id TEXT NOT NULL,
    principal TEXT,
    policy_revision TEXT NOT NULL,
    payload TEXT NOT NULL,
    calls TEXT NOT NULL,
    requested_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL,
    state TEXT NOT NULL,
    resolved_by TEXT,
    resolved_at_ms BIGINT,
    resume_value TEXT,
    consumed_by TEXT,
    edits TEXT
);
CREATE INDEX interrupts_pending ON interrupts (state, principal);
CREATE INDEX interrupts_node ON interrupts (run_id, node_id);

CREATE TABLE run_trust (
    run_id TEXT PRIMARY KEY,
    trust TEXT NOT NULL,
    request_id TEXT NOT NULL,
    at_ms BIGINT NOT NULL
);

CREATE TABLE principal_tokens (
    fingerprint TEXT PRIMARY KEY,
    expires_at_ms BIGINT NOT NULL,
    first_seen_ms BIGINT NOT NULL
);

CREATE TABLE tool_schemas (
    schema_digest TEXT PRIMARY KEY,
    schema TEXT,
    at_ms BIGINT NOT NULL
);

CREATE TABLE declared_tools (
    id BIGSERIAL PRIMARY KEY,
    request_id TEXT NOT NULL,
    run_id TEXT,
    api TEXT NOT NULL,
    name TEXT NOT NULL,
    schema_digest TEXT,
    at_ms BIGINT NOT NULL,
    UNIQUE (request_id, name)
);
CREATE INDEX declared_tools_name ON declared_tools (name);
