//! Authorization rules in Cedar (tool-turn contract §B stage 5).
//!
//! Entities: the principal is `User::"<sub>"` (the verified acting person) or
//! `Agent::"<id>"`; the action is `Action::"call"`; the resource is `Tool::"<toolId>"` with
//! the descriptor's attributes (unknown tools are `Tool::"turnguard:unknown"`, a `write`
//! tool). Context: `trust`, `provider`, `model`, `run`, `approved` and `args` — the call's
//! arguments, typed from the catalog's `inputSchema`.
//!
//! Validation at load: every rule is validated (Cedar strict mode) against a schema
//! generated from the catalog. A rule whose scope is `resource == Tool::"<id>"` is validated
//! against that tool's argument types, so `context.args.amout` for a tool without `amout` is a
//! load error naming file, line and rule. A rule not scoped to one tool cannot read
//! arguments: one that names `context.args` (a `has` test too) or uses `context` whole is a
//! load error, and at decision time only the tools some rule is scoped to have their
//! arguments converted into `context.args` (the others get the empty record). An argument
//! the `inputSchema` does not require, or allows to be `null`, is an optional attribute: a
//! rule that reads it without a `has` guard is a load error that says so (`policy check`).
//!
//! Arguments: an argument value never refuses a call by itself ([`to_cedar`]): `null`s are
//! left out (absent), arrays are sets (duplicates collapse), numbers Cedar has no exact form
//! for become their JSON text as a string, so only a rule that reads them can be affected —
//! and then it fails closed (an evaluation error refuses).
//!
//! Decisions: forbid overrides permit, and no permit is a deny (Cedar's semantics). A deny
//! whose determining policies are all annotated `@outcome("hold")` is `held`; any other deny
//! (a forbid, no permit, or any evaluation error) is `refused` — a rule that cannot be
//! evaluated refuses (fail closed).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr;

use cedar_policy::{
    Authorizer, Context, Decision, Entities, Entity, EntityId, EntityTypeName, EntityUid, Policy,
    PolicyId, PolicySet, Request, ResourceConstraint, RestrictedExpression, Schema, ValidationMode,
    Validator,
};
use serde_json::{json, Map, Value};

use super::catalog::{Catalog, CatalogTool};
use super::PolicyError;

/// The resource id of tools the catalog does not know.
pub const UNKNOWN_TOOL_ID: &str = "turnguard:unknown";

/// Where a rule came from.
#[derive(Debug, Clone)]
pub struct RuleMeta {
    /// Bundle-relative file.
    pub file: String,
    /// 1-based line of the rule's first token.
    pub line: usize,
    /// `@outcome("hold")`: a deny by this rule holds instead of refusing.
    pub hold: bool,
}

/// Compiled rules: the policy set, the tool entities, and where each rule came from.
pub struct Rules {
    policies: PolicySet,
    entities: Entities,
    meta: HashMap<PolicyId, RuleMeta>,
    /// Tool ids some rule is scoped to (`resource == Tool::"<id>"`): only those rules are
    /// validated against a tool's argument types, so only for these tools are the call's
    /// arguments converted into `context.args`; every other tool's rules see the empty
    /// record they were validated against.
    reads_args: foldhash::HashSet<String>,
    /// The last few decisions for tools no rule reads the arguments of ([`Rules::authorize`]):
    /// such a decision is a pure function of the principal, the tool and the context's other
    /// facts under this rule set (Cedar reads no clock and no randomness; the policies and
    /// entities are fixed for the life of a `Rules`), and the same facts recur across the
    /// calls of a round and across an agent's turns.
    decisions: std::sync::Mutex<DecisionMemo>,
    authorizer: Authorizer,
}

/// How many argument-free decisions [`Rules`] keeps (the oldest is forgotten first).
const CACHED_DECISIONS: usize = 64;

/// What an argument-free decision depends on: who calls (the person, or the agent), which
/// tool, and the context's facts other than the arguments. Borrowed from a request
/// ([`FactsRef`]) to look a decision up, owned ([`DecisionFacts`]) while the memo keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Facts<S> {
    person: Option<S>,
    agent: S,
    tool_id: S,
    trust: S,
    provider: S,
    model: S,
    run: S,
    approved: bool,
}

type FactsRef<'a> = Facts<&'a str>;
type DecisionFacts = Facts<String>;

impl<'a> FactsRef<'a> {
    fn of(req: &AuthzRequest<'a>) -> Self {
        Self {
            person: req.person,
            agent: req.agent,
            tool_id: &req.tool.descriptor.tool_id,
            trust: req.trust,
            provider: req.provider,
            model: req.model,
            run: req.run,
            approved: req.approved,
        }
    }

    fn owned(self) -> DecisionFacts {
        Facts {
            person: self.person.map(str::to_owned),
            agent: self.agent.to_owned(),
            tool_id: self.tool_id.to_owned(),
            trust: self.trust.to_owned(),
            provider: self.provider.to_owned(),
            model: self.model.to_owned(),
            run: self.run.to_owned(),
            approved: self.approved,
        }
    }
}

impl DecisionFacts {
    fn as_ref(&self) -> FactsRef<'_> {
        Facts {
            person: self.person.as_deref(),
            agent: &self.agent,
            tool_id: &self.tool_id,
            trust: &self.trust,
            provider: &self.provider,
            model: &self.model,
            run: &self.run,
            approved: self.approved,
        }
    }
}

