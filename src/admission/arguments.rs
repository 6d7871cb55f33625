//! Stage 3, **arguments** (tool-turn contract §B): the arguments must be a JSON object valid
//! against the request's declared schema (JSON Schema 2020-12 unless the schema says
//! otherwise), before any gate.
//!
//! A free-form tool (Responses `type: "custom"`) takes raw text instead, and its check is the
//! declared `format`, not a JSON Schema ([`check_format`]):
//! - `text` (or no format): any text;
//! - `grammar` with `syntax: "regex"`: the whole input must match the definition, compiled
//!   by the `regex` crate (the syntax the API's grammar engine uses; a definition that does
//!   not compile, or compiles past 1 MiB, refuses every input);
//! - `grammar` with `syntax: "lark"`: **not parsed**. turnguard has no faithful Lark (and
//!   llguidance-extension) parser, so it checks only that the input is text, as the format
//!   requires; the call is then judged by its catalog tool like any other (the shipped `codex`
//!   catalog classifies Codex's free-form `exec` and `apply_patch` as exec and write tools,
//!   gated in an untrusted turn). The provider constrains the model's sampling to the grammar;
//!   turnguard does not vouch for it;
//! - any other format or syntax: no input passes (fail closed).
//!
//! A call must have the form its tool was declared with: JSON arguments for a function tool,
//! raw text for a custom tool (`input_kind_mismatch` otherwise); a tool declared more than
//! once must meet every declaration. Later stages see a free-form call's input as the object
//! `{"input": "<the raw text>"}`: the catalog's `inputSchema`, Cedar rules
//! (`context.args.input`), redaction and `argsHash` all read that form.
//!
//! Compiled validators are cached by the SHA-256 of the schema's RFC 8785 form, bounded in
//! estimated bytes and evicted least recently used first ([`SchemaCache`]); a schema larger
//! than `max_schema_bytes` is never compiled. No remote
//! `$ref` is ever fetched: `jsonschema` is built without its HTTP and file resolvers, so a
//! schema that needs one fails to compile and the call is withheld (fail closed).

use std::sync::{Arc, Mutex};

use jsonschema::Draft;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::model::{CallInput, Decision, FreeformFormat, Outcome, Stage, ToolCall, Turn};

/// At most this many validation errors are listed in a host-authored explanation.
const MAX_LISTED_ERRORS: usize = 5;
/// Compiled validators kept at most, whatever their size.
pub const MAX_CACHED_SCHEMAS: usize = 1024;

/// Why the arguments text is not a JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgsError {
    /// Not JSON at all.
    NotJson,
    /// JSON with an object key twice ([`crate::strict_json`]: refused, as in request bodies).
    DuplicateKey,
    /// JSON, but not an object.
    NotObject,
}

/// Parses the arguments as emitted. An empty string is read as `{}` (OpenAI sends `""` for
/// a call without arguments); it is then validated like any other arguments. Parsed like a
/// request body ([`crate::strict_json::from_slice`]): a key twice in one object, at any depth,
/// is refused, because the agent receives these bytes as the model wrote them and its parser
/// may take the first value where admission read the last.
pub fn parse(text: &str) -> Result<Value, ArgsError> {
    if text.trim().is_empty() {
        return Ok(Value::Object(Default::default()));
    }
    match crate::strict_json::from_str(text) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ArgsError::NotObject),
        Err(crate::strict_json::StrictJsonError::DuplicateKey { .. }) => {
            Err(ArgsError::DuplicateKey)
        }
        Err(_) => Err(ArgsError::NotJson),
    }
}

/// The call's input as the later stages see it: a JSON call's arguments parsed ([`parse`]),
/// a free-form call's raw text as `{"input": text}` (never parsed as JSON).
pub fn parse_call(call: &ToolCall) -> Result<Value, ArgsError> {
    match call.input {
        CallInput::Json => parse(&call.arguments),
        CallInput::Text => Ok(serde_json::json!({ "input": call.arguments })),
    }
}

/// Largest compiled program of a `regex` grammar, bytes.
const MAX_REGEX_BYTES: usize = 1 << 20;

/// Checks a free-form call's raw `input` against its declared `format` (see the module
/// docs). `Err((reason, message))`: a stable reason code and host-authored text naming what
/// failed, never the input.
pub fn check_format(
    format: &FreeformFormat,
    input: &str,
) -> Result<(), (crate::reason::Reason, String)> {
    match format {
        FreeformFormat::Text | FreeformFormat::Lark(_) => Ok(()),
        FreeformFormat::Regex(definition) => {
            let anchored = format!(r"\A(?:{definition})\z");
            let re = regex::RegexBuilder::new(&anchored)
                .size_limit(MAX_REGEX_BYTES)
                .dfa_size_limit(MAX_REGEX_BYTES)
                .build()
                .map_err(|e| {
                    (
                        crate::reason::Reason::FormatUncompilable,
                        format!(
                            "the declared regex grammar does not compile ({})",
                            match e {
                                regex::Error::CompiledTooBig(n) =>
                                    format!("larger than {n} bytes compiled"),
                                _ => "invalid syntax".to_owned(),
                            }
                        ),
                    )
                })?;
            if re.is_match(input) {
                Ok(())
            } else {
                Err((
                    crate::reason::Reason::FormatViolation,
                    "the input does not match the declared regex grammar".into(),
                ))
            }
        }
        FreeformFormat::Unknown(what) => Err((
            crate::reason::Reason::FormatUnsupported,
            format!(
                "the declared input format `{}` is not one turnguard can check (text, or a regex or lark grammar)",
                super::sanitize_label(what)
            ),
        )),
    }
}

