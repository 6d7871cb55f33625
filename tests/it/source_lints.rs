//! Lints over turnguard's own source for the provider boundary (issue 13 item 1, "One round
//! engine"; STYLE.md "Provider specifics live in `src/provider/<api>.rs` and nowhere else"):
//!
//! - `src/provider/mod.rs` names an [`Api`](turnguard::model::Api) variant (`Api::…`) only
//!   inside `fn adapter`, the one selector of a provider adapter: every other per-API choice
//!   is a method of the adapter's `Provider` / `ProviderStream`, in the API's own module;
//! - no file under `src/proxy/` or `src/admission/` holds a provider's SSE event name or a
//!   JSON pointer into a provider's event (`"message_stop"`, `"response.completed"`,
//!   `"/choices/0/delta/content"`, …, [`PROVIDER_LITERALS`]): the request path and the
//!   admission order ask the adapter instead.
//!
//! Both scan the code before a file's `#[cfg(test)]` (tests may hold provider fixtures), with
//! comments blanked; string literals are kept, since the second check looks for them.

use std::path::{Path, PathBuf};

/// Provider event names and event pointers, as the string literals code would match them
/// with. A literal that starts with one of these is provider-specific (`"/choices/` covers
/// every pointer into a Chat chunk's choices).
const PROVIDER_LITERALS: &[&str] = &[
    // Messages (wire-formats.md §3).
    "\"message_start\"",
    "\"message_delta\"",
    "\"message_stop\"",
    "\"content_block_start\"",
    "\"content_block_delta\"",
    "\"content_block_stop\"",
    "\"text_delta\"",
    "\"input_json_delta\"",
    "\"thinking_delta\"",
    // Responses (wire-formats.md §4).
    "\"response.created\"",
    "\"response.in_progress\"",
    "\"response.completed\"",
    "\"response.incomplete\"",
    "\"response.failed\"",
    "\"response.output_text.delta\"",
    "\"response.output_item.added\"",
    "\"response.output_item.done\"",
    "\"response.function_call_arguments.delta\"",
    // Pointers into Chat chunks and Messages deltas (wire-formats.md §2, §3).
    "\"/choices/",
    "\"/delta/",
];

/// `text` before its test module, with `//` and `/* */` comments dropped: the code with its
/// string, raw-string and char literals as written, and the same code with each literal's
/// contents blanked (same length), so braces and names in literals do not count.
fn code_of(text: &str) -> (String, String) {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    let b = text.as_bytes();
    let (mut code, mut masked) = (String::with_capacity(text.len()), String::new());
    let mut i = 0;
    while i < b.len() {
        let rest = &text[i..];
        let ident_before = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
            continue;
        }
        if let Some(after) = rest.strip_prefix("/*") {
            let end = after.find("*/").map_or(rest.len(), |p| p + 4);
            let newlines: String = rest[..end].chars().filter(|c| *c == '\n').collect();
            code.push_str(&newlines);
            masked.push_str(&newlines);
            i += end;
            continue;
        }
        let literal = if !ident_before && (rest.starts_with("r#") || rest.starts_with("r\"")) {
            let hashes = rest[1..].chars().take_while(|c| *c == '#').count();
            (rest.as_bytes().get(1 + hashes) == Some(&b'"')).then(|| {
                let close = format!("\"{}", "#".repeat(hashes));
                let body = 2 + hashes;
                rest[body..]
                    .find(&close)
                    .map_or(rest.len(), |p| body + p + close.len())
            })
        } else if rest.starts_with('"') {
            let mut j = 1;
            while j < rest.len() && rest.as_bytes()[j] != b'"' {
                j += if rest.as_bytes()[j] == b'\\' { 2 } else { 1 };
            }
            Some((j + 1).min(rest.len()))
        } else if let Some(inner) = rest.strip_prefix('\'') {
            // A char literal (`'"'`, `'\''`, `'\u{..}'`), else a lifetime.
            if inner.starts_with('\\') {
                inner.get(2..).and_then(|s| s.find('\'')).map(|p| p + 4)
            } else {
                let ch = inner.chars().next().map_or(0, char::len_utf8);
                inner[ch..].starts_with('\'').then_some(ch + 2)
            }
        } else {
            None
        };
        let len = literal.unwrap_or_else(|| rest.chars().next().map_or(1, char::len_utf8));
        let piece = &rest[..len.min(rest.len())];
        code.push_str(piece);
        if literal.is_some() {
            masked.extend(piece.chars().map(|c| match c {
                '"' | '\'' | '\n' => c,
                _ => ' ',
            }));
            // Multi-byte chars blank to one space each: pad to keep byte offsets equal.
            masked.extend(std::iter::repeat_n(
                ' ',
                piece.len() - piece.chars().count(),
            ));
        } else {
            masked.push_str(piece);
        }
        i += len;
    }
    (code, masked)
}