/// The last [`CACHED_DECISIONS`] argument-free decisions ([`Rules::authorize`]), found by a
/// keyed SipHash of their facts and forgotten oldest first. A lookup costs the same however
/// the memo is filled: scanned in order, a memo full of other runs' facts (each run id is a
/// fact) cost a chat turn's call ~1 µs before it found its own (bench/RESULTS.md, issue 13
/// run 33). An entry answers only a request whose facts equal its own, so two facts that
/// hash alike share a slot (the later replaces the earlier) but never a decision.
#[derive(Debug, Default)]
struct DecisionMemo {
    keys: std::hash::RandomState,
    /// Keyed by `keys`' SipHash of the facts: foldhash spreads that already keyed 64-bit
    /// value (a second SipHash of it cost as much as the first).
    entries: foldhash::HashMap<u64, (DecisionFacts, Authz)>,
    /// Keys of `entries`, oldest first.
    order: std::collections::VecDeque<u64>,
}

impl DecisionMemo {
    fn key(&self, facts: &FactsRef<'_>) -> u64 {
        std::hash::BuildHasher::hash_one(&self.keys, facts)
    }

    /// The decision remembered for exactly these facts.
    fn get(&self, key: u64, facts: &FactsRef<'_>) -> Option<&Authz> {
        self.entries
            .get(&key)
            .filter(|(known, _)| known.as_ref() == *facts)
            .map(|(_, decided)| decided)
    }

    /// Remembers `decided` for these facts, forgetting the oldest entry when full.
    fn put(&mut self, key: u64, facts: &FactsRef<'_>, decided: Authz) {
        let entry = (facts.owned(), decided);
        if self.entries.insert(key, entry).is_none() {
            self.order.push_back(key);
            if self.order.len() > CACHED_DECISIONS {
                if let Some(oldest) = self.order.pop_front() {
                    self.entries.remove(&oldest);
                }
            }
        }
    }
}

impl Rules {
    /// How many `permit` rules the bundle has: with none, every call is refused (Cedar's
    /// default deny), which `policy check` and `serve` warn about.
    pub fn permits(&self) -> usize {
        self.policies
            .policies()
            .filter(|p| p.effect() == cedar_policy::Effect::Permit)
            .count()
    }
}

/// The facts one authorization needs.
#[derive(Debug, Clone)]
pub struct AuthzRequest<'a> {
    /// `Some(sub)` for a verified acting person, `None` for the agent itself.
    pub person: Option<&'a str>,
    /// The agent identity used when no person acts.
    pub agent: &'a str,
    /// The catalog tool (or the unknown-tool stand-in).
    pub tool: &'a CatalogTool,
    /// `trusted` / `untrusted`.
    pub trust: &'a str,
    /// Provider API label.
    pub provider: &'a str,
    /// Model name, empty when unknown.
    pub model: &'a str,
    /// Run id, empty for a chat turn.
    pub run: &'a str,
    /// An approval covers this call (its `argsHash`).
    pub approved: bool,
    /// The call's arguments.
    pub args: &'a Value,
}

/// The authorization decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authz {
    /// Permitted; the permitting rules.
    Permit(Vec<String>),
    /// Denied by `@outcome("hold")` rules only.
    Hold(Vec<String>),
    /// Refused: a forbid, no permit, an unrepresentable argument or an evaluation error.
    Refuse {
        rules: Vec<String>,
        reason: crate::reason::Reason,
        detail: String,
    },
}

impl Authz {
    /// A refusal no rule determined (the request or its context could not be formed).
    fn refused(reason: crate::reason::Reason, detail: String) -> Self {
        Self::Refuse {
            rules: Vec::new(),
            reason,
            detail,
        }
    }
}