/// `argsHash`: SHA-256 (lowercase hex) of the RFC 8785 (JCS) form of `args`.
pub fn args_hash(args: &Value) -> String {
    hex::encode(Sha256::digest(canonical(args)))
}

/// The RFC 8785 (JCS) serialization of `v`.
pub fn canonical(v: &Value) -> Vec<u8> {
    crate::jcs::to_vec(v)
}

/// A compiled validator, or why the schema does not compile.
pub type Compiled = crate::policy::catalog::CompiledSchema;

/// Estimated memory of a compiled validator per byte of its schema's JSON (measured with
/// `jsonschema` 0.61: a 1.7 MB schema compiles to about 41 MB, ×24; rounded up).
pub const COMPILED_BYTES_PER_JSON_BYTE: usize = 32;

/// The bounds of the compiled-schema cache (issue 11: compiled schemas are bounded in bytes).
#[derive(Debug, Clone, Copy)]
pub struct SchemaLimits {
    /// Largest schema compiled, bytes of its RFC 8785 JSON (`max_schema_bytes`).
    pub max_schema_bytes: usize,
    /// Estimated memory the cache may hold, bytes (`max_schema_cache_bytes`).
    pub budget_bytes: usize,
}

impl Default for SchemaLimits {
    fn default() -> Self {
        Self {
            max_schema_bytes: 256 << 10,
            budget_bytes: 32 << 20,
        }
    }
}

/// Estimated memory of the schema's own tree kept beside its validator (to tell a cached
/// schema from a different one with the same hash), per byte of its JSON.
pub const SCHEMA_TREE_BYTES_PER_JSON_BYTE: usize = 8;

/// Compiled validators shared by every request, keyed by a structural hash of the schema
/// tree (SipHash with per-process random keys; a hit is confirmed by comparing the trees, so
/// a collision compiles rather than borrows another schema's validator). Least recently used
/// first out once the estimated memory (([`COMPILED_BYTES_PER_JSON_BYTE`] +
/// [`SCHEMA_TREE_BYTES_PER_JSON_BYTE`]) × the schema's RFC 8785 size) passes the budget, or
/// past [`MAX_CACHED_SCHEMAS`] entries. A schema larger than `max_schema_bytes` is never
/// compiled.
///
/// A schema is serialized (RFC 8785) only on a miss: the agent declares the same tools on
/// every request, and the hit path (hash, compare) allocates nothing but the key sort of
/// each object (issue 13 item 6: one canonicalization per schema, not one per call).
pub struct SchemaCache {
    limits: SchemaLimits,
    hasher: std::hash::RandomState,
    lru: Mutex<Lru>,
    /// Schemas that passed [`SchemaCache::check_size`], compiled or not (a declared tool no
    /// call names is never compiled), by fingerprint, each with the tree requests share
    /// ([`crate::model::DeclaredSchemas::share`]): the next request declaring the same
    /// schema neither copies it out of its body nor serializes it (RFC 8785); an agent
    /// declares every tool on every request, and only the called ones are compiled.
    sized: Mutex<SizedSchemas>,
    bytes: prometheus_client::metrics::gauge::Gauge,
    evictions: prometheus_client::metrics::counter::Counter,
}

/// Fingerprints [`SchemaCache`] remembers as within the size cap (8 bytes each and the LRU's
/// links: ~200 KiB when full, besides the trees).
const SIZED_FINGERPRINTS: usize = 4096;

/// Longest tool name whose last schema [`SchemaCache`] remembers (a provider's tool names are
/// at most 64 characters; a longer one is looked up by fingerprint only, so the names kept
/// stay within [`SIZED_FINGERPRINTS`] × this many bytes).
const MAX_HINTED_NAME_BYTES: usize = 128;

/// Estimated memory of the declared schema trees [`SchemaCache`] keeps to share, bytes
/// ([`SCHEMA_TREE_BYTES_PER_JSON_BYTE`] × each one's RFC 8785 size). One tree over an eighth
/// of it is remembered by fingerprint only, and each request copies it as before.
pub const SHARED_TREE_BYTES: usize = 4 << 20;

/// The schemas that passed the size check: oldest use first, each with its tree and that
/// tree's estimated bytes, or `None` when it is remembered by fingerprint only.
struct SizedSchemas {
    map: hashlink::LinkedHashMap<u64, Option<(Arc<Value>, usize)>>,
    /// Estimated memory of the trees in `map`, bytes.
    tree_bytes: usize,
    /// The fingerprint of the schema each tool name was last declared with: a request that
    /// declares a tool as before finds the kept tree by its name and compares it, without
    /// fingerprinting its own schema (a hint only; the comparison decides).
    by_name: hashlink::LruCache<String, u64>,
}

