//! The provider-neutral model every stage after the adapters speaks (DESIGN.md §3).
//!
//! A request becomes a [`Turn`]; a response (JSON or stream) becomes one [`ChoiceEmissions`]
//! per choice, holding its [`Completion`] and its [`ToolCall`]s; admission turns each call into
//! a [`Decision`] (tool-turn contract §B).

use serde_json::Value;

/// The provider API a request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// OpenAI Chat Completions and compatibles, `POST /v1/chat/completions`.
    OpenAiChat,
    /// Anthropic Messages, `POST /v1/messages`.
    AnthropicMessages,
    /// OpenAI Responses, `POST /v1/responses`.
    OpenAiResponses,
}

impl Api {
    /// Label used in metrics and the journal.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OpenAiChat => "openai_chat",
            Self::AnthropicMessages => "anthropic_messages",
            Self::OpenAiResponses => "openai_responses",
        }
    }

    /// The API for a label (`openai_chat`, `anthropic_messages`).
    pub fn from_label(label: &str) -> Option<Self> {
        match label {
            "openai_chat" => Some(Self::OpenAiChat),
            "anthropic_messages" => Some(Self::AnthropicMessages),
            "openai_responses" => Some(Self::OpenAiResponses),
            _ => None,
        }
    }

    /// The API whose endpoint is `path` (exact, no trailing slash or query:
    /// `/v1/chat/completions`, `/v1/messages`, `/v1/responses`), as the data plane routes
    /// `POST`s to the request path and the edge labels them.
    pub fn of_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Self::OpenAiChat),
            "/v1/messages" => Some(Self::AnthropicMessages),
            "/v1/responses" => Some(Self::OpenAiResponses),
            _ => None,
        }
    }

    /// The configured upstream name this API is sent to.
    pub fn upstream(self) -> &'static str {
        match self {
            Self::OpenAiChat => "openai",
            Self::AnthropicMessages => "anthropic",
            Self::OpenAiResponses => "openai",
        }
    }
}

/// A tool the request declares (`tools[]`, a Responses `additional_tools` input item …), with
/// its input schema or free-form format when it has one.
#[derive(Debug, Clone, Default)]
pub struct DeclaredTool {
    /// The tool's identity ([`qualified_name`]): the provider-facing name, qualified
    /// `namespace.name` when the tool is declared inside a Responses `namespace` tool.
    pub name: String,
    /// JSON Schema of the arguments (`function.parameters` / `input_schema`), shared: the
    /// journal's record of the declaration holds the same tree, not a copy.
    pub schema: Option<std::sync::Arc<Value>>,
    /// `Some` for a free-form tool (Responses `type: "custom"`): its input is raw text in this
    /// format, not a JSON object, and the arguments stage checks the format instead of a
    /// schema. `None`: JSON arguments.
    pub freeform: Option<FreeformFormat>,
    /// The schema's fingerprint in this process's schema cache, set when the request's schema
    /// sizes are checked ([`crate::admission::arguments::SchemaCache::check_size`]): the
    /// arguments stage looks the compiled schema up by it and the journal's writer its digest,
    /// instead of hashing the tree again. A lookup by it still compares the trees, so a stale
    /// or missing one costs a hash, never a wrong schema. `None`: not checked yet.
    pub fingerprint: Option<u64>,
}

/// Declarations are equal when they declare the same thing; the cache fingerprint is not part
/// of what a declaration says.
impl PartialEq for DeclaredTool {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.schema == other.schema && self.freeform == other.freeform
    }
}

impl DeclaredTool {
    /// A tool with JSON arguments and an optional schema.
    pub fn json(name: impl Into<String>, schema: Option<Value>) -> Self {
        Self {
            name: name.into(),
            schema: schema.map(std::sync::Arc::new),
            freeform: None,
            fingerprint: None,
        }
    }