impl Rules {
    /// Parses and validates every `rules/*.cedar` file against the catalog (`files`:
    /// bundle-relative path → text): each statement is parsed with its `@id` and
    /// `@outcome`, then validated in Cedar strict mode against the schema of the one tool it
    /// is scoped to, or the generic schema (the module docs give the rules).
    ///
    /// Errors: one [`PolicyError`] per problem, each naming file, line and rule; every rule
    /// is checked, so one run reports them all.
    pub fn compile(
        files: &[(String, String)],
        catalog: &Catalog,
    ) -> Result<Self, Vec<PolicyError>> {
        let mut errors = Vec::new();
        let schemas = Schemas::of(catalog, &mut errors).map_err(|e| vec![e])?;
        let mut policies = PolicySet::new();
        let mut meta = HashMap::new();
        let mut reads_args = foldhash::HashSet::default();
        for (file, text) in files {
            for chunk in split_statements(text) {
                let statement = Statement { file, text, chunk };
                let rule = match statement.compile(&schemas) {
                    Ok(rule) => rule,
                    Err(e) => {
                        errors.extend(e);
                        continue;
                    }
                };
                if policies.add(rule.policy).is_err() {
                    errors.push(statement.error(
                        statement.line(),
                        &rule.label,
                        format!("rule id `{}` is used twice", rule.label),
                    ));
                    continue;
                }
                meta.insert(PolicyId::new(&rule.label), rule.meta);
                reads_args.extend(rule.args_of);
            }
        }
        let entities = match tool_entities(catalog) {
            Ok(e) => e,
            Err(e) => {
                errors.push(PolicyError::bundle(e));
                Entities::empty()
            }
        };
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Self {
            policies,
            entities,
            meta,
            reads_args,
            decisions: Default::default(),
            authorizer: Authorizer::new(),
        })
    }

    /// Number of rules.
    pub fn len(&self) -> usize {
        self.meta.len()
    }

    /// No rules at all (every call is refused: default deny).
    pub fn is_empty(&self) -> bool {
        self.meta.is_empty()
    }

    /// Where a rule came from.
    pub fn meta(&self, id: &str) -> Option<&RuleMeta> {
        self.meta.get(&PolicyId::new(id))
    }

    /// The request context of one call (module docs: `trust`, `provider`, `model`, `run`,
    /// `approved`, `args`). Only a rule scoped to the tool can read its arguments (the others
    /// were validated against an empty `args` record), so for any other tool `args` is the
    /// empty record.
    /// `Err`: the refusal (an argument with no Cedar form, or a context Cedar rejects).
    fn context(&self, req: &AuthzRequest<'_>, reads_args: bool) -> Result<Context, Box<Authz>> {
        let refuse = |reason, detail| Box::new(Authz::refused(reason, detail));
        let args = if reads_args {
            to_cedar(req.args, req.tool.input_schema())
        } else {
            RestrictedExpression::new_record(Vec::<(String, RestrictedExpression)>::new())
                .map_err(|e| e.to_string())
        };
        let args = args.map_err(|why| refuse(crate::reason::Reason::ArgsUnrepresentable, why))?;
        let string = |v: &str| RestrictedExpression::new_string(v.to_owned());
        Context::from_pairs([
            ("trust".to_owned(), string(req.trust)),
            ("provider".to_owned(), string(req.provider)),
            ("model".to_owned(), string(req.model)),
            ("run".to_owned(), string(req.run)),
            (
                "approved".to_owned(),
                RestrictedExpression::new_bool(req.approved),
            ),
            ("args".to_owned(), args),
        ])
        .map_err(|_| {
            refuse(
                crate::reason::Reason::RuleError,
                "the context could not be built".into(),
            )
        })
    }

    /// Decides one call. Cannot fail: anything that cannot be evaluated refuses. For a tool no
    /// rule reads the arguments of, a decision made before for the same principal, tool and
    /// context facts is answered again ([`Rules::decisions`]) instead of evaluated.
    pub fn authorize(&self, req: &AuthzRequest<'_>) -> Authz {
        let reads_args = self.reads_args.contains(&req.tool.descriptor.tool_id);
        if reads_args {
            return self.evaluate(req, true);
        }
        let memo = || self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        let facts = FactsRef::of(req);
        let key = {
            let memo = memo();
            let key = memo.key(&facts);
            if let Some(decided) = memo.get(key, &facts) {
                return decided.clone();
            }
            key
        };
        let decided = self.evaluate(req, false);
        memo().put(key, &facts, decided.clone());
        decided
    }

    /// Evaluates one call's request against the rules (`reads_args`: the tool's arguments go
    /// into `context.args`).
    fn evaluate(&self, req: &AuthzRequest<'_>, reads_args: bool) -> Authz {
        let refuse = Authz::refused;
        let principal = match req.person {
            Some(sub) => uid(Kind::User, sub),
            None => uid(Kind::Agent, req.agent),
        };
        let (Some(principal), Some(action), Some(resource)) = (
            principal,
            action_call(),
            uid(Kind::Tool, &req.tool.descriptor.tool_id),
        ) else {
            return refuse(
                crate::reason::Reason::RuleError,
                "an entity id could not be formed".into(),
            );
        };
        let context = match self.context(req, reads_args) {
            Ok(c) => c,
            Err(refusal) => return *refusal,
        };
        let Ok(request) = Request::new(principal, action, resource, context, None) else {
            return refuse(
                crate::reason::Reason::RuleError,
                "the request could not be built".into(),
            );
        };
        let response = self
            .authorizer
            .is_authorized(&request, &self.policies, &self.entities);
        let rules: Vec<String> = response
            .diagnostics()
            .reason()
            .map(|id| id.to_string())
            .collect();
        let errors: Vec<String> = response
            .diagnostics()
            .errors()
            .map(|e| e.to_string())
            .collect();
        if !errors.is_empty() {
            return Authz::Refuse {
                rules,
                reason: crate::reason::Reason::RuleError,
                detail: errors.join("; "),
            };
        }
        match response.decision() {
            Decision::Allow => Authz::Permit(rules),
            Decision::Deny if rules.is_empty() => Authz::Refuse {
                rules,
                reason: crate::reason::Reason::NoPermit,
                detail: "no rule permits this call (default deny)".into(),
            },
            Decision::Deny => {
                let all_hold = rules.iter().all(|r| self.meta(r).is_some_and(|m| m.hold));
                if all_hold {
                    Authz::Hold(rules)
                } else {
                    Authz::Refuse {
                        detail: format!("forbidden by {}", rules.join(", ")),
                        rules,
                        reason: crate::reason::Reason::Forbidden,
                    }
                }
            }
        }
    }
}

impl Rules {
    /// Whether the caller may invoke `tool` at all (OpenWOP tool-catalog.md: the catalog lists
    /// only such tools). Decided by the rules with empty arguments and an approval in hand:
    /// a tool some call could be permitted for is listed; one no call can be permitted for
    /// (no permit, or a forbid that does not depend on the arguments) is not. Rules that read
    /// arguments cannot be evaluated here and do not hide a tool.
    pub fn may_invoke(&self, person: Option<&str>, agent: &str, tool: &CatalogTool) -> bool {
        let principal = match person {
            Some(sub) => uid(Kind::User, sub),
            None => uid(Kind::Agent, agent),
        };
        let (Some(principal), Some(action), Some(resource)) = (
            principal,
            action_call(),
            uid(Kind::Tool, &tool.descriptor.tool_id),
        ) else {
            return false;
        };
        let empty = RestrictedExpression::new_record(Vec::<(String, RestrictedExpression)>::new());
        let Ok(args) = empty else { return false };
        let context = Context::from_pairs([
            (
                "trust".to_owned(),
                RestrictedExpression::new_string("trusted".into()),
            ),
            (
                "provider".to_owned(),
                RestrictedExpression::new_string(String::new()),
            ),
            (
                "model".to_owned(),
                RestrictedExpression::new_string(String::new()),
            ),
            (
                "run".to_owned(),
                RestrictedExpression::new_string(String::new()),
            ),
            ("approved".to_owned(), RestrictedExpression::new_bool(true)),
            ("args".to_owned(), args),
        ]);
        let Ok(context) = context else { return false };
        let Ok(request) = Request::new(principal, action, resource, context, None) else {
            return false;
        };
        let response = self
            .authorizer
            .is_authorized(&request, &self.policies, &self.entities);
        match response.decision() {
            Decision::Allow => true,
            Decision::Deny => {
                let rules: Vec<String> = response
                    .diagnostics()
                    .reason()
                    .map(|id| id.to_string())
                    .collect();
                !rules.is_empty() && rules.iter().all(|r| self.meta(r).is_some_and(|m| m.hold))
            }
        }
    }
}

