//! JSON parsing that refuses duplicate object keys.
//!
//! turnguard forwards the agent's request bytes upstream unchanged when it does not rewrite
//! them (issue 13 item 6). A body with a key twice (`{"stream": false, "stream": true}`)
//! would then be read two ways: `serde_json` keeps the last value, other parsers the first,
//! so what turnguard admitted and what the provider runs could differ (a parser
//! differential). RFC 8259 §4 says names "SHOULD be unique" and leaves duplicates'
//! meaning to the implementation; turnguard refuses them, at every depth, before anything
//! else reads the body.

use std::borrow::Cow;
use std::collections::HashSet;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Why a body is not JSON turnguard accepts.
#[derive(Debug, thiserror::Error)]
pub enum StrictJsonError {
    /// Not JSON: the parser's position (1-based line and column) and its category.
    #[error("malformed JSON at line {line} column {column}: {category}")]
    Malformed {
        line: usize,
        column: usize,
        category: &'static str,
    },
    /// An object names `key` twice (the key is shown with control characters and quotes
    /// escaped, at most 64 characters).
    #[error("malformed JSON at line {line} column {column}: the object key {key} appears twice (duplicate keys are refused: parsers disagree on which one counts)")]
    DuplicateKey {
        line: usize,
        column: usize,
        key: String,
    },
}

/// `v` as compact JSON text, the same text as `v.to_string()`. Written through
/// `serde_json::to_string` (straight into a byte buffer) rather than `Display` (which passes
/// every piece through a `fmt::Formatter`): it is on the request path for every journaled
/// call and event (issue 13, profile-led: `call_record` 9.6k → 6.3k instructions a call under
/// callgrind).
pub fn to_text(v: &Value) -> String {
    // Serializing a `Value` cannot fail (its keys are strings); `Display` is the fallback
    // all the same, never an empty string.
    serde_json::to_string(v).unwrap_or_else(|_| v.to_string())
}

/// RFC 6901 JSON Pointer lookup on a [`Value`] without allocating: the same answers as
/// `serde_json::Value::pointer` (an empty pointer is the value itself; one not starting with
/// `/` is `None`; `~1` and `~0` are unescaped in each reference token; an array index is
/// decimal digits without a leading `+` or `0`, `"0"` itself allowed), but a token is
/// unescaped only when it holds a `~`, where `Value::pointer` builds two strings per token.
/// The hot paths read provider bodies and stream chunks through it (issue 13, profile-led:
/// `call_from_message` made eight allocations a call).
pub trait Lookup {
    /// The value at `pointer`, if any.
    fn at(&self, pointer: &str) -> Option<&Value>;

    /// `self.get(key)` for an object's member ([`member`]); `None` for any other value.
    fn member(&self, key: &str) -> Option<&Value>;
}

/// Objects of at most this many members are searched in order by [`member`].
const SCAN_MEMBERS: usize = 16;

/// `map.get(key)`, with the same answer: an object of at most 16 members is searched in
/// order, comparing keys (their lengths first), where `get` hashes `key` with SipHash, the
/// hasher serde_json's `Map` is built with: ~250 instructions a lookup, of which a request's
/// dozen or so made 1.7 % of its cost under callgrind (issue 13, profile-led). A larger object
/// is looked up by hash.
pub fn member<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    if map.len() <= SCAN_MEMBERS {
        map.iter().find_map(|(k, v)| (k == key).then_some(v))
    } else {
        map.get(key)
    }
}

impl Lookup for Value {
    fn at(&self, pointer: &str) -> Option<&Value> {
        if pointer.is_empty() {
            return Some(self);
        }
        let rest = pointer.strip_prefix('/')?;
        rest.split('/').try_fold(self, |target, token| {
            let token: std::borrow::Cow<'_, str> = if token.contains('~') {
                token.replace("~1", "/").replace("~0", "~").into()
            } else {
                token.into()
            };
            match target {
                Value::Object(map) => member(map, &token),
                Value::Array(list) => array_index(&token).and_then(|i| list.get(i)),
                _ => None,
            }
        })
    }

    fn member(&self, key: &str) -> Option<&Value> {
        member(self.as_object()?, key)
    }
}

/// An RFC 6901 array index as `serde_json` reads one: no `+`, no leading zero but `"0"`.
fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// Parses `raw` as one JSON value (serde_json's grammar and its nesting limit of 128),
/// refusing any object with a repeated key.
///
/// Errors: [`StrictJsonError`]; its message names the position and never echoes body
/// content other than a duplicated key (escaped, bounded).
pub fn from_slice(raw: &[u8]) -> Result<Value, StrictJsonError> {
    match std::str::from_utf8(raw) {
        Ok(text) => from_str(text),
        Err(_) => unique(serde_json::Deserializer::from_slice(raw)),
    }
}

/// [`from_slice`] of text already known to be UTF-8: serde_json then checks no string's
/// bytes again. Reading bytes, it validates each string's UTF-8 on its own, with a call per
/// string: 5.7k of the 21.5k instructions the json cell's request spent reading strings,
/// where checking each whole body once costs ~1.2k (issue 13, profile-led, callgrind). The
/// values read and the errors are [`from_slice`]'s.
pub fn from_str(text: &str) -> Result<Value, StrictJsonError> {
    unique(serde_json::Deserializer::from_str(text))
}

/// Reads `T` from `raw` as `serde_json::from_slice` does, through its text reader when `raw`
/// is UTF-8 ([`from_str`] says why). `None` when `T` cannot be read from `raw`: the callers
/// are the typed views ([`crate::provider::view`]), which read the tree for such a body.
pub fn view_from_slice<'de, T: serde::Deserialize<'de>>(raw: &'de [u8]) -> Option<T> {
    match std::str::from_utf8(raw) {
        Ok(text) => serde_json::from_str(text).ok(),
        Err(_) => serde_json::from_slice(raw).ok(),
    }
}