    /// A tool with JSON arguments whose schema, when it declares one, is read from the
    /// request's tree through `schemas` (a tree the process already holds for an equal
    /// schema, or a copy).
    pub fn declared(
        name: impl Into<String>,
        schema: Option<&Value>,
        schemas: &dyn DeclaredSchemas,
    ) -> Self {
        let name = name.into();
        let (schema, fingerprint) = match schema {
            Some(s) => {
                let (tree, fingerprint) = schemas.share(&name, s);
                (Some(tree), fingerprint)
            }
            None => (None, None),
        };
        Self {
            name,
            schema,
            freeform: None,
            fingerprint,
        }
    }
}

/// Where the schemas a request declares are kept once it is parsed. An agent declares the
/// same tools on every request, so the process keeps one tree per schema it has seen
/// ([`crate::admission::arguments::SchemaCache`]) and each request shares it, instead of
/// copying the schema out of its own body every time (issue 13: the copy was 17 of a chat
/// turn's ~300 allocations, and it grows with the declared tools).
pub trait DeclaredSchemas {
    /// A tree equal to `schema`, the declared schema of the tool `name`, shared, and its
    /// fingerprint in this process's schema cache when it has one (`None`: the size check
    /// computes it). Never a tree that differs from `schema`: a kept tree is compared with it
    /// before it is shared.
    fn share(&self, name: &str, schema: &Value) -> (std::sync::Arc<Value>, Option<u64>);
}

/// Each schema copied out of the request, with no fingerprint: for a request read outside
/// the proxy (the policy tools, tests).
pub struct CopiedSchemas;

impl DeclaredSchemas for CopiedSchemas {
    fn share(&self, _name: &str, schema: &Value) -> (std::sync::Arc<Value>, Option<u64>) {
        (std::sync::Arc::new(schema.clone()), None)
    }
}

/// The identity of a tool declared inside a namespace (Responses `type: "namespace"`): a call
/// names both, so the namespace is part of the name admission and the catalog see —
/// `namespace.name` (`functions.exec`). Without a namespace, the name itself.
pub fn qualified_name(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("{ns}.{name}"),
        None => name.to_owned(),
    }
}

/// The input format of a free-form tool (Responses custom tools, `format`; the API's
/// default is unconstrained text). The arguments stage checks a call's raw input against it
/// ([`crate::admission::arguments`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreeformFormat {
    /// `{"type": "text"}` or no `format`: any text.
    Text,
    /// `{"type": "grammar", "syntax": "regex", "definition": D}`: the whole input must match
    /// the regular expression `D`.
    Regex(String),
    /// `{"type": "grammar", "syntax": "lark", "definition": D}`: a Lark grammar, which
    /// turnguard does not parse (the input is checked as text only; see
    /// [`crate::admission::arguments`]).
    Lark(String),
    /// A format type or grammar syntax turnguard does not know (named here, sanitized): no
    /// input passes (fail closed).
    Unknown(String),
}

/// A tool result the agent sends back in a request (`role: tool` / `tool_result` block).
#[derive(Debug, Clone)]
pub struct ToolResultSeen {
    /// The provider's call id (`tool_call_id` / `tool_use_id`).
    pub tool_call_id: String,
    /// The tool's name, when the echoed assistant turn names it.
    pub tool_name: Option<String>,
    /// The result content as the request holds it (a string, or the provider's content
    /// blocks). Journaled as its JSON text ([`crate::strict_json::to_text`]: a string stays a
    /// JSON string), which is written only for a result the journal has not recorded yet
    /// ([`crate::journal::seen_results`]).
    pub content: serde_json::Value,
    /// The agent marked the result as a failure (`is_error`).
    pub is_error: bool,
}

