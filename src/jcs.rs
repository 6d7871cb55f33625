//! RFC 8785 (JSON Canonicalization Scheme) serialization, written in one pass.
//!
//! `argsHash`, the semantic request digest and effect business keys are SHA-256 over this
//! form (OpenWOP `argsHash`; RFC 8785 §3.2): object members sorted by the UTF-16 code units
//! of their names, no whitespace, every number written as the IEEE 754 double ECMAScript's
//! `Number.prototype.toString` gives (RFC 8785 §3.2.2.3, via `ryu-js`), strings with only
//! `"`, `\`, and control characters escaped (`\b \t \n \f \r`, else `\u00xx`).
//!
//! The output is byte-identical to `serde_jcs` (a test pins it over a generated corpus), so
//! digests journaled before are unchanged; it writes into one buffer instead of one buffer
//! per object value and parsing every key back.

use serde_json::Value;

/// A JSON tree to canonicalize that borrows its parts: lets a caller canonicalize a view
/// (some members of a request, a sorted list of its tools) without cloning the values.
#[derive(Debug, Clone)]
pub enum View<'a> {
    /// A value as it is.
    Value(&'a Value),
    /// A string.
    Str(&'a str),
    /// An array of views, in order.
    Array(Vec<View<'a>>),
    /// An object; member names must be distinct (they are sorted here).
    Object(Vec<(&'a str, View<'a>)>),
    /// A value's RFC 8785 form, already written ([`to_vec`]'s output): copied as it is.
    Canonical(std::borrow::Cow<'a, [u8]>),
}

/// The RFC 8785 form of `v`.
pub fn to_vec(v: &Value) -> Vec<u8> {
    // A call's arguments fit at once, mostly (growing from 128 bytes took two reallocations
    // for the bench's ~0.4 KiB arguments, issue 13).
    let mut out = Vec::with_capacity(512);
    write_value(&mut out, v);
    out
}

/// The RFC 8785 form of a borrowed view.
pub fn view_to_vec(v: &View<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(1024);
    write_view(&mut out, v);
    out
}

fn write_view(out: &mut Vec<u8>, v: &View<'_>) {
    match v {
        View::Value(v) => write_value(out, v),
        View::Str(s) => write_str(out, s),
        View::Canonical(text) => out.extend_from_slice(text),
        View::Array(items) => write_array(out, items, write_view),
        View::Object(members) => write_object(
            out,
            members.iter().map(|(k, v)| (*k, v)).collect(),
            write_view,
        ),
    }
}

fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => {
            // Without `arbitrary_precision` every number has an f64 value, and it is finite.
            let f = n.as_f64().unwrap_or(0.0);
            let mut buf = ryu_js::Buffer::new();
            out.extend_from_slice(buf.format_finite(f).as_bytes());
        }
        Value::String(s) => write_str(out, s),
        Value::Array(items) => write_array(out, items, write_value),
        Value::Object(map) => write_object(
            out,
            map.iter().map(|(k, v)| (k.as_str(), v)).collect(),
            write_value,
        ),
    }
}

/// `[a,b,…]`, each item written by `each`.
fn write_array<'a, T: 'a>(
    out: &mut Vec<u8>,
    items: impl IntoIterator<Item = &'a T>,
    each: fn(&mut Vec<u8>, &T),
) {
    out.push(b'[');
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        each(out, item);
    }
    out.push(b']');
}

/// `{"k":v,…}` with the members in RFC 8785 order, each value written by `each`.
fn write_object<T: ?Sized>(
    out: &mut Vec<u8>,
    mut members: Vec<(&str, &T)>,
    each: fn(&mut Vec<u8>, &T),
) {
    members.sort_by(|a, b| utf16_order(a.0, b.0));
    out.push(b'{');
    for (i, (k, v)) in members.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_str(out, k);
        out.push(b':');
        each(out, v);
    }
    out.push(b'}');
}

/// Member-name order: UTF-16 code units (RFC 8785 §3.2.3). UTF-8 byte order agrees with it
/// except past U+FFFF, so ASCII names (nearly all) compare as bytes.
fn utf16_order(a: &str, b: &str) -> std::cmp::Ordering {
    if a.is_ascii() && b.is_ascii() {
        a.as_bytes().cmp(b.as_bytes())
    } else {
        a.encode_utf16().cmp(b.encode_utf16())
    }
}

/// For each byte, how a string writes it: 0 as it is, else the letter after its `\\`
/// (`u` for the `\\u00xx` form of a control character without a short escape).
static ESCAPE: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = b'u';
        b += 1;
    }
    table[0x08] = b'b';
    table[0x09] = b't';
    table[0x0a] = b'n';
    table[0x0c] = b'f';
    table[0x0d] = b'r';
    table[b'"' as usize] = b'"';
    table[b'\\' as usize] = b'\\';
    table
};

/// Whether any of the eight bytes in `w` needs an escape: a control character (< 0x20), `"`
/// or `\\` (the classic zero-byte tests of "Bit Twiddling Hacks": `x - 0x01…` sets a byte's
/// high bit where the byte was 0 (or borrowed from), `& !x` keeps it only if that byte's own
/// high bit was clear). Exact, not a filter: no false positives or negatives.
fn needs_escape(w: u64) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    let below = |x: u64, n: u8| x.wrapping_sub(ONES * u64::from(n)) & !x & HIGH;
    let zero = |x: u64| below(x, 1);
    (below(w, 0x20) | zero(w ^ (ONES * u64::from(b'"'))) | zero(w ^ (ONES * u64::from(b'\\')))) != 0
}

