//! Configuration: embedded defaults, then an optional TOML file (`--config FILE`), then
//! `TURNGUARD_<NAME>` environment variables, then command-line flags (flags win).
//!
//! One definition per setting, in two halves that share its name: the [`ServeArgs`] field is
//! its surface (flag `--NAME`, variable `TURNGUARD_NAME` through clap's `env`, file key
//! `NAME`, the doc `--help` shows, the value's syntax); the [`Config`] field is its type,
//! default ([`Config::default`]) and validation (`deserialize_with`, one check for every
//! source). [`Config::resolve`] stacks the layers with `figment` and deserializes `Config`
//! once, so an error names the key and the layer its value came from.
//!
//! Nothing here reads the process environment: [`Config::resolve`] takes the environment as
//! a lookup function, so tests pass their own.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Args, FromArgMatches};
use figment::value::{Dict, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Deserializer};

/// Why the configuration could not be built. Each variant names the source and the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {file}: {reason}")]
    Read { file: PathBuf, reason: String },
    /// The config file is not TOML.
    #[error("{file}: {reason}")]
    Syntax { file: PathBuf, reason: String },
    /// A key of the config file is not valid (unknown key, wrong type, bad value …).
    #[error("{file}: at `{path}`: {reason}")]
    File {
        file: PathBuf,
        path: String,
        reason: String,
    },
    /// A flag's or environment variable's value is not valid; `source_name` is the flag
    /// (`--max-body-bytes`) or the variable (`TURNGUARD_MAX_BODY_BYTES`).
    #[error("{source_name}: {reason}")]
    Value { source_name: String, reason: String },
}

/// The upstreams every configuration starts with; the file, env and flags override by name.
const DEFAULT_UPSTREAMS: [(&str, &str); 2] = [
    ("openai", "https://api.openai.com"),
    ("anthropic", "https://api.anthropic.com"),
];