/// One request, as the adapter read it.
#[derive(Debug, Clone)]
pub struct Turn {
    /// The API spoken.
    pub api: Api,
    /// `model` of the request.
    pub model: Option<String>,
    /// `stream: true` was asked.
    pub stream: bool,
    /// Tools declared in `tools[]`, in request order.
    pub tools: Vec<DeclaredTool>,
    /// Tool results present in the transcript, in order.
    pub tool_results: Vec<ToolResultSeen>,
    /// Output token limit of the request (`max_tokens`, `max_completion_tokens`), tokens.
    pub max_output_tokens: Option<u64>,
    /// Chat only: `stream_options.include_usage` is set, so a usage chunk will follow.
    pub include_usage: bool,
    /// Index of the model round this request asks for: assistant turns already in the
    /// transcript (DESIGN.md §2: derived from the transcript, not a counter). With a
    /// `previous_response_id` the earlier turns are held by the provider: the adapter counts
    /// the turns the request itself carries, and [`Turn::continue_chain`] adds the stored
    /// response's position from the journal.
    pub round_index: u32,
    /// Names of the tool calls already in the transcript, in order (with a
    /// `previous_response_id`, the provider-held ones first: [`Turn::continue_chain`]).
    pub prior_calls: Vec<String>,
    /// Inputs of the request that make the turn untrusted, each with where it is
    /// (tool-turn contract §C: the meet of the inputs; DESIGN.md §9: any input turnguard does
    /// not recognise is untrusted). Empty: every input the request shows is the person's, the
    /// system's, or a tool result judged by its catalog tool.
    pub untrusted_inputs: Vec<UntrustedInput>,
    /// Chat only: turnguard asked the upstream for the usage chunk the agent did not ask for
    /// (`stream_options.include_usage`), so it can tell a call cut by the token limit from a
    /// complete one; that chunk is turnguard's own and is not forwarded.
    pub usage_for_turnguard: bool,
    /// Responses only: `previous_response_id`. The provider holds the earlier turns of the
    /// conversation, which the proxy cannot see in this request; their trust can only come
    /// from turnguard's own journal of that response chain (the trust rule is in
    /// [`crate::journal`], "The response chain"), and an unknown chain is untrusted (fail
    /// closed).
    pub previous_response_id: Option<String>,
    /// Tools the request asks the *provider* to call on the agent's behalf through MCP or A2A
    /// (Responses `tools[].type = "mcp"`), named by their request path, e.g.
    /// `tools[1] (mcp, server_label deepwiki)`. Inside a run such a request is refused
    /// (tool-turn contract §F).
    pub provider_delegations: Vec<String>,
    /// The provider adapter cannot rewrite a call's arguments in this turn's answer (a
    /// streamed Responses answer: set by [`crate::provider`]'s Responses adapter). A secret
    /// that must be stripped before an egress tool is then refused at the redaction stage
    /// (fail closed) rather than released.
    pub arguments_fixed: bool,
    /// Responses only: `item_reference` input items, the stored items the provider fills in.
    /// Each is also an [`UntrustedKind::StoredItem`] input (the proxy cannot read it) until
    /// [`Turn::resolve_references`] lifts that for the ones turnguard's own journal holds as
    /// trusted output.
    pub item_references: Vec<ItemReference>,
}

/// An `item_reference` input item: the provider's id of a stored item, and where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemReference {
    /// The stored item's id (`rs_…`, `msg_…`, `fc_…`).
    pub id: String,
    /// The request path (`input[3]`), as in the matching [`UntrustedInput::at`].
    pub at: String,
}

/// What of a request its non-stream answer is read against
/// ([`crate::provider::Provider::parse_response`]): the token limit the completion stage
/// compares with, and the stored response it continues (Responses).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AnswerContext {
    /// `max_tokens` / `max_completion_tokens` / `max_output_tokens` of the request.
    pub max_output_tokens: Option<u64>,
    /// `previous_response_id` of the request (Responses).
    pub previous_response_id: Option<String>,
}

impl Turn {
    /// What its answer is read against ([`AnswerContext`]).
    pub fn answer_context(&self) -> AnswerContext {
        AnswerContext {
            max_output_tokens: self.max_output_tokens,
            previous_response_id: self.previous_response_id.clone(),
        }
    }