/// The entity types a request names (policy/README.md, "Entities").
#[derive(Debug, Clone, Copy)]
enum Kind {
    User,
    Agent,
    Tool,
}

/// The entity type names, parsed once (a parse per call cost more than the rules' own
/// evaluation of a small bundle).
struct Types {
    user: Option<EntityTypeName>,
    agent: Option<EntityTypeName>,
    tool: Option<EntityTypeName>,
    action_call: Option<EntityUid>,
}

static TYPES: std::sync::LazyLock<Types> = std::sync::LazyLock::new(|| {
    let ty = |t: &str| EntityTypeName::from_str(t).ok();
    Types {
        user: ty("User"),
        agent: ty("Agent"),
        tool: ty("Tool"),
        action_call: ty("Action")
            .map(|a| EntityUid::from_type_name_and_id(a, EntityId::new("call"))),
    }
});

/// The entity `kind::"id"`; `None` when the type name does not parse (it always does).
fn uid(kind: Kind, id: &str) -> Option<EntityUid> {
    let ty = match kind {
        Kind::User => &TYPES.user,
        Kind::Agent => &TYPES.agent,
        Kind::Tool => &TYPES.tool,
    };
    Some(EntityUid::from_type_name_and_id(
        ty.clone()?,
        EntityId::new(id),
    ))
}

/// `Action::"call"`, the one action.
fn action_call() -> Option<EntityUid> {
    TYPES.action_call.clone()
}

/// The byte range of one statement (up to and including its `;`).
struct Chunk {
    start: usize,
    end: usize,
}

/// Splits Cedar source into statements at top-level `;`, skipping strings and `//` comments.
/// Leading whitespace and comments are not part of a statement.
fn split_statements(text: &str) -> Vec<Chunk> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let mut start: Option<usize> = None;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'/' && bytes.get(i + 1) == Some(&b'/') {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if b.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if start.is_none() {
            start = Some(i);
        }
        if b == b'"' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                if bytes[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            continue;
        }
        if b == b';' {
            if let Some(s) = start.take() {
                out.push(Chunk {
                    start: s,
                    end: i + 1,
                });
            }
        }
        i += 1;
    }
    if let Some(s) = start {
        out.push(Chunk {
            start: s,
            end: text.len(),
        });
    }
    out
}

/// The Cedar schemas rules are validated against: the generic one (`context.args` an empty
/// record) and one per catalog tool (`context.args` typed from its `inputSchema`).
struct Schemas {
    generic: Schema,
    per_tool: HashMap<String, Schema>,
}

impl Schemas {
    /// Builds the schemas of `catalog`. A tool whose `inputSchema` does not map to Cedar
    /// types is an error pushed to `errors` (and has no schema of its own); `Err` when the
    /// catalog does not make even the generic schema.
    fn of(catalog: &Catalog, errors: &mut Vec<PolicyError>) -> Result<Self, PolicyError> {
        let generic = Schema::from_json_value(cedar_schema(catalog, None)).map_err(|e| {
            PolicyError::bundle(format!("the catalog does not make a Cedar schema: {e}"))
        })?;
        let mut per_tool = HashMap::new();
        for tool in catalog.tools() {
            match Schema::from_json_value(cedar_schema(catalog, Some(tool))) {
                Ok(s) => {
                    per_tool.insert(tool.descriptor.tool_id.clone(), s);
                }
                Err(e) => errors.push(PolicyError::at(
                    &tool.file,
                    None,
                    format!(
                        "tool `{}`: its inputSchema does not map to Cedar types: {e}",
                        tool.descriptor.tool_id
                    ),
                )),
            }
        }
        Ok(Self { generic, per_tool })
    }

    /// The schema `policy` is validated against, with the tool it belongs to: its tool's
    /// when its scope is `resource == Tool::"<id>"` (the unknown-tool stand-in gets the
    /// generic one, `None`), else the generic one. `Err` with the message when the scope
    /// names a tool without a schema.
    fn for_rule(&self, policy: &Policy) -> Result<(&Schema, Option<String>), String> {
        let ResourceConstraint::Eq(uid) = policy.resource_constraint() else {
            return Ok((&self.generic, None));
        };
        let id = uid.id().unescaped().to_owned();
        match self.per_tool.get(&id) {
            Some(s) => Ok((s, Some(id))),
            None if id == UNKNOWN_TOOL_ID => Ok((&self.generic, None)),
            None => Err(format!("names Tool::\"{id}\", which is not in the catalog")),
        }
    }
}

/// One statement of a rules file: the file, its whole text and the statement's range.
struct Statement<'a> {
    file: &'a str,
    text: &'a str,
    chunk: Chunk,
}