/// `turnguard serve` flags: the settings. Every flag is also a key of the TOML file (its
/// field name, for example `admin_listen`) and the environment variable clap's `env` names
/// (`TURNGUARD_<NAME>`, upper case); `--help` lists both. A list flag takes its values
/// repeated or comma-separated (the variable: comma-separated).
///
/// Each field is `None` (or empty) when not set, so lower layers show through; the value's
/// type, default and validation are the [`Config`] field of the same name.
#[derive(Debug, Clone, Default, Args, serde::Serialize)]
pub struct ServeArgs {
    /// TOML config file; keys are the flag names with `_` (for example `admin_listen`).
    #[arg(long, value_name = "FILE", env = "TURNGUARD_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Data-plane address [default: 127.0.0.1:8787].
    #[arg(long, value_name = "ADDR", env = "TURNGUARD_LISTEN")]
    pub listen: Option<String>,
    /// Admin-plane address (metrics, health) [default: 127.0.0.1:8788].
    #[arg(long, value_name = "ADDR", env = "TURNGUARD_ADMIN_LISTEN")]
    pub admin_listen: Option<String>,
    /// Policy bundle directory [default: ./policy].
    #[arg(long, value_name = "DIR", env = "TURNGUARD_POLICY")]
    pub policy: Option<PathBuf>,
    /// Journal: a SQLite file, or a `postgres://` URL for a journal shared by replicas
    /// [default: ./turnguard.db].
    #[arg(long, value_name = "PATH|URL", env = "TURNGUARD_JOURNAL")]
    pub journal: Option<PathBuf>,
    /// Shipped tool catalogs to include, comma-separated (`claude-code`, `codex`,
    /// `openai-agents`, or `none`); replaces the bundle's `catalogs` list [default: the
    /// bundle's list; the default bundle includes all three].
    #[arg(
        long,
        value_name = "NAMES",
        value_delimiter = ',',
        env = "TURNGUARD_CATALOG",
        value_parser = parse::name
    )]
    pub catalog: Option<Vec<String>>,
    /// Upstream `NAME=URL`, repeatable or comma-separated; each overrides the upstream of its
    /// name [defaults: openai=https://api.openai.com, anthropic=https://api.anthropic.com].
    /// In the file, a table `[upstream]` of `NAME = "URL"`.
    #[arg(
        long = "upstream",
        value_name = "NAME=URL",
        env = "TURNGUARD_UPSTREAM",
        value_delimiter = ','
    )]
    #[serde(skip)]
    pub upstream: Vec<String>,
    /// Largest request body accepted, bytes [default: 8 MiB].
    #[arg(long, value_name = "BYTES", env = "TURNGUARD_MAX_BODY_BYTES", value_parser = parse::bytes)]
    pub max_body_bytes: Option<usize>,
    /// Largest non-stream upstream response turnguard parses, bytes [default: 32 MiB].
    #[arg(long, value_name = "BYTES", env = "TURNGUARD_MAX_RESPONSE_BYTES", value_parser = parse::bytes)]
    pub max_response_bytes: Option<usize>,
    /// Largest single SSE event, bytes [default: 4 MiB].
    #[arg(long, value_name = "BYTES", env = "TURNGUARD_MAX_EVENT_BYTES", value_parser = parse::bytes)]
    pub max_event_bytes: Option<usize>,
    /// Largest record body kept in the journal, bytes; larger ones keep a digest [default: 1 MiB].
    #[arg(long, value_name = "BYTES", env = "TURNGUARD_JOURNAL_MAX_RECORD_BYTES", value_parser = parse::bytes)]
    pub journal_max_record_bytes: Option<usize>,
    /// Upstream connect timeout, milliseconds [default: 10000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_UPSTREAM_CONNECT_TIMEOUT_MS", value_parser = parse::millis)]
    pub upstream_connect_timeout_ms: Option<u64>,
    /// Time to the upstream's response headers, milliseconds [default: 600000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_UPSTREAM_RESPONSE_TIMEOUT_MS", value_parser = parse::millis)]
    pub upstream_response_timeout_ms: Option<u64>,
    /// Longest silence inside an upstream body, milliseconds [default: 300000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_UPSTREAM_IDLE_TIMEOUT_MS", value_parser = parse::millis)]
    pub upstream_idle_timeout_ms: Option<u64>,
    /// Log format: `text` or `json` [default: text].
    #[arg(long, value_name = "FORMAT", env = "TURNGUARD_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Longest a log line waits in turnguard's buffer before it is written to stderr,
    /// milliseconds (0 = every line at once); warnings and errors are written at once
    /// [default: 100].
    #[arg(long, value_name = "MS", env = "TURNGUARD_LOG_FLUSH_MS", value_parser = parse::millis)]
    pub log_flush_ms: Option<u64>,
    /// Which response bodies the journal keeps: `runs` (rounds of a run node, which
    /// recovery and replay serve; chat turns keep decisions and digests only) or `all`
    /// [default: runs].
    #[arg(long, value_name = "WHICH", env = "TURNGUARD_JOURNAL_BODIES")]
    pub journal_bodies: Option<String>,
    /// Data-plane requests (streams included) served at once; more are shed with 503 and
    /// `Retry-After` [default: 512].
    #[arg(long, value_name = "N", env = "TURNGUARD_MAX_CONCURRENT_REQUESTS", value_parser = parse::count)]
    pub max_concurrent_requests: Option<usize>,
    /// `Retry-After` sent with a shed request, seconds [default: 1].
    #[arg(long, value_name = "SECONDS", env = "TURNGUARD_SHED_RETRY_AFTER_S", value_parser = parse::seconds)]
    pub shed_retry_after_s: Option<u64>,
    /// On SIGTERM, time between readiness going false and the listeners closing,
    /// milliseconds (0 = close at once) [default: 0].
    #[arg(long, value_name = "MS", env = "TURNGUARD_SHUTDOWN_DELAY_MS", value_parser = parse::millis)]
    pub shutdown_delay_ms: Option<u64>,
    /// On SIGTERM, how long in-flight requests and streams may take to finish before they
    /// are cut, milliseconds [default: 30000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_SHUTDOWN_GRACE_MS", value_parser = parse::millis)]
    pub shutdown_grace_ms: Option<u64>,
    /// Tenant id in effect identities (RFC 0150) [default: default].
    #[arg(long, value_name = "ID", env = "TURNGUARD_TENANT")]
    pub tenant: Option<String>,
    /// Days run records and effects are kept before pruning; at least 14 [default: 30].
    #[arg(long, value_name = "DAYS", env = "TURNGUARD_JOURNAL_RETENTION_DAYS", value_parser = parse::days)]
    pub journal_retention_days: Option<u64>,
    /// Expected `iss` of principal tokens (`Turnguard-Principal-Token`, approver tokens).
    #[arg(long, value_name = "URL", env = "TURNGUARD_IDENTITY_ISSUER")]
    pub identity_issuer: Option<String>,
    /// Expected `aud` of principal tokens.
    #[arg(long, value_name = "AUDIENCE", env = "TURNGUARD_IDENTITY_AUDIENCE")]
    pub identity_audience: Option<String>,
    /// Expected `aud` of approver tokens on the admin plane [default: identity_audience].
    /// A distinct audience keeps the agent's principal token from ever approving.
    #[arg(
        long,
        value_name = "AUDIENCE",
        env = "TURNGUARD_IDENTITY_APPROVAL_AUDIENCE"
    )]
    pub identity_approval_audience: Option<String>,
    /// JWKS file with the identity provider's public keys (RS256, ES256, EdDSA).
    #[arg(long, value_name = "FILE", env = "TURNGUARD_IDENTITY_JWKS")]
    pub identity_jwks: Option<PathBuf>,
    /// PEM public key file of the identity provider (RSA → RS256, P-256 → ES256, Ed25519 → EdDSA).
    #[arg(long, value_name = "FILE", env = "TURNGUARD_IDENTITY_PUBLIC_KEY")]
    pub identity_public_key: Option<PathBuf>,
    /// File holding an HS256 shared secret (development only; logged as such at start).
    #[arg(
        long,
        value_name = "FILE",
        env = "TURNGUARD_IDENTITY_HS256_SECRET_FILE"
    )]
    pub identity_hs256_secret_file: Option<PathBuf>,
    /// Development only: trust a plain `Turnguard-Principal` header as the verified person on
    /// both planes [default: false]. Logged loudly at start.
    #[arg(long, value_name = "BOOL", env = "TURNGUARD_IDENTITY_DEV_PRINCIPAL_HEADER", value_parser = parse::boolean)]
    pub identity_dev_principal_header: Option<bool>,
    /// How long a held call waits for the acting person's approval, milliseconds; then it is
    /// refused (a timeout never approves) [default: 300000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_APPROVAL_TIMEOUT_MS", value_parser = parse::millis)]
    pub approval_timeout_ms: Option<u64>,
    /// Interval of SSE comment keep-alives while a streamed call waits, milliseconds
    /// [default: 15000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_APPROVAL_KEEPALIVE_MS", value_parser = parse::millis)]
    pub approval_keepalive_ms: Option<u64>,
    /// Time a data-plane or admin client has to send a request's headers (and the longest an
    /// idle keep-alive connection is kept), milliseconds; then the connection is closed
    /// [default: 30000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_HEADER_READ_TIMEOUT_MS", value_parser = parse::millis)]
    pub header_read_timeout_ms: Option<u64>,
    /// Time a client has to send a whole request body, milliseconds; then 408 [default: 30000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_BODY_READ_TIMEOUT_MS", value_parser = parse::millis)]
    pub body_read_timeout_ms: Option<u64>,
    /// Time a data-plane client may leave turnguard's next write to it waiting (it stopped
    /// reading a response or a stream), milliseconds; then the connection is closed and the
    /// request's concurrency permit given back, as nginx's `send_timeout` does [default: 60000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_SEND_TIMEOUT_MS", value_parser = parse::millis)]
    pub send_timeout_ms: Option<u64>,
    /// Threads of the async runtime (tokio workers) serving both planes. A sidecar shares
    /// its pod: the default is one per CPU the process may run on (its affinity and cgroup
    /// quota, as `std::thread::available_parallelism` reads them), at most 4. One worker
    /// is a current-thread runtime (the main thread polls every task)
    /// [default: min(CPUs, 4)].
    #[arg(long, value_name = "N", env = "TURNGUARD_WORKER_THREADS", value_parser = parse::count)]
    pub worker_threads: Option<usize>,
    /// Data-plane connections open at once; more are closed at accept. Keep it below the
    /// process's file-descriptor limit (`ulimit -n`) [default: 1024].
    #[arg(long, value_name = "N", env = "TURNGUARD_MAX_CONNECTIONS", value_parser = parse::count)]
    pub max_connections: Option<usize>,
    /// Largest JSON Schema turnguard compiles (a declared tool schema, a `response_format`
    /// schema), bytes of its JSON; a request declaring a larger one is 413 [default: 256 KiB].
    #[arg(long, value_name = "BYTES", env = "TURNGUARD_MAX_SCHEMA_BYTES", value_parser = parse::bytes)]
    pub max_schema_bytes: Option<usize>,
    /// Memory budget of the compiled-schema cache, bytes, estimated as 32 × each schema's
    /// JSON size; least recently used schemas are evicted past it [default: 32 MiB].
    #[arg(long, value_name = "BYTES", env = "TURNGUARD_MAX_SCHEMA_CACHE_BYTES", value_parser = parse::bytes)]
    pub max_schema_cache_bytes: Option<usize>,
    /// How long a journal write waits for a lock another process holds, milliseconds; then
    /// the write fails [default: 1000].
    #[arg(long, value_name = "MS", env = "TURNGUARD_JOURNAL_BUSY_TIMEOUT_MS", value_parser = parse::millis)]
    pub journal_busy_timeout_ms: Option<u64>,
    /// File holding the admin token: `Authorization: Bearer <token>` then reads run data
    /// (`/runs/{runId}/events`, `/runs/{runId}/effects`) on the admin plane (at least 16
    /// characters; surrounding whitespace is trimmed).
    #[arg(long, value_name = "FILE", env = "TURNGUARD_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// An MCP server (Streamable HTTP) to put behind `/mcp/NAME`, as `NAME=URL`, repeatable
    /// or comma-separated (the MCP front, [`crate::mcp`]). In the file, a table `[mcp.NAME]`
    /// with `url` and `ticket`, or `mcp.NAME = "URL"`.
    #[arg(
        long = "mcp",
        value_name = "NAME=URL",
        env = "TURNGUARD_MCP",
        value_delimiter = ','
    )]
    #[serde(skip)]
    pub mcp: Vec<String>,
    /// Whether a `tools/call` inside a run must match an admitted model emission of that run,
    /// per MCP server, as `NAME=required|optional`, repeatable or comma-separated [default:
    /// required]. In the file, `ticket` in `[mcp.NAME]`.
    #[arg(
        long = "mcp-ticket",
        value_name = "NAME=required|optional",
        env = "TURNGUARD_MCP_TICKET",
        value_delimiter = ','
    )]
    #[serde(skip)]
    pub mcp_ticket: Vec<String>,
    /// Serve the approval page `/ui/approvals` on the admin plane (OpenID Connect sign-in
    /// against `identity_issuer`; needs `approval_ui_client_id` and
    /// `approval_ui_redirect_uri`) [default: false]. `--approval-ui` alone means true.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", env = "TURNGUARD_APPROVAL_UI", value_parser = parse::boolean)]
    pub approval_ui: Option<bool>,
    /// OAuth client id of the approval page at the identity provider (the ID token's `aud`).
    #[arg(long, value_name = "ID", env = "TURNGUARD_APPROVAL_UI_CLIENT_ID")]
    pub approval_ui_client_id: Option<String>,
    /// File holding the approval page's OAuth client secret (confidential client,
    /// `client_secret_basic`); without it the page is a public client (PKCE only).
    #[arg(
        long,
        value_name = "FILE",
        env = "TURNGUARD_APPROVAL_UI_CLIENT_SECRET_FILE"
    )]
    pub approval_ui_client_secret_file: Option<PathBuf>,
    /// The approval page's redirect URI as registered at the identity provider, ending in
    /// `/ui/callback` (https, or http on a loopback host).
    #[arg(long, value_name = "URL", env = "TURNGUARD_APPROVAL_UI_REDIRECT_URI")]
    pub approval_ui_redirect_uri: Option<String>,
    /// URL that receives a signed POST for every approval interrupt raised and resolved.
    #[arg(long, value_name = "URL", env = "TURNGUARD_APPROVAL_WEBHOOK")]
    pub approval_webhook: Option<String>,
    /// File holding the webhook's HMAC-SHA256 key (at least 32 bytes); required with
    /// `approval_webhook`.
    #[arg(
        long,
        value_name = "FILE",
        env = "TURNGUARD_APPROVAL_WEBHOOK_SECRET_FILE"
    )]
    pub approval_webhook_secret_file: Option<PathBuf>,
}

