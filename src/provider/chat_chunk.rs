//! One Chat Completions stream chunk (`chat.completion.chunk`, wire-formats.md §2) as the
//! Chat stream machine ([`super::openai_chat::ChatStream`]) reads it: each choice's index,
//! whether its delta carries a role, text or a refusal, its `tool_calls` fragments, a legacy
//! `function_call` fragment and its `finish_reason`, and the chunk's usage.
//!
//! Read two ways, to the same [`Chunk`]: from the chunk's text through a typed view
//! ([`Chunk::of_text`], one pass, no tree, strings borrowed where they need no unescaping),
//! and from its tree ([`Chunk::of_tree`]), for the chunks the view refuses. The view is an
//! optimization of the tree reader, never a second reading (as [`super::view`] says of its
//! views): it answers only for a chunk whose every field it reads has the type the tree
//! reader reads there, that has no field it reads twice, no `error`, and no structure
//! [`super::openai_chat::ChatStream`] refuses (a choice without an index or twice, a `null`
//! `choices` or `delta`, a `tool_calls` entry without an index); the stream reads the tree of
//! any other chunk, which fails or refuses it as before. Every member the view skips is read
//! as serde_json's tree would read it ([`super::view::members`]), so a chunk the view
//! answers for is one a tree can be read from. `tests/it/fuzz.rs`
//! (`a_chat_stream_reads_text_as_it_reads_trees`) holds the two readings equal.

use std::borrow::Cow;

use serde_json::Value;

use super::openai_chat::UsageView;
use super::view::{object_view, Obj, Str};
use crate::strict_json::Lookup as _;

/// A chunk as the stream machine reads it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Chunk<'a> {
    /// `choices`, when it is an array (a chunk without one is forwarded as it is).
    pub choices: Option<Vec<DeltaChoice<'a>>>,
    /// A `usage` that is not `null`: its `completion_tokens`, when a non-negative integer.
    pub usage: Option<Option<u64>>,
}

/// One choice of a chunk.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct DeltaChoice<'a> {
    /// The choice's `index`.
    pub index: u32,
    /// `delta.role` is there and not `null`.
    pub role: bool,
    /// `delta.content` is a non-empty string.
    pub content: bool,
    /// `delta.refusal` is a non-empty string.
    pub refusal: bool,
    /// The `delta.tool_calls` entries, in order.
    pub tool_calls: Vec<CallDelta<'a>>,
    /// `delta.function_call`, when it is an object.
    pub function_call: Option<FunctionDelta<'a>>,
    /// `finish_reason`, when it is a string.
    pub finish_reason: Option<Cow<'a, str>>,
}

/// One `tool_calls` entry of a delta: a fragment of the call at `index`.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct CallDelta<'a> {
    /// The entry's `index` (the call's slot on the wire).
    pub index: u64,
    /// `id`, when a non-empty string.
    pub id: Option<Cow<'a, str>>,
    /// `function.name` and `function.arguments` fragments.
    pub function: FunctionDelta<'a>,
}

/// A `function` (or legacy `function_call`) fragment: its `name` and `arguments`, each when
/// a string.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct FunctionDelta<'a> {
    pub name: Option<Cow<'a, str>>,
    pub arguments: Option<Cow<'a, str>>,
}

impl DeltaChoice<'_> {
    /// The delta carries a call fragment (a `tool_calls` entry or a `function_call`).
    pub fn has_calls(&self) -> bool {
        !self.tool_calls.is_empty() || self.function_call.is_some()
    }

    /// The delta carries text the agent may have at once (content or a refusal).
    pub fn carries_text(&self) -> bool {
        self.content || self.refusal
    }
}

impl<'a> Chunk<'a> {
    /// The chunk read from its text through the typed view; `None` when the view does not
    /// answer for it (see the module docs) and the caller reads its tree.
    pub fn of_text(text: &'a str) -> Option<Self> {
        let Obj(view) = serde_json::from_str::<Obj<ChunkView<'a>>>(text).ok()?;
        let choices = match view.choices {
            None => None,
            Some(list) => {
                let mut choices: Vec<DeltaChoice<'a>> = Vec::with_capacity(list.len());
                for Obj(c) in list {
                    let index = c.index.and_then(|i| u32::try_from(i).ok())?;
                    if choices.iter().any(|seen| seen.index == index) {
                        return None;
                    }
                    choices.push(c.into_choice(index)?);
                }
                Some(choices)
            }
        };
        Some(Self {
            choices,
            usage: view.usage.map(|Obj(u)| u.completion_tokens),
        })
    }