/// A rule that passed every check, ready for the policy set.
struct CompiledRule {
    /// The policy, under the rule's id.
    policy: Policy,
    /// The tool whose argument types the rule was validated against (`None`: the generic
    /// schema, which cannot read arguments).
    args_of: Option<String>,
    /// The rule's id: its `@id`, else `file:line`.
    label: String,
    meta: RuleMeta,
}

impl Statement<'_> {
    /// The statement's source text.
    fn src(&self) -> &str {
        &self.text[self.chunk.start..self.chunk.end]
    }

    /// The 1-based line of the statement's first token.
    fn line(&self) -> usize {
        line_of(self.text, self.chunk.start)
    }

    /// The 1-based line of a byte offset into the statement.
    fn line_at(&self, offset: usize) -> usize {
        line_of(self.text, self.chunk.start + offset)
    }

    /// An error in this statement's rule `label`, at `line`.
    fn error(&self, line: usize, label: &str, message: String) -> PolicyError {
        PolicyError::rule(self.file, line, label, message)
    }

    /// Parses, scopes and validates the statement (every check but the set-wide unique id).
    fn compile(&self, schemas: &Schemas) -> Result<CompiledRule, Vec<PolicyError>> {
        let (policy, label, hold) = self.parse().map_err(|e| vec![e])?;
        let line = self.line();
        let (schema, args_of) = schemas
            .for_rule(&policy)
            .map_err(|why| vec![self.error(line, &label, why)])?;
        self.validate(&policy, &label, schema)?;
        // The generic schema types `args` as the empty record, so a rule checked against it
        // may still test `context.args has <x>` (typed `false`) or use `context` whole;
        // refused here so that such a rule cannot see arguments it was not validated for.
        if args_of.is_none() && names_context_args(&policy) {
            let why = "reads `context.args` (or the whole `context`) but is not scoped to one \
                       tool: only a rule whose scope is `resource == Tool::\"<toolId>\"` sees \
                       the call's arguments"
                .to_owned();
            return Err(vec![self.error(line, &label, why)]);
        }
        Ok(CompiledRule {
            policy,
            args_of,
            meta: RuleMeta {
                file: self.file.to_owned(),
                line,
                hold,
            },
            label,
        })
    }

    /// Parses the statement as one Cedar policy and reads its annotations: the policy under
    /// its id (`@id`, else `file:line`), the id, and whether it holds (`@outcome("hold")`,
    /// only on a forbid; `@outcome("refuse")` or none refuses).
    fn parse(&self) -> Result<(Policy, String, bool), PolicyError> {
        let line = self.line();
        let parsed = Policy::parse(None, self.src()).map_err(|e| {
            let at = first_label(&e).map(|o| self.line_at(o)).unwrap_or(line);
            PolicyError::at(self.file, Some(at), format!("Cedar syntax: {e}"))
        })?;
        let label = parsed
            .annotation("id")
            .map(str::to_owned)
            .unwrap_or_else(|| format!("{}:{line}", self.file));
        let hold = match parsed.annotation("outcome") {
            None | Some("refuse") => false,
            Some("hold") => true,
            Some(other) => {
                let why = format!("@outcome(\"{other}\") is not `hold` or `refuse`");
                return Err(self.error(line, &label, why));
            }
        };
        if hold && parsed.effect() != cedar_policy::Effect::Forbid {
            let why = "@outcome(\"hold\") only means something on a forbid rule".into();
            return Err(self.error(line, &label, why));
        }
        let policy = parsed.new_id(PolicyId::new(&label));
        Ok((policy, label, hold))
    }

    /// Validates the rule alone against `schema` (Cedar strict mode): one error per problem,
    /// at the line of what it names where that is known, with the guard to add for a read
    /// of an argument that can be absent ([`explain_validation`]).
    fn validate(
        &self,
        policy: &Policy,
        label: &str,
        schema: &Schema,
    ) -> Result<(), Vec<PolicyError>> {
        let line = self.line();
        let mut one = PolicySet::new();
        if one.add(policy.clone()).is_err() {
            return Err(vec![self.error(line, label, "duplicate rule id".into())]);
        }
        let result = Validator::new(schema.clone()).validate(&one, ValidationMode::Strict);
        let errors: Vec<PolicyError> = result
            .validation_errors()
            .map(|e| {
                let at = first_label(e)
                    .or_else(|| mentioned_offset(self.src(), &e.to_string()))
                    .map(|o| self.line_at(o))
                    .unwrap_or(line);
                self.error(at, label, explain_validation(e))
            })
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// Whether `policy`'s conditions read `context.args` (`context.args…`, `context has args…`)
/// or use `context` other than through one of its attributes (which would include `args`),
/// read from the policy's JSON form (Cedar EST: `{".": {"left", "attr"}}`, `{"has": {"left",
/// "attr"}}` with `attr` a string or a path, `{"Var": "context"}`). A policy whose JSON form
/// cannot be had counts as reading them.
fn names_context_args(policy: &Policy) -> bool {
    fn walk(v: &Value) -> bool {
        match v {
            Value::Object(map) => {
                if map.get("Var").and_then(Value::as_str) == Some("context") {
                    return true;
                }
                for op in [".", "has"] {
                    if let Some(Value::Object(inner)) = map.get(op) {
                        let on_context = inner.get("left").and_then(|l| l.get("Var"))
                            == Some(&Value::from("context"));
                        if on_context {
                            let first = match inner.get("attr") {
                                Some(Value::String(a)) => Some(a.as_str()),
                                Some(Value::Array(path)) => path.first().and_then(Value::as_str),
                                _ => None,
                            };
                            return first.is_none_or(|a| a == "args");
                        }
                    }
                }
                map.values().any(walk)
            }
            Value::Array(items) => items.iter().any(walk),
            _ => false,
        }
    }
    match policy.to_json() {
        Ok(est) => est.get("conditions").is_some_and(walk),
        Err(_) => true,
    }
}

/// A validation error as the policy author reads it. A read of an optional attribute without
/// a `has` guard gets the reason it can be absent: an argument the tool's `inputSchema` does
/// not require, or that may be `null` (nulls are left out of the context, [`to_cedar`]).
fn explain_validation(e: &cedar_policy::ValidationError) -> String {
    let text = e.to_string();
    if !matches!(
        e,
        cedar_policy::ValidationError::UnsafeOptionalAttributeAccess(_)
    ) {
        return text;
    }
    // "… optional attribute `args.limit` in context for Action::\"call\"".
    let after = text.split("optional attribute ").nth(1).unwrap_or_default();
    let access = after.split('`').nth(1).unwrap_or_default();
    let (record, attr) = access.rsplit_once('.').unwrap_or(("args", access));
    let record = if after.contains("in context") {
        format!("context.{record}")
    } else {
        record.to_owned()
    };
    format!(
        "{text}: `{attr}` can be absent (the tool's inputSchema does not require it, or allows null, and a null argument is left out of the context); guard the read: `{record} has {attr} && …`"
    )
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())]
        .bytes()
        .filter(|b| *b == b'\n')
        .count()
        + 1
}