/// The value syntax of the flags and variables (clap value parsers): each says which unit
/// it wanted. Ranges are checked once, on the resolved value ([`check`]).
mod parse {
    fn number<T: std::str::FromStr>(v: &str, what: &str) -> Result<T, String> {
        v.trim().parse().map_err(|_| format!("`{v}` is not {what}"))
    }
    pub fn bytes(v: &str) -> Result<usize, String> {
        number(v, "a byte count")
    }
    pub fn count(v: &str) -> Result<usize, String> {
        number(v, "a count")
    }
    pub fn millis(v: &str) -> Result<u64, String> {
        number(v, "a number of milliseconds")
    }
    pub fn seconds(v: &str) -> Result<u64, String> {
        number(v, "a number of seconds")
    }
    pub fn days(v: &str) -> Result<u64, String> {
        number(v, "a number of days")
    }
    /// A name of a list (`--catalog a, b`): surrounding whitespace is not part of it.
    pub fn name(v: &str) -> Result<String, String> {
        Ok(v.trim().to_owned())
    }
    /// `true` or `1`, `false` or `0`.
    pub fn boolean(v: &str) -> Result<bool, String> {
        match v.trim() {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            _ => Err(format!("`{v}` is not `true` or `false`")),
        }
    }
}

/// The checks of [`Config`]'s fields, run on the value whatever layer it came from.
mod check {
    use std::net::SocketAddr;
    use std::path::PathBuf;

    use serde::de::Error;
    use serde::{Deserialize, Deserializer};

    /// A count, size or duration that must not be 0.
    pub fn positive<'de, D, T>(d: D) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de> + Default + PartialEq,
    {
        let v = T::deserialize(d)?;
        if v == T::default() {
            return Err(D::Error::custom("must be greater than 0"));
        }
        Ok(v)
    }

    /// `host:port` with a literal IP.
    pub fn address<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
        let v = String::deserialize(d)?;
        v.parse()
            .map_err(|_| D::Error::custom(format!("`{v}` is not an address like 127.0.0.1:8787")))
    }

    /// A SQLite path or a `postgres://` URL ([`crate::journal::JournalLocation`]).
    pub fn journal<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<crate::journal::JournalLocation, D::Error> {
        Ok(PathBuf::deserialize(d)?.into())
    }

    /// Tenant id of effect identities (RFC 0150): 1-64 unreserved URI characters.
    pub fn tenant<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        let v = String::deserialize(d)?;
        let ok = !v.is_empty()
            && v.len() <= 64
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '~' | '-'));
        if !ok {
            return Err(D::Error::custom(format!(
                "`{v}` is not a tenant id (1-64 of A-Z a-z 0-9 . _ ~ -)"
            )));
        }
        Ok(v)
    }

    /// Run records are kept at least 14 days (OpenWOP idempotency.md).
    pub fn retention_days<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let v = u64::deserialize(d)?;
        if v < 14 {
            return Err(D::Error::custom(
                "records are kept at least 14 days (OpenWOP idempotency.md)",
            ));
        }
        Ok(v)
    }
}

impl<'de> Deserialize<'de> for Upstream {
    /// From `http(s)://host[:port][/prefix]` ([`Upstream::parse`]; errors never show
    /// credentials).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let url = String::deserialize(d)?;
        Upstream::parse(&url).map_err(serde::de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for McpServer {
    /// From `{ url, ticket? }` (the file's `mcp.NAME = "URL"` is read as `{ url }`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Entry {
            url: Option<Upstream>,
            #[serde(default)]
            ticket: Ticket,
        }
        let e = Entry::deserialize(d)?;
        let url = e.url.ok_or_else(|| {
            serde::de::Error::custom(
                "no MCP server of this name is configured (its ticket is set, its URL is not)",
            )
        })?;
        Ok(Self {
            url,
            ticket: e.ticket,
        })
    }
}

/// Names of the figment layers ([`Metadata::name`]), which errors are attributed by.
const DEFAULTS: &str = "defaults";
const FILE: &str = "file";
const ENV: &str = "env";
const FLAGS: &str = "flags";

/// One layer of settings for figment: a dictionary of keys (the [`ServeArgs`] field names)
/// and the layer's name.
struct Layer {
    name: &'static str,
    file: Option<PathBuf>,
    dict: Dict,
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        match &self.file {
            Some(path) => Metadata::named(self.name).source(path.as_path()),
            None => Metadata::named(self.name),
        }
    }

    fn data(&self) -> Result<figment::value::Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}

/// The settings as clap declares them: each one's flag and variable, by key.
struct Settings {
    /// `ServeArgs` as a clap command that reads no environment (values are looked up by
    /// [`Settings::env_layer`] through the caller's lookup).
    command: clap::Command,
    /// key → (`--flag`, `TURNGUARD_VAR`).
    names: BTreeMap<String, (String, String)>,
}

impl Settings {
    fn new() -> Self {
        let declared = ServeArgs::augment_args(clap::Command::new("serve"));
        let names = declared
            .get_arguments()
            .filter_map(|a| {
                let long = a.get_long()?;
                let var = a.get_env()?.to_string_lossy().into_owned();
                Some((a.get_id().to_string(), (format!("--{long}"), var)))
            })
            .collect();
        // `Arg::env` captured the process's value when the command was built: drop it.
        let command = declared
            .mut_args(|a| a.env(None::<&str>))
            .no_binary_name(true);
        Self { command, names }
    }

    /// The flag of `key` (`--max-body-bytes`).
    fn flag(&self, key: &str) -> String {
        self.names
            .get(key)
            .map_or_else(|| format!("--{key}"), |(f, _)| f.clone())
    }

    /// The environment variable of `key` (`TURNGUARD_MAX_BODY_BYTES`).
    fn var(&self, key: &str) -> String {
        self.names.get(key).map_or_else(
            || format!("TURNGUARD_{}", key.to_uppercase()),
            |(_, v)| v.clone(),
        )
    }