impl Default for SizedSchemas {
    fn default() -> Self {
        Self {
            map: hashlink::LinkedHashMap::new(),
            tree_bytes: 0,
            by_name: hashlink::LruCache::new(SIZED_FINGERPRINTS),
        }
    }
}

impl SizedSchemas {
    /// Remembers `key` as within the size cap, with `tree` to share when it fits the budget;
    /// the least recently used go first past [`SIZED_FINGERPRINTS`] or [`SHARED_TREE_BYTES`].
    fn remember(&mut self, key: u64, tree: Option<&Arc<Value>>, json_len: usize) {
        let cost = json_len.saturating_mul(SCHEMA_TREE_BYTES_PER_JSON_BYTE);
        let kept = tree
            .filter(|_| cost <= SHARED_TREE_BYTES / 8)
            .map(|t| (Arc::clone(t), cost));
        self.tree_bytes += kept.as_ref().map_or(0, |(_, c)| *c);
        // A different schema under the same key (a hash collision) is replaced.
        if let Some(Some((_, old))) = self.map.insert(key, kept) {
            self.tree_bytes -= old;
        }
        while self.map.len() > SIZED_FINGERPRINTS || self.tree_bytes > SHARED_TREE_BYTES {
            let Some((_, old)) = self.map.pop_front() else {
                break;
            };
            self.tree_bytes -= old.map_or(0, |(_, c)| c);
        }
    }
}

/// A cached schema: its tree, its validator, its estimated memory in bytes.
struct Entry {
    schema: Value,
    compiled: Compiled,
    cost: usize,
}

#[derive(Default)]
struct Lru {
    /// Oldest use first.
    map: hashlink::LinkedHashMap<u64, Entry>,
    bytes: usize,
}

impl Default for SchemaCache {
    fn default() -> Self {
        Self::new(
            SchemaLimits::default(),
            Default::default(),
            Default::default(),
        )
    }
}

impl SchemaCache {
    /// A cache within `limits`, reporting its estimated bytes and evictions to the given
    /// metrics (`turnguard_schema_cache_bytes`, `turnguard_schema_cache_evictions_total`).
    pub fn new(
        limits: SchemaLimits,
        bytes: prometheus_client::metrics::gauge::Gauge,
        evictions: prometheus_client::metrics::counter::Counter,
    ) -> Self {
        Self {
            limits,
            hasher: std::hash::RandomState::new(),
            lru: Mutex::new(Lru::default()),
            sized: Mutex::new(SizedSchemas::default()),
            bytes,
            evictions,
        }
    }