/// Where in `src` a name the message quotes (`` `args.amout` `` → `amout`) first appears.
fn mentioned_offset(src: &str, message: &str) -> Option<usize> {
    message
        .split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|quoted| quoted.rsplit(['.', ':']).next())
        .filter(|name| !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_'))
        .find_map(|name| src.find(name))
}

fn first_label(d: &dyn miette::Diagnostic) -> Option<usize> {
    d.labels().and_then(|mut l| l.next()).map(|l| l.offset())
}

/// The Cedar schema (JSON form) for the catalog; `tool` types `context.args` for that tool.
fn cedar_schema(catalog: &Catalog, tool: Option<&CatalogTool>) -> Value {
    let args = tool
        .and_then(|t| t.input_schema())
        .and_then(|s| cedar_type(&Value::Object(s.clone().into_iter().collect())))
        .filter(|t| t["type"] == "Record")
        .unwrap_or_else(|| json!({"type": "Record", "attributes": {}}));
    let _ = catalog;
    let string = json!({"type": "String"});
    json!({
        "": {
            "entityTypes": {
                "User": {},
                "Agent": {},
                "Tool": {"shape": {"type": "Record", "attributes": {
                    "toolId": string, "source": string, "safetyTier": string, "egress": string,
                    "approval": string, "replayPolicy": string, "contentTrust": string,
                    "scopes": {"type": "Set", "element": string}
                }}}
            },
            "actions": {
                "call": {"appliesTo": {
                    "principalTypes": ["User", "Agent"],
                    "resourceTypes": ["Tool"],
                    "context": {"type": "Record", "attributes": {
                        "trust": string, "provider": string, "model": string, "run": string,
                        "approved": {"type": "Boolean"},
                        "args": args
                    }}
                }}
            }
        }
    })
}

/// The schema a value is checked against once `null` is set aside: the one non-null branch
/// of `anyOf`/`oneOf: [X, {"type": "null"}]` (pydantic's `Optional[X]`), else the schema
/// itself; and whether `null` is allowed (that branch, or `"type": [T, "null"]`, the form
/// OpenAI strict mode uses for optional parameters).
fn non_null(schema: &Value) -> (&Value, bool) {
    for key in ["anyOf", "oneOf"] {
        if let Some(branches) = schema.get(key).and_then(Value::as_array) {
            let is_null = |b: &Value| b.get("type").and_then(Value::as_str) == Some("null");
            let rest: Vec<&Value> = branches.iter().filter(|b| !is_null(b)).collect();
            if rest.len() == 1 && rest.len() < branches.len() {
                return (rest[0], true);
            }
        }
    }
    let nullable = schema
        .get("type")
        .and_then(Value::as_array)
        .is_some_and(|t| t.iter().any(|x| x == "null"));
    (schema, nullable)
}

/// The JSON Schema `type` of a (non-null) schema: `"T"`, or the one non-null member of
/// `["T", "null"]`.
fn type_name(schema: &Value) -> Option<&str> {
    match schema.get("type")? {
        Value::String(t) => Some(t),
        Value::Array(list) => {
            let rest: Vec<&str> = list
                .iter()
                .filter_map(Value::as_str)
                .filter(|t| *t != "null")
                .collect();
            (rest.len() == 1).then(|| rest[0])
        }
        _ => None,
    }
}

/// Maps a JSON Schema to a Cedar type; `None` for what Cedar cannot type (unions, `$ref` …).
/// A property is a required Cedar attribute only when the schema requires it *and* it cannot
/// be `null`: a `null` argument is left out of the context ([`to_cedar`]), so a nullable
/// property can be absent, and a rule reading it must guard it with `has` (Cedar's
/// validator reports an unguarded read when the bundle is compiled).
fn cedar_type(schema: &Value) -> Option<Value> {
    let (schema, _) = non_null(schema);
    match type_name(schema)? {
        "string" => Some(json!({"type": "String"})),
        "integer" => Some(json!({"type": "Long"})),
        "number" => Some(json!({"type": "Extension", "name": "decimal"})),
        "boolean" => Some(json!({"type": "Boolean"})),
        "array" => {
            let element = cedar_type(schema.get("items")?)?;
            Some(json!({"type": "Set", "element": element}))
        }
        "object" => {
            let required: HashSet<&str> = schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let mut attributes = Map::new();
            for (name, prop) in schema
                .get("properties")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
            {
                if let Some(mut t) = cedar_type(prop) {
                    let (_, nullable) = non_null(prop);
                    t["required"] = json!(required.contains(name.as_str()) && !nullable);
                    attributes.insert(name.clone(), t);
                }
            }
            Some(json!({"type": "Record", "attributes": attributes}))
        }
        _ => None,
    }
}