    /// The environment's settings, read through `env` and parsed by the same clap parsers as
    /// the flags (the `--config` variable is read by [`Config::resolve`] itself).
    fn env_layer(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<ServeArgs, ConfigError> {
        let mut argv = Vec::new();
        for (key, (flag, var)) in &self.names {
            let Some(v) = env(var).filter(|_| key != "config") else {
                continue;
            };
            let arg = format!("{flag}={v}");
            self.command
                .clone()
                .try_get_matches_from([arg.as_str()])
                .map_err(|e| value_err(var, clap_reason(&e)))?;
            argv.push(arg);
        }
        let matches = self
            .command
            .clone()
            .try_get_matches_from(argv)
            .map_err(|e| value_err("TURNGUARD_*", clap_reason(&e)))?;
        ServeArgs::from_arg_matches(&matches).map_err(|e| value_err("TURNGUARD_*", clap_reason(&e)))
    }

    /// `e` as a [`ConfigError`] naming the layer, the key and what was wrong.
    fn error(&self, e: figment::Error, file: Option<&Path>) -> ConfigError {
        let path = e.path.join(".");
        let reason = reason_of(&e.kind);
        let layer = e.metadata.as_ref().map(|m| m.name.as_ref());
        if let (Some(FILE), Some(file)) = (layer, file) {
            return ConfigError::File {
                file: file.to_owned(),
                path,
                reason,
            };
        }
        // `upstream.NAME`, `mcp.NAME`, `mcp.NAME.ticket`: the setting, then the name.
        let key = match e.path.as_slice() {
            [mcp, _, ticket] if mcp == "mcp" && ticket == "ticket" => "mcp_ticket",
            [first, ..] => first.as_str(),
            [] => "",
        };
        let reason = match e.path.get(1) {
            Some(name) => format!("`{name}`: {reason}"),
            None => reason,
        };
        let source_name = match layer {
            Some(ENV) => self.var(key),
            Some(FLAGS) => self.flag(key),
            _ => format!("{} `{path}`", layer.unwrap_or(DEFAULTS)),
        };
        value_err(&source_name, reason)
    }
}

/// A figment error's reason, without the offending value when it is text: a URL there can
/// carry credentials (`user:password@host`), and the error goes to stderr and logs.
fn reason_of(kind: &figment::error::Kind) -> String {
    use figment::error::{Actual, Kind};
    let shown = |a: &Actual| match a {
        Actual::Str(_) | Actual::Char(_) | Actual::Bytes(_) | Actual::Other(_) => {
            "a string".to_owned()
        }
        a => a.to_string(),
    };
    match kind {
        Kind::InvalidType(a, expected) => {
            format!("invalid type: found {}, expected {expected}", shown(a))
        }
        Kind::InvalidValue(a, expected) => {
            format!("invalid value: found {}, expected {expected}", shown(a))
        }
        k => k.to_string(),
    }
}

/// What clap said was wrong with a value, without its usage text.
fn clap_reason(e: &clap::Error) -> String {
    if let Some(inner) = std::error::Error::source(e) {
        return inner.to_string();
    }
    let text = e.to_string();
    let first = text.lines().next().unwrap_or_default();
    first.trim_start_matches("error: ").to_owned()
}

impl ServeArgs {
    /// This layer as figment keys: the settings it sets, with `upstream`, `mcp` and
    /// `mcp_ticket` pairs turned into the file's tables (`upstream.NAME = URL`,
    /// `mcp.NAME.url`, `mcp.NAME.ticket`). `name` names a setting in errors.
    fn layer(&self, name: &dyn Fn(&str) -> String) -> Result<Dict, ConfigError> {
        let mut dict = match Value::serialize(self) {
            Ok(Value::Dict(_, d)) => d,
            Ok(_) => Dict::new(),
            Err(e) => return Err(value_err(&name(""), e.to_string())),
        };
        dict.retain(|_, v| match v {
            Value::Empty(..) => false,
            Value::Array(_, a) => !a.is_empty(),
            _ => true,
        });
        let pairs = |list: &[String], key: &str, what: &str| {
            let mut out = Vec::new();
            for pair in list.iter().map(|p| p.trim()).filter(|p| !p.is_empty()) {
                let (n, v) = pair.split_once('=').ok_or_else(|| {
                    value_err(&name(key), format!("`{}` is not {what}", redact_url(pair)))
                })?;
                out.push((n.trim().to_owned(), Value::from(v.trim())));
            }
            Ok::<_, ConfigError>(out)
        };
        let upstream: Dict = pairs(&self.upstream, "upstream", "NAME=URL")?
            .into_iter()
            .collect();
        if !upstream.is_empty() {
            dict.insert("upstream".into(), upstream.into());
        }
        let mut mcp: BTreeMap<String, Dict> = BTreeMap::new();
        for (key, field, list, what) in [
            ("mcp", "url", &self.mcp, "NAME=URL"),
            (
                "mcp_ticket",
                "ticket",
                &self.mcp_ticket,
                "NAME=required|optional",
            ),
        ] {
            for (server, v) in pairs(list, key, what)? {
                mcp_name(&server).map_err(|r| value_err(&name(key), r))?;
                mcp.entry(server).or_default().insert(field.into(), v);
            }
        }
        if !mcp.is_empty() {
            let mcp: Dict = mcp.into_iter().map(|(k, d)| (k, d.into())).collect();
            dict.insert("mcp".into(), mcp.into());
        }
        Ok(dict)
    }
}

impl Config {
    /// Builds the configuration: defaults < file < env < flags, key by key (the upstream
    /// and MCP tables name by name).
    ///
    /// `env` looks up a variable by its full name (`TURNGUARD_LISTEN`); the file is
    /// `flags.config`, else `TURNGUARD_CONFIG`.
    /// Errors: [`ConfigError`] naming the file and key, or the variable or flag, and what
    /// was wrong.
    pub fn resolve(
        flags: &ServeArgs,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let settings = Settings::new();
        let file = flags
            .config
            .clone()
            .or_else(|| env("TURNGUARD_CONFIG").map(PathBuf::from));
        let upstream: Dict = DEFAULT_UPSTREAMS
            .iter()
            .map(|(n, u)| ((*n).to_owned(), Value::from(*u)))
            .collect();
        let defaults: Dict = [("upstream".to_owned(), upstream.into())].into();
        let mut figment = Figment::from(Layer {
            name: DEFAULTS,
            file: None,
            dict: defaults,
        });
        if let Some(path) = &file {
            figment = figment.merge(Layer {
                name: FILE,
                file: Some(path.clone()),
                dict: read_file(path, &settings)?,
            });
        }
        let from_env = settings.env_layer(env)?;
        figment = figment
            .merge(Layer {
                name: ENV,
                file: None,
                dict: from_env.layer(&|k| settings.var(k))?,
            })
            .merge(Layer {
                name: FLAGS,
                file: None,
                dict: flags.layer(&|k| settings.flag(k))?,
            });
        let mut c: Config = figment
            .extract()
            .map_err(|e| settings.error(e, file.as_deref()))?;
        c.policy_explicit = figment.contains("policy");
        Ok(c)
    }
}

/// Whether an MCP `tools/call` inside a run needs a ticket: an admitted, released, not yet
/// executed model emission of that run with the same tool and `argsHash` (DESIGN.md §10).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Ticket {
    /// Inside a run, a call without a ticket is refused (`no_admitted_emission`). The default.
    #[default]
    Required,
    /// Inside a run, a call without a ticket is admitted on its own (the run's trust applies).
    Optional,
}

impl Ticket {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Required => "required",
            Self::Optional => "optional",
        }
    }
}

/// An MCP server turnguard fronts at `/mcp/NAME` (Streamable HTTP), fixed at start like every
/// upstream (no client-chosen hosts).
#[derive(Debug, Clone, serde::Serialize)]
pub struct McpServer {
    /// Where the server's MCP endpoint is: scheme, authority and the endpoint path.
    pub url: Upstream,
    /// Whether calls inside a run need a ticket.
    pub ticket: Ticket,
}

/// Which upstream response bodies the journal keeps (`journal_bodies`). Tool-turn contract
/// §D scopes chat turns (no `Turnguard-Run`) out of replay and recovery, so by default their
/// rounds keep the decisions, calls and the body's digest and size, not the body, and their
/// calls keep `argsHash`, not the arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JournalBodies {
    /// Bodies of run rounds only (what recovery and replay serve).
    Runs,
    /// Every round's body and its calls' arguments, chat turns too (redacted as always).
    All,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// A configured upstream: scheme, authority and optional path prefix; fixed at start (no
/// client-chosen hosts, so no SSRF).
///
/// Credentials embedded in the URL (`user:pass@host`) are never shown: `Debug`, `Display`
/// and `Serialize` (what `/config`, logs and errors use) replace the userinfo with `***`.
#[derive(Clone)]
pub struct Upstream {
    /// `http` or `https`.
    pub scheme: String,
    /// `host[:port]`.
    pub authority: String,
    /// Path prefix without a trailing `/` (empty for none).
    pub prefix: String,
}

impl Upstream {
    /// `authority` with any userinfo replaced by `***` (`***@host:port`).
    pub fn redacted_authority(&self) -> String {
        match self.authority.rsplit_once('@') {
            Some((_, host)) => format!("***@{host}"),
            None => self.authority.clone(),
        }
    }

