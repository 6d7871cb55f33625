//! Redaction (tool-turn contract §B stage 7): secrets in arguments are replaced by
//! `[REDACTED:<name>]` in everything turnguard records, logs or emits; `argsHash` is taken
//! after redaction (OpenWOP run-event-payloads `argsHash`: "with resolved secrets already
//! redacted").

use regex::Regex;
use serde_json::Value;

use crate::strict_json::Lookup as _;

use super::bundle::Redaction;
use super::PolicyError;

/// Built-in recognizers: (name, pattern).
const BUILTIN: &[(&str, &str)] = &[
    (
        "private-key",
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z0-9 ]*PRIVATE KEY-----",
    ),
    (
        "jwt",
        r"eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}",
    ),
    ("bearer-token", r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{12,}"),
    (
        "api-key",
        r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{20,}",
    ),
    ("api-key", r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"),
    (
        "aws-access-key-id",
        r"\b(?:AKIA|ASIA|AIDA|AROA)[0-9A-Z]{16}\b",
    ),
    (
        "aws-secret-access-key",
        r#"(?i)aws_?secret_?access_?key["'\s:=]+[A-Za-z0-9/+=]{40}"#,
    ),
    (
        "github-token",
        r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})",
    ),
    ("slack-token", r"\bxox[abprs]-[A-Za-z0-9-]{10,}"),
    ("google-api-key", r"\bAIza[0-9A-Za-z_-]{35}"),
    (
        "gcp-service-account-key",
        r#""private_key_id"\s*:\s*"[a-f0-9]{40}""#,
    ),
    ("azure-storage-key", r"(?i)AccountKey=[A-Za-z0-9+/=]{40,}"),
];

/// Compiled redaction rules.
#[derive(Debug, Clone)]
pub struct Redactor {
    patterns: Vec<(String, Regex)>,
    /// Every pattern as one alternation ([`prefilters`]), asked only whether a text holds any
    /// secret at all: a text it does not match (almost every argument, id and hash) costs one
    /// search instead of one per pattern. `None` when it cannot be formed (the patterns then
    /// run one by one, as before).
    any: Option<Regex>,
    /// The shortest text, bytes, any pattern can match (the least of their HIRs'
    /// `minimum_len`): a shorter string (most ids, names and enum values) is not searched.
    shortest_match: usize,
    pointers: Vec<(String, String)>,
    /// Also strip matches from arguments released to egress tools.
    pub strip_from_egress: bool,
}

/// The built-in recognizers, compiled once for the process: every policy's redactor and
/// [`builtins`] share them (a compiled regex is most of a redactor's memory; a clone shares
/// it). One entry per [`BUILTIN`] entry, in its order (two recognizers may share a name); a
/// pattern that does not compile is `None`, and [`Redactor::compile`] reports it.
fn builtin_patterns() -> &'static [Option<(String, Regex)>] {
    static PATTERNS: std::sync::LazyLock<Vec<Option<(String, Regex)>>> =
        std::sync::LazyLock::new(|| {
            BUILTIN
                .iter()
                .map(|(name, re)| Regex::new(re).ok().map(|r| ((*name).to_owned(), r)))
                .collect()
        });
    &PATTERNS
}

/// The built-in recognizers alone: for text turnguard shows or keeps where no policy is at
/// hand or whatever the bundle says — a label made from a name the model or the agent chose
/// ([`crate::admission::sanitize_label`]), an `x-request-id` it echoes and logs. It shares
/// the compiled patterns ([`builtin_patterns`]) and has no alternation of its own: a text at
/// least as long as the shortest match is searched pattern by pattern.
pub fn builtins() -> &'static Redactor {
    static BUILTINS: std::sync::LazyLock<Redactor> = std::sync::LazyLock::new(|| {
        let patterns: Vec<(String, Regex)> = builtin_patterns().iter().flatten().cloned().collect();
        Redactor {
            shortest_match: shortest_match(&patterns),
            patterns,
            any: None,
            pointers: Vec::new(),
            strip_from_egress: false,
        }
    });
    &BUILTINS
}