/// Converts arguments to a Cedar value. An argument value never refuses a call by itself
/// (policy/README.md, "Arguments in rules"); values Cedar has no exact form for are mapped
/// so that only a rule that reads them can be affected, and then it fails closed:
///
/// - `null` is absent: an object member whose value is `null` is left out of the record,
///   and a `null` array member out of the set (a rule must guard such a member with `has`;
///   `policy check` reports a read of an argument that can be absent without one);
/// - an array is a Cedar set: duplicate members collapse (Cedar has no way to observe
///   multiplicity, so nothing a rule can test changes);
/// - an integer is a `Long` (a whole float such as `3.0` too, where the schema says
///   `integer`); a number the schema types `number` is a `decimal` when it has at most 4
///   decimals and fits Cedar's range. Any other number (more decimals, out of range) becomes
///   its JSON text as a *string*, never a rounded number: a rule that compares it as a
///   number then hits a type error, which refuses the call (an evaluation error refuses),
///   while rules that do not read it decide as usual.
fn to_cedar(
    v: &Value,
    schema: Option<&BTreeMap<String, Value>>,
) -> Result<RestrictedExpression, String> {
    match (v, schema) {
        // The usual root, an object under a schema with no `anyOf` / `oneOf` of its own: its
        // properties are read in place (what `convert` does with the schema as a value).
        (Value::Object(map), Some(root))
            if !root.contains_key("anyOf") && !root.contains_key("oneOf") =>
        {
            convert_fields(map, root.get("properties"), "")
        }
        _ => {
            let schema = schema.map(|s| Value::Object(s.clone().into_iter().collect()));
            convert(v, schema.as_ref(), "")
        }
    }
}

fn convert(v: &Value, schema: Option<&Value>, path: &str) -> Result<RestrictedExpression, String> {
    let schema = schema.map(|s| non_null(s).0);
    let ty = schema.and_then(type_name);
    match v {
        // Callers leave nulls out of records and sets; a null anywhere else (a bare value)
        // has no Cedar form, and the empty record is what a rule sees of it.
        Value::Null => {
            RestrictedExpression::new_record(Vec::<(String, RestrictedExpression)>::new())
                .map_err(|e| format!("`{}`: {e}", display_path(path)))
        }
        Value::Bool(b) => Ok(RestrictedExpression::new_bool(*b)),
        Value::String(s) => Ok(RestrictedExpression::new_string(s.clone())),
        Value::Number(n) => {
            if ty != Some("number") {
                if let Some(i) = n.as_i64() {
                    return Ok(RestrictedExpression::new_long(i));
                }
                // `3.0` where the schema says `integer` (JSON Schema counts it as one).
                let whole = n
                    .as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                    .map(|f| f as i64);
                if let (Some("integer"), Some(i)) = (ty, whole) {
                    return Ok(RestrictedExpression::new_long(i));
                }
            }
            Ok(match decimal(n) {
                Some(d) => RestrictedExpression::new_decimal(d),
                None => RestrictedExpression::new_string(n.to_string()),
            })
        }
        Value::Array(items) => {
            let item_schema = schema.and_then(|s| s.get("items"));
            let mut seen = HashSet::new();
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                if item.is_null() || !seen.insert(item.to_string()) {
                    continue;
                }
                out.push(convert(item, item_schema, &format!("{path}/{i}"))?);
            }
            Ok(RestrictedExpression::new_set(out))
        }
        Value::Object(map) => convert_fields(map, schema.and_then(|s| s.get("properties")), path),
    }
}

/// An object's non-null fields as a Cedar record, each under its `properties` schema.
fn convert_fields(
    map: &Map<String, Value>,
    props: Option<&Value>,
    path: &str,
) -> Result<RestrictedExpression, String> {
    let mut fields = Vec::with_capacity(map.len());
    for (k, item) in map.iter().filter(|(_, item)| !item.is_null()) {
        let p = props.and_then(|p| p.get(k));
        fields.push((k.clone(), convert(item, p, &format!("{path}/{k}"))?));
    }
    RestrictedExpression::new_record(fields).map_err(|e| format!("`{}`: {e}", display_path(path)))
}

fn display_path(p: &str) -> &str {
    if p.is_empty() {
        "/"
    } else {
        p
    }
}

/// The decimal text of `n` when it has at most 4 decimals and fits Cedar's range.
fn decimal(n: &serde_json::Number) -> Option<String> {
    let text = n.to_string();
    if text.contains(['e', 'E']) {
        return None;
    }
    let (int, frac) = match text.split_once('.') {
        Some((i, f)) => (i.to_owned(), f.to_owned()),
        None => (text.clone(), "0".to_owned()),
    };
    if frac.len() > 4 {
        return None;
    }
    let digits = int.trim_start_matches('-');
    if digits.len() > 14 {
        return None; // Cedar decimal: i64 scaled by 10^4
    }
    Some(format!("{int}.{frac}"))
}