    /// A request that continues the stored response `link` (`previous_response_id`, the
    /// journal's row of it) takes its position after that response: the provider-held
    /// transcript's rounds and calls come before the ones the request carries. A row without a
    /// recorded position (an older journal) leaves the turn as the request shows it.
    pub fn continue_chain(&mut self, link: &ChainLink) {
        if self.previous_response_id.as_deref() != Some(link.response_id.as_str()) {
            return;
        }
        if let Some(next) = link.next_round_index {
            self.round_index = self.round_index.saturating_add(next);
        }
        if let Some(before) = &link.calls_so_far {
            let own = std::mem::take(&mut self.prior_calls);
            self.prior_calls = before.iter().cloned().chain(own).collect();
        }
    }

    /// A request with nothing in it yet, for `api`.
    pub fn new(api: Api) -> Self {
        Self {
            api,
            model: None,
            stream: false,
            tools: Vec::new(),
            tool_results: Vec::new(),
            max_output_tokens: None,
            include_usage: false,
            round_index: 0,
            prior_calls: Vec::new(),
            untrusted_inputs: Vec::new(),
            usage_for_turnguard: false,
            previous_response_id: None,
            provider_delegations: Vec::new(),
            arguments_fixed: false,
            item_references: Vec::new(),
        }
    }

    /// The first declared tool named `name`, if any.
    pub fn declared(&self, name: &str) -> Option<&DeclaredTool> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// Every declaration of `name` (a tool may be declared more than once: at the top level
    /// and in an `additional_tools` item, or in two such items). A call must meet all of them.
    pub fn declarations<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a DeclaredTool> {
        self.tools.iter().filter(move |t| t.name == name)
    }

    /// Declares a tool; a declaration equal to one already there is not repeated.
    pub fn declare(&mut self, tool: DeclaredTool) {
        if !self.tools.contains(&tool) {
            self.tools.push(tool);
        }
    }

    /// Lifts the [`UntrustedKind::StoredItem`] mark of every `item_reference` whose id is in
    /// `trusted` (the journal resolved it to output turnguard recorded as trusted; the rule
    /// is [`crate::admission::trust::reference_fault`]). Every other reference stays
    /// untrusted.
    pub fn resolve_references(&mut self, trusted: &std::collections::BTreeSet<String>) {
        let lifted: Vec<&str> = self
            .item_references
            .iter()
            .filter(|r| trusted.contains(&r.id))
            .map(|r| r.at.as_str())
            .collect();
        self.untrusted_inputs
            .retain(|u| !(u.kind == UntrustedKind::StoredItem && lifted.contains(&u.at.as_str())));
    }

    /// Notes an input that makes the turn untrusted; `at` names it by its request path
    /// (`messages[2].role`).
    pub fn untrusted(&mut self, kind: UntrustedKind, at: impl Into<String>) {
        self.untrusted_inputs.push(UntrustedInput {
            kind,
            at: at.into(),
        });
    }
}

/// Why an input makes its turn untrusted (tool-turn contract §C, §F; DESIGN.md §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UntrustedKind {
    /// Provider-executed tool output in the transcript (Anthropic `web_search_tool_result`,
    /// Responses `web_search_call` …), or a request that lets the provider run a tool or an
    /// MCP server in this very turn (Anthropic server tools and `mcp_servers`, Responses
    /// built-in tools, Chat `web_search_options`): the model may read its output before it
    /// calls a tool.
    ProviderOutput,
    /// Content the provider fetches or holds for the model, which turnguard never sees: a URL
    /// (`image_url`, a `url` source, `file_url`), a file id, a stored item or prompt, a
    /// Conversations API `conversation`.
    ProviderFetched,
    /// One tool-call id names two calls of the transcript: which call a result answers (and
    /// so which tool's `content_trust` it takes) is ambiguous.
    DuplicateCallId,
    /// A role, item, block or part type turnguard does not recognise: never skipped.
    Unrecognised,
    /// A Responses `item_reference`: a stored item the provider fills in, which the proxy
    /// cannot read. Lifted only when turnguard's journal holds the item as trusted output
    /// ([`Turn::resolve_references`]).
    StoredItem,
}