    /// The chunk read from its tree, which passed the stream's structure check (every choice
    /// has an index, a `delta` is an object, every `tool_calls` entry has an index).
    pub fn of_tree(chunk: &'a Value) -> Self {
        Self {
            choices: chunk
                .get("choices")
                .and_then(Value::as_array)
                .map(|list| list.iter().map(DeltaChoice::of_tree).collect()),
            usage: chunk
                .get("usage")
                .filter(|u| !u.is_null())
                .map(|u| u.get("completion_tokens").and_then(Value::as_u64)),
        }
    }
}

impl<'a> DeltaChoice<'a> {
    fn of_tree(c: &'a Value) -> Self {
        let text = |v: Option<&Value>| matches!(v, Some(Value::String(s)) if !s.is_empty());
        let str_at = |v: &'a Value, pointer: &str| v.at(pointer).and_then(Value::as_str);
        Self {
            index: super::openai_chat::choice_index(c).unwrap_or_default(),
            role: c.at("/delta/role").is_some_and(|r| !r.is_null()),
            content: text(c.at("/delta/content")),
            refusal: text(c.at("/delta/refusal")),
            tool_calls: c
                .at("/delta/tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|e| CallDelta {
                    index: e.get("index").and_then(Value::as_u64).unwrap_or_default(),
                    id: e
                        .get("id")
                        .and_then(Value::as_str)
                        .filter(|s| !s.is_empty())
                        .map(Cow::Borrowed),
                    function: FunctionDelta {
                        name: str_at(e, "/function/name").map(Cow::Borrowed),
                        arguments: str_at(e, "/function/arguments").map(Cow::Borrowed),
                    },
                })
                .collect(),
            function_call: c
                .at("/delta/function_call")
                .filter(|f| f.is_object())
                .map(|f| FunctionDelta {
                    name: str_at(f, "/name").map(Cow::Borrowed),
                    arguments: str_at(f, "/arguments").map(Cow::Borrowed),
                }),
            finish_reason: c
                .get("finish_reason")
                .and_then(Value::as_str)
                .map(Cow::Borrowed),
        }
    }
}

/// What the view reads of a chunk: `choices` (`null` refused: the stream refuses it),
/// `usage`; an `error` member makes the view refuse the chunk (the stream reads a provider
/// error from the tree).
struct ChunkView<'a> {
    choices: Option<Vec<Obj<ChoiceView<'a>>>>,
    usage: Option<Obj<UsageView>>,
}

struct ChoiceView<'a> {
    index: Option<u64>,
    delta: Option<Obj<DeltaView<'a>>>,
    finish_reason: Option<Str<'a>>,
}

struct DeltaView<'a> {
    role: Option<Str<'a>>,
    content: Option<Str<'a>>,
    refusal: Option<Str<'a>>,
    tool_calls: Option<Vec<Obj<CallView<'a>>>>,
    function_call: Option<Obj<FunctionView<'a>>>,
}

struct CallView<'a> {
    index: Option<u64>,
    id: Option<Str<'a>>,
    function: Option<Obj<FunctionView<'a>>>,
}

struct FunctionView<'a> {
    name: Option<Str<'a>>,
    arguments: Option<Str<'a>>,
}

object_view!(ChunkView<'a> { usage } keep_null { choices } refuse { "error" });
object_view!(ChoiceView<'a> { index, finish_reason } keep_null { delta });
object_view!(DeltaView<'a> { role, content, refusal, tool_calls, function_call });
object_view!(CallView<'a> { index, id, function });
object_view!(FunctionView<'a> { name, arguments });

impl<'a> ChoiceView<'a> {
    /// The choice at `index`; `None` when an entry of its `tool_calls` has no index.
    fn into_choice(self, index: u32) -> Option<DeltaChoice<'a>> {
        let delta = self.delta.map(|Obj(d)| d);
        let (role, content, refusal, tool_calls, function_call) = match delta {
            Some(d) => (d.role, d.content, d.refusal, d.tool_calls, d.function_call),
            None => (None, None, None, None, None),
        };
        let text = |s: &Option<Str<'_>>| s.as_ref().is_some_and(|s| !s.as_str().is_empty());
        let tool_calls = tool_calls
            .into_iter()
            .flatten()
            .map(|Obj(e)| {
                Some(CallDelta {
                    index: e.index?,
                    id: e.id.map(|Str(s)| s).filter(|s| !s.is_empty()),
                    function: e.function.map(|Obj(f)| f.into_delta()).unwrap_or_default(),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(DeltaChoice {
            index,
            role: role.is_some(),
            content: text(&content),
            refusal: text(&refusal),
            tool_calls,
            function_call: function_call.map(|Obj(f)| f.into_delta()),
            finish_reason: self.finish_reason.map(|Str(s)| s),
        })
    }
}

impl<'a> FunctionView<'a> {
    fn into_delta(self) -> FunctionDelta<'a> {
        FunctionDelta {
            name: self.name.map(|Str(s)| s),
            arguments: self.arguments.map(|Str(s)| s),
        }
    }
}