    /// The schema's fingerprint in this process: SipHash-1-3 of the tree under a key drawn at
    /// start ([`std::hash::RandomState`]), so nobody outside can aim at a collision. Equal
    /// trees have equal fingerprints whatever their members' order (the trees' equality
    /// ignores it): an object's members are hashed each under the key and summed, which
    /// needs no sorted copy of its keys (`Value`'s own `Hash` sorts one for every object).
    fn key(&self, schema: &Value) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = self.hasher.build_hasher();
        fingerprint(&self.hasher, schema, &mut h);
        h.finish()
    }

    /// The cached validator of `schema` (now the most recently used), if it is cached.
    fn cached(&self, key: u64, schema: &Value) -> Option<Compiled> {
        let mut lru = self.lru.lock().ok()?;
        let entry = lru.map.to_back(&key)?;
        same_tree(&entry.schema, schema).then(|| Arc::clone(&entry.compiled))
    }

    /// `Err((bytes, limit))` when `schema` is larger than `max_schema_bytes` (its RFC 8785
    /// JSON): turnguard refuses to compile it; `Ok(fingerprint)` otherwise (the journal's
    /// writer keys the schema's digest by it). A schema that passed before (the same tree, or
    /// one remembered by fingerprint only) passes again without being serialized (a collision
    /// needs the process's hash key, and [`SchemaCache::get`] checks the size again before it
    /// compiles, so the compiled-memory bound never rests on the fingerprint).
    pub fn check_size(&self, schema: &Value) -> Result<u64, (usize, usize)> {
        self.check(schema, None, None)
    }

    /// [`SchemaCache::check_size`] of a declared tool's schema, with the fingerprint
    /// [`crate::model::DeclaredSchemas::share`] gave it (`None`: computed). The tree that
    /// passes is kept for the next request declaring it to share.
    pub fn check_declared(
        &self,
        schema: &Arc<Value>,
        fingerprint: Option<u64>,
    ) -> Result<u64, (usize, usize)> {
        self.check(schema, Some(schema), fingerprint)
    }

    fn check(
        &self,
        schema: &Value,
        shared: Option<&Arc<Value>>,
        fingerprint: Option<u64>,
    ) -> Result<u64, (usize, usize)> {
        let key = fingerprint.unwrap_or_else(|| self.key(schema));
        let known = self
            .sized
            .lock()
            .ok()
            .and_then(|mut sized| sized.map.to_back(&key).map(|e| e.clone()));
        match known {
            // Remembered by fingerprint only, or the very tree that passed.
            Some(None) => return Ok(key),
            Some(Some((tree, _))) => match shared {
                None => return Ok(key),
                Some(s) if Arc::ptr_eq(s, &tree) || *tree == *schema => return Ok(key),
                // Another tree under this fingerprint: sized, and kept, in its place.
                Some(_) => {}
            },
            None => {}
        }
        let n = canonical(schema).len();
        if n > self.limits.max_schema_bytes {
            return Err((n, self.limits.max_schema_bytes));
        }
        if let Ok(mut sized) = self.sized.lock() {
            sized.remember(key, shared, n);
        }
        Ok(key)
    }

    /// The compiled validator for `schema`, compiling it on first use.
    /// `Err(reason)` when the schema does not compile (for example a remote `$ref`) or is
    /// larger than `max_schema_bytes` (the reason names the cap and its flag).
    pub fn get(&self, schema: &Value) -> Compiled {
        self.get_fingerprinted(None, schema)
    }

    /// [`SchemaCache::get`] with the schema's fingerprint from [`SchemaCache::check_size`]
    /// when the caller has it (`None`: it is computed). The cached entry is still compared
    /// with `schema`, so a fingerprint of another schema finds nothing wrong.
    pub fn get_fingerprinted(&self, fingerprint: Option<u64>, schema: &Value) -> Compiled {
        let key = fingerprint.unwrap_or_else(|| self.key(schema));
        if let Some(hit) = self.cached(key, schema) {
            return hit;
        }
        let (built, json_len) = self.compile_sized(schema);
        if json_len > self.limits.max_schema_bytes {
            return built;
        }
        let cost = json_len
            .saturating_mul(COMPILED_BYTES_PER_JSON_BYTE + SCHEMA_TREE_BYTES_PER_JSON_BYTE)
            .saturating_add(1024);
        if cost > self.limits.budget_bytes {
            // Larger than the whole budget: used for this call, never kept.
            return built;
        }
        if let Ok(mut lru) = self.lru.lock() {
            let entry = Entry {
                schema: schema.clone(),
                compiled: Arc::clone(&built),
                cost,
            };
            // A different schema under the same key (a hash collision) is replaced.
            if let Some(old) = lru.map.insert(key, entry) {
                lru.bytes -= old.cost;
            }
            lru.bytes += cost;
            while lru.bytes > self.limits.budget_bytes || lru.map.len() > MAX_CACHED_SCHEMAS {
                let Some((_, old)) = lru.map.pop_front() else {
                    break;
                };
                lru.bytes -= old.cost;
                self.evictions.inc();
            }
            self.bytes.set(i64::try_from(lru.bytes).unwrap_or(i64::MAX));
        }
        built
    }

    /// `schema` compiled, not cached: for a schema whose owner keeps it (a catalog tool's
    /// `inputSchema`, compiled once per policy snapshot: [`CatalogTool::input_validator`]).
    /// The same size cap and errors as [`SchemaCache::get`].
    ///
    /// [`CatalogTool::input_validator`]: crate::policy::catalog::CatalogTool::input_validator
    pub fn compile(&self, schema: &Value) -> Compiled {
        self.compile_sized(schema).0
    }

    /// [`SchemaCache::compile`] and the schema's RFC 8785 length, bytes (over
    /// `max_schema_bytes`: not compiled).
    fn compile_sized(&self, schema: &Value) -> (Compiled, usize) {
        let json_len = canonical(schema).len();
        if json_len > self.limits.max_schema_bytes {
            let refused = Err(format!(
                "the schema is {json_len} bytes; turnguard compiles schemas of at most {} bytes (max_schema_bytes; raise it with --max-schema-bytes)",
                self.limits.max_schema_bytes
            ));
            return (Arc::new(refused), json_len);
        }
        let built = jsonschema::options()
            .with_draft(Draft::Draft202012)
            .build(schema)
            .map_err(|e| {
                format!(
                    "the declared schema does not compile: {}",
                    e.kind().keyword()
                )
            });
        (Arc::new(built), json_len)
    }

    /// Number of compiled schemas held.
    pub fn len(&self) -> usize {
        self.lru.lock().map(|m| m.map.len()).unwrap_or(0)
    }

    /// No schema compiled yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Estimated memory held, bytes.
    pub fn bytes(&self) -> usize {
        self.lru.lock().map(|m| m.bytes).unwrap_or(0)
    }
}

/// Feeds `v` to `h` for [`SchemaCache::key`]: a tag per kind, then the value (an array's
/// items in order; an object's members as the wrapping sum of each member's own hash under
/// `keys`, so member order does not count).
fn fingerprint(keys: &std::hash::RandomState, v: &Value, h: &mut impl std::hash::Hasher) {
    use std::hash::{BuildHasher, Hash, Hasher};
    match v {
        Value::Null => h.write_u8(0),
        Value::Bool(b) => {
            h.write_u8(1);
            b.hash(h);
        }
        Value::Number(n) => {
            h.write_u8(2);
            n.hash(h);
        }
        Value::String(s) => {
            h.write_u8(3);
            s.hash(h);
        }
        Value::Array(items) => {
            h.write_u8(4);
            h.write_usize(items.len());
            for item in items {
                fingerprint(keys, item, h);
            }
        }
        Value::Object(members) => {
            h.write_u8(5);
            h.write_usize(members.len());
            let sum = members.iter().fold(0u64, |sum, (k, v)| {
                let mut member = keys.build_hasher();
                k.hash(&mut member);
                fingerprint(keys, v, &mut member);
                sum.wrapping_add(member.finish())
            });
            h.write_u64(sum);
        }
    }
}