impl UntrustedKind {
    /// Label used in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ProviderOutput => "provider_output",
            Self::ProviderFetched => "provider_fetched",
            Self::DuplicateCallId => "duplicate_call_id",
            Self::Unrecognised => "unrecognised_input",
            Self::StoredItem => "stored_item",
        }
    }
}

/// One input that makes a turn untrusted: why, and where in the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UntrustedInput {
    /// Why.
    pub kind: UntrustedKind,
    /// The request path (`messages[2].content[1]`), with any name taken from the request
    /// sanitized.
    pub at: String,
}

/// How the model's output ended (tool-turn contract §B stage 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionState {
    /// The output ended normally.
    Clean,
    /// The output hit a token limit; anything open at that point is cut.
    Truncated,
    /// The model or provider refused. Never retried (tool-turn contract §B).
    Refused,
    /// The transcript and the output filled the model's context window (Anthropic
    /// `model_context_window_exceeded`): truncated, and asking again with a longer transcript
    /// cannot help, so it is never repaired.
    ContextExhausted,
}

impl CompletionState {
    /// Label used in metrics and the journal.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Clean => "clean",
            Self::Truncated => "truncated",
            Self::Refused => "refused",
            Self::ContextExhausted => "context_exhausted",
        }
    }
}

/// The completion state of one choice, with the provider's own reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The classified state.
    pub state: CompletionState,
    /// The provider's `finish_reason` / `stop_reason`, or what stood in for it.
    pub reason: String,
}

impl Completion {
    /// A completion with the provider's reason.
    pub fn new(state: CompletionState, reason: &str) -> Self {
        Self {
            state,
            reason: reason.to_owned(),
        }
    }
}

/// A provider-native tool call emitted by the model (channel `tool`, contract §A).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The provider's call id (`call_…`, `toolu_…`).
    pub id: String,
    /// The tool the model called: its name, qualified `namespace.name` when the call names a
    /// namespace ([`qualified_name`]).
    pub name: String,
    /// The input exactly as emitted (the concatenation of all deltas): JSON text, or the raw
    /// text of a free-form call ([`CallInput::Text`]).
    pub arguments: String,
    /// How the model wrote the input.
    pub input: CallInput,
}

impl ToolCall {
    /// A call with JSON arguments.
    pub fn json(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<String>,
    ) -> Self {
        Self {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
            input: CallInput::Json,
        }
    }
}

/// The form of a call's input (which must be the form its tool was declared with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CallInput {
    /// JSON arguments (function calls, `tool_use`, the Responses client built-ins).
    #[default]
    Json,
    /// Raw text (a Responses `custom_tool_call`'s `input`), not JSON-quoted.
    Text,
}

/// Checks that a response identifies every choice and every call uniquely (DESIGN.md §9:
/// one emission, one decision): no two choices share an index, and no two calls of a choice
/// share a non-empty id. Otherwise a verdict could be applied to another choice's or call's
/// emission.
///
/// Errors: what was ambiguous, for the provider-shaped error and the journal.
pub fn check_identities(round: &[ChoiceEmissions]) -> Result<(), String> {
    let mut choices = std::collections::BTreeSet::new();
    for c in round {
        if !choices.insert(c.choice) {
            return Err(format!(
                "two choices of the response share index {}",
                c.choice
            ));
        }
        let mut ids = std::collections::BTreeSet::new();
        for call in c.calls.iter().filter(|call| !call.id.is_empty()) {
            if !ids.insert(call.id.as_str()) {
                return Err(format!(
                    "two tool calls of choice {} share the id `{}`",
                    c.choice,
                    crate::admission::sanitize_label(&call.id)
                ));
            }
        }
    }
    Ok(())
}

