//! Stage 3, **arguments** (tool-turn contract §B): the arguments must be a JSON object valid
//! against the request's declared schema (JSON Schema 2020-12 unless the schema says
//! otherwise), before any gate.
//!
//! Compiled validators are cached by the SHA-256 of the schema's RFC 8785 form. No remote
//! `$ref` is ever fetched: `jsonschema` is built without its HTTP and file resolvers, so a
//! schema that needs one fails to compile and the call is withheld (fail closed).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use jsonschema::{Draft, Validator};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::model::{Decision, Outcome, Stage, ToolCall, Turn};

/// At most this many validation errors are listed in a host-authored explanation.
const MAX_LISTED_ERRORS: usize = 5;
/// Compiled validators kept before the cache is cleared.
const MAX_CACHED_SCHEMAS: usize = 1024;

/// Why the arguments text is not a JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgsError {
    /// Not JSON at all.
    NotJson,
    /// JSON, but not an object.
    NotObject,
}

/// Parses the arguments as emitted. An empty string is read as `{}` (OpenAI sends `""` for
/// a call without arguments); it is then validated like any other arguments.
pub fn parse(text: &str) -> Result<Value, ArgsError> {
    if text.trim().is_empty() {
        return Ok(Value::Object(Default::default()));
    }
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ArgsError::NotObject),
        Err(_) => Err(ArgsError::NotJson),
    }
}

/// `argsHash`: SHA-256 (lowercase hex) of the RFC 8785 (JCS) form of `args`.
pub fn args_hash(args: &Value) -> String {
    hex::encode(Sha256::digest(canonical(args)))
}

/// The RFC 8785 (JCS) serialization of `v`.
pub fn canonical(v: &Value) -> Vec<u8> {
    // serde_jcs only fails for maps with non-string keys, which a `Value` cannot hold.
    serde_jcs::to_vec(v).unwrap_or_else(|_| v.to_string().into_bytes())
}

/// A compiled validator, or why the schema does not compile.
pub type Compiled = Arc<Result<Validator, String>>;

/// Compiled validators keyed by schema hash, shared by every request.
#[derive(Default)]
pub struct SchemaCache {
    compiled: Mutex<HashMap<[u8; 32], Compiled>>,
}

impl SchemaCache {
    /// The compiled validator for `schema`, compiling it on first use.
    /// `Err(reason)` when the schema does not compile (for example a remote `$ref`).
    pub fn get(&self, schema: &Value) -> Compiled {
        let key: [u8; 32] = Sha256::digest(canonical(schema)).into();
        if let Ok(map) = self.compiled.lock() {
            if let Some(v) = map.get(&key) {
                return Arc::clone(v);
            }
        }
        let built = Arc::new(
            jsonschema::options()
                .with_draft(Draft::Draft202012)
                .build(schema)
                .map_err(|e| {
                    format!(
                        "the declared schema does not compile: {}",
                        e.kind().keyword()
                    )
                }),
        );
        if let Ok(mut map) = self.compiled.lock() {
            if map.len() >= MAX_CACHED_SCHEMAS {
                map.clear();
            }
            map.insert(key, Arc::clone(&built));
        }
        built
    }

    /// Number of compiled schemas held.
    pub fn len(&self) -> usize {
        self.compiled.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// No schema compiled yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `Some(invalid)` when the arguments are not an object valid against the request's declared
/// schema and the catalog's `inputSchema`.
pub fn check(
    turn: &Turn,
    call: &ToolCall,
    args: &Result<Value, ArgsError>,
    catalog_schema: Option<&Value>,
    schemas: &SchemaCache,
) -> Option<Decision> {
    let invalid = |reason: &'static str, message: String| {
        Some(Decision::new(
            Outcome::Invalid,
            Stage::Arguments,
            reason,
            message,
        ))
    };
    let args = match args {
        Ok(v) => v,
        Err(ArgsError::NotJson) => {
            return invalid(
                "arguments_not_json",
                "the arguments are not valid JSON".into(),
            )
        }
        Err(ArgsError::NotObject) => {
            return invalid(
                "arguments_not_object",
                "the arguments are JSON but not an object".into(),
            )
        }
    };
    let declared = turn.declared(&call.name).and_then(|t| t.schema.as_ref());
    for (which, schema) in [("declared", declared), ("catalog", catalog_schema)] {
        let Some(schema) = schema else { continue };
        let compiled = schemas.get(schema);
        let validator = match compiled.as_ref() {
            Ok(v) => v,
            Err(reason) => {
                return invalid(
                    "schema_uncompilable",
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
        return invalid("schema_violation", message);
    }
    None
}

/// Describes one validation error from the validator's output only: the instance path (as a
/// JSON pointer, sanitized), the failing keyword, and schema-side values. Never the instance
/// value, which is model text.
pub(crate) fn describe(e: &jsonschema::ValidationError<'_>) -> String {
    use jsonschema::error::ValidationErrorKind as K;
    let path = sanitize_pointer(e.instance_path().as_str());
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

fn sanitize_pointer(p: &str) -> String {
    let s: String = p
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '/' | '.'))
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