/// Reads one value with [`Unique`] and the end of the input.
fn unique<'de, R: serde_json::de::Read<'de>>(
    mut de: serde_json::Deserializer<R>,
) -> Result<Value, StrictJsonError> {
    let value = Unique
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v));
    value.map_err(|e| {
        let (line, column) = (e.line(), e.column());
        let text = e.to_string();
        match text
            .strip_prefix(DUPLICATE)
            .and_then(|rest| rest.split_once(END))
        {
            Some((key, _)) => StrictJsonError::DuplicateKey {
                line,
                column,
                key: key.to_owned(),
            },
            None => StrictJsonError::Malformed {
                line,
                column,
                category: match e.classify() {
                    serde_json::error::Category::Eof => "unexpected end of input",
                    serde_json::error::Category::Syntax => "syntax error",
                    serde_json::error::Category::Data => "unexpected data",
                    serde_json::error::Category::Io => "read error",
                },
            },
        }
    })
}

/// [`from_slice`] for an agent's request body, with the elements of its top-level `tools`
/// array held as shared trees ([`RequestBody`]): an element whose exact text was read before
/// is taken from `tools`, one read for the first time is read by [`from_slice`] itself and
/// kept. An agent declares the same tools, byte for byte, every turn; a coding agent's are
/// most of its request's objects. Building their tree was the largest part of reading the
/// request (bench/RESULTS.md, issue 13 run 26: 28.5 % of a 16-tool request's CPU), and
/// copying a cached tree into each request's tree, then dropping it, cost about as much again
/// (run 31: 10.6 % and 9.8 % of the coding-agent cell's CPU): the body shares them instead. A
/// kept element is the tree [`from_slice`] built from the same bytes, so the body is the tree
/// [`from_slice`] builds of the whole text ([`RequestBody::into_tree`]). The element's text is
/// located in the one pass that reads the body, and a new element is read at the depth it has
/// there (the nesting limit counts from the body's root, as in [`from_slice`]).
///
/// Errors: exactly [`from_slice`]'s: whatever fails, the body is read again by
/// [`from_slice`], which names the error and its position in the whole body.
pub fn request_from_slice(raw: &[u8], tools: &ValueCache) -> Result<RequestBody, StrictJsonError> {
    let cache = BodyRead { cache: tools };
    // Through the text reader when `raw` is UTF-8 ([`from_str`] says why); any failure is
    // named by `from_slice`.
    let read = match std::str::from_utf8(raw) {
        Ok(text) => {
            let mut de = serde_json::Deserializer::from_str(text);
            cache
                .deserialize(&mut de)
                .and_then(|v| de.end().map(|()| v))
        }
        Err(_) => Err(serde::de::Error::custom("not UTF-8")),
    };
    match read {
        Ok(body) => Ok(body),
        Err(_) => from_slice(raw).map(RequestBody::from),
    }
}

/// An agent's request body as turnguard holds it: its JSON tree, with the elements of a
/// top-level `tools` array held apart as shared, immutable trees (the declared-tools cache's,
/// [`request_from_slice`]) instead of copied into it. Everything reads the tree
/// ([`RequestBody::tree`]) but the `tools` member, which is read through
/// [`RequestBody::tools`] (the declared-tool parsers) or [`RequestBody::members`] (the
/// semantic digest); the body serializes as the whole tree, `tools` at its place
/// ([`RequestBody::to_text`]), and an edit takes the whole tree ([`RequestBody::tree_mut`]).
/// A body made from a tree ([`From<Value>`]) holds its `tools` inline.
#[derive(Debug, Clone)]
pub struct RequestBody {
    /// The body; without its `tools` member when `shared` holds it.
    tree: Value,
    shared: Option<SharedTools>,
}

/// A top-level `tools` array held apart from the tree.
#[derive(Debug, Clone)]
struct SharedTools {
    /// How many of the tree's members come before `tools` in the body.
    at: usize,
    list: Vec<std::sync::Arc<SharedTool>>,
}

/// One element of a top-level `tools` array as [`ValueCache`] keeps it and bodies share it:
/// the tree [`from_slice`] reads of its text, and its RFC 8785 form once the semantic digest
/// wrote it ([`SharedTool::canonical`]), so an agent's unchanged tools are canonicalized once,
/// not every turn.
#[derive(Debug)]
pub struct SharedTool {
    tree: Value,
    /// Longest canonical form kept, bytes: twice the text. Only numbers grow when written
    /// canonically (`1e20` is 21 bytes), so a tool's form fits; an element made of such
    /// numbers is canonicalized at each use instead, and its reserve stays bounded.
    max_canonical: usize,
    canonical: std::sync::OnceLock<Option<Box<[u8]>>>,
}

impl SharedTool {
    fn new(tree: Value, text: &str) -> Self {
        SharedTool {
            tree,
            max_canonical: 2 * text.len(),
            canonical: std::sync::OnceLock::new(),
        }
    }

    /// The element's tree.
    pub fn tree(&self) -> &Value {
        &self.tree
    }

    /// The memory [`ValueCache`] charges for this element read from `text`, bytes: the text
    /// (the cache's key), the tree ([`tree_bytes`]) and the reserve for its canonical form.
    /// Walks the tree: taken only for an element the cache may keep.
    fn charge(&self, text: &str) -> usize {
        std::mem::size_of::<Self>() + text.len() + self.max_canonical + tree_bytes(&self.tree)
    }

    /// The tree's RFC 8785 form: `canonicalize(tree)`, kept with the tree the first time and
    /// shared by every body holding it after (unless longer than twice the text: then
    /// written again at each call). Every caller passes `crate::jcs::to_vec` (the one
    /// canonicalization; this module imports nothing of the crate): the semantic digest
    /// ([`crate::recipes`]) is the only one.
    pub fn canonical(&self, canonicalize: impl Fn(&Value) -> Vec<u8>) -> Cow<'_, [u8]> {
        let kept = self.canonical.get_or_init(|| {
            let text = canonicalize(&self.tree);
            (text.len() <= self.max_canonical).then(|| text.into_boxed_slice())
        });
        match kept {
            Some(text) => Cow::Borrowed(text),
            None => Cow::Owned(canonicalize(&self.tree)),
        }
    }
}