/// Everything one choice emitted that admission decides on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChoiceEmissions {
    /// Choice index (0 for Anthropic).
    pub choice: u32,
    /// How the choice ended.
    pub completion: Completion,
    /// Its tool calls, in emission order.
    pub calls: Vec<ToolCall>,
    /// Its assistant text (for the structured and prompted channels), when read.
    pub text: Option<String>,
    /// The same response carries provider-executed tool output (a web search, a fetch …):
    /// its calls are decided as in an untrusted turn (tool-turn contract §C, §F).
    pub provider_output: bool,
    /// The choice's output in the provider's own shape, in order, as a repair turn must
    /// replay it (Anthropic: every content block — `thinking` with its `signature`,
    /// `redacted_thinking` with its `data`, text, `tool_use` with its input; Responses: the
    /// output items of the calls). Opaque to everything but the adapter that made it; empty
    /// when the adapter keeps none (the repair turn is then built from [`Self::calls`]).
    pub output: Vec<Value>,
}

/// The outcome of one tool call (tool-turn contract §B).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Executed,
    Refused,
    Held,
    SuppressedRepeat,
    EndedTurn,
    Invalid,
}

impl Outcome {
    /// The contract's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Refused => "refused",
            Self::Held => "held",
            Self::SuppressedRepeat => "suppressed-repeat",
            Self::EndedTurn => "ended-turn",
            Self::Invalid => "invalid",
        }
    }
}

/// The admission stages, in their fixed order (tool-turn contract §B).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    Completion,
    Name,
    Arguments,
    Trust,
    Authorization,
    Limits,
    Redaction,
    Dispatch,
}

impl Stage {
    /// The contract's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completion => "completion",
            Self::Name => "name",
            Self::Arguments => "arguments",
            Self::Trust => "trust",
            Self::Authorization => "authorization",
            Self::Limits => "limits",
            Self::Redaction => "redaction",
            Self::Dispatch => "dispatch",
        }
    }
}

/// What admission decided for one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The outcome.
    pub outcome: Outcome,
    /// The stage that decided it.
    pub stage: Stage,
    /// Why ([`crate::reason::Reason`]: its spelling, wire code and event status).
    pub reason: crate::reason::Reason,
    /// Host-authored explanation, built from validator or decision output, never model text.
    pub message: String,
    /// `argsHash`: SHA-256 (hex) of the RFC 8785 form of the *redacted* arguments, when they
    /// parsed.
    pub args_hash: Option<String>,
    /// The catalog `toolId` (or `turnguard:unknown`).
    pub tool_id: String,
    /// The provider-facing tool name, sanitized for host-authored text.
    pub tool_name: String,
    /// `false` when shadow mode released a call enforcement would have withheld.
    pub enforced: bool,
    /// Cedar rules that determined an authorization decision.
    pub rules: Vec<String>,
    /// For `rate_limited`: seconds until the bucket has a token.
    pub retry_after_secs: Option<u64>,
    /// The arguments after redaction (safe to journal and log), when they parsed.
    pub redacted_args: Option<serde_json::Value>,
    /// The call's arguments text when `redacted_args` is exactly its parse (JSON arguments,
    /// nothing redacted): the journal stores this text rather than serializing the tree again.
    /// `None` whenever `redacted_args` came from anywhere else.
    pub args_text: Option<String>,
    /// How many secrets redaction found in the arguments.
    pub secrets: usize,
    /// Arguments to release instead of the model's (JSON text): the redacted form, when the
    /// bundle strips secrets from calls to egress tools (`redaction.strip_from_egress`).
    pub release_args: Option<String>,
    /// Stage by stage, what admission found (for `policy explain`): empty unless admission
    /// was asked to explain ([`crate::admission::AdmitCtx::explain`]), except the notes an
    /// approval's outcome adds.
    pub trace: Vec<(Stage, String)>,
}