/// A request's declared schemas are shared with the trees of [`SchemaCache::check_declared`]:
/// a kept tree equal to the request's is handed out (compared first, so a fingerprint
/// collision copies instead); any other schema is copied out of the request.
impl crate::model::DeclaredSchemas for SchemaCache {
    fn share(&self, name: &str, schema: &Value) -> (Arc<Value>, Option<u64>) {
        let kept = |sized: &SizedSchemas, key: u64| {
            sized.map.get(&key).cloned().flatten().map(|(tree, _)| tree)
        };
        // The schema this name was declared with last time, when it still is.
        let hinted = self.sized.lock().ok().and_then(|mut sized| {
            let key = sized.by_name.get(name).copied()?;
            Some((key, kept(&sized, key)?))
        });
        if let Some((key, tree)) = hinted.filter(|(_, t)| same_tree(t, schema)) {
            return (tree, Some(key));
        }
        let key = self.key(schema);
        let found = self.sized.lock().ok().and_then(|mut sized| {
            if name.len() <= MAX_HINTED_NAME_BYTES {
                sized.by_name.insert(name.to_owned(), key);
            }
            kept(&sized, key)
        });
        match found {
            Some(tree) if same_tree(&tree, schema) => (tree, Some(key)),
            _ => (Arc::new(schema.clone()), Some(key)),
        }
    }
}

/// `a == b`, trying the members of every object in the order they were sent first: an agent
/// sends the same schema the same way every time, and that walk hashes no keys (a
/// `serde_json` map's equality looks each member up in the other map). When that walk finds
/// a difference the trees are compared by `==` once, from the top, so the answer is always
/// tree equality and the cost at most two walks.
fn same_tree(a: &Value, b: &Value) -> bool {
    same_in_order(a, b) || a == b
}

/// Whether `a` and `b` are equal with every object's members in the same order.
fn same_in_order(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y.iter())
                    .all(|((ka, va), (kb, vb))| ka == kb && same_in_order(va, vb))
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_in_order(p, q))
        }
        _ => a == b,
    }
}

/// `Some(invalid)` when the input does not have the form its tool was declared with, or is
/// not valid against every declaration of the tool (a JSON object valid against the declared
/// schema, or free-form text in the declared format) and the catalog's `inputSchema`.
pub fn check(
    turn: &Turn,
    call: &ToolCall,
    args: &Result<Value, ArgsError>,
    catalog_schema: Option<Compiled>,
    schemas: &SchemaCache,
) -> Option<Decision> {
    let invalid = |reason: crate::reason::Reason, message: String| {
        Some(Decision::new(
            Outcome::Invalid,
            Stage::Arguments,
            reason,
            message,
        ))
    };
    // Only a refusal's message names the tool: a valid call does not pay for the label.
    let name = || super::sanitize_label(&call.name);
    for declared in turn.declarations(&call.name) {
        match (&declared.freeform, call.input) {
            (None, CallInput::Json) => {}
            (Some(format), CallInput::Text) => {
                if let Err((reason, message)) = check_format(format, &call.arguments) {
                    return invalid(reason, message);
                }
            }
            (None, CallInput::Text) => {
                return invalid(
                    crate::reason::Reason::InputKindMismatch,
                    format!("the tool `{}` is declared with JSON arguments, but the call carries free-form input", name()),
                )
            }
            (Some(_), CallInput::Json) => {
                return invalid(
                    crate::reason::Reason::InputKindMismatch,
                    format!("the tool `{}` is declared as a free-form (custom) tool, but the call carries JSON arguments", name()),
                )
            }
        }
    }
    let args = match args {
        Ok(v) => v,
        Err(ArgsError::NotJson) => {
            return invalid(
                crate::reason::Reason::ArgumentsNotJson,
                "the arguments are not valid JSON".into(),
            )
        }
        Err(ArgsError::DuplicateKey) => {
            return invalid(
                crate::reason::Reason::ArgumentsDuplicateKey,
                "the arguments name an object key twice (duplicate keys are refused: parsers disagree on which one counts)".into(),
            )
        }
        Err(ArgsError::NotObject) => {
            return invalid(
                crate::reason::Reason::ArgumentsNotObject,
                "the arguments are JSON but not an object".into(),
            )
        }
    };
    let declared = turn.declarations(&call.name).filter_map(|t| {
        Some((
            "declared",
            schemas.get_fingerprinted(t.fingerprint, t.schema.as_deref()?),
        ))
    });
    for (which, compiled) in declared.chain(catalog_schema.map(|c| ("catalog", c))) {
        let validator = match compiled.as_ref() {
            Ok(v) => v,
            Err(reason) => {
                return invalid(
                    crate::reason::Reason::SchemaUncompilable,
                    format!("the {which} schema: {reason}"),
                )
            }
        };
        let errors: Vec<String> = validator
            .iter_errors(args)
            .take(MAX_LISTED_ERRORS + 1)
            .map(|e| describe(&e))
            .collect();
        if errors.is_empty() {
            continue;
        }
        let mut message = format!("the arguments do not match the {which} schema: ");
        message.push_str(&errors[..errors.len().min(MAX_LISTED_ERRORS)].join("; "));
        if errors.len() > MAX_LISTED_ERRORS {
            message.push_str("; …");
        }
        return invalid(crate::reason::Reason::SchemaViolation, message);
    }
    None
}

