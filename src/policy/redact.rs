//! Redaction (tool-turn contract §B stage 7): secrets in arguments are replaced by
//! `[REDACTED:<name>]` in everything turnguard records, logs or emits; `argsHash` is taken
//! after redaction (OpenWOP run-event-payloads `argsHash`: "with resolved secrets already
//! redacted").

use regex::Regex;
use serde_json::Value;

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
    /// The shortest text, bytes, any pattern can match (the least of their HIRs'
    /// `minimum_len`): a shorter string (most ids, names and enum values) is not searched.
    shortest_match: usize,
    pointers: Vec<(String, String)>,
    /// Also strip matches from arguments released to egress tools.
    pub strip_from_egress: bool,
}

impl Redactor {
    /// Compiles the built-ins (when enabled) and the bundle's patterns.
    pub fn compile(cfg: &Redaction, file: &str, text: &str) -> Result<Self, Vec<PolicyError>> {
        let mut patterns = Vec::new();
        let mut errors = Vec::new();
        if cfg.builtin {
            for (name, re) in BUILTIN {
                match Regex::new(re) {
                    Ok(r) => patterns.push(((*name).to_owned(), r)),
                    Err(e) => errors.push(PolicyError::at(
                        file,
                        None,
                        format!("built-in recognizer {name}: {e}"),
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
        let shortest_match = patterns
            .iter()
            .map(|(_, re)| shortest_match(re.as_str()))
            .min()
            .unwrap_or(usize::MAX);
        Ok(Self {
            patterns,
            shortest_match,
            pointers: cfg
                .pointers
                .iter()
                .map(|p| (p.tool.clone(), p.pointer.clone()))
                .collect(),
            strip_from_egress: cfg.strip_from_egress,
        })
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

    /// Redacts secrets inside free text (log lines, tool results).
    pub fn redact_text(&self, text: &str) -> String {
        self.redacted(text).unwrap_or_else(|| text.to_owned())
    }

    /// `text` with its secrets replaced, or `None` when it holds none: the patterns run in
    /// order, each over what the previous ones left, and a text none of them matches is not
    /// copied. (One `RegexSet` scan of all patterns was measured instead: it cost 1 MiB more
    /// anonymous memory at start for the built-ins, against a 32 MiB budget.)
    fn redacted(&self, text: &str) -> Option<String> {
        if text.len() < self.shortest_match {
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

/// The fewest bytes a match of `pattern` (already compiled by `regex`, so it parses) spans:
/// `regex-syntax`'s `minimum_len` of its HIR, parsed with the defaults `Regex::new` uses; 0
/// when it cannot tell (so nothing is skipped), `usize::MAX` when nothing can match.
fn shortest_match(pattern: &str) -> usize {
    match regex_syntax::parse(pattern) {
        Ok(hir) => hir.properties().minimum_len().unwrap_or(usize::MAX),
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