impl Decision {
    /// A decision with only the outcome fields set.
    pub fn new(
        outcome: Outcome,
        stage: Stage,
        reason: crate::reason::Reason,
        message: String,
    ) -> Self {
        Self {
            outcome,
            stage,
            reason,
            message,
            args_hash: None,
            tool_id: String::new(),
            tool_name: String::new(),
            enforced: true,
            rules: Vec::new(),
            retry_after_secs: None,
            redacted_args: None,
            args_text: None,
            secrets: 0,
            release_args: None,
            trace: Vec::new(),
        }
    }

    /// The call goes to the agent (executed, or withheld only in shadow mode).
    pub fn released(&self) -> bool {
        self.outcome == Outcome::Executed || !self.enforced
    }
}

/// A response the provider stores and a later request can continue from
/// (`previous_response_id`, Responses only), as the journal records it (table `responses`;
/// the trust rule that reads it is in [`crate::journal`], "The response chain").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseLink {
    /// The provider's response id (`resp_…`).
    pub response_id: String,
    /// The `previous_response_id` of the request that produced it.
    pub previous_response_id: Option<String>,
    /// The response's final `status` (`completed`, `incomplete`, `failed` …); `None` when the
    /// stream ended before its terminal event.
    pub status: Option<String>,
    /// Types of the output items the provider executed itself (`web_search_call`,
    /// `mcp_call` …, and any item type turnguard does not know), in order, deduplicated.
    /// Their output is untrusted (tool-turn contract §C, §F).
    pub provider_items: Vec<String>,
    /// The response's `contentTrust` (`trusted` / `untrusted`), judged by the trust stage
    /// ([`crate::admission::trust::of_response`]) before the response is recorded; `None`
    /// until then (the chain rule reads a missing value as untrusted).
    pub content_trust: Option<crate::policy::bundle::ContentTrust>,
    /// The round index a request continuing this response takes (before the model turns it
    /// carries itself); set with `content_trust`.
    pub next_round_index: Option<u32>,
    /// Names of the calls of the transcript through this response, in order: the request's
    /// own prior calls, then this round's. A request continuing the response counts its
    /// per-node ordinals (and clarification asks) on from them; set with `content_trust`.
    pub calls_so_far: Option<Vec<String>>,
    /// The response's output items that carry an id, in order: what a later request's
    /// `item_reference` may name (table `response_items`).
    pub items: Vec<StoredOutputItem>,
}

/// One output item of a stored response, as the journal records it for `item_reference`
/// lookups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredOutputItem {
    /// The item's id (`rs_…`, `msg_…`), at most 256 characters.
    pub id: String,
    /// Its type (`reasoning`, `message`, `function_call`, `web_search_call` …), sanitized.
    pub item_type: String,
    /// The provider executed it (or its type is one turnguard does not know): its content is
    /// untrusted (tool-turn contract §C, §F).
    pub provider_executed: bool,
}

/// What the journal holds of a stored output item an `item_reference` names, with the
/// response it belongs to (the rule that judges it is
/// [`crate::admission::trust::reference_fault`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredItemRow {
    /// The item's id.
    pub item_id: String,
    /// The response it was output of.
    pub response_id: String,
    /// [`StoredOutputItem::provider_executed`].
    pub provider_executed: bool,
    /// That response's final status (`None`: its stream was cut).
    pub status: Option<String>,
    /// That response's recorded `contentTrust` (a stored value outside the vocabulary fails
    /// the read).
    pub content_trust: Option<crate::policy::bundle::ContentTrust>,
    /// The item's `type` as it was output (`message`, `reasoning`, `function_call` …).
    pub item_type: String,
}