/// Describes one validation error from the validator's output only: the instance path (as a
/// JSON pointer, sanitized), the failing keyword, and schema-side values. Never the instance
/// value, which is model text.
pub(crate) fn describe(e: &jsonschema::ValidationError<'_>) -> String {
    use jsonschema::error::ValidationErrorKind as K;
    let path = host_path(e.instance_path().as_str(), e.schema_path().as_str());
    let keyword = e.kind().keyword();
    let detail = match e.kind() {
        K::Required { property } => format!("missing required property {property}"),
        K::Type { kind } => format!("expected {}", type_name(kind)),
        K::AdditionalProperties { unexpected } => {
            format!(
                "{} property(ies) not allowed by the schema",
                unexpected.len()
            )
        }
        K::Enum { options } => format!("must be one of {options}"),
        K::Constant { expected_value } => format!("must equal {expected_value}"),
        K::MinLength { limit } => format!("shorter than {limit}"),
        K::MaxLength { limit } => format!("longer than {limit}"),
        K::Minimum { limit } => format!("less than {limit}"),
        K::Maximum { limit } => format!("greater than {limit}"),
        K::MinItems { limit } => format!("fewer than {limit} items"),
        K::MaxItems { limit } => format!("more than {limit} items"),
        K::Pattern { pattern } => format!("does not match pattern {pattern}"),
        _ => "fails the schema".to_string(),
    };
    format!("at `{path}`: {keyword}: {detail}")
}

/// The instance path of a violation as host-authored text may show it: array indices, and
/// object keys the schema names (a `properties/<name>` step of the schema path); every other
/// key is the model's own text (an undeclared key, held to `additionalProperties`), shown as
/// `*`, so no model-chosen prose — or a secret used as a key — reaches turnguard's end-turn
/// text or a repair's tool result (tool-turn contract §B: corrective text is host-authored
/// from validator output).
fn host_path(instance: &str, schema: &str) -> String {
    let steps: Vec<&str> = schema.split('/').collect();
    let declared: std::collections::HashSet<&str> = steps
        .windows(2)
        .filter(|w| w[0] == "properties")
        .map(|w| w[1])
        .collect();
    let shown: Vec<&str> = instance
        .split('/')
        .map(|seg| {
            if seg.is_empty() || seg.bytes().all(|b| b.is_ascii_digit()) || declared.contains(seg) {
                seg
            } else {
                "*"
            }
        })
        .collect();
    sanitize_pointer(&shown.join("/"))
}

fn sanitize_pointer(p: &str) -> String {
    let s: String = p
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '/' | '.' | '*'))
        .take(128)
        .collect();
    if s.is_empty() {
        "/".into()
    } else {
        s
    }
}

fn type_name(kind: &jsonschema::error::TypeKind) -> String {
    use jsonschema::error::TypeKind;
    match kind {
        TypeKind::Single(t) => t.to_string(),
        TypeKind::Multiple(ts) => ts
            .into_iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(" or "),
    }
}

#[cfg(test)]
mod format_tests {
    use super::*;

    #[test]
    fn regex_grammars_match_the_whole_input_and_other_formats_are_checked_as_documented() {
        let digits = FreeformFormat::Regex(r"[0-9]+(,[0-9]+)*".into());
        assert_eq!(check_format(&digits, "12,7"), Ok(()));
        for bad in ["12,", "x12", "12 ", ""] {
            assert_eq!(
                check_format(&digits, bad).map_err(|e| e.0),
                Err(crate::reason::Reason::FormatViolation),
                "{bad:?}"
            );
        }
        // Alternation is anchored as a whole, not per branch.
        let alt = FreeformFormat::Regex("a|b".into());
        assert!(check_format(&alt, "ab").is_err());
        let broken = FreeformFormat::Regex("(".into());
        assert_eq!(
            check_format(&broken, "x").map_err(|e| e.0),
            Err(crate::reason::Reason::FormatUncompilable)
        );
        let huge = FreeformFormat::Regex(r"\w{1000}{1000}".into());
        assert_eq!(
            check_format(&huge, "x").map_err(|e| e.0),
            Err(crate::reason::Reason::FormatUncompilable)
        );
        assert_eq!(
            check_format(&FreeformFormat::Text, "anything at all"),
            Ok(())
        );
        assert_eq!(
            check_format(&FreeformFormat::Lark("start: \"a\"".into()), "not a"),
            Ok(()),
            "lark grammars are not parsed (documented)"
        );
        assert_eq!(
            check_format(&FreeformFormat::Unknown("ebnf".into()), "x").map_err(|e| e.0),
            Err(crate::reason::Reason::FormatUnsupported)
        );
    }