fn tool_entities(catalog: &Catalog) -> Result<Entities, String> {
    let mut list = Vec::new();
    for tool in catalog.tools().chain(std::iter::once(catalog.unknown())) {
        let d = &tool.descriptor;
        let s = |v: &str| RestrictedExpression::new_string(v.to_owned());
        let attrs: HashMap<String, RestrictedExpression> = [
            ("toolId", s(&d.tool_id)),
            ("source", s(d.source.as_str())),
            ("safetyTier", s(d.safety_tier.as_str())),
            ("egress", s(d.egress.map_or("unspecified", |e| e.as_str()))),
            (
                "approval",
                s(d.approval.map_or("unspecified", |e| e.as_str())),
            ),
            (
                "replayPolicy",
                s(d.replay_policy.map_or("unspecified", |e| e.as_str())),
            ),
            ("contentTrust", s(tool.content_trust.as_str())),
            (
                "scopes",
                RestrictedExpression::new_set(
                    d.auth
                        .iter()
                        .flat_map(|a| a.scopes.iter())
                        .map(|x| RestrictedExpression::new_string(x.clone())),
                ),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let uid = uid(Kind::Tool, &d.tool_id).ok_or("a tool id cannot be a Cedar entity id")?;
        list.push(Entity::new(uid, attrs, HashSet::new()).map_err(|e| e.to_string())?);
    }
    Entities::from_entities(list, None).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(run: &str) -> FactsRef<'_> {
        FactsRef {
            person: None,
            agent: "agent",
            tool_id: "acme.assistant:get_weather",
            trust: "trusted",
            provider: "openai_chat",
            model: "gpt-4o",
            run,
            approved: false,
        }
    }

    fn permit(rule: &str) -> Authz {
        Authz::Permit(vec![rule.to_owned()])
    }

    #[test]
    fn the_decision_memo_answers_only_its_own_facts_and_forgets_the_oldest() {
        let mut memo = DecisionMemo::default();
        let chat = facts("");
        let chat_key = memo.key(&chat);
        memo.put(chat_key, &chat, permit("chat"));
        assert_eq!(memo.get(chat_key, &chat), Some(&permit("chat")));
        // Other facts under the same key (a hash collision) are not answered.
        assert_eq!(memo.get(chat_key, &facts("run-1")), None);
        assert_eq!(memo.get(memo.key(&facts("run-1")), &facts("run-1")), None);

        // Other runs' facts fill the memo: each is its own entry, found directly, and the
        // oldest (the chat turn's) is forgotten once CACHED_DECISIONS newer ones are kept.
        let runs: Vec<String> = (0..CACHED_DECISIONS).map(|i| format!("run-{i}")).collect();
        for (i, run) in runs.iter().enumerate() {
            let f = facts(run);
            memo.put(memo.key(&f), &f, permit(run));
            if i + 1 < CACHED_DECISIONS {
                assert_eq!(
                    memo.get(chat_key, &chat),
                    Some(&permit("chat")),
                    "after {i}"
                );
            }
        }
        assert_eq!(memo.get(chat_key, &chat), None);
        assert_eq!(memo.entries.len(), CACHED_DECISIONS);
        assert_eq!(memo.order.len(), CACHED_DECISIONS);
        for run in &runs {
            let f = facts(run);
            assert_eq!(memo.get(memo.key(&f), &f), Some(&permit(run)));
        }

        // A colliding put replaces the slot's entry and adds no key.
        let last = facts(&runs[CACHED_DECISIONS - 1]);
        let slot = memo.key(&last);
        memo.put(slot, &chat, permit("collided"));
        assert_eq!(memo.get(slot, &last), None);
        assert_eq!(memo.get(slot, &chat), Some(&permit("collided")));
        assert_eq!(memo.entries.len(), CACHED_DECISIONS);
        assert_eq!(memo.order.len(), CACHED_DECISIONS);
    }

    #[test]
    fn statements_split_outside_strings_and_comments() {
        let src = "// a; b\npermit(principal, action, resource) when { context.model == \"x;y\" };\n\nforbid(principal, action, resource);";
        let chunks = split_statements(src);
        assert_eq!(chunks.len(), 2);
        assert!(src[chunks[0].start..chunks[0].end].starts_with("permit"));
        assert_eq!(line_of(src, chunks[1].start), 4);
    }

    #[test]
    fn argument_values_cedar_cannot_hold_exactly_never_fail_the_conversion() {
        let args =
            json!({"a": null, "b": [1, 1, null], "c": 0.123_456_7, "d": {"e": null}, "f": 3.0});
        let schema: BTreeMap<String, Value> = serde_json::from_value(json!({
            "type": "object",
            "properties": {"c": {"type": "number"}, "f": {"type": ["integer", "null"]}}
        }))
        .unwrap();
        assert!(to_cedar(&args, Some(&schema)).is_ok());
        assert!(to_cedar(&args, None).is_ok());
        // Nullable and optional properties are optional Cedar attributes.
        let t = cedar_type(
            &json!({"type": "object", "required": ["x", "y", "z"], "properties": {
            "x": {"type": "string"}, "y": {"type": ["string", "null"]},
            "z": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "w": {"type": "boolean"}}}),
        )
        .unwrap();
        assert_eq!(t["attributes"]["x"]["required"], true);
        assert_eq!(t["attributes"]["y"]["required"], false);
        assert_eq!(t["attributes"]["z"]["type"], "Long");
        assert_eq!(t["attributes"]["z"]["required"], false);
        assert_eq!(t["attributes"]["w"]["required"], false);
    }

    #[test]
    fn decimals_are_exact_or_refused() {
        let n = |s: &str| serde_json::from_str::<serde_json::Number>(s).unwrap();
        assert_eq!(decimal(&n("12.5")).as_deref(), Some("12.5"));
        assert_eq!(decimal(&n("-3")).as_deref(), Some("-3.0"));
        assert_eq!(decimal(&n("0.12345")), None);
        assert_eq!(decimal(&n("1e30")), None);
    }
}