/// The byte range of the body of `fn name` in `masked` code (its braces included), if any.
fn fn_body(masked: &str, name: &str) -> Option<std::ops::Range<usize>> {
    let at = masked.find(&format!("fn {name}("))?;
    let open = at + masked[at..].find('{')?;
    let mut depth = 0usize;
    for (k, c) in masked[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open..open + k + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// The line (1-based) of byte `at` in `code`, and its text.
fn line_at(code: &str, at: usize) -> (usize, &str) {
    let start = code[..at].rfind('\n').map_or(0, |p| p + 1);
    let end = code[at..].find('\n').map_or(code.len(), |p| at + p);
    (
        code[..at].matches('\n').count() + 1,
        code[start..end].trim(),
    )
}

/// Every `Api::` in the code of `src/provider/mod.rs` outside `fn adapter`, and a missing or
/// doubled selector.
fn api_matches_outside_the_selector(text: &str) -> Vec<String> {
    let (code, masked) = code_of(text);
    let mut failures = Vec::new();
    let selectors = masked.matches("fn adapter(").count();
    if selectors != 1 {
        failures.push(format!(
            "{selectors} `fn adapter(` selectors (exactly one picks the provider adapter)"
        ));
    }
    let body = fn_body(&masked, "adapter").unwrap_or(0..0);
    for (at, _) in masked.match_indices("Api::") {
        if !body.contains(&at) {
            let (line, text) = line_at(&code, at);
            failures.push(format!("line {line}: `Api::` outside `fn adapter`: {text}"));
        }
    }
    failures
}

/// Every provider literal ([`PROVIDER_LITERALS`]) in the code of one file.
fn provider_literals(text: &str) -> Vec<String> {
    let (code, _) = code_of(text);
    let mut found = Vec::new();
    for lit in PROVIDER_LITERALS {
        for (at, _) in code.match_indices(lit) {
            let (line, text) = line_at(&code, at);
            found.push(format!("line {line}: {lit}: {text}"));
        }
    }
    found.sort();
    found
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn provider_mod_names_an_api_only_in_the_adapter_selector() {
    let path = root().join("src/provider/mod.rs");
    let text = std::fs::read_to_string(&path).expect("src/provider/mod.rs is readable");
    let failures = api_matches_outside_the_selector(&text);
    assert!(
        failures.is_empty(),
        "src/provider/mod.rs:\n  {}",
        failures.join("\n  ")
    );
}

#[test]
fn no_provider_event_names_in_proxy_or_admission() {
    let mut files = Vec::new();
    rs_files(&root().join("src/proxy"), &mut files);
    rs_files(&root().join("src/admission"), &mut files);
    assert!(
        files.len() > 8,
        "the scan found src/proxy and src/admission"
    );
    let mut failures = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let found = provider_literals(&text);
        if !found.is_empty() {
            let rel = path.strip_prefix(root()).unwrap_or(&path).display();
            failures.push(format!("{rel}:\n  {}", found.join("\n  ")));
        }
    }
    assert!(
        failures.is_empty(),
        "provider specifics outside src/provider/ (ask the adapter):\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_provider_scans_see_what_they_must_and_nothing_else() {
    // The selector check: a `match api` outside `fn adapter` fails, as does no selector.
    let dispatching = "pub fn parse(api: Api) { match api { Api::OpenAiChat => a(), _ => b() } }\n";
    assert_eq!(api_matches_outside_the_selector(dispatching).len(), 2);
    let selector = "/// Api::X in a doc\npub fn adapter(api: Api) -> &'static dyn Provider {\n    match api {\n        Api::OpenAiChat => &C, // Api::Y\n        Api::AnthropicMessages => &M,\n    }\n}\nfn f() { let s = \"}\"; let c = '}'; }\n#[cfg(test)]\nmod tests { fn t() { Api::OpenAiChat; } }\n";
    assert!(
        api_matches_outside_the_selector(selector).is_empty(),
        "{:?}",
        api_matches_outside_the_selector(selector)
    );
    let after =
        format!("{selector}fn g() {{ Api::OpenAiResponses }}\n").replace("#[cfg(test)]", "");
    assert!(!api_matches_outside_the_selector(&after).is_empty());
    let two = format!("{selector}fn adapter(x: u8) {{}}\n").replace("#[cfg(test)]", "");
    assert!(!api_matches_outside_the_selector(&two).is_empty());
    // The literal check: event names and pointers in code fail; in comments, in backticks
    // and in the test module they do not.
    let bad = [
        r#"matches!(event.kind(), Some("message_stop" | "response.completed"))"#,
        r#"v.pointer("/choices/0/delta/content")"#,
        r#"if kind == "response.output_text.delta" {}"#,
        r#"(v.pointer("/delta/type") == Some("text_delta"))"#,
    ];
    for b in bad {
        assert!(!provider_literals(b).is_empty(), "missed: {b}");
    }
    let fine = [
        "// matches `\"message_stop\"` in a comment\nlet x = 1;",
        "/// Messages `message_stop`, Responses `response.completed`\nfn f() {}",
        "/* \"text_delta\" */ let y = 2;",
        "let url = \"http://x/\"; // \"message_stop\"",
        "fn f() {}\n#[cfg(test)]\nmod tests { const S: &str = \"message_stop\"; }",
        "let q = '\"'; let s = \"delta\";",
    ];
    for f in fine {
        assert!(
            provider_literals(f).is_empty(),
            "false positive: {f}: {:?}",
            provider_literals(f)
        );
    }
}