    #[test]
    fn a_free_form_call_is_seen_as_an_input_object() {
        let mut call = ToolCall::json("c", "exec", "ls -la");
        assert_eq!(parse_call(&call), Err(ArgsError::NotJson));
        call.input = CallInput::Text;
        assert_eq!(
            parse_call(&call),
            Ok(serde_json::json!({"input": "ls -la"}))
        );
    }
}

#[cfg(test)]
mod cache_tests {
    use super::*;

    fn schema(props: usize, salt: usize) -> Value {
        let mut p = serde_json::Map::new();
        for i in 0..props {
            p.insert(
                format!("p{salt}_{i}"),
                serde_json::json!({"type": "string"}),
            );
        }
        serde_json::json!({"type": "object", "properties": p})
    }

    /// A lookup by another schema's fingerprint (stale, or a collision) never hands back the
    /// other schema's validator: the trees are compared, and the right schema is compiled.
    #[test]
    fn a_wrong_fingerprint_never_finds_another_schema() {
        let cache = SchemaCache::new(
            SchemaLimits {
                max_schema_bytes: 64 << 10,
                budget_bytes: 256 << 10,
            },
            Default::default(),
            Default::default(),
        );
        let strict = serde_json::json!({"type": "object", "required": ["q"]});
        let loose = serde_json::json!({"type": "object"});
        let key = cache.check_size(&strict).unwrap();
        let v = cache.get_fingerprinted(Some(key), &strict);
        assert!(!v
            .as_ref()
            .as_ref()
            .unwrap()
            .is_valid(&serde_json::json!({})));
        let v = cache.get_fingerprinted(Some(key), &loose);
        assert!(
            v.as_ref()
                .as_ref()
                .unwrap()
                .is_valid(&serde_json::json!({})),
            "the loose schema, not the cached strict one"
        );
        let v = cache.get_fingerprinted(Some(key), &strict);
        assert!(
            !v.as_ref()
                .as_ref()
                .unwrap()
                .is_valid(&serde_json::json!({})),
            "and back"
        );
    }

    #[test]
    fn the_cache_stays_within_its_byte_budget_and_evicts_least_recently_used() {
        let cache = SchemaCache::new(
            SchemaLimits {
                max_schema_bytes: 64 << 10,
                budget_bytes: 256 << 10,
            },
            Default::default(),
            Default::default(),
        );
        let first = schema(100, 0);
        assert!(cache.get(&first).is_ok());
        for salt in 1..20 {
            assert!(cache.get(&schema(100, salt)).is_ok());
            // Keep the first one in use: it is never the least recently used.
            assert!(cache.get(&first).is_ok());
            assert!(cache.bytes() <= 256 << 10, "{}", cache.bytes());
        }
        assert!(cache.len() < 20);
        let key = cache.key(&first);
        assert!(cache.lru.lock().unwrap().map.contains_key(&key));
        // A hit is the same tree, not only the same hash.
        assert!(cache.cached(key, &schema(100, 1)).is_none());
        assert!(cache.cached(key, &first).is_some());
        let too_big = schema(5000, 99);
        let err = cache.get(&too_big);
        let reason = err.as_ref().as_ref().err().unwrap();
        assert!(reason.contains("--max-schema-bytes"), "{reason}");
        assert!(cache.check_size(&too_big).is_err());
        // A schema that passed is remembered by fingerprint, and the fingerprint is the
        // cache's key; a larger one is still refused, every time.
        let small = schema(10, 7);
        assert_eq!(cache.check_size(&small), Ok(cache.key(&small)));
        assert!(cache
            .sized
            .lock()
            .unwrap()
            .map
            .contains_key(&cache.key(&small)));
        assert_eq!(cache.check_size(&small), Ok(cache.key(&small)));
        assert!(cache.check_size(&too_big).is_err());
        assert!(!cache
            .sized
            .lock()
            .unwrap()
            .map
            .contains_key(&cache.key(&too_big)));
    }