impl Redactor {
    /// Compiles the built-ins (when enabled) and the bundle's patterns.
    pub fn compile(cfg: &Redaction, file: &str, text: &str) -> Result<Self, Vec<PolicyError>> {
        let mut patterns = Vec::new();
        let mut errors = Vec::new();
        if cfg.builtin {
            for ((name, re), compiled) in BUILTIN.iter().zip(builtin_patterns()) {
                match compiled {
                    Some(p) => patterns.push(p.clone()),
                    None => errors.push(PolicyError::at(
                        file,
                        None,
                        format!(
                            "built-in recognizer {name}: {}",
                            Regex::new(re)
                                .err()
                                .map_or_else(String::new, |e| e.to_string())
                        ),
                    )),
                }
            }
        }
        for p in &cfg.patterns {
            match Regex::new(&p.regex) {
                Ok(r) => patterns.push((p.name.clone(), r)),
                Err(e) => errors.push(PolicyError::at(
                    file,
                    super::catalog::line_of_value(text, &p.name),
                    format!("redaction pattern `{}` is not a valid regex: {e}", p.name),
                )),
            }
        }
        for p in &cfg.pointers {
            if !p.pointer.starts_with('/') {
                errors.push(PolicyError::at(
                    file,
                    None,
                    format!("redaction pointer `{}` is not a JSON pointer", p.pointer),
                ));
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let (shortest_match, any) = prefilters(&patterns);
        Ok(Self {
            patterns,
            any,
            shortest_match,
            pointers: cfg
                .pointers
                .iter()
                .map(|p| (p.tool.clone(), p.pointer.clone()))
                .collect(),
            strip_from_egress: cfg.strip_from_egress,
        })
    }

    /// [`Redactor::redact`] when it would change `args`, `None` when it would not (no pointer
    /// configured for `tool_id` resolves in them and none of their strings holds a secret):
    /// then the arguments are their own redacted form, and a call without secrets, the
    /// common case, is not copied (admission stage 7). The check only reads; a call with a
    /// secret runs the patterns again while it is copied.
    pub fn redacted_copy(&self, tool_id: &str, args: &Value) -> Option<(Value, usize)> {
        self.finds(tool_id, args)
            .then(|| self.redact(tool_id, args))
    }

    /// Whether [`Redactor::redact`] would change `args` (see [`Redactor::redacted_copy`]).
    fn finds(&self, tool_id: &str, args: &Value) -> bool {
        self.pointers
            .iter()
            .any(|(tool, pointer)| tool == tool_id && args.at(pointer).is_some())
            || self.holds_secret(args)
    }

    fn holds_secret(&self, v: &Value) -> bool {
        match v {
            Value::String(s) => self.redacted(s).is_some(),
            Value::Array(a) => a.iter().any(|x| self.holds_secret(x)),
            Value::Object(m) => m.values().any(|x| self.holds_secret(x)),
            _ => false,
        }
    }

    /// A copy of `args` with every secret replaced; returns it and how many were found.
    pub fn redact(&self, tool_id: &str, args: &Value) -> (Value, usize) {
        let mut out = args.clone();
        let found = self.redact_in_place(tool_id, &mut out);
        (out, found)
    }

    /// [`Redactor::redact`] on a value the caller owns (no copy); returns how many secrets
    /// were replaced.
    pub fn redact_in_place(&self, tool_id: &str, v: &mut Value) -> usize {
        let mut found = 0;
        for (tool, pointer) in &self.pointers {
            if tool == tool_id {
                if let Some(v) = v.pointer_mut(pointer) {
                    *v = Value::String("[REDACTED:pointer]".into());
                    found += 1;
                }
            }
        }
        self.walk(v, &mut found);
        found
    }

    /// `text` with its secrets replaced, borrowed when it holds none: what
    /// [`Redactor::redact_in_place`] does to one string of a tree (an event payload built
    /// without one).
    pub fn redact_str<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        self.redacted(text)
            .map_or(std::borrow::Cow::Borrowed(text), std::borrow::Cow::Owned)
    }

    /// Redacts secrets inside free text (log lines, tool results).
    pub fn redact_text(&self, text: &str) -> String {
        self.redacted(text).unwrap_or_else(|| text.to_owned())
    }

    /// `text` with its secrets replaced, or `None` when it holds none: the patterns run in
    /// order, each over what the previous ones left, and a text none of them matches is not
    /// copied. A text the one alternation ([`Redactor::any`]) does not match is not searched
    /// pattern by pattern. (One `RegexSet` scan of all patterns was measured instead: it cost
    /// 1 MiB more anonymous memory at start for the built-ins, against a 32 MiB budget.)
    fn redacted(&self, text: &str) -> Option<String> {
        if text.len() < self.shortest_match {
            return None;
        }
        if self.any.as_ref().is_some_and(|any| !any.is_match(text)) {
            return None;
        }
        let first = self.patterns.iter().position(|(_, re)| re.is_match(text))?;
        let mut s = text.to_owned();
        for (name, re) in &self.patterns[first..] {
            if re.is_match(&s) {
                s = re
                    .replace_all(&s, format!("[REDACTED:{name}]").as_str())
                    .into_owned();
            }
        }
        (s != text).then_some(s)
    }

    fn walk(&self, v: &mut Value, found: &mut usize) {
        match v {
            Value::String(s) => {
                if let Some(r) = self.redacted(s) {
                    *found += 1;
                    *s = r;
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|x| self.walk(x, found)),
            Value::Object(m) => m.values_mut().for_each(|x| self.walk(x, found)),
            _ => {}
        }
    }
}

/// What the patterns' parsed forms tell before any text is searched, each pattern parsed
/// once (HIR, with the defaults `Regex::new` uses): the shortest text any of them can match
/// ([`Redactor::shortest_match`]: the least `minimum_len`; 0 for a pattern that does not
/// parse, so nothing is skipped; `usize::MAX` when nothing can match), and one regex that
/// matches where any of them matches ([`Redactor::any`]).
///
/// The alternation is formed of the HIRs, not of the patterns' texts: joining texts would let
/// one pattern's syntax reach into the next (a `(?x)` comment runs to the next newline, past
/// the group meant to close it, and could re-pair with a later pattern's brackets into a regex
/// that compiles and matches less). The HIR has every flag resolved and no comments; its
/// printed form is a pattern equivalent to it (`regex-syntax`'s `Display` for `Hir`). Whether
/// a text matches is the same question as whether some pattern does; which one, and where,
/// is left to the patterns themselves. No alternation with no patterns, when one does not
/// parse, or when it does not compile (`regex`'s size limits).
fn prefilters(patterns: &[(String, Regex)]) -> (usize, Option<Regex>) {
    let hirs: Vec<_> = patterns
        .iter()
        .map(|(_, re)| regex_syntax::parse(re.as_str()).ok())
        .collect();
    let shortest = shortest_of(&hirs);
    let any = if hirs.is_empty() {
        None
    } else {
        hirs.into_iter()
            .collect::<Option<Vec<_>>>()
            .and_then(|h| Regex::new(&regex_syntax::hir::Hir::alternation(h).to_string()).ok())
    };
    (shortest, any)
}

/// The least `minimum_len` of the patterns' parsed forms ([`prefilters`]' first half).
fn shortest_match(patterns: &[(String, Regex)]) -> usize {
    let hirs: Vec<_> = patterns
        .iter()
        .map(|(_, re)| regex_syntax::parse(re.as_str()).ok())
        .collect();
    shortest_of(&hirs)
}

fn shortest_of(hirs: &[Option<regex_syntax::hir::Hir>]) -> usize {
    hirs.iter()
        .map(|hir| {
            hir.as_ref()
                .map_or(0, |h| h.properties().minimum_len().unwrap_or(usize::MAX))
        })
        .min()
        .unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn builtins_compile() {
        assert!(builtin_patterns().iter().all(Option::is_some));
        let policy = Redactor::compile(&Redaction::default(), "built-in", "").unwrap();
        // Every recognizer, the two that share the name `api-key` included, in both.
        assert_eq!(policy.patterns.len(), BUILTIN.len());
        assert_eq!(builtins().patterns.len(), BUILTIN.len());
        for key in [
            "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789",
            "sk_live_AbCdEfGhIjKlMnOp1234",
        ] {
            assert!(
                builtins().redact_str(key).starts_with("[REDACTED:"),
                "{key}"
            );
            assert!(policy.redact_str(key).starts_with("[REDACTED:"), "{key}");
        }
    }

    /// No copy exactly when redaction would change nothing: a clean call, a call with a
    /// pointer configured for another tool; a copy equal to `redact`'s for a secret in a
    /// string and for a configured pointer that resolves.
    #[test]
    fn a_copy_is_made_exactly_when_redaction_changes_something() {
        let cfg = Redaction {
            pointers: vec![crate::policy::bundle::RedactionPointer {
                tool: "vault".into(),
                pointer: "/auth/pin".into(),
            }],
            ..Redaction::default()
        };
        let r = Redactor::compile(&cfg, "t", "").unwrap();
        let clean = json!({"city": "Lisbon", "ids": ["a1", 2], "auth": {"pin": "1234"}});
        assert_eq!(r.redacted_copy("weather", &clean), None);
        assert_eq!(r.redact("weather", &clean), (clean.clone(), 0));
        let copy = r
            .redacted_copy("vault", &clean)
            .expect("the pointer resolves");
        assert_eq!(copy, r.redact("vault", &clean));
        assert_eq!(copy.0["auth"]["pin"], "[REDACTED:pointer]");
        let secret = json!({"q": ["x", {"k": "sk-proj-abcdefghijklmnopqrstuvwxyz012345"}]});
        let copy = r.redacted_copy("weather", &secret).expect("a secret");
        assert_eq!(copy, r.redact("weather", &secret));
        assert_eq!(copy.1, 1);
    }

    #[test]
    fn builtins_catch_common_secrets() {
        let r = Redactor::compile(&Redaction::default(), "t", "").unwrap();
        let args = json!({
            "key": "sk-proj-abcdefghijklmnopqrstuvwxyz012345",
            "nested": {"auth": "Bearer abcdefghijklmnopqrstuv"},
            "aws": "AKIAABCDEFGHIJKLMNOP",
            "note": "nothing here"
        });
        let (out, n) = r.redact("t", &args);
        assert_eq!(n, 3);
        assert_eq!(out["key"], "[REDACTED:api-key]");
        assert_eq!(out["nested"]["auth"], "[REDACTED:bearer-token]");
        assert_eq!(out["note"], "nothing here");
    }

    /// The length skip never hides a secret: the built-ins' shortest match is a Slack token's
    /// 15 bytes, a 15-byte token is still found, and a pattern that can match the empty
    /// string turns the skip off.
    #[test]
    fn strings_shorter_than_any_match_are_skipped_and_no_longer_one() {
        let r = Redactor::compile(&Redaction::default(), "t", "").unwrap();
        assert_eq!(r.shortest_match, 15);
        assert_eq!(
            r.redact_text("xoxb-abcdefghi"),
            "xoxb-abcdefghi",
            "14 bytes"
        );
        assert_eq!(r.redact_text("xoxb-abcdefghij"), "[REDACTED:slack-token]");
        let toml = "[[patterns]]\nname = \"any\"\nregex = \"x*\"\n";
        let cfg: Redaction = toml::from_str(toml).unwrap();
        let r = Redactor::compile(&cfg, "t", toml).unwrap();
        assert_eq!(r.shortest_match, 0);
    }

    /// The one alternation asks the same question as the patterns one by one: over texts
    /// holding each built-in's secret, near misses and plain text, and with a bundle pattern
    /// whose own `(?i)` must stay inside its group, the prefilter matches exactly when some
    /// pattern does, and a `(?x)` comment cannot reach from one pattern into the next.
    #[test]
    fn the_alternation_matches_exactly_when_some_pattern_does() {
        // A bundle pattern's `(?i)` must not reach the pattern after it.
        let toml = "[[patterns]]\nname = \"ticket\"\nregex = \"(?i)tkt-[0-9]{6}\"\n\
                    [[patterns]]\nname = \"exact\"\nregex = \"EXACT-[0-9]{4}\"\n";
        let cfg: Redaction = toml::from_str(toml).unwrap();
        let r = Redactor::compile(&cfg, "t", toml).unwrap();
        let any = r.any.as_ref().expect("the alternation compiles");
        let texts = [
            "-----BEGIN RSA PRIVATE KEY-----\nMIIB\n-----END RSA PRIVATE KEY-----",
            "-----BEGIN RSA PRIVATE KEY----- but never ended",
            "eyJhbGciOi.eyJzdWIiOi.c2lnbmF0dXJl",
            "authorization: Bearer abcdefghijklmnop",
            "BEARER abcdefghijklmnop",
            "sk-proj-abcdefghijklmnopqrstuvwxyz012345",
            "sk_live_abcdefghijklmnop1234",
            "AKIAABCDEFGHIJKLMNOP",
            "AKIAABCDEFGHIJKLMNOPQ",
            "AWS_SECRET_ACCESS_KEY=abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123",
            "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
            "xoxb-abcdefghij",
            "AIzaabcdefghijklmnopqrstuvwxyz012345678",
            r#""private_key_id": "0123456789abcdef0123456789abcdef01234567""#,
            "DefaultEndpointsProtocol=https;accountkey=abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123",
            "TKT-123456 and tkt-654321",
            "TKT-12345",
            "EXACT-1234",
            "exact-1234",
            "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
            "call_9f86d081884c7d659a2feaa0c55ad015",
            "What is the weather in San Francisco?",
            "",
        ];
        for text in texts {
            let some = r.patterns.iter().any(|(_, re)| re.is_match(text));
            assert_eq!(any.is_match(text), some, "{text}");
        }
        assert_eq!(r.redact_text("ref TKT-123456"), "ref [REDACTED:ticket]");
        assert_eq!(r.redact_text("ref exact-1234"), "ref exact-1234");
        assert_eq!(
            r.redact_text("What is the weather in San Francisco?"),
            "What is the weather in San Francisco?"
        );

        // A `(?x)` comment at the end of one pattern, and a later pattern with a newline:
        // joined as texts, the comment would run past its group into the next pattern and
        // the brackets would pair up again into `(?:tkt-[0-9]{6}ENDSECRET)`, which compiles
        // and matches neither. Formed from the parsed patterns, both are found.
        let cfg = Redaction {
            builtin: false,
            patterns: vec![
                crate::policy::bundle::RedactionPattern {
                    name: "commented".into(),
                    regex: "(?x) tkt-[0-9]{6}  # ticket number".into(),
                },
                crate::policy::bundle::RedactionPattern {
                    name: "two-lines".into(),
                    regex: "BEGIN SECRET\nEND SECRET".into(),
                },
            ],
            ..Redaction::default()
        };
        let r = Redactor::compile(&cfg, "t", "").unwrap();
        let any = r.any.as_ref().expect("the alternation compiles");
        for text in [
            "ref tkt-123456",
            "BEGIN SECRET\nEND SECRET",
            "tkt-123456ENDSECRET",
        ] {
            let some = r.patterns.iter().any(|(_, re)| re.is_match(text));
            assert_eq!(any.is_match(text), some, "{text:?}");
        }
        assert_eq!(
            r.redact_text("BEGIN SECRET\nEND SECRET"),
            "[REDACTED:two-lines]"
        );
        assert_eq!(r.redact_text("ref tkt-123456"), "ref [REDACTED:commented]");
    }
}