/// Estimated heap memory of `v`'s tree, bytes (serde_json with `preserve_order`): every
/// array's slots at its capacity and every object's at its length rounded up to a power of
/// two (a `Value` each; an object's entry also holds its key's `String`, its hash and an
/// index word), every string's and key's bytes, and 16 bytes of allocator bookkeeping per
/// allocation. What [`ValueCache`] charges for a tree: an element like `[{},{},…]` takes ~40
/// times its text, a tool declaration ~10–15 times.
fn tree_bytes(v: &Value) -> usize {
    const SLOT: usize = std::mem::size_of::<Value>();
    const ALLOCATION: usize = 16;
    match v {
        Value::String(s) => s.capacity() + ALLOCATION,
        Value::Array(a) => {
            a.capacity() * SLOT + ALLOCATION + a.iter().map(tree_bytes).sum::<usize>()
        }
        Value::Object(m) => {
            let entry = SLOT + std::mem::size_of::<String>() + 2 * std::mem::size_of::<usize>();
            // The map's capacity is not exposed; it grows by doubling.
            m.len().next_power_of_two() * entry
                + 2 * ALLOCATION
                + m.iter()
                    .map(|(k, v)| k.capacity() + ALLOCATION + tree_bytes(v))
                    .sum::<usize>()
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
    }
}

/// A request body's top-level `tools` member ([`RequestBody::tools`]).
pub enum ToolsMember<'a> {
    /// An array: its elements, in order.
    Array(Vec<&'a Value>),
    /// Any other value (`null`, an object, a string…), for the adapter to accept or refuse.
    Other(&'a Value),
}

impl<'a> ToolsMember<'a> {
    /// The elements of an array; `None` for any other value.
    pub fn into_array(self) -> Option<Vec<&'a Value>> {
        match self {
            ToolsMember::Array(list) => Some(list),
            ToolsMember::Other(_) => None,
        }
    }
}

/// One top-level member's value ([`RequestBody::members`]).
pub enum Member<'a> {
    /// A member of the tree.
    Value(&'a Value),
    /// The shared `tools` array's elements.
    Tools(&'a [std::sync::Arc<SharedTool>]),
}

/// The top-level `tools` member of a body held as one tree (what [`RequestBody::tools`] reads
/// of a body whose tools are not shared).
pub fn tools_member(tree: &Value) -> Option<ToolsMember<'_>> {
    tree.get("tools").map(|v| match v {
        Value::Array(list) => ToolsMember::Array(list.iter().collect()),
        other => ToolsMember::Other(other),
    })
}

impl From<Value> for RequestBody {
    fn from(tree: Value) -> Self {
        RequestBody { tree, shared: None }
    }
}

impl RequestBody {
    /// The body's tree, which lacks the top-level `tools` member while it is shared: read
    /// `tools` through [`RequestBody::tools`].
    pub fn tree(&self) -> &Value {
        &self.tree
    }

    /// The top-level `tools` member, if the body (an object) has one.
    pub fn tools(&self) -> Option<ToolsMember<'_>> {
        if let Some(shared) = &self.shared {
            return Some(ToolsMember::Array(
                shared.list.iter().map(|t| &t.tree).collect(),
            ));
        }
        tools_member(&self.tree)
    }

    /// The top-level members in the body's order, `tools` included (empty when the body is
    /// not an object).
    pub fn members(&self) -> Vec<(&str, Member<'_>)> {
        let Some(map) = self.tree.as_object() else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(map.len() + 1);
        for (i, (k, v)) in map.iter().enumerate() {
            if let Some(s) = self.shared.as_ref().filter(|s| s.at == i) {
                out.push(("tools", Member::Tools(&s.list)));
            }
            out.push((k.as_str(), Member::Value(v)));
        }
        if let Some(s) = self.shared.as_ref().filter(|s| s.at >= map.len()) {
            out.push(("tools", Member::Tools(&s.list)));
        }
        out
    }

    /// The whole tree to edit: a shared `tools` array is copied into it at its place first.
    pub fn tree_mut(&mut self) -> &mut Value {
        if let Some(shared) = self.shared.take() {
            let tools = Value::Array(shared.list.iter().map(|t| t.tree.clone()).collect());
            if let Value::Object(map) = &mut self.tree {
                let at = shared.at.min(map.len());
                map.shift_insert(at, "tools".to_owned(), tools);
            }
        }
        &mut self.tree
    }

    /// The whole tree.
    pub fn into_tree(mut self) -> Value {
        self.tree_mut();
        self.tree
    }

    /// The body as compact JSON text: the text [`to_text`] writes of [`RequestBody::into_tree`].
    pub fn to_text(&self) -> String {
        match &self.shared {
            None => to_text(&self.tree),
            Some(_) => {
                serde_json::to_string(self).unwrap_or_else(|_| self.clone().into_tree().to_string())
            }
        }
    }
}

impl serde::Serialize for RequestBody {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        if self.shared.is_none() || !self.tree.is_object() {
            return self.tree.serialize(s);
        }
        let members = self.members();
        let mut map = s.serialize_map(Some(members.len()))?;
        for (k, v) in members {
            match v {
                Member::Value(v) => map.serialize_entry(k, v)?,
                Member::Tools(list) => map.serialize_entry(k, &TreesOf(list))?,
            }
        }
        map.end()
    }
}

/// Shared trees ([`SharedTool`]) by the exact text they were read from
/// ([`request_from_slice`]'s declared tools), for texts of at most [`ValueCache::MAX_TEXT`]
/// bytes. Each entry is charged its estimated memory ([`SharedTool::charge`]: text, tree and
/// canonical form), not its text's length — a tree takes 10 to 40 times its text. Two
/// generations of at most `budget` charged bytes each: when the newer one is full it becomes
/// the older one, and the older one is dropped (a body still holding one of its trees keeps it
/// until the body is dropped). So the cache holds about 2 × `budget` bytes at most, whatever
/// the agents declare.
pub struct ValueCache {
    budget: usize,
    generations: std::sync::Mutex<ValueGenerations>,
}