    /// Equal trees have one fingerprint whatever their members' order; a changed value, a
    /// moved member or a reordered array has another.
    #[test]
    fn fingerprints_follow_tree_equality() {
        let cache = SchemaCache::default();
        let a: Value = serde_json::from_str(
            r#"{"type":"object","properties":{"a":{"type":"string"},"b":{"enum":[1,2]}},"required":["a"]}"#,
        )
        .unwrap();
        let reordered: Value = serde_json::from_str(
            r#"{"required":["a"],"properties":{"b":{"enum":[1,2]},"a":{"type":"string"}},"type":"object"}"#,
        )
        .unwrap();
        assert_eq!(a, reordered);
        assert_eq!(cache.key(&a), cache.key(&reordered));
        for other in [
            r#"{"type":"object","properties":{"a":{"type":"string"},"b":{"enum":[2,1]}},"required":["a"]}"#,
            r#"{"type":"object","properties":{"a":{"type":"string"},"b":{"enum":[1,2.0]}},"required":["a"]}"#,
            r#"{"type":"object","properties":{"a":{"type":"string"}},"b":{"enum":[1,2]},"required":["a"]}"#,
            r#"{"type":"object","properties":{"a":{"type":"string"},"b":{"enum":[1,2]}},"required":"a"}"#,
            r#"{"type":"object","properties":{"b":{"type":"string"},"a":{"enum":[1,2]}},"required":["a"]}"#,
        ] {
            let other: Value = serde_json::from_str(other).unwrap();
            assert_ne!(a, other);
            assert_ne!(cache.key(&a), cache.key(&other), "{other}");
        }
    }

    /// Tree equality whatever the member order, and a different tree under a tool's name is
    /// never taken for its schema: the name only says where to look first.
    #[test]
    fn a_tools_last_schema_is_shared_only_when_equal() {
        use crate::model::DeclaredSchemas as _;
        let a: Value = serde_json::from_str(
            r#"{"type":"object","properties":{"x":{"type":"string"},"y":{"type":"integer"}}}"#,
        )
        .unwrap();
        let reordered: Value = serde_json::from_str(
            r#"{"properties":{"y":{"type":"integer"},"x":{"type":"string"}},"type":"object"}"#,
        )
        .unwrap();
        let changed: Value = serde_json::from_str(
            r#"{"type":"object","properties":{"x":{"type":"string"},"y":{"type":"number"}}}"#,
        )
        .unwrap();
        assert!(same_tree(&a, &reordered) && !same_in_order(&a, &reordered));
        assert!(!same_tree(&a, &changed));
        let cache = SchemaCache::default();
        let (first, key) = cache.share("t", &a);
        cache.check_declared(&first, key).unwrap();
        // Declared again under the same name: the kept tree, found by name.
        let (again, key2) = cache.share("t", &reordered);
        assert!(Arc::ptr_eq(&again, &first));
        assert_eq!(key2, key);
        // The same name with another schema: its own copy and its own fingerprint.
        let (other, key3) = cache.share("t", &changed);
        assert!(!Arc::ptr_eq(&other, &first));
        assert_eq!(*other, changed);
        assert_eq!(key3, Some(cache.key(&changed)));
        assert_ne!(key3, key);
        // Another name with the first schema: the kept tree, found by fingerprint.
        let (by_key, _) = cache.share("u", &a);
        assert!(Arc::ptr_eq(&by_key, &first));
    }

    /// A declared schema that passed the size check is shared with the next request that
    /// declares an equal one (the same tree, not a copy, with its fingerprint); a different
    /// schema under the same fingerprint (a collision) gets a copy of its own, and its size
    /// is checked; a tree over the sharing budget is remembered by fingerprint only.
    #[test]
    fn declared_schemas_are_shared_only_when_equal() {
        use crate::model::DeclaredSchemas as _;
        let cache = SchemaCache::new(
            SchemaLimits {
                max_schema_bytes: 1 << 20,
                budget_bytes: 1 << 20,
            },
            Default::default(),
            Default::default(),
        );
        let first = schema(3, 1);
        // Nothing kept yet: a copy.
        let (copy, key) = cache.share("lookup", &first);
        assert_eq!((*copy == first, key), (true, Some(cache.key(&first))));
        assert_eq!(cache.check_declared(&copy, key), Ok(cache.key(&first)));
        // Kept: the next request's equal schema is that very tree.
        let (shared, key2) = cache.share("lookup", &first.clone());
        assert!(Arc::ptr_eq(&shared, &copy));
        assert_eq!(key2, key);
        assert_eq!(cache.check_declared(&shared, key2), Ok(cache.key(&first)));

        // A collision: another tree kept under `first`'s fingerprint is never handed out
        // for `first`; `first` gets a copy, passes its own size check and takes the place.
        let other = Arc::new(schema(3, 2));
        cache
            .sized
            .lock()
            .unwrap()
            .remember(cache.key(&first), Some(&other), 10);
        let (copy2, key3) = cache.share("lookup", &first);
        assert!(!Arc::ptr_eq(&copy2, &other));
        assert_eq!(*copy2, first);
        assert_eq!(cache.check_declared(&copy2, key3), Ok(cache.key(&first)));
        let (again, _) = cache.share("lookup", &first);
        assert!(Arc::ptr_eq(&again, &copy2));

        // Over an eighth of the budget: remembered as sized, never kept to share.
        let big = Arc::new(schema(9000, 3));
        let big_key = cache.check_declared(&big, None).unwrap();
        assert!(matches!(
            cache.sized.lock().unwrap().map.get(&big_key),
            Some(None)
        ));
        let (big_copy, _) = cache.share("big", &big);
        assert!(!Arc::ptr_eq(&big_copy, &big));
        assert!(cache.sized.lock().unwrap().tree_bytes <= SHARED_TREE_BYTES);
    }
}