    /// Parses `http(s)://host[:port][/prefix]`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let shown = redact_url(url);
        let url_shown = &shown;
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("`{url_shown}` is not a URL: {e}"))?;
        let scheme = uri.scheme_str().unwrap_or_default().to_owned();
        if scheme != "http" && scheme != "https" {
            return Err(format!("`{url_shown}`: the scheme must be http or https"));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("`{url_shown}` has no host"))?
            .to_string();
        if uri.query().is_some() {
            return Err(format!("`{url_shown}`: an upstream URL takes no query"));
        }
        Ok(Self {
            scheme,
            authority,
            prefix: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// The full URI for `path_and_query` (which starts with `/`).
    pub fn uri(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        http::Uri::builder()
            .scheme(self.scheme.as_str())
            .authority(self.authority.as_str())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}://{}{}",
            self.scheme,
            self.redacted_authority(),
            self.prefix
        )
    }
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("scheme", &self.scheme)
            .field("authority", &self.redacted_authority())
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl serde::Serialize for Upstream {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Upstream", 3)?;
        st.serialize_field("scheme", &self.scheme)?;
        st.serialize_field("authority", &self.redacted_authority())?;
        st.serialize_field("prefix", &self.prefix)?;
        st.end()
    }
}

/// The resolved configuration of `turnguard serve`: each field is the setting of the same
/// name in [`ServeArgs`] (which documents it), typed, defaulted ([`Config::default`]) and
/// validated here (`deserialize_with`), once for every source.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    #[serde(deserialize_with = "check::address")]
    pub listen: SocketAddr,
    #[serde(deserialize_with = "check::address")]
    pub admin_listen: SocketAddr,
    pub policy: PathBuf,
    /// `policy` was set by a flag, env var or the file: a missing directory is then an error,
    /// not the embedded default bundle.
    #[serde(skip)]
    pub policy_explicit: bool,
    /// Shipped catalogs to include instead of the bundle's `catalogs` list
    /// ([`crate::policy::catalogs`]); `None`: the bundle's list.
    pub catalog: Option<Vec<String>>,
    /// Where the journal lives ([`crate::journal::JournalLocation`]).
    #[serde(deserialize_with = "check::journal")]
    pub journal: crate::journal::JournalLocation,
    #[serde(rename(deserialize = "upstream"))]
    pub upstreams: BTreeMap<String, Upstream>,
    #[serde(deserialize_with = "check::positive")]
    pub max_body_bytes: usize,
    #[serde(deserialize_with = "check::positive")]
    pub max_response_bytes: usize,
    #[serde(deserialize_with = "check::positive")]
    pub max_event_bytes: usize,
    #[serde(deserialize_with = "check::positive")]
    pub journal_max_record_bytes: usize,
    #[serde(deserialize_with = "check::positive")]
    pub upstream_connect_timeout_ms: u64,
    #[serde(deserialize_with = "check::positive")]
    pub upstream_response_timeout_ms: u64,
    #[serde(deserialize_with = "check::positive")]
    pub upstream_idle_timeout_ms: u64,
    pub log_format: LogFormat,
    /// Longest a log line waits in the buffer, milliseconds ([`crate::logs`]).
    pub log_flush_ms: u64,
    /// Which response bodies the journal keeps ([`JournalBodies`]).
    pub journal_bodies: JournalBodies,
    /// Concurrency limit of the data plane; requests over it are shed (503, `Retry-After`).
    #[serde(deserialize_with = "check::positive")]
    pub max_concurrent_requests: usize,
    /// `Retry-After` of a shed request, seconds.
    #[serde(deserialize_with = "check::positive")]
    pub shed_retry_after_s: u64,
    /// Readiness-false-to-close delay on SIGTERM, milliseconds.
    pub shutdown_delay_ms: u64,
    /// Deadline for in-flight requests and streams on SIGTERM, milliseconds.
    #[serde(deserialize_with = "check::positive")]
    pub shutdown_grace_ms: u64,
    #[serde(deserialize_with = "check::tenant")]
    pub tenant: String,
    #[serde(deserialize_with = "check::retention_days")]
    pub journal_retention_days: u64,
    /// Expected `iss` of principal and approver tokens ([`crate::identity`]).
    pub identity_issuer: Option<String>,
    /// Expected `aud` of principal tokens (and of approver tokens unless
    /// `identity_approval_audience` is set).
    pub identity_audience: Option<String>,
    /// Expected `aud` of approver tokens.
    pub identity_approval_audience: Option<String>,
    /// JWKS file of the identity provider.
    pub identity_jwks: Option<PathBuf>,
    /// PEM public key file of the identity provider.
    pub identity_public_key: Option<PathBuf>,
    /// HS256 secret file (development). The path is shown in `/config`, never the secret.
    pub identity_hs256_secret_file: Option<PathBuf>,
    /// Development only: trust a plain `Turnguard-Principal` header.
    pub identity_dev_principal_header: bool,
    /// Approval wait bound (`timeoutMs` of the approval interrupt), milliseconds.
    #[serde(deserialize_with = "check::positive")]
    pub approval_timeout_ms: u64,
    /// SSE comment keep-alive interval while a streamed call waits, milliseconds.
    #[serde(deserialize_with = "check::positive")]
    pub approval_keepalive_ms: u64,
    /// Deadline for a client's request headers (and idle keep-alive), milliseconds.
    #[serde(deserialize_with = "check::positive")]
    pub header_read_timeout_ms: u64,
    /// Deadline for a client's whole request body, milliseconds (408 past it).
    #[serde(deserialize_with = "check::positive")]
    pub body_read_timeout_ms: u64,
    /// Deadline for a data-plane client to take turnguard's next write, milliseconds (the
    /// connection is closed past it).
    #[serde(deserialize_with = "check::positive")]
    pub send_timeout_ms: u64,
    /// tokio worker threads ([`default_worker_threads`] unless set).
    #[serde(deserialize_with = "check::positive")]
    pub worker_threads: usize,
    /// Data-plane connections open at once; more are closed at accept.
    #[serde(deserialize_with = "check::positive")]
    pub max_connections: usize,
    /// Largest schema compiled, bytes of its JSON (413 for a request declaring a larger one).
    #[serde(deserialize_with = "check::positive")]
    pub max_schema_bytes: usize,
    /// Estimated memory budget of the compiled-schema cache, bytes.
    #[serde(deserialize_with = "check::positive")]
    pub max_schema_cache_bytes: usize,
    /// Journal writer's wait for a lock held elsewhere, milliseconds.
    #[serde(deserialize_with = "check::positive")]
    pub journal_busy_timeout_ms: u64,
    /// Admin token file (the path is shown in `/config`, never the token).
    pub admin_token_file: Option<PathBuf>,
    /// MCP servers behind `/mcp/NAME`, by name ([`crate::mcp`]).
    pub mcp: BTreeMap<String, McpServer>,
    /// Serve the approval page (`/ui/approvals`, [`crate::approval_ui`]).
    pub approval_ui: bool,
    /// OAuth client id of the approval page.
    pub approval_ui_client_id: Option<String>,
    /// OAuth client secret file of the approval page (the path is shown, never the secret).
    pub approval_ui_client_secret_file: Option<PathBuf>,
    /// Redirect URI of the approval page (`…/ui/callback`).
    pub approval_ui_redirect_uri: Option<String>,
    /// Approval webhook URL (shown with its userinfo replaced by `***`, [`redact_url`]).
    #[serde(serialize_with = "url_redacted")]
    pub approval_webhook: Option<String>,
    /// HMAC key file of the approval webhook (the path is shown, never the key).
    pub approval_webhook_secret_file: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        let mut upstreams = BTreeMap::new();
        for (name, url) in DEFAULT_UPSTREAMS {
            if let Ok(u) = Upstream::parse(url) {
                upstreams.insert(name.to_owned(), u);
            }
        }
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 8788)),
            policy: PathBuf::from("./policy"),
            policy_explicit: false,
            catalog: None,
            journal: crate::journal::JournalLocation::Sqlite(PathBuf::from("./turnguard.db")),
            upstreams,
            max_body_bytes: 8 << 20,
            max_response_bytes: 32 << 20,
            max_event_bytes: 4 << 20,
            journal_max_record_bytes: 1 << 20,
            upstream_connect_timeout_ms: 10_000,
            upstream_response_timeout_ms: 600_000,
            upstream_idle_timeout_ms: 300_000,
            log_format: LogFormat::Text,
            log_flush_ms: 100,
            journal_bodies: JournalBodies::Runs,
            max_concurrent_requests: 512,
            shed_retry_after_s: 1,
            shutdown_delay_ms: 0,
            shutdown_grace_ms: 30_000,
            tenant: "default".to_owned(),
            journal_retention_days: 30,
            identity_issuer: None,
            identity_audience: None,
            identity_approval_audience: None,
            identity_jwks: None,
            identity_public_key: None,
            identity_hs256_secret_file: None,
            identity_dev_principal_header: false,
            approval_timeout_ms: 300_000,
            approval_keepalive_ms: 15_000,
            header_read_timeout_ms: 30_000,
            body_read_timeout_ms: 30_000,
            send_timeout_ms: 60_000,
            worker_threads: default_worker_threads(),
            max_connections: 1024,
            max_schema_bytes: 256 << 10,
            max_schema_cache_bytes: 32 << 20,
            journal_busy_timeout_ms: 1_000,
            admin_token_file: None,
            mcp: BTreeMap::new(),
            approval_ui: false,
            approval_ui_client_id: None,
            approval_ui_client_secret_file: None,
            approval_ui_redirect_uri: None,
            approval_webhook: None,
            approval_webhook_secret_file: None,
        }
    }
}