/// One stored response of a `previous_response_id` chain as turnguard's journal has it
/// (table `responses`), read back by the trust stage: the chain rule is
/// [`crate::admission::trust::chain_fault`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainLink {
    /// The provider's response id.
    pub response_id: String,
    /// The journal's round id of the request that produced it (`tool_calls.request_id`).
    pub request_id: String,
    /// The `previous_response_id` of that request: the next link back, `None` at the start of
    /// the chain.
    pub previous_response_id: Option<String>,
    /// The response's final `status`; `None` when its stream was cut.
    pub status: Option<String>,
    /// Its output held provider-executed items.
    pub provider_executed: bool,
    /// The `contentTrust` recorded for it (`None`: not judged; a stored value outside the
    /// vocabulary fails the read).
    pub content_trust: Option<crate::policy::bundle::ContentTrust>,
    /// [`ResponseLink::next_round_index`] as recorded (`None` in journals older than v4).
    pub next_round_index: Option<u32>,
    /// [`ResponseLink::calls_so_far`] as recorded (`None` in journals older than v4).
    pub calls_so_far: Option<Vec<String>>,
}

/// A host-authored tool result for a repair round (MCP result shape, tool-turn contract §G).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairItem {
    /// Index of the call in [`ChoiceEmissions::calls`].
    pub call: usize,
    /// The result text, built from validator or decision output (or a recorded result for a
    /// suppressed repeat), never from model text.
    pub text: String,
    /// `isError`: a model-correctable failure.
    pub is_error: bool,
}

/// An HTTP error surfaced for a withheld call (DESIGN.md §7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SurfacedError {
    /// HTTP status.
    pub status: u16,
    /// OpenWOP error code.
    pub code: &'static str,
    /// Host-authored message.
    pub message: String,
    /// `Retry-After` seconds, for `rate_limited`.
    pub retry_after_secs: Option<u64>,
}

/// How a choice's withheld calls reach the agent (DESIGN.md §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Surfacing {
    /// Every call is released as emitted.
    Release,
    /// The withheld calls are removed; the released ones go out and the finish reason is
    /// kept (calls after a clarification ask, tool-turn contract §E).
    Drop,
    /// The withheld calls are removed, the text is added as assistant text, the finish
    /// reason becomes a normal stop.
    EndTurn(String),
    /// The model is asked again with these host-authored results.
    Repair(Vec<RepairItem>),
    /// The request fails with this error.
    Error(SurfacedError),
    /// Held calls wait for the acting person's approval (an OpenWOP `approval` interrupt);
    /// the proxy resolves this before anything reaches the agent, so no adapter sees it.
    Wait,
}

/// Admission's verdict on one choice: a decision per call and how it surfaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChoiceVerdict {
    /// Choice index.
    pub choice: u32,
    /// One decision per call, aligned with [`ChoiceEmissions::calls`].
    pub decisions: Vec<Decision>,
    /// How the withheld calls surface.
    pub surfacing: Surfacing,
    /// Effect claims (effect id, call id) of the calls this verdict releases; confirmed in
    /// the journal before the calls leave (DESIGN.md §4 §D effects).
    pub claims: Vec<(String, String)>,
}

impl ChoiceVerdict {
    /// Whether call `i` goes to the agent.
    pub fn released(&self, i: usize) -> bool {
        self.decisions.get(i).is_some_and(Decision::released)
    }

    /// Held calls wait for an approval.
    pub fn waiting(&self) -> bool {
        self.surfacing == Surfacing::Wait
    }

    /// Some call is withheld.
    pub fn any_withheld(&self) -> bool {
        self.decisions.iter().any(|d| !d.released())
    }

    /// The arguments to release for call `i` instead of the model's, if any.
    pub fn release_args(&self, i: usize) -> Option<&str> {
        self.decisions
            .get(i)
            .filter(|d| d.released())
            .and_then(|d| d.release_args.as_deref())
    }

    /// Some released call's arguments are replaced.
    pub fn any_replaced(&self) -> bool {
        (0..self.decisions.len()).any(|i| self.release_args(i).is_some())
    }

    /// The host-authored text when the turn is ended with calls removed.
    pub fn end_turn(&self) -> Option<&str> {
        match &self.surfacing {
            Surfacing::Release | Surfacing::Drop => None,
            Surfacing::EndTurn(t) => Some(t),
            Surfacing::Repair(_) | Surfacing::Error(_) | Surfacing::Wait => None,
        }
    }
}