#[derive(Default)]
struct ValueGenerations {
    current: std::collections::HashMap<Box<str>, std::sync::Arc<SharedTool>>,
    current_bytes: usize,
    older: std::collections::HashMap<Box<str>, std::sync::Arc<SharedTool>>,
}

impl ValueCache {
    /// The longest text kept, bytes: a tool declaration larger than this is read every time.
    pub const MAX_TEXT: usize = 64 << 10;

    /// A cache charging up to `budget` bytes of estimated memory per generation.
    pub fn new(budget: usize) -> Self {
        ValueCache {
            budget,
            generations: std::sync::Mutex::new(ValueGenerations::default()),
        }
    }

    /// The tree read from exactly `text`, if kept.
    fn get(&self, text: &str) -> Option<std::sync::Arc<SharedTool>> {
        let g = self.generations.lock().unwrap_or_else(|e| e.into_inner());
        g.current.get(text).or_else(|| g.older.get(text)).cloned()
    }

    /// Keeps `value`, read from `text` (not when its text is longer than
    /// [`ValueCache::MAX_TEXT`] or its charge alone exceeds the budget).
    fn put(&self, text: &str, value: &std::sync::Arc<SharedTool>) {
        if text.len() > Self::MAX_TEXT {
            return;
        }
        let size = value.charge(text);
        if size > self.budget {
            return;
        }
        let mut g = self.generations.lock().unwrap_or_else(|e| e.into_inner());
        if g.current.contains_key(text) {
            return;
        }
        if g.current_bytes + size > self.budget {
            g.older = std::mem::take(&mut g.current);
            g.current_bytes = 0;
        }
        g.current_bytes += size;
        g.current.insert(text.into(), std::sync::Arc::clone(value));
    }

    /// The memory charged for the entries kept, bytes (both generations).
    #[cfg(test)]
    fn charged(&self) -> usize {
        let g = self.generations.lock().unwrap_or_else(|e| e.into_inner());
        (g.current.iter().chain(&g.older))
            .map(|(text, tool)| tool.charge(text))
            .sum()
    }
}

/// Shared tools serialized as the array of their trees.
struct TreesOf<'a>(&'a [std::sync::Arc<SharedTool>]);

impl serde::Serialize for TreesOf<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|t| &t.tree))
    }
}

/// Reads a request body for [`request_from_slice`]: its top-level `tools` array through the
/// cache ([`ToolsRead`]), every other value as [`Unique`] does.
#[derive(Clone, Copy)]
struct BodyRead<'c> {
    cache: &'c ValueCache,
}

