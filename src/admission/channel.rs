//! The `structured` and `prompted` channels (tool-turn contract §A).
//!
//! - `structured`: the provider enforces a schema (`response_format: json_schema`); turnguard
//!   still validates the answer against it. A refusal there is the answer and is never
//!   retried.
//! - `prompted`: the agent asked for JSON in text because no enforced mode exists. It says so
//!   with `Turnguard-Prompted-Schema: <name>` (a schema of the bundle) or the bundle routes the
//!   model to one. The text is validated and repaired within `repair_rounds`; it is never
//!   dispatched as a tool: nothing here, or anywhere in turnguard, turns text into a call.

use std::sync::Arc;

use serde_json::Value;

use super::arguments::SchemaCache;
use crate::model::{Completion, CompletionState};

/// Which channel a text answer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    Structured,
    Prompted,
}

impl Channel {
    /// The contract's spelling (metric label, journal).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Structured => "structured",
            Self::Prompted => "prompted",
        }
    }
}

/// The schema a request's text answer must meet.
#[derive(Debug, Clone)]
pub struct ChannelSpec {
    pub channel: Channel,
    /// Schema name (`json_schema.name`, or the bundle's schema name).
    pub name: String,
    pub schema: Arc<Value>,
}

/// The decision on one text answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelVerdict {
    /// Valid JSON that meets the schema.
    Valid,
    /// A refusal: passed through, never retried (§B completion).
    Refused,
    /// Not acceptable; `reason` is a stable code, `message` host-authored validator output.
    Invalid {
        reason: &'static str,
        message: String,
    },
}

/// Validates a text answer. `text` is the answer as the model wrote it (for `prompted`, one
/// surrounding Markdown code fence is allowed).
pub fn check(
    spec: &ChannelSpec,
    text: Option<&str>,
    completion: &Completion,
    schemas: &SchemaCache,
) -> ChannelVerdict {
    match completion.state {
        CompletionState::Refused => return ChannelVerdict::Refused,
        CompletionState::Truncated => {
            return ChannelVerdict::Invalid {
                reason: "truncated",
                message: format!(
                    "the answer was cut by the token limit ({})",
                    super::sanitize_label(&completion.reason)
                ),
            }
        }
        CompletionState::ContextExhausted => {
            return ChannelVerdict::Invalid {
                reason: "context_window_exceeded",
                message: format!(
                    "the model's context window is full ({}); asking again cannot fit",
                    super::sanitize_label(&completion.reason)
                ),
            }
        }
        CompletionState::Clean => {}
    }
    let Some(text) = text else {
        return ChannelVerdict::Invalid {
            reason: "no_answer",
            message: "the answer has no text".into(),
        };
    };
    let body = match spec.channel {
        Channel::Prompted => strip_fence(text),
        Channel::Structured => text.trim(),
    };
    let Ok(value) = serde_json::from_str::<Value>(body) else {
        return ChannelVerdict::Invalid {
            reason: "not_json",
            message: "the answer is not a JSON document".into(),
        };
    };
    let compiled = schemas.get(&spec.schema);
    let validator = match compiled.as_ref() {
        Ok(v) => v,
        Err(e) => {
            return ChannelVerdict::Invalid {
                reason: "schema_uncompilable",
                message: e.clone(),
            }
        }
    };
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .take(5)
        .map(|e| super::arguments::describe(&e))
        .collect();
    if errors.is_empty() {
        ChannelVerdict::Valid
    } else {
        ChannelVerdict::Invalid {
            reason: "schema_violation",
            message: format!(
                "the answer does not match the schema `{}`: {}",
                super::sanitize_label(&spec.name),
                errors.join("; ")
            ),
        }
    }
}

/// Removes one surrounding ```` ``` ```` / ```` ```json ```` fence, if the whole text is fenced.
fn strip_fence(text: &str) -> &str {
    let t = text.trim();
    let Some(rest) = t.strip_prefix("```") else {
        return t;
    };
    let Some(inner) = rest.strip_suffix("```") else {
        return t;
    };
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    inner.trim()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(channel: Channel) -> ChannelSpec {
        ChannelSpec {
            channel,
            name: "answer".into(),
            schema: Arc::new(
                json!({"type": "object", "required": ["answer"], "properties": {"answer": {"type": "string"}}}),
            ),
        }
    }

    fn clean() -> Completion {
        Completion {
            state: CompletionState::Clean,
            reason: "stop".into(),
        }
    }

    #[test]
    fn prompted_text_is_validated_and_never_more() {
        let cache = SchemaCache::default();
        assert_eq!(
            check(
                &spec(Channel::Prompted),
                Some("```json\n{\"answer\": \"4\"}\n```"),
                &clean(),
                &cache
            ),
            ChannelVerdict::Valid
        );
        assert!(matches!(
            check(
                &spec(Channel::Prompted),
                Some("{\"answer\": 4}"),
                &clean(),
                &cache
            ),
            ChannelVerdict::Invalid {
                reason: "schema_violation",
                ..
            }
        ));
        assert!(matches!(
            check(&spec(Channel::Prompted), Some("four"), &clean(), &cache),
            ChannelVerdict::Invalid {
                reason: "not_json",
                ..
            }
        ));
        let refused = Completion {
            state: CompletionState::Refused,
            reason: "refusal".into(),
        };
        assert_eq!(
            check(&spec(Channel::Structured), None, &refused, &cache),
            ChannelVerdict::Refused
        );
    }
}