/// Most tokio workers turnguard starts by default: a sidecar's proxy work is short and its
/// journal writer is its own thread, so more workers add context switches, not throughput.
pub const MAX_DEFAULT_WORKER_THREADS: usize = 4;

/// The default `worker_threads`: the CPUs this process may run on
/// (`std::thread::available_parallelism`: its CPU affinity and cgroup quota), at most
/// [`MAX_DEFAULT_WORKER_THREADS`]; 1 when that cannot be read.
pub fn default_worker_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(MAX_DEFAULT_WORKER_THREADS)
}

/// Serializes an optional URL as [`redact_url`] shows it (`/config`).
fn url_redacted<S: serde::Serializer>(url: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match url {
        Some(u) => s.serialize_some(&redact_url(u)),
        None => s.serialize_none(),
    }
}

/// `url` with the userinfo of its authority (`user:pass@`) replaced by `***@`, for messages.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (Some(s), r),
        None => (None, url),
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = match authority.rsplit_once('@') {
        Some((_, host)) => format!("***@{host}"),
        None => authority.to_owned(),
    };
    match scheme {
        Some(s) => format!("{s}://{authority}{tail}"),
        None => format!("{authority}{tail}"),
    }
}

/// Checks `NAME` of an MCP server: 1-64 of `A-Z a-z 0-9 . _ -` (it is a path segment of
/// `/mcp/NAME`).
fn mcp_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{name}` is not an MCP server name (1-64 of A-Z a-z 0-9 . _ -)"
        ))
    }
}

fn value_err(src: &str, reason: String) -> ConfigError {
    ConfigError::Value {
        source_name: src.to_owned(),
        reason,
    }
}

/// The TOML file as figment keys: only the settings' keys (flag names with `_`, not
/// `config`, and MCP tickets inside `[mcp.NAME]`), `mcp.NAME = "URL"` read as `{ url }`.
fn read_file(path: &Path, settings: &Settings) -> Result<Dict, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        file: path.to_owned(),
        reason: e.to_string(),
    })?;
    let mut dict: Dict = toml::from_str(&text).map_err(|e| ConfigError::Syntax {
        file: path.to_owned(),
        reason: e.to_string(),
    })?;
    let at = |key: String, reason: String| ConfigError::File {
        file: path.to_owned(),
        path: key,
        reason,
    };
    for key in dict.keys() {
        if !settings.names.contains_key(key) || key == "config" || key == "mcp_ticket" {
            return Err(at(
                key.clone(),
                "unknown key (the keys are `turnguard serve` flag names with `_`, for example `admin_listen`)".into(),
            ));
        }
    }
    if let Some(Value::Dict(_, servers)) = dict.get_mut("mcp") {
        for (name, entry) in servers.iter_mut() {
            mcp_name(name).map_err(|r| at(format!("mcp.{name}"), r))?;
            if let Value::String(_, url) = entry {
                let table: Dict = [("url".to_owned(), Value::from(url.as_str()))].into();
                *entry = table.into();
            }
        }
    }
    Ok(dict)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn defaults_start_with_nothing() {
        let c = Config::resolve(&ServeArgs::default(), &env_of(&[])).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:8787");
        assert_eq!(c.admin_listen.to_string(), "127.0.0.1:8788");
        assert_eq!(c.upstreams["openai"].authority, "api.openai.com");
        assert_eq!(c.upstreams["anthropic"].scheme, "https");
        assert_eq!(c.max_concurrent_requests, 512);
        assert_eq!(c.shutdown_grace_ms, 30_000);
    }

    #[test]
    fn protection_and_shutdown_keys_layer_like_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(
            &file,
            "max_concurrent_requests = 7\nshed_retry_after_s = 3\nshutdown_grace_ms = 900\nshutdown_delay_ms = 5\n",
        )
        .unwrap();
        let flags = ServeArgs {
            config: Some(file),
            shutdown_grace_ms: Some(1200),
            ..Default::default()
        };
        let c = Config::resolve(
            &flags,
            &env_of(&[
                ("TURNGUARD_SHED_RETRY_AFTER_S", "4"),
                ("TURNGUARD_SHUTDOWN_DELAY_MS", "0"),
            ]),
        )
        .unwrap();
        assert_eq!(c.max_concurrent_requests, 7);
        assert_eq!(c.shed_retry_after_s, 4);
        assert_eq!(c.shutdown_delay_ms, 0);
        assert_eq!(c.shutdown_grace_ms, 1200);
        let zero = ServeArgs {
            max_concurrent_requests: Some(0),
            ..Default::default()
        };
        let err = Config::resolve(&zero, &env_of(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--max-concurrent-requests"), "{err}");
    }

    #[test]
    fn flags_beat_env_beat_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:1001\"\nadmin_listen = \"127.0.0.1:1002\"\nmax_body_bytes = 10\n[upstream]\nopenai = \"http://127.0.0.1:9/v1x\"\n",
        )
        .unwrap();
        let flags = ServeArgs {
            config: Some(file),
            listen: Some("127.0.0.1:3001".into()),
            ..Default::default()
        };
        let c = Config::resolve(
            &flags,
            &env_of(&[
                ("TURNGUARD_LISTEN", "127.0.0.1:2001"),
                ("TURNGUARD_ADMIN_LISTEN", "127.0.0.1:2002"),
            ]),
        )
        .unwrap();
        assert_eq!(c.listen.port(), 3001);
        assert_eq!(c.admin_listen.port(), 2002);
        assert_eq!(c.max_body_bytes, 10);
        assert_eq!(c.upstreams["openai"].prefix, "/v1x");
        assert_eq!(
            c.upstreams["openai"].uri("/v1/models").unwrap().to_string(),
            "http://127.0.0.1:9/v1x/v1/models"
        );
    }

    #[test]
    fn unknown_file_key_names_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(&file, "listne = \"127.0.0.1:1\"\n").unwrap();
        let flags = ServeArgs {
            config: Some(file),
            ..Default::default()
        };
        let err = Config::resolve(&flags, &env_of(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("t.toml") && err.contains("listne"), "{err}");
    }

    /// The defaults the READMEs state (README.md's flags table, deploy/README.md's settings)
    /// are the ones in code.
    /// `shed_retry_after_s` is seconds: its env value is read and reported as seconds, not
    /// milliseconds.
    #[test]
    fn shed_retry_after_is_validated_as_seconds() {
        let env = |k: &str| (k == "TURNGUARD_SHED_RETRY_AFTER_S").then(|| "soon".to_owned());
        let e = Config::resolve(&ServeArgs::default(), &env)
            .unwrap_err()
            .to_string();
        assert!(e.contains("TURNGUARD_SHED_RETRY_AFTER_S"), "{e}");
        assert!(e.contains("is not a number of seconds"), "{e}");
        let env = |k: &str| (k == "TURNGUARD_SHED_RETRY_AFTER_S").then(|| "7".to_owned());
        let c = Config::resolve(&ServeArgs::default(), &env).unwrap();
        assert_eq!(c.shed_retry_after_s, 7);
    }

    #[test]
    fn the_default_worker_count_follows_the_cpus_at_most_four() {
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert_eq!(default_worker_threads(), cpus.min(4));
        assert_eq!(Config::default().worker_threads, cpus.min(4));
        let env = |k: &str| (k == "TURNGUARD_WORKER_THREADS").then(|| "0".to_owned());
        let e = Config::resolve(&ServeArgs::default(), &env)
            .unwrap_err()
            .to_string();
        assert!(e.contains("TURNGUARD_WORKER_THREADS"), "{e}");
    }

    #[test]
    fn readme_defaults_are_the_code_defaults() {
        let d = Config::default();
        let n = |v: usize| v as u64;
        let expected: BTreeMap<&str, u64> = [
            ("--max-body-bytes", n(d.max_body_bytes)),
            ("--max-response-bytes", n(d.max_response_bytes)),
            ("--max-event-bytes", n(d.max_event_bytes)),
            ("--max-schema-bytes", n(d.max_schema_bytes)),
            ("--max-schema-cache-bytes", n(d.max_schema_cache_bytes)),
            ("--journal-max-record-bytes", n(d.journal_max_record_bytes)),
            (
                "--upstream-connect-timeout-ms",
                d.upstream_connect_timeout_ms,
            ),
            (
                "--upstream-response-timeout-ms",
                d.upstream_response_timeout_ms,
            ),
            ("--upstream-idle-timeout-ms", d.upstream_idle_timeout_ms),
            ("--header-read-timeout-ms", d.header_read_timeout_ms),
            ("--body-read-timeout-ms", d.body_read_timeout_ms),
            ("--send-timeout-ms", d.send_timeout_ms),
            ("--max-connections", n(d.max_connections)),
            ("--journal-busy-timeout-ms", d.journal_busy_timeout_ms),
            ("--max-concurrent-requests", n(d.max_concurrent_requests)),
            ("--shed-retry-after-s", d.shed_retry_after_s),
            ("--shutdown-delay-ms", d.shutdown_delay_ms),
            ("--shutdown-grace-ms", d.shutdown_grace_ms),
            ("--approval-timeout-ms", d.approval_timeout_ms),
            ("--approval-keepalive-ms", d.approval_keepalive_ms),
            ("--journal-retention-days", d.journal_retention_days),
            ("--log-flush-ms", d.log_flush_ms),
        ]
        .into_iter()
        .collect();
        // "8 MiB", "256 KiB", "30 s" (of a `-ms` flag), "30000", "`512`".
        let parse = |cell: &str, flag: &str| -> Option<u64> {
            let mut it = cell.trim().trim_matches('`').split_whitespace();
            let v: f64 = it.next()?.parse().ok()?;
            let scale = match it.next() {
                Some("MiB") => 1048576.0,
                Some("KiB") => 1024.0,
                Some("s") if flag.ends_with("-ms") => 1000.0,
                _ => 1.0,
            };
            Some((v * scale) as u64)
        };
        let mut checked = 0;
        for (name, text) in [
            ("README.md", include_str!("../README.md")),
            ("deploy/README.md", include_str!("../deploy/README.md")),
        ] {
            for line in text.lines().filter(|l| l.starts_with("| `--")) {
                let cells: Vec<&str> = line.split('|').collect();
                let (Some(flags), Some(defaults)) = (cells.get(1), cells.get(2)) else {
                    continue;
                };
                let flags: Vec<&str> = flags.split(" / ").collect();
                let defaults: Vec<&str> = defaults.split(" / ").collect();
                if flags.len() != defaults.len() {
                    continue;
                }
                for (flag, default) in flags.iter().zip(&defaults) {
                    let flag = flag.trim().trim_matches('`');
                    let flag = flag.split_whitespace().next().unwrap_or(flag);
                    let Some(want) = expected.get(flag) else {
                        continue;
                    };
                    assert_eq!(
                        parse(default, flag),
                        Some(*want),
                        "{name}: the default of {flag} is `{}`, the code's is {want}",
                        default.trim()
                    );
                    checked += 1;
                }
            }
        }
        assert!(
            checked >= 30,
            "only {checked} defaults found in the READMEs"
        );
    }

    #[test]
    fn credentials_in_an_upstream_url_are_never_shown() {
        let u = Upstream::parse("https://user:s3cret@proxy.example:8443/v1").unwrap();
        assert_eq!(u.to_string(), "https://***@proxy.example:8443/v1");
        assert!(!format!("{u:?}").contains("s3cret"));
        assert!(!serde_json::to_string(&u).unwrap().contains("s3cret"));
        let err = Upstream::parse("ftp://user:s3cret@h").unwrap_err();
        assert!(!err.contains("s3cret") && err.contains("***@h"), "{err}");
        assert_eq!(redact_url("http://h:1/p@x"), "http://h:1/p@x");
    }

    #[test]
    fn mcp_servers_layer_like_every_setting() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(
            &file,
            "[mcp.github]\nurl = \"http://127.0.0.1:9/mcp\"\nticket = \"optional\"\n[mcp]\nfiles = \"http://127.0.0.1:8/mcp\"\n",
        )
        .unwrap();
        let flags = ServeArgs {
            config: Some(file.clone()),
            mcp: vec!["files=http://127.0.0.1:7/x".into()],
            ..Default::default()
        };
        let c = Config::resolve(&flags, &env_of(&[])).unwrap();
        assert_eq!(c.mcp["github"].ticket, Ticket::Optional);
        assert_eq!(c.mcp["github"].url.prefix, "/mcp");
        assert_eq!(c.mcp["files"].url.authority, "127.0.0.1:7");
        assert_eq!(c.mcp["files"].ticket, Ticket::Required);
        let c = Config::resolve(
            &ServeArgs::default(),
            &env_of(&[
                (
                    "TURNGUARD_MCP",
                    "a=http://127.0.0.1:1/mcp,b=http://127.0.0.1:2/mcp",
                ),
                ("TURNGUARD_MCP_TICKET", "b=optional"),
            ]),
        )
        .unwrap();
        assert_eq!(c.mcp["a"].ticket, Ticket::Required);
        assert_eq!(c.mcp["b"].ticket, Ticket::Optional);
        for bad in [
            ServeArgs {
                mcp: vec!["bad name=http://x".into()],
                ..Default::default()
            },
            ServeArgs {
                mcp: vec!["a=ftp://x".into()],
                ..Default::default()
            },
            ServeArgs {
                mcp_ticket: vec!["nobody=optional".into()],
                ..Default::default()
            },
            ServeArgs {
                mcp: vec!["a=http://x".into()],
                mcp_ticket: vec!["a=sometimes".into()],
                ..Default::default()
            },
        ] {
            assert!(Config::resolve(&bad, &env_of(&[])).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn approval_ui_keys_layer_like_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(
            &file,
            "approval_ui = true\napproval_ui_client_id = \"from-file\"\napproval_webhook = \"https://hooks.example/a\"\n",
        )
        .unwrap();
        let flags = ServeArgs {
            config: Some(file),
            approval_ui_redirect_uri: Some("http://127.0.0.1:8788/ui/callback".into()),
            ..Default::default()
        };
        let c = Config::resolve(
            &flags,
            &env_of(&[("TURNGUARD_APPROVAL_UI_CLIENT_ID", "from-env")]),
        )
        .unwrap();
        assert!(c.approval_ui);
        assert_eq!(c.approval_ui_client_id.as_deref(), Some("from-env"));
        assert_eq!(
            c.approval_ui_redirect_uri.as_deref(),
            Some("http://127.0.0.1:8788/ui/callback")
        );
        assert_eq!(
            c.approval_webhook.as_deref(),
            Some("https://hooks.example/a")
        );
        let off = Config::resolve(
            &ServeArgs::default(),
            &env_of(&[("TURNGUARD_APPROVAL_UI", "false")]),
        )
        .unwrap();
        assert!(!off.approval_ui, "off unless enabled");
        assert!(Config::resolve(
            &ServeArgs::default(),
            &env_of(&[("TURNGUARD_APPROVAL_UI", "yes")])
        )
        .is_err());
    }

    /// A value's error names the layer it came from: the flag, the variable, or the file and
    /// key; the check is the same for every layer.
    #[test]
    fn a_wrong_typed_value_is_not_echoed_in_the_error() {
        // A URL where a table belongs (`upstream = "…"`) may carry credentials: the error
        // names the key and the types, never the value.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(&file, "upstream = \"https://user:s3cret@api.example\"\n").unwrap();
        let flags = ServeArgs {
            config: Some(file.clone()),
            ..Default::default()
        };
        let e = Config::resolve(&flags, &env_of(&[]))
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
        assert!(e.contains("upstream") && e.contains("a string"), "{e}");
    }

    #[test]
    fn errors_name_the_setting_and_its_layer() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        let with_file = |text: &str| {
            std::fs::write(&file, text).unwrap();
            ServeArgs {
                config: Some(file.clone()),
                ..Default::default()
            }
        };
        let err = |flags: &ServeArgs, env: &[(&str, &str)]| {
            Config::resolve(flags, &env_of(env))
                .unwrap_err()
                .to_string()
        };
        let zero = "must be greater than 0";
        let f = with_file("max_event_bytes = 0\n");
        assert_eq!(
            err(&f, &[]),
            format!("{}: at `max_event_bytes`: {zero}", file.display())
        );
        let flags = ServeArgs {
            max_event_bytes: Some(0),
            ..Default::default()
        };
        assert_eq!(err(&flags, &[]), format!("--max-event-bytes: {zero}"));
        assert_eq!(
            err(&ServeArgs::default(), &[("TURNGUARD_MAX_EVENT_BYTES", "0")]),
            format!("TURNGUARD_MAX_EVENT_BYTES: {zero}")
        );
        // The winning layer's value is the one checked: a good flag hides a bad env value.
        let good = ServeArgs {
            max_event_bytes: Some(5),
            ..Default::default()
        };
        let c = Config::resolve(&good, &env_of(&[("TURNGUARD_MAX_EVENT_BYTES", "0")])).unwrap();
        assert_eq!(c.max_event_bytes, 5);
        // Syntax of a variable: its unit.
        assert_eq!(
            err(
                &ServeArgs::default(),
                &[("TURNGUARD_MAX_EVENT_BYTES", "4MiB")]
            ),
            "TURNGUARD_MAX_EVENT_BYTES: `4MiB` is not a byte count"
        );
        assert_eq!(
            err(&ServeArgs::default(), &[("TURNGUARD_LISTEN", "localhost")]),
            "TURNGUARD_LISTEN: `localhost` is not an address like 127.0.0.1:8787"
        );
        // Types and values in the file.
        let f = with_file("max_event_bytes = \"big\"\n");
        let e = err(&f, &[]);
        assert!(e.contains("at `max_event_bytes`: invalid type"), "{e}");
        let f = with_file("tenant = \"a b\"\n");
        assert!(err(&f, &[]).contains("at `tenant`: `a b` is not a tenant id"));
        let f = with_file("log_format = \"xml\"\n");
        let e = err(&f, &[]);
        assert!(
            e.contains("at `log_format`: unknown variant: found `xml`"),
            "{e}"
        );
        let f =
            with_file("[mcp.files]\nurl = \"http://127.0.0.1:1/mcp\"\ntickets = \"optional\"\n");
        let e = err(&f, &[]);
        assert!(
            e.contains("at `mcp.files.tickets`: unknown field: found `tickets`"),
            "{e}"
        );
        let f = with_file("listen = [\n");
        assert!(err(&f, &[]).starts_with(&format!("{}: ", file.display())));
        // Map entries name the setting and the entry.
        assert_eq!(
            err(
                &ServeArgs::default(),
                &[("TURNGUARD_UPSTREAM", "openai=http://127.0.0.1:1,b=ftp://x")]
            ),
            "TURNGUARD_UPSTREAM: `b`: `ftp://x`: the scheme must be http or https"
        );
        let bad_ticket = ServeArgs {
            mcp: vec!["a=http://127.0.0.1:1/mcp".into()],
            mcp_ticket: vec!["a=sometimes".into()],
            ..Default::default()
        };
        let e = err(&bad_ticket, &[]);
        assert!(
            e.starts_with("--mcp-ticket: `a`: unknown variant: found `sometimes`"),
            "{e}"
        );
        let e = err(
            &ServeArgs::default(),
            &[("TURNGUARD_MCP_TICKET", "nobody=optional")],
        );
        assert!(
            e.contains("`nobody`: no MCP server of this name is configured"),
            "{e}"
        );
    }

    /// Tables (upstreams, MCP servers) layer name by name: a layer overrides the names it
    /// sets and keeps the others; an MCP ticket set in one layer applies to a server of
    /// another.
    #[test]
    fn tables_layer_name_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(
            &file,
            "[upstream]\nopenai = \"http://127.0.0.1:1/file\"\nlocal = \"http://127.0.0.1:1/local\"\n[mcp]\nfiles = \"http://127.0.0.1:1/mcp\"\n",
        )
        .unwrap();
        let flags = ServeArgs {
            config: Some(file),
            upstream: vec!["openai=http://127.0.0.1:1/flag".into()],
            mcp_ticket: vec!["files=optional".into()],
            ..Default::default()
        };
        let c = Config::resolve(
            &flags,
            &env_of(&[(
                "TURNGUARD_UPSTREAM",
                "openai=http://127.0.0.1:1/env, other=http://127.0.0.1:1/other,",
            )]),
        )
        .unwrap();
        let prefix = |n: &str| c.upstreams[n].prefix.clone();
        assert_eq!(prefix("openai"), "/flag");
        assert_eq!(prefix("other"), "/other");
        assert_eq!(prefix("local"), "/local");
        assert_eq!(c.upstreams["anthropic"].authority, "api.anthropic.com");
        assert_eq!(c.upstreams.len(), 4);
        assert_eq!(c.mcp["files"].ticket, Ticket::Optional);
        assert_eq!(c.mcp["files"].url.prefix, "/mcp");
        // A list variable is comma-separated; whitespace around a name is not part of it.
        let c = Config::resolve(
            &ServeArgs::default(),
            &env_of(&[("TURNGUARD_CATALOG", "claude-code, codex")]),
        )
        .unwrap();
        assert_eq!(c.catalog, Some(vec!["claude-code".into(), "codex".into()]));
    }

    /// `policy_explicit` is set by any layer that names the policy, never by the default.
    #[test]
    fn policy_is_explicit_when_any_layer_sets_it() {
        let none = Config::resolve(&ServeArgs::default(), &env_of(&[])).unwrap();
        assert!(!none.policy_explicit);
        assert_eq!(none.policy, PathBuf::from("./policy"));
        let env = Config::resolve(
            &ServeArgs::default(),
            &env_of(&[("TURNGUARD_POLICY", "/etc/tg")]),
        )
        .unwrap();
        assert!(env.policy_explicit);
        assert_eq!(env.policy, PathBuf::from("/etc/tg"));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(
            &file,
            "policy = \"/srv/tg\"\njournal = \"postgres://u:p@db/tg\"\n",
        )
        .unwrap();
        let c = Config::resolve(
            &ServeArgs::default(),
            &env_of(&[("TURNGUARD_CONFIG", file.to_str().unwrap())]),
        )
        .unwrap();
        assert!(c.policy_explicit);
        assert_eq!(c.policy, PathBuf::from("/srv/tg"));
        assert!(
            matches!(c.journal, crate::journal::JournalLocation::Postgres(_)),
            "{:?}",
            c.journal
        );
    }

    #[test]
    fn bad_upstream_is_refused() {
        let flags = ServeArgs {
            upstream: vec!["openai=ftp://x".into()],
            ..Default::default()
        };
        assert!(Config::resolve(&flags, &env_of(&[])).is_err());
        let c = Config::resolve(
            &ServeArgs::default(),
            &env_of(&[(
                "TURNGUARD_UPSTREAM",
                "openai=http://127.0.0.1:1,local=http://127.0.0.1:2",
            )]),
        )
        .unwrap();
        assert_eq!(c.upstreams["local"].authority, "127.0.0.1:2");
        assert_eq!(c.upstreams["anthropic"].authority, "api.anthropic.com");
    }
}