impl<'de> DeserializeSeed<'de> for BodyRead<'_> {
    type Value = RequestBody;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RequestBody, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for BodyRead<'_> {
    type Value = RequestBody;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<RequestBody, E> {
        Unique.visit_bool(v).map(RequestBody::from)
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<RequestBody, E> {
        Unique.visit_i64(v).map(RequestBody::from)
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<RequestBody, E> {
        Unique.visit_u64(v).map(RequestBody::from)
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<RequestBody, E> {
        Unique.visit_f64(v).map(RequestBody::from)
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RequestBody, E> {
        Unique.visit_str(v).map(RequestBody::from)
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<RequestBody, E> {
        Unique.visit_string(v).map(RequestBody::from)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<RequestBody, E> {
        Unique.visit_unit().map(RequestBody::from)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<RequestBody, A::Error> {
        Unique.visit_seq(seq).map(RequestBody::from)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RequestBody, A::Error> {
        let mut out = Map::new();
        let mut shared: Option<SharedTools> = None;
        while let Some(key) = map.next_key::<String>()? {
            if key == "tools" {
                if shared.is_some() || out.contains_key("tools") {
                    return Err(duplicate(&key));
                }
                match map.next_value_seed(ToolsRead { cache: self.cache })? {
                    ToolsValue::Shared(list) => {
                        shared = Some(SharedTools {
                            at: out.len(),
                            list,
                        });
                    }
                    ToolsValue::Other(v) => {
                        out.insert(key, v);
                    }
                }
                continue;
            }
            match out.entry(key) {
                serde_json::map::Entry::Occupied(seen) => return Err(duplicate(seen.key())),
                serde_json::map::Entry::Vacant(slot) => {
                    slot.insert(map.next_value_seed(Unique)?);
                }
            }
        }
        Ok(RequestBody {
            tree: Value::Object(out),
            shared,
        })
    }
}

/// A top-level `tools` value as [`ToolsRead`] reads it.
enum ToolsValue {
    /// An array: each element shared (from the cache, or read and kept).
    Shared(Vec<std::sync::Arc<SharedTool>>),
    /// Any other value, read as [`Unique`] does.
    Other(Value),
}

/// Reads a request body's top-level `tools` value ([`BodyRead`]): each element of an array is
/// taken from the cache, or read and kept.
#[derive(Clone, Copy)]
struct ToolsRead<'c> {
    cache: &'c ValueCache,
}

impl<'de> DeserializeSeed<'de> for ToolsRead<'_> {
    type Value = ToolsValue;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<ToolsValue, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ToolsRead<'_> {
    type Value = ToolsValue;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<ToolsValue, E> {
        Unique.visit_bool(v).map(ToolsValue::Other)
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ToolsValue, E> {
        Unique.visit_i64(v).map(ToolsValue::Other)
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ToolsValue, E> {
        Unique.visit_u64(v).map(ToolsValue::Other)
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<ToolsValue, E> {
        Unique.visit_f64(v).map(ToolsValue::Other)
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ToolsValue, E> {
        Unique.visit_str(v).map(ToolsValue::Other)
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<ToolsValue, E> {
        Unique.visit_string(v).map(ToolsValue::Other)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<ToolsValue, E> {
        Unique.visit_unit().map(ToolsValue::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ToolsValue, A::Error> {
        Unique.visit_map(map).map(ToolsValue::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ToolsValue, A::Error> {
        use serde::de::Error;
        let mut out = Vec::new();
        while let Some(raw) = seq.next_element::<&'de serde_json::value::RawValue>()? {
            let text = raw.get();
            let value = match self.cache.get(text) {
                Some(kept) => kept,
                None => {
                    // Read at the depth it has in the body (an element of the top-level
                    // object's array): the nesting limit counts from the body's root.
                    let wrapped = format!("[[{text}]]");
                    let mut outer = from_str(&wrapped).map_err(A::Error::custom)?;
                    let value = outer
                        .get_mut(0)
                        .and_then(|inner| inner.get_mut(0))
                        .map(Value::take)
                        .ok_or_else(|| A::Error::custom("a tool element read as no value"))?;
                    let value = std::sync::Arc::new(SharedTool::new(value, text));
                    self.cache.put(text, &value);
                    value
                }
            };
            out.push(value);
        }
        Ok(ToolsValue::Shared(out))
    }
}

/// Whether `raw` is one JSON object that `serde_json::from_slice::<Value>` reads, checked
/// without building the tree: the same deserializer visits every value as serde_json's
/// `Value` does (the grammar, string escapes and lone surrogates, the number range — `1e400`
/// is refused — and the nesting limit of 128), keeping nothing, and refusing an object that
/// names a key twice at any depth, as [`from_slice`] does. No request path calls this any more: a view
/// reads each member it does not use with [`Readable`] ([`crate::provider::view::members`]),
/// which makes the same check in the same pass. It stays as [`Readable`]'s statement, the
/// oracle the tests hold against serde_json's tree (the lib test below and
/// `tests/it/fuzz.rs`'s typed-view test).
pub fn is_readable_object(raw: &[u8]) -> bool {
    let mut de = serde_json::Deserializer::from_slice(raw);
    matches!(Readable.deserialize(&mut de), Ok(true)) && de.end().is_ok()
}

/// Visits one JSON value as serde_json's `Value` does and keeps nothing: `true` for an object.
/// A seed: `map.next_value_seed(Readable)` checks a member's value as [`from_slice`] would
/// read it, a key twice in any object included (a view that skips a member forwards its
/// bytes as they came, so a repeat there would reach the agent read two ways).
pub struct Readable;

impl<'de> DeserializeSeed<'de> for Readable {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Readable {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_i64<E>(self, _: i64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_u64<E>(self, _: u64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_f64<E>(self, _: f64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_str<E>(self, _: &str) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_unit<E>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while seq.next_element_seed(Readable)?.is_some() {}
        Ok(false)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        // Keys are read as `Value` reads them: as strings (escapes checked and decoded, so
        // `"\u0061"` repeats `"a"`).
        let mut keys = KeySet::default();
        while let Some(key) = map.next_key_seed(ReadableKey)? {
            if keys.contains(&key) {
                return Err(duplicate(&key));
            }
            keys.insert(key);
            map.next_value_seed(Readable)?;
        }
        Ok(true)
    }
}

/// An object key, read as a string (borrowed from the input when it has no escapes).
struct ReadableKey;

impl<'de> DeserializeSeed<'de> for ReadableKey {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for ReadableKey {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v))
    }
}

/// Keys of one JSON object seen so far, to refuse a repeat while reading without a tree
/// ([`Readable`], [`crate::provider::view::members`]). The first [`KeySet::INLINE`] keys are
/// kept inline and searched in order (most objects are that small, and reading one then
/// allocates nothing); past that, in a hash set, so an object with many keys costs linear
/// time, not quadratic.
#[derive(Default)]
pub struct KeySet<'de> {
    inline: [Option<Cow<'de, str>>; KeySet::INLINE],
    len: usize,
    set: Option<HashSet<Cow<'de, str>>>,
}

impl<'de> KeySet<'de> {
    /// Keys kept inline before they move to a hash set.
    const INLINE: usize = 16;

    /// Whether `key` was inserted before.
    pub fn contains(&self, key: &str) -> bool {
        match &self.set {
            Some(set) => set.contains(key),
            None => self.inline[..self.len]
                .iter()
                .any(|k| k.as_deref() == Some(key)),
        }
    }

    /// Remembers `key`.
    pub fn insert(&mut self, key: Cow<'de, str>) {
        if let Some(set) = &mut self.set {
            set.insert(key);
        } else if self.len < Self::INLINE {
            self.inline[self.len] = Some(key);
            self.len += 1;
        } else {
            let mut set: HashSet<Cow<'de, str>> =
                self.inline.iter_mut().filter_map(Option::take).collect();
            set.insert(key);
            self.set = Some(set);
        }
    }
}

/// The error for an object that names `key` twice: the same text [`from_slice`] reads as
/// [`StrictJsonError::DuplicateKey`].
pub fn duplicate<E: serde::de::Error>(key: &str) -> E {
    let shown: String = key.chars().take(MAX_KEY_SHOWN).collect();
    E::custom(format!("{DUPLICATE}{}{END}", Value::String(shown)))
}

/// The marker of the duplicate-key error inside serde's custom error text.
const DUPLICATE: &str = "\u{0}duplicate key ";
const END: &str = "\u{0}";

/// Longest duplicated key shown, characters.
const MAX_KEY_SHOWN: usize = 64;

struct Unique;

impl<'de> DeserializeSeed<'de> for Unique {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Unique {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        // serde_json yields only finite floats; `Null` as serde_json's own `Value` does.
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(v) = seq.next_element_seed(Unique)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            // One lookup per key: the entry both finds a repeat and holds the slot.
            match out.entry(key) {
                serde_json::map::Entry::Occupied(seen) => return Err(duplicate(seen.key())),
                serde_json::map::Entry::Vacant(slot) => {
                    slot.insert(map.next_value_seed(Unique)?);
                }
            }
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `request_from_slice` reads every body as `from_slice` does, the first time and again
    /// with its tools cached: the same tree, or the same error at the same position.
    #[test]
    fn a_request_read_with_cached_tools_is_the_tree_from_slice_reads() {
        let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
        let tool = r#"{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"string"}}}}}"#;
        let cases: Vec<String> = vec![
            format!(r#"{{"model":"m","tools":[{tool}]}}"#),
            format!(r#"{{"tools":[{tool},{tool}],"model":"m"}}"#),
            format!(r#"{{"tools" : [ {tool} , 1 , "x" , null , [] ]}}"#),
            r#"{"tools":[{"a":1,"a":2}]}"#.into(),
            r#"{"tools":[{"a":{"b":1,"b":1}}]}"#.into(),
            r#"{"tools":[{"\u0061":1,"a":2}]}"#.into(),
            r#"{"tools":[1e400]}"#.into(),
            r#"{"tools":[{"a":1e400}]}"#.into(),
            r#"{"tools":[{"a":"\ud800"}]}"#.into(),
            r#"{"tools":[{"a":1},]}"#.into(),
            r#"{"tools":[{"a":1}"#.into(),
            r#"{"tools":{"a":1,"a":2}}"#.into(),
            r#"{"tools":{"a":[1]}}"#.into(),
            r#"{"tools":"x","tools":[]}"#.into(),
            r#"{"tools":[],"tools":[]}"#.into(),
            r#"{"x":{"tools":[{"a":1}]}}"#.into(),
            r#"[{"tools":[1]}]"#.into(),
            r#""tools""#.into(),
            r#"{"tools":[{"a":1}]} x"#.into(),
            format!(r#"{{"tools":[{}]}}"#, deep(125)),
            format!(r#"{{"tools":[{}]}}"#, deep(126)),
            format!(r#"{{"tools":[{}]}}"#, deep(127)),
            format!(r#"{{"tools":[{}]}}"#, deep(200)),
        ];
        let shown = |r: &Result<Value, StrictJsonError>| match r {
            Ok(v) => format!("ok {v}"),
            Err(e) => format!("err {e}"),
        };
        let cache = ValueCache::new(1 << 20);
        for case in &cases {
            let want = shown(&from_slice(case.as_bytes()));
            for round in ["first", "cached"] {
                let read = request_from_slice(case.as_bytes(), &cache);
                let got = shown(&read.map(RequestBody::into_tree));
                assert_eq!(got, want, "{round} read of {case}");
            }
        }
        // A body whose tools were all kept reads the same after the cache turned over.
        let one = SharedTool::new(from_slice(tool.as_bytes()).unwrap(), tool).charge(tool);
        let small = ValueCache::new(one);
        let body = format!(r#"{{"tools":[{tool},{tool}]}}"#);
        for _ in 0..3 {
            assert_eq!(
                shown(&request_from_slice(body.as_bytes(), &small).map(RequestBody::into_tree)),
                shown(&from_slice(body.as_bytes()))
            );
        }
    }

    /// The cache charges an entry its tree's memory, not its text's length: an element of
    /// many empty objects costs at least a `Value` slot each, a long string at least its
    /// bytes; what the cache holds stays within two budgets however such elements arrive, and
    /// an element dearer than the budget is not kept.
    #[test]
    fn the_cache_charges_a_tree_by_its_memory() {
        let slots = |n: usize, i: usize| format!("[{}{i}]", "{},".repeat(n));
        let text = slots(3000, 0);
        let tool = SharedTool::new(from_slice(text.as_bytes()).unwrap(), &text);
        let charge = tool.charge(&text);
        assert!(charge >= 3000 * std::mem::size_of::<Value>());
        assert!(charge > 20 * text.len(), "{charge} for {}", text.len());
        let long = format!(r#"{{"description":"{}"}}"#, "x".repeat(10_000));
        let tool = SharedTool::new(from_slice(long.as_bytes()).unwrap(), &long);
        assert!(tool.charge(&long) >= 10_000 + long.len());

        let budget = 256 << 10;
        let cache = ValueCache::new(budget);
        for i in 0..60 {
            let element = slots(1000, i);
            let body = format!(r#"{{"tools":[{element}]}}"#);
            request_from_slice(body.as_bytes(), &cache).unwrap();
            assert!(cache.get(&element).is_some(), "element {i} kept");
            assert!(
                cache.charged() <= 2 * budget,
                "{} after {i}",
                cache.charged()
            );
        }
        // 60 elements of ~3 KB of text: by text they would all fit in one generation.
        assert!(
            cache.get(&slots(1000, 0)).is_none(),
            "the oldest was dropped"
        );
        let dear = slots(20_000, 0);
        request_from_slice(format!(r#"{{"tools":[{dear}]}}"#).as_bytes(), &cache).unwrap();
        assert!(
            cache.get(&dear).is_none(),
            "an element dearer than the budget is not kept"
        );
    }

    /// A shared tool's canonical form is written once and kept; one that would take more
    /// than twice its text (numbers that grow when written out) is written at each use.
    #[test]
    fn a_canonical_form_is_kept_unless_it_outgrows_its_text() {
        let calls = std::cell::Cell::new(0);
        let write = |v: &Value| {
            calls.set(calls.get() + 1);
            serde_jcs::to_vec(v).unwrap()
        };
        let tool = r#"{"type":"function","function":{"name":"f"}}"#;
        let shared = SharedTool::new(from_slice(tool.as_bytes()).unwrap(), tool);
        let first = shared.canonical(write).into_owned();
        assert!(matches!(shared.canonical(write), Cow::Borrowed(_)));
        assert_eq!(calls.get(), 1);
        assert_eq!(first, serde_jcs::to_vec(shared.tree()).unwrap());

        calls.set(0);
        let grows = "[1e20,1e20,1e20,1e20]";
        let shared = SharedTool::new(from_slice(grows.as_bytes()).unwrap(), grows);
        for _ in 0..2 {
            let text = shared.canonical(write);
            assert!(matches!(text, Cow::Owned(_)));
            assert_eq!(
                text.as_ref(),
                serde_jcs::to_vec(shared.tree()).unwrap().as_slice()
            );
        }
        assert_eq!(
            calls.get(),
            3,
            "written at each use (and once when first tried)"
        );
    }

    /// A body whose `tools` are shared reads, serializes and edits as its whole tree, the
    /// member first, in the middle, last or alone: [`RequestBody::to_text`] and
    /// [`RequestBody::members`] put `tools` at its place, [`RequestBody::tools`] lists its
    /// elements while [`RequestBody::tree`] lacks it, and [`RequestBody::tree_mut`] gives
    /// the whole tree back (an edit then keeps the order too).
    #[test]
    fn a_body_with_shared_tools_is_its_whole_tree() {
        let tool = r#"{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}"#;
        let cache = ValueCache::new(1 << 20);
        for text in [
            format!(r#"{{"tools":[{tool},{tool}],"model":"m","n":1}}"#),
            format!(r#"{{"model":"m","tools":[{tool}],"n":1}}"#),
            format!(r#"{{"model":"m","n":1,"tools":[{tool}]}}"#),
            format!(r#"{{"tools":[{tool}]}}"#),
            r#"{"model":"m","tools":[]}"#.to_owned(),
        ] {
            let whole = from_slice(text.as_bytes()).unwrap();
            for round in ["first", "cached"] {
                let body = request_from_slice(text.as_bytes(), &cache).unwrap();
                assert!(body.shared.is_some(), "{round}: {text}");
                assert_eq!(body.tree().get("tools"), None, "{round}: {text}");
                assert_eq!(body.to_text(), to_text(&whole), "{round}: {text}");
                let names: Vec<&str> = body.members().iter().map(|(k, _)| *k).collect();
                let want: Vec<&str> = whole
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(String::as_str)
                    .collect();
                assert_eq!(names, want, "{round}: {text}");
                let Some(ToolsMember::Array(list)) = body.tools() else {
                    panic!("{round}: no tools array in {text}");
                };
                let listed: Vec<Value> = list.into_iter().cloned().collect();
                assert_eq!(
                    Some(&Value::Array(listed)),
                    whole.get("tools"),
                    "{round}: {text}"
                );
                let mut edited = body.clone();
                edited.tree_mut()["stream_options"] = serde_json::json!({"include_usage": true});
                let mut want_edited = whole.clone();
                want_edited["stream_options"] = serde_json::json!({"include_usage": true});
                assert_eq!(edited.to_text(), to_text(&want_edited), "{round}: {text}");
                assert_eq!(body.clone().into_tree(), whole, "{round}: {text}");
            }
        }
        // A `tools` that is not an array stays in the tree, where everything reads it.
        let body = request_from_slice(br#"{"tools":{"a":1},"model":"m"}"#, &cache).unwrap();
        assert!(body.shared.is_none());
        assert!(
            matches!(body.tools(), Some(ToolsMember::Other(v)) if v == &serde_json::json!({"a":1}))
        );
    }

    #[test]
    fn a_readable_object_is_exactly_what_from_slice_reads_into_an_object() {
        let deep = |n: usize| format!("{{\"a\":{}1{}}}", "[".repeat(n), "]".repeat(n));
        let cases: Vec<String> = [
            r#"{}"#,
            r#"{"a":1}"#,
            r#"  {"a":[1,2,{"b":null}],"c":"x"}  "#,
            r#"[]"#,
            r#"1"#,
            r#""s""#,
            r#"null"#,
            r#"{"a":1e400}"#,
            r#"{"a":-1e400}"#,
            r#"{"a":1.7976931348623157e308}"#,
            r#"{"a":1e-400}"#,
            r#"{"a":-0}"#,
            r#"{"a":18446744073709551616}"#,
            r#"{"a":-9223372036854775809}"#,
            r#"{"a":NaN}"#,
            r#"{"a":Infinity}"#,
            r#"{"a":01}"#,
            r#"{"a":1.}"#,
            r#"{"a":"\ud800"}"#,
            r#"{"\ud800":1}"#,
            r#"{"a":"\ud83d\ude00"}"#,
            r#"{"a":"\x"}"#,
            r#"{"\u0061":1}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,}"#,
            r#"{"a":1} x"#,
            r#"{"a":1}{}"#,
            "{\"a\":\"tab\tin a string\"}",
            "{\"a\":\"nul\u{0}in a string\"}",
            r#"{1:2}"#,
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([deep(126), deep(127), deep(128), deep(200)])
        .collect();
        for case in &cases {
            let tree = from_slice(case.as_bytes()).is_ok_and(|v| v.is_object());
            assert_eq!(is_readable_object(case.as_bytes()), tree, "{case:.80}");
        }
        let not_utf8 = b"{\"a\":\"\xff\"}";
        assert!(serde_json::from_slice::<Value>(not_utf8).is_err());
        assert!(!is_readable_object(not_utf8));
        // The cases that matter most: a view skipping these would pass what a tree refuses.
        for refused in [r#"{"a":1e400}"#, r#"{"a":"\ud800"}"#, r#"{"a":1} x"#] {
            assert!(!is_readable_object(refused.as_bytes()), "{refused}");
        }
        // A key twice, at any depth and however it is spelled, is refused as `from_slice`
        // refuses it (serde_json alone would keep the last).
        for twice in [
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"x":[{"b":{"c":1,"c":1}}]}"#,
        ] {
            assert!(!is_readable_object(twice.as_bytes()), "{twice}");
            assert!(from_slice(twice.as_bytes()).is_err(), "{twice}");
        }
        let many: String = (0..40).map(|i| format!("\"k{i}\":{i},")).collect();
        assert!(is_readable_object(format!("{{{many}\"z\":0}}").as_bytes()));
        assert!(!is_readable_object(
            format!("{{{many}\"k3\":0}}").as_bytes()
        ));
    }

    /// `from_slice` reads UTF-8 through serde_json's text reader (`from_str`): the same
    /// values and the same errors, positions included, as serde_json's byte reader gives;
    /// bytes that are not UTF-8 still get the byte reader's error, where it finds them.
    #[test]
    fn the_text_reader_reads_what_the_byte_reader_reads() {
        let deep = |n: usize| format!("{{\"a\":{}1{}}}", "[".repeat(n), "]".repeat(n));
        let cases: Vec<String> = [
            r#"{"a":[1,2,{"b":null}],"c":"x\u00e9\n\"q\""}"#,
            "{\"a\":\"\\ud83d\\ude00\",\"b\":\"\u{1f600}\u{e9}\"}",
            r#"{"a":"\ud800"}"#,
            r#"{"a":"\x"}"#,
            r#"{"a":1e400}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"x":[{"b":{"c":1,"c":1}}]}"#,
            "{\"a\":\"tab\tin a string\"}",
            "{\n  \"a\": [1,\n  2,,]}",
            r#"{"a":1} x"#,
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([deep(127), deep(128)])
        .collect();
        let bytes_read = |raw: &[u8]| unique(serde_json::Deserializer::from_slice(raw));
        let shown = |r: Result<Value, StrictJsonError>| r.map_err(|e| e.to_string());
        for case in &cases {
            let by_bytes = shown(bytes_read(case.as_bytes()));
            assert_eq!(shown(from_str(case)), by_bytes, "{case:.80}");
            assert_eq!(shown(from_slice(case.as_bytes())), by_bytes, "{case:.80}");
            let cache = ValueCache::new(1 << 20);
            let body = request_from_slice(case.as_bytes(), &cache).map(RequestBody::into_tree);
            assert_eq!(shown(body), by_bytes, "{case:.80}");
        }
        let not_utf8: [&[u8]; 3] = [
            b"{\"a\":\"\xff\"}",
            b"{\"a\":1,\n\"b\":\"\xc3\x28\"}",
            b"\xef\xbb\xbf{}",
        ];
        for raw in not_utf8 {
            let by_bytes = shown(bytes_read(raw));
            assert!(by_bytes.is_err());
            assert_eq!(shown(from_slice(raw)), by_bytes);
            let cache = ValueCache::new(1 << 20);
            let body = request_from_slice(raw, &cache).map(RequestBody::into_tree);
            assert_eq!(shown(body), by_bytes);
            assert!(view_from_slice::<Value>(raw).is_none());
        }
        assert_eq!(
            view_from_slice::<Value>(br#"{"a":"\u00e9"}"#),
            Some(serde_json::json!({"a": "\u{e9}"}))
        );
    }

    /// `member` answers as `Map::get` on objects below, at and above the size it scans.
    #[test]
    fn member_answers_as_get() {
        for size in [0, 1, 2, 15, 16, 17, 40] {
            let map: Map<String, Value> = (0..size)
                .map(|i| (format!("k{i}"), Value::from(i)))
                .chain([(String::new(), Value::Null)])
                .collect();
            let object = Value::Object(map.clone());
            for key in ["", "k0", "k1", "k15", "k16", "k39", "k40", "missing", "k"] {
                assert_eq!(member(&map, key), map.get(key), "{size} {key}");
                assert_eq!(object.member(key), object.get(key), "{size} {key}");
            }
        }
        assert_eq!(Value::from(1).member("a"), None);
        assert_eq!(serde_json::json!(["a"]).member("0"), None);
    }

    #[test]
    fn lookup_answers_as_serde_json_pointer() {
        let v: Value = serde_json::json!({
            "a": {"b": [10, {"c": "x"}], "": {"": 1}},
            "m~n": {"p/q": 2},
            "0": "zero",
            "arr": [[0, 1], [2, 3]],
        });
        for p in [
            "",
            "/",
            "//",
            "/a",
            "/a/b",
            "/a/b/0",
            "/a/b/1/c",
            "/a/b/2",
            "/a/b/01",
            "/a/b/+1",
            "/a/b/-1",
            "/a/b/ 1",
            "/a/b/1/c/x",
            "/a/",
            "/a//",
            "/m~0n",
            "/m~0n/p~1q",
            "/m~n",
            "/m~01n",
            "/m~1n",
            "/0",
            "/arr/1/0",
            "/arr/1/0/0",
            "a",
            "a/b",
            "/missing",
            "/arr/18446744073709551616",
            "/~2",
        ] {
            assert_eq!(v.at(p), v.pointer(p), "pointer {p:?}");
        }
    }

    #[test]
    fn parses_what_serde_json_parses_and_keeps_key_order() {
        let raw = br#"{"b":1,"a":[true,null,-2,3.5,"x\u00e9",{"z":{}}],"c":18446744073709551615}"#;
        let ours = from_slice(raw).unwrap();
        let theirs: Value = serde_json::from_slice(raw).unwrap();
        assert_eq!(ours, theirs);
        assert_eq!(ours.to_string(), theirs.to_string());
    }

    #[test]
    fn refuses_a_duplicate_key_at_any_depth() {
        for raw in [
            &br#"{"stream":false,"stream":true}"#[..],
            br#"{"messages":[{"role":"user","role":"system"}]}"#,
        ] {
            let err = from_slice(raw).unwrap_err();
            assert!(
                matches!(err, StrictJsonError::DuplicateKey { .. }),
                "{err:?}"
            );
            assert!(err.to_string().contains("appears twice"), "{err}");
        }
        let err = from_slice(br#"{"a\n\"b":1,"a\n\"b":2}"#).unwrap_err();
        let text = err.to_string();
        assert!(!text.contains('\n'), "{text}");
        // The same key in sibling objects is not a duplicate.
        assert!(from_slice(br#"[{"a":1},{"a":2}]"#).is_ok());
    }

    #[test]
    fn malformed_json_names_its_position_not_its_content() {
        let err = from_slice(b"{\"secret\": sk-live").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("line 1 column"), "{text}");
        assert!(!text.contains("sk-live"), "{text}");
        assert!(from_slice(b"{} trailing").is_err());
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(from_slice(deep.as_bytes()).is_err(), "nesting limit");
    }
}