/// Writes `s` as a JSON string: the bytes serde_json writes for it too (the same escapes:
/// `"`, `\\`, `\b \t \n \f \r`, other control characters as lowercase `\u00xx`, nothing
/// else), eight bytes at a time where none needs one. The log lines use it
/// ([`crate::logs::JsonLines`]).
pub(crate) fn write_str(out: &mut Vec<u8>, s: &str) {
    out.reserve(s.len() + 2);
    out.push(b'"');
    write_str_contents(out, s);
    out.push(b'"');
}

/// [`write_str`] without the quotes: `s`'s escaped text, to write one string in pieces.
pub(crate) fn write_str_contents(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        // Eight bytes at a time while none needs an escape (most text).
        if let Some(chunk) = bytes.get(i..i + 8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            if !needs_escape(u64::from_ne_bytes(w)) {
                i += 8;
                continue;
            }
        }
        let b = bytes[i];
        let letter = ESCAPE[usize::from(b)];
        if letter != 0 {
            out.extend_from_slice(&bytes[start..i]);
            if letter == b'u' {
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
            } else {
                out.push(b'\\');
                out.push(letter);
            }
            start = i + 1;
        }
        i += 1;
    }
    out.extend_from_slice(&bytes[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ATOMS: &[&str] = &[
        "",
        "a",
        "b",
        "A",
        "é",
        "\u{e000}",
        "\u{1f600}",
        "\u{ffff}",
        "\"",
        "\\",
        "\n\t\r",
        "\u{0}\u{1f}\u{7f}",
        "/",
        "caf\u{e9}",
        "\u{10000}",
        "z\u{8}\u{c}",
    ];

    /// xorshift64: a deterministic stream of pseudo-random numbers.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn atom(&mut self) -> &'static str {
            ATOMS[(self.next() % ATOMS.len() as u64) as usize]
        }
    }

    /// A value covering what canonicalization must order and format: names past U+FFFF and
    /// in U+E000..U+FFFF, control characters, quotes, integers past 2^53, tiny and huge
    /// floats, negative zero, nesting.
    fn build(depth: u32, rng: &mut Rng) -> Value {
        match rng.next() % if depth == 0 { 6 } else { 8 } {
            0 => Value::Null,
            1 => Value::Bool(rng.next() % 2 == 0),
            2 => json!((rng.next() as i64) >> (rng.next() % 64)),
            3 => json!(rng.next() >> (rng.next() % 64)),
            4 => {
                let f = f64::from_bits(rng.next());
                json!(if f.is_finite() { f } else { -0.0 })
            }
            5 => json!(rng.atom()),
            6 => Value::Array((0..rng.next() % 4).map(|_| build(depth - 1, rng)).collect()),
            _ => {
                let mut m = serde_json::Map::new();
                for _ in 0..rng.next() % 5 {
                    let k = format!("{}{}", rng.atom(), rng.atom());
                    m.insert(k, build(depth - 1, rng));
                }
                Value::Object(m)
            }
        }
    }

    fn corpus() -> Vec<Value> {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut out: Vec<Value> = (0..3000).map(|_| build(4, &mut rng)).collect();
        out.extend([
            json!({"b": 1, "a": [1e21, 1e-7, 0.1, -0.0, 9_007_199_254_740_993_u64, 1.5e300]}),
            json!({"\u{e000}": 1, "\u{1f600}": 2, "a": {}}),
            json!([[], {}, "", 0]),
        ]);
        out
    }

    #[test]
    fn byte_identical_to_serde_jcs() {
        for v in corpus() {
            let want = serde_jcs::to_vec(&v).unwrap();
            assert_eq!(
                String::from_utf8(to_vec(&v)).unwrap(),
                String::from_utf8(want).unwrap(),
                "{v}"
            );
        }
    }

    /// Long strings (the eight-byte scan) of the atoms, escapes at every offset of a chunk.
    #[test]
    fn long_strings_are_byte_identical_to_serde_jcs() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for _ in 0..5000 {
            let n = rng.next() % 40;
            let text: String = (0..n).map(|_| rng.atom()).collect();
            let v = json!({ text.clone(): text });
            assert_eq!(
                String::from_utf8(to_vec(&v)).unwrap(),
                String::from_utf8(serde_jcs::to_vec(&v).unwrap()).unwrap(),
                "{text:?}"
            );
        }
        // Every byte value, alone and at each position of a chunk.
        for b in 0u8..=0x7f {
            for at in 0..9 {
                let mut text = "a".repeat(at);
                text.push(char::from(b));
                text.push_str("bcdefghij");
                let v = json!(text);
                assert_eq!(to_vec(&v), serde_jcs::to_vec(&v).unwrap(), "{b:#x} at {at}");
            }
        }
    }

    #[test]
    fn a_view_canonicalizes_as_the_tree_it_shows() {
        let tools = json!([{"name": "b"}, {"name": "a"}]);
        let model = json!("gpt");
        let view = View::Object(vec![
            ("model", View::Value(&model)),
            ("recipe", View::Str("r")),
            (
                "tools",
                View::Array(tools.as_array().unwrap().iter().map(View::Value).collect()),
            ),
        ]);
        let tree = json!({"tools": tools, "recipe": "r", "model": "gpt"});
        assert_eq!(view_to_vec(&view), serde_jcs::to_vec(&tree).unwrap());
        // The same with each tool given by its canonical form, written before.
        let written: Vec<Vec<u8>> = tools.as_array().unwrap().iter().map(to_vec).collect();
        let view = View::Object(vec![
            ("model", View::Value(&model)),
            ("recipe", View::Str("r")),
            (
                "tools",
                View::Array(written.iter().map(|t| View::Canonical(t.into())).collect()),
            ),
        ]);
        assert_eq!(view_to_vec(&view), serde_jcs::to_vec(&tree).unwrap());
    }
}
