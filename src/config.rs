//! Configuration: embedded defaults, then an optional TOML file (`--config FILE`), then
//! `TURNGUARD_<NAME>` environment variables, then command-line flags (flags win).
//!
//! Nothing here reads the process environment: [`Config::resolve`] takes the environment as
//! a lookup function, so tests pass their own.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Args;
use serde::Deserialize;

/// Why the configuration could not be built. Each variant names the source and the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {file}: {reason}")]
    Read { file: PathBuf, reason: String },
    /// The config file is not valid (unknown key, wrong type …).
    #[error("{file}: at `{path}`: {reason}")]
    File {
        file: PathBuf,
        path: String,
        reason: String,
    },
    /// A value (flag, env var or file key) is not valid.
    #[error("{source_name}: {reason}")]
    Value { source_name: String, reason: String },
}

/// `turnguard serve` flags. Every flag is also a key of the TOML file and a
/// `TURNGUARD_<NAME>` environment variable (upper-case, `-` → `_`).
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// TOML config file; keys are the flag names with `_` (for example `admin_listen`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Data-plane address [default: 127.0.0.1:8787].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Admin-plane address (metrics, health) [default: 127.0.0.1:8788].
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// Policy bundle directory [default: ./policy].
    #[arg(long, value_name = "DIR")]
    pub policy: Option<PathBuf>,
    /// Journal: a SQLite file, or a `postgres://` URL for a journal shared by replicas
    /// [default: ./turnguard.db].
    #[arg(long, value_name = "PATH|URL")]
    pub journal: Option<PathBuf>,
    /// Shipped tool catalogs to include, comma-separated (`claude-code`, `codex`,
    /// `openai-agents`, or `none`); replaces the bundle's `catalogs` list [default: the
    /// bundle's list; the default bundle includes all three].
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub catalog: Option<Vec<String>>,
    /// Upstream `NAME=URL`, repeatable [defaults: openai=https://api.openai.com,
    /// anthropic=https://api.anthropic.com]. In the env var, comma-separated.
    #[arg(long = "upstream", value_name = "NAME=URL")]
    pub upstream: Vec<String>,
    /// Largest request body accepted, bytes [default: 8 MiB].
    #[arg(long, value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Largest non-stream upstream response turnguard parses, bytes [default: 32 MiB].
    #[arg(long, value_name = "BYTES")]
    pub max_response_bytes: Option<usize>,
    /// Largest single SSE event, bytes [default: 4 MiB].
    #[arg(long, value_name = "BYTES")]
    pub max_event_bytes: Option<usize>,
    /// Largest record body kept in the journal, bytes; larger ones keep a digest [default: 1 MiB].
    #[arg(long, value_name = "BYTES")]
    pub journal_max_record_bytes: Option<usize>,
    /// Upstream connect timeout, milliseconds [default: 10000].
    #[arg(long, value_name = "MS")]
    pub upstream_connect_timeout_ms: Option<u64>,
    /// Time to the upstream's response headers, milliseconds [default: 600000].
    #[arg(long, value_name = "MS")]
    pub upstream_response_timeout_ms: Option<u64>,
    /// Longest silence inside an upstream body, milliseconds [default: 300000].
    #[arg(long, value_name = "MS")]
    pub upstream_idle_timeout_ms: Option<u64>,
    /// Log format: `text` or `json` [default: text].
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<String>,
    /// Which response bodies the journal keeps: `runs` (rounds of a run node, which
    /// recovery and replay serve; chat turns keep decisions and digests only) or `all`
    /// [default: runs].
    #[arg(long, value_name = "WHICH")]
    pub journal_bodies: Option<String>,
    /// Data-plane requests (streams included) served at once; more are shed with 503 and
    /// `Retry-After` [default: 512].
    #[arg(long, value_name = "N")]
    pub max_concurrent_requests: Option<usize>,
    /// `Retry-After` sent with a shed request, seconds [default: 1].
    #[arg(long, value_name = "SECONDS")]
    pub shed_retry_after_s: Option<u64>,
    /// On SIGTERM, time between readiness going false and the listeners closing,
    /// milliseconds (0 = close at once) [default: 0].
    #[arg(long, value_name = "MS")]
    pub shutdown_delay_ms: Option<u64>,
    /// On SIGTERM, how long in-flight requests and streams may take to finish before they
    /// are cut, milliseconds [default: 30000].
    #[arg(long, value_name = "MS")]
    pub shutdown_grace_ms: Option<u64>,
    /// Tenant id in effect identities (RFC 0150) [default: default].
    #[arg(long, value_name = "ID")]
    pub tenant: Option<String>,
    /// Days run records and effects are kept before pruning; at least 14 [default: 30].
    #[arg(long, value_name = "DAYS")]
    pub journal_retention_days: Option<u64>,
    /// Expected `iss` of principal tokens (`Turnguard-Principal-Token`, approver tokens).
    #[arg(long, value_name = "URL")]
    pub identity_issuer: Option<String>,
    /// Expected `aud` of principal tokens.
    #[arg(long, value_name = "AUDIENCE")]
    pub identity_audience: Option<String>,
    /// Expected `aud` of approver tokens on the admin plane [default: identity_audience].
    /// A distinct audience keeps the agent's principal token from ever approving.
    #[arg(long, value_name = "AUDIENCE")]
    pub identity_approval_audience: Option<String>,
    /// JWKS file with the identity provider's public keys (RS256, ES256, EdDSA).
    #[arg(long, value_name = "FILE")]
    pub identity_jwks: Option<PathBuf>,
    /// PEM public key file of the identity provider (RSA → RS256, P-256 → ES256, Ed25519 → EdDSA).
    #[arg(long, value_name = "FILE")]
    pub identity_public_key: Option<PathBuf>,
    /// File holding an HS256 shared secret (development only; logged as such at start).
    #[arg(long, value_name = "FILE")]
    pub identity_hs256_secret_file: Option<PathBuf>,
    /// Development only: trust a plain `Turnguard-Principal` header as the verified person on
    /// both planes [default: false]. Logged loudly at start.
    #[arg(long, value_name = "BOOL")]
    pub identity_dev_principal_header: Option<bool>,
    /// How long a held call waits for the acting person's approval, milliseconds; then it is
    /// refused (a timeout never approves) [default: 300000].
    #[arg(long, value_name = "MS")]
    pub approval_timeout_ms: Option<u64>,
    /// Interval of SSE comment keep-alives while a streamed call waits, milliseconds
    /// [default: 15000].
    #[arg(long, value_name = "MS")]
    pub approval_keepalive_ms: Option<u64>,
    /// Time a data-plane or admin client has to send a request's headers (and the longest an
    /// idle keep-alive connection is kept), milliseconds; then the connection is closed
    /// [default: 30000].
    #[arg(long, value_name = "MS")]
    pub header_read_timeout_ms: Option<u64>,
    /// Time a client has to send a whole request body, milliseconds; then 408 [default: 30000].
    #[arg(long, value_name = "MS")]
    pub body_read_timeout_ms: Option<u64>,
    /// Data-plane connections open at once; more are closed at accept. Keep it below the
    /// process's file-descriptor limit (`ulimit -n`) [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Largest JSON Schema turnguard compiles (a declared tool schema, a `response_format`
    /// schema), bytes of its JSON; a request declaring a larger one is 413 [default: 256 KiB].
    #[arg(long, value_name = "BYTES")]
    pub max_schema_bytes: Option<usize>,
    /// Memory budget of the compiled-schema cache, bytes, estimated as 32 × each schema's
    /// JSON size; least recently used schemas are evicted past it [default: 32 MiB].
    #[arg(long, value_name = "BYTES")]
    pub max_schema_cache_bytes: Option<usize>,
    /// How long a journal write waits for a lock another process holds, milliseconds; then
    /// the write fails [default: 1000].
    #[arg(long, value_name = "MS")]
    pub journal_busy_timeout_ms: Option<u64>,
    /// File holding the admin token: `Authorization: Bearer <token>` then reads run data
    /// (`/runs/{runId}/events`, `/runs/{runId}/effects`) on the admin plane (at least 16
    /// characters; surrounding whitespace is trimmed).
    #[arg(long, value_name = "FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// An MCP server (Streamable HTTP) to put behind `/mcp/NAME`, as `NAME=URL`, repeatable
    /// (the MCP front, [`crate::mcp`]). In the env var, comma-separated. In the file, a table
    /// `[mcp.NAME]` with `url` and `ticket`, or `mcp.NAME = "URL"`.
    #[arg(long = "mcp", value_name = "NAME=URL")]
    pub mcp: Vec<String>,
    /// Whether a `tools/call` inside a run must match an admitted model emission of that run,
    /// per MCP server, as `NAME=required|optional`, repeatable [default: required]. In the env
    /// var (`TURNGUARD_MCP_TICKET`), comma-separated.
    #[arg(long = "mcp-ticket", value_name = "NAME=required|optional")]
    pub mcp_ticket: Vec<String>,
    /// Serve the approval page `/ui/approvals` on the admin plane (OpenID Connect sign-in
    /// against `identity_issuer`; needs `approval_ui_client_id` and
    /// `approval_ui_redirect_uri`) [default: false]. `--approval-ui` alone means true.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub approval_ui: Option<bool>,
    /// OAuth client id of the approval page at the identity provider (the ID token's `aud`).
    #[arg(long, value_name = "ID")]
    pub approval_ui_client_id: Option<String>,
    /// File holding the approval page's OAuth client secret (confidential client,
    /// `client_secret_basic`); without it the page is a public client (PKCE only).
    #[arg(long, value_name = "FILE")]
    pub approval_ui_client_secret_file: Option<PathBuf>,
    /// The approval page's redirect URI as registered at the identity provider, ending in
    /// `/ui/callback` (https, or http on a loopback host).
    #[arg(long, value_name = "URL")]
    pub approval_ui_redirect_uri: Option<String>,
    /// URL that receives a signed POST for every approval interrupt raised and resolved.
    #[arg(long, value_name = "URL")]
    pub approval_webhook: Option<String>,
    /// File holding the webhook's HMAC-SHA256 key (at least 32 bytes); required with
    /// `approval_webhook`.
    #[arg(long, value_name = "FILE")]
    pub approval_webhook_secret_file: Option<PathBuf>,
}

/// The TOML file: the same keys as the flags, all optional, nothing else.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    admin_listen: Option<String>,
    policy: Option<PathBuf>,
    journal: Option<PathBuf>,
    catalog: Option<Vec<String>>,
    upstream: Option<BTreeMap<String, String>>,
    max_body_bytes: Option<usize>,
    max_response_bytes: Option<usize>,
    max_event_bytes: Option<usize>,
    journal_max_record_bytes: Option<usize>,
    upstream_connect_timeout_ms: Option<u64>,
    upstream_response_timeout_ms: Option<u64>,
    upstream_idle_timeout_ms: Option<u64>,
    log_format: Option<String>,
    journal_bodies: Option<String>,
    max_concurrent_requests: Option<usize>,
    shed_retry_after_s: Option<u64>,
    shutdown_delay_ms: Option<u64>,
    shutdown_grace_ms: Option<u64>,
    tenant: Option<String>,
    journal_retention_days: Option<u64>,
    identity_issuer: Option<String>,
    identity_audience: Option<String>,
    identity_approval_audience: Option<String>,
    identity_jwks: Option<PathBuf>,
    identity_public_key: Option<PathBuf>,
    identity_hs256_secret_file: Option<PathBuf>,
    identity_dev_principal_header: Option<bool>,
    approval_timeout_ms: Option<u64>,
    approval_keepalive_ms: Option<u64>,
    header_read_timeout_ms: Option<u64>,
    body_read_timeout_ms: Option<u64>,
    max_connections: Option<usize>,
    max_schema_bytes: Option<usize>,
    max_schema_cache_bytes: Option<usize>,
    journal_busy_timeout_ms: Option<u64>,
    admin_token_file: Option<PathBuf>,
    mcp: Option<BTreeMap<String, McpFileEntry>>,
    approval_ui: Option<bool>,
    approval_ui_client_id: Option<String>,
    approval_ui_client_secret_file: Option<PathBuf>,
    approval_ui_redirect_uri: Option<String>,
    approval_webhook: Option<String>,
    approval_webhook_secret_file: Option<PathBuf>,
}

/// One `[mcp.NAME]` entry of the file: a URL, or a table with `url` and `ticket`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum McpFileEntry {
    Url(String),
    Table(McpFileTable),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct McpFileTable {
    url: String,
    #[serde(default)]
    ticket: Option<Ticket>,
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

    fn parse(v: &str) -> Option<Self> {
        match v.trim() {
            "required" => Some(Self::Required),
            "optional" => Some(Self::Optional),
            _ => None,
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
/// rounds keep the decisions, calls and the body's digest and size, not the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JournalBodies {
    /// Bodies of run rounds only (what recovery and replay serve).
    Runs,
    /// Every round's body, chat turns too (redacted as always).
    All,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
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

/// The resolved configuration of `turnguard serve`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub policy: PathBuf,
    /// `policy` was set by a flag, env var or the file: a missing directory is then an error,
    /// not the embedded default bundle.
    pub policy_explicit: bool,
    /// Shipped catalogs to include instead of the bundle's `catalogs` list
    /// ([`crate::policy::catalogs`]); `None`: the bundle's list.
    pub catalog: Option<Vec<String>>,
    /// Where the journal lives ([`crate::journal::JournalLocation`]).
    pub journal: crate::journal::JournalLocation,
    pub upstreams: BTreeMap<String, Upstream>,
    pub max_body_bytes: usize,
    pub max_response_bytes: usize,
    pub max_event_bytes: usize,
    pub journal_max_record_bytes: usize,
    pub upstream_connect_timeout_ms: u64,
    pub upstream_response_timeout_ms: u64,
    pub upstream_idle_timeout_ms: u64,
    pub log_format: LogFormat,
    /// Which response bodies the journal keeps ([`JournalBodies`]).
    pub journal_bodies: JournalBodies,
    /// Concurrency limit of the data plane; requests over it are shed (503, `Retry-After`).
    pub max_concurrent_requests: usize,
    /// `Retry-After` of a shed request, seconds.
    pub shed_retry_after_s: u64,
    /// Readiness-false-to-close delay on SIGTERM, milliseconds.
    pub shutdown_delay_ms: u64,
    /// Deadline for in-flight requests and streams on SIGTERM, milliseconds.
    pub shutdown_grace_ms: u64,
    pub tenant: String,
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
    pub approval_timeout_ms: u64,
    /// SSE comment keep-alive interval while a streamed call waits, milliseconds.
    pub approval_keepalive_ms: u64,
    /// Deadline for a client's request headers (and idle keep-alive), milliseconds.
    pub header_read_timeout_ms: u64,
    /// Deadline for a client's whole request body, milliseconds (408 past it).
    pub body_read_timeout_ms: u64,
    /// Data-plane connections open at once; more are closed at accept.
    pub max_connections: usize,
    /// Largest schema compiled, bytes of its JSON (413 for a request declaring a larger one).
    pub max_schema_bytes: usize,
    /// Estimated memory budget of the compiled-schema cache, bytes.
    pub max_schema_cache_bytes: usize,
    /// Journal writer's wait for a lock held elsewhere, milliseconds.
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
    /// Approval webhook URL.
    pub approval_webhook: Option<String>,
    /// HMAC key file of the approval webhook (the path is shown, never the key).
    pub approval_webhook_secret_file: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        let mut upstreams = BTreeMap::new();
        for (name, url) in [
            ("openai", "https://api.openai.com"),
            ("anthropic", "https://api.anthropic.com"),
        ] {
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

impl Config {
    /// Builds the configuration: defaults < file < env < flags.
    ///
    /// `env` looks up a variable by its full name (`TURNGUARD_LISTEN`).
    /// Errors: [`ConfigError`] naming the file and key, or the variable or flag.
    pub fn resolve(
        flags: &ServeArgs,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let config_file = flags
            .config
            .clone()
            .or_else(|| env("TURNGUARD_CONFIG").map(PathBuf::from));
        let file = match &config_file {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let file_name = config_file
            .as_deref()
            .map(Path::display)
            .map(|d| d.to_string())
            .unwrap_or_default();
        let mut c = Config::default();

        // Each key: flag, else env, else file, else default.
        macro_rules! layer {
            ($field:ident, $env:literal, $parse:expr) => {
                if let Some(v) = &flags.$field {
                    c.$field = $parse(
                        v.clone(),
                        &format!("--{}", stringify!($field).replace('_', "-")),
                    )?;
                } else if let Some(v) = env($env) {
                    c.$field = $parse(v, $env)?;
                } else if let Some(v) = &file.$field {
                    c.$field =
                        $parse(v.clone(), &format!("{file_name}: `{}`", stringify!($field)))?;
                }
            };
        }
        let addr = |v: String, src: &str| -> Result<SocketAddr, ConfigError> {
            v.parse()
                .map_err(|_| value_err(src, format!("`{v}` is not an address like 127.0.0.1:8787")))
        };
        let same = |v: PathBuf, _: &str| -> Result<PathBuf, ConfigError> { Ok(v) };
        let path_env =
            |v: String, _: &str| -> Result<PathBuf, ConfigError> { Ok(PathBuf::from(v)) };
        let size = |v: usize, src: &str| -> Result<usize, ConfigError> {
            if v == 0 {
                Err(value_err(src, "must be greater than 0".into()))
            } else {
                Ok(v)
            }
        };
        let size_env = |v: String, src: &str| -> Result<usize, ConfigError> {
            let n: usize = v
                .parse()
                .map_err(|_| value_err(src, format!("`{v}` is not a byte count")))?;
            size(n, src)
        };
        let ms = |v: u64, src: &str| -> Result<u64, ConfigError> {
            if v == 0 {
                Err(value_err(src, "must be greater than 0".into()))
            } else {
                Ok(v)
            }
        };
        let ms_env = |v: String, src: &str| -> Result<u64, ConfigError> {
            let n: u64 = v
                .parse()
                .map_err(|_| value_err(src, format!("`{v}` is not a number of milliseconds")))?;
            ms(n, src)
        };
        let secs_env = |v: String, src: &str| -> Result<u64, ConfigError> {
            let n: u64 = v
                .parse()
                .map_err(|_| value_err(src, format!("`{v}` is not a number of seconds")))?;
            ms(n, src)
        };
        let log = |v: String, src: &str| -> Result<LogFormat, ConfigError> {
            match v.as_str() {
                "text" => Ok(LogFormat::Text),
                "json" => Ok(LogFormat::Json),
                _ => Err(value_err(src, format!("`{v}` is not `text` or `json`"))),
            }
        };

        // Addresses and the log format are strings everywhere.
        layer!(listen, "TURNGUARD_LISTEN", |v: String, s: &str| addr(v, s));
        layer!(
            admin_listen,
            "TURNGUARD_ADMIN_LISTEN",
            |v: String, s: &str| addr(v, s)
        );
        layer!(
            log_format,
            "TURNGUARD_LOG_FORMAT",
            |v: String, s: &str| log(v, s)
        );
        layer!(
            journal_bodies,
            "TURNGUARD_JOURNAL_BODIES",
            |v: String, src: &str| match v.as_str() {
                "runs" => Ok(JournalBodies::Runs),
                "all" => Ok(JournalBodies::All),
                _ => Err(value_err(src, format!("`{v}` is not `runs` or `all`"))),
            }
        );
        let tenant = |v: String, src: &str| -> Result<String, ConfigError> {
            let ok = !v.is_empty()
                && v.len() <= 64
                && v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '~' | '-'));
            if ok {
                Ok(v)
            } else {
                Err(value_err(
                    src,
                    format!("`{v}` is not a tenant id (1-64 of A-Z a-z 0-9 . _ ~ -)"),
                ))
            }
        };
        layer!(tenant, "TURNGUARD_TENANT", |v: String, s: &str| tenant(
            v, s
        ));
        c.policy_explicit =
            flags.policy.is_some() || env("TURNGUARD_POLICY").is_some() || file.policy.is_some();
        // Paths.
        resolve_path(
            &mut c.policy,
            &flags.policy,
            env("TURNGUARD_POLICY"),
            &file.policy,
            same,
            path_env,
        )?;
        let mut journal = PathBuf::from(c.journal.to_string());
        resolve_path(
            &mut journal,
            &flags.journal,
            env("TURNGUARD_JOURNAL"),
            &file.journal,
            same,
            path_env,
        )?;
        if flags.journal.is_some() || env("TURNGUARD_JOURNAL").is_some() || file.journal.is_some() {
            c.journal = crate::journal::JournalLocation::from(journal);
        }
        // Shipped catalogs: a list in the file and flags, comma-separated in the environment.
        c.catalog = flags
            .catalog
            .clone()
            .or_else(|| {
                env("TURNGUARD_CATALOG")
                    .map(|v| v.split(',').map(|n| n.trim().to_owned()).collect())
            })
            .or_else(|| file.catalog.clone());
        // Numbers: typed in the file and flags, strings in the environment.
        macro_rules! number {
            ($field:ident, $env:literal, $typed:expr, $from_env:expr) => {
                if let Some(v) = flags.$field {
                    c.$field = $typed(v, &format!("--{}", stringify!($field).replace('_', "-")))?;
                } else if let Some(v) = env($env) {
                    c.$field = $from_env(v, $env)?;
                } else if let Some(v) = file.$field {
                    c.$field = $typed(v, &format!("{file_name}: `{}`", stringify!($field)))?;
                }
            };
        }
        number!(max_body_bytes, "TURNGUARD_MAX_BODY_BYTES", size, size_env);
        number!(
            max_response_bytes,
            "TURNGUARD_MAX_RESPONSE_BYTES",
            size,
            size_env
        );
        number!(max_event_bytes, "TURNGUARD_MAX_EVENT_BYTES", size, size_env);
        number!(
            journal_max_record_bytes,
            "TURNGUARD_JOURNAL_MAX_RECORD_BYTES",
            size,
            size_env
        );
        number!(
            upstream_connect_timeout_ms,
            "TURNGUARD_UPSTREAM_CONNECT_TIMEOUT_MS",
            ms,
            ms_env
        );
        number!(
            upstream_response_timeout_ms,
            "TURNGUARD_UPSTREAM_RESPONSE_TIMEOUT_MS",
            ms,
            ms_env
        );
        number!(
            upstream_idle_timeout_ms,
            "TURNGUARD_UPSTREAM_IDLE_TIMEOUT_MS",
            ms,
            ms_env
        );
        let days = |v: u64, src: &str| -> Result<u64, ConfigError> {
            if v < 14 {
                Err(value_err(
                    src,
                    "records are kept at least 14 days (OpenWOP idempotency.md)".into(),
                ))
            } else {
                Ok(v)
            }
        };
        let days_env = |v: String, src: &str| -> Result<u64, ConfigError> {
            let n: u64 = v
                .parse()
                .map_err(|_| value_err(src, format!("`{v}` is not a number of days")))?;
            days(n, src)
        };
        number!(
            journal_retention_days,
            "TURNGUARD_JOURNAL_RETENTION_DAYS",
            days,
            days_env
        );

        number!(
            approval_timeout_ms,
            "TURNGUARD_APPROVAL_TIMEOUT_MS",
            ms,
            ms_env
        );
        number!(
            approval_keepalive_ms,
            "TURNGUARD_APPROVAL_KEEPALIVE_MS",
            ms,
            ms_env
        );
        // Identity (optional keys): flag, else env, else file, else unset.
        macro_rules! optional {
            ($field:ident, $env:literal, $from:expr) => {
                if let Some(v) = &flags.$field {
                    c.$field = Some(v.clone());
                } else if let Some(v) = env($env) {
                    c.$field = Some($from(v));
                } else if let Some(v) = &file.$field {
                    c.$field = Some(v.clone());
                }
            };
        }
        optional!(identity_issuer, "TURNGUARD_IDENTITY_ISSUER", |v: String| v);
        optional!(
            identity_audience,
            "TURNGUARD_IDENTITY_AUDIENCE",
            |v: String| v
        );
        optional!(
            identity_approval_audience,
            "TURNGUARD_IDENTITY_APPROVAL_AUDIENCE",
            |v: String| v
        );
        optional!(identity_jwks, "TURNGUARD_IDENTITY_JWKS", PathBuf::from);
        optional!(
            identity_public_key,
            "TURNGUARD_IDENTITY_PUBLIC_KEY",
            PathBuf::from
        );
        optional!(
            identity_hs256_secret_file,
            "TURNGUARD_IDENTITY_HS256_SECRET_FILE",
            PathBuf::from
        );
        let flag = |v: String, src: &str| -> Result<bool, ConfigError> {
            match v.as_str() {
                "true" | "1" => Ok(true),
                "false" | "0" => Ok(false),
                _ => Err(value_err(src, format!("`{v}` is not `true` or `false`"))),
            }
        };
        if let Some(v) = flags.identity_dev_principal_header {
            c.identity_dev_principal_header = v;
        } else if let Some(v) = env("TURNGUARD_IDENTITY_DEV_PRINCIPAL_HEADER") {
            c.identity_dev_principal_header = flag(v, "TURNGUARD_IDENTITY_DEV_PRINCIPAL_HEADER")?;
        } else if let Some(v) = file.identity_dev_principal_header {
            c.identity_dev_principal_header = v;
        }
        // The approval page and notifications (issue 16).
        if let Some(v) = flags.approval_ui {
            c.approval_ui = v;
        } else if let Some(v) = env("TURNGUARD_APPROVAL_UI") {
            c.approval_ui = flag(v, "TURNGUARD_APPROVAL_UI")?;
        } else if let Some(v) = file.approval_ui {
            c.approval_ui = v;
        }
        optional!(
            approval_ui_client_id,
            "TURNGUARD_APPROVAL_UI_CLIENT_ID",
            |v: String| v
        );
        optional!(
            approval_ui_client_secret_file,
            "TURNGUARD_APPROVAL_UI_CLIENT_SECRET_FILE",
            PathBuf::from
        );
        optional!(
            approval_ui_redirect_uri,
            "TURNGUARD_APPROVAL_UI_REDIRECT_URI",
            |v: String| v
        );
        optional!(
            approval_webhook,
            "TURNGUARD_APPROVAL_WEBHOOK",
            |v: String| v
        );
        optional!(
            approval_webhook_secret_file,
            "TURNGUARD_APPROVAL_WEBHOOK_SECRET_FILE",
            PathBuf::from
        );

        // Protection and shutdown (issue 6).
        let any_ms = |v: u64, _: &str| -> Result<u64, ConfigError> { Ok(v) };
        let any_ms_env = |v: String, src: &str| -> Result<u64, ConfigError> {
            v.parse()
                .map_err(|_| value_err(src, format!("`{v}` is not a number of milliseconds")))
        };
        number!(
            max_concurrent_requests,
            "TURNGUARD_MAX_CONCURRENT_REQUESTS",
            size,
            size_env
        );
        number!(
            shed_retry_after_s,
            "TURNGUARD_SHED_RETRY_AFTER_S",
            ms,
            secs_env
        );
        number!(
            shutdown_delay_ms,
            "TURNGUARD_SHUTDOWN_DELAY_MS",
            any_ms,
            any_ms_env
        );
        number!(shutdown_grace_ms, "TURNGUARD_SHUTDOWN_GRACE_MS", ms, ms_env);

        // Hostile clients and memory bounds (issue 11).
        number!(
            header_read_timeout_ms,
            "TURNGUARD_HEADER_READ_TIMEOUT_MS",
            ms,
            ms_env
        );
        number!(
            body_read_timeout_ms,
            "TURNGUARD_BODY_READ_TIMEOUT_MS",
            ms,
            ms_env
        );
        number!(max_connections, "TURNGUARD_MAX_CONNECTIONS", size, size_env);
        number!(
            max_schema_bytes,
            "TURNGUARD_MAX_SCHEMA_BYTES",
            size,
            size_env
        );
        number!(
            max_schema_cache_bytes,
            "TURNGUARD_MAX_SCHEMA_CACHE_BYTES",
            size,
            size_env
        );
        number!(
            journal_busy_timeout_ms,
            "TURNGUARD_JOURNAL_BUSY_TIMEOUT_MS",
            ms,
            ms_env
        );
        optional!(
            admin_token_file,
            "TURNGUARD_ADMIN_TOKEN_FILE",
            PathBuf::from
        );

        // Upstreams: each layer overrides names it sets; defaults stay for the others.
        if let Some(map) = &file.upstream {
            for (name, url) in map {
                let u = Upstream::parse(url)
                    .map_err(|r| value_err(&format!("{file_name}: `upstream.{name}`"), r))?;
                c.upstreams.insert(name.clone(), u);
            }
        }
        let pairs: Vec<(String, &str)> = if !flags.upstream.is_empty() {
            flags
                .upstream
                .iter()
                .map(|p| (p.clone(), "--upstream"))
                .collect()
        } else if let Some(v) = env("TURNGUARD_UPSTREAM") {
            v.split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| (s.trim().to_owned(), "TURNGUARD_UPSTREAM"))
                .collect()
        } else {
            Vec::new()
        };
        for (pair, src) in pairs {
            let (name, url) = pair.split_once('=').ok_or_else(|| {
                value_err(src, format!("`{}` is not NAME=URL", redact_url(&pair)))
            })?;
            let u = Upstream::parse(url).map_err(|r| value_err(src, r))?;
            c.upstreams.insert(name.to_owned(), u);
        }
        resolve_mcp(&mut c, flags, env, &file, &file_name)?;
        Ok(c)
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

/// `NAME` of an MCP server: 1-64 of `A-Z a-z 0-9 . _ -` (it is a path segment of `/mcp/NAME`).
fn mcp_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// MCP servers: the file's table, then `--mcp` / `TURNGUARD_MCP` (names they set override
/// the file's), then the ticket settings (`--mcp-ticket` / `TURNGUARD_MCP_TICKET` override
/// the file's `ticket`).
fn resolve_mcp(
    c: &mut Config,
    flags: &ServeArgs,
    env: &dyn Fn(&str) -> Option<String>,
    file: &FileConfig,
    file_name: &str,
) -> Result<(), ConfigError> {
    let server = |name: &str, url: &str, src: &str| -> Result<McpServer, ConfigError> {
        if !mcp_name_ok(name) {
            return Err(value_err(
                src,
                format!("`{name}` is not an MCP server name (1-64 of A-Z a-z 0-9 . _ -)"),
            ));
        }
        let url = Upstream::parse(url).map_err(|r| value_err(src, r))?;
        Ok(McpServer {
            url,
            ticket: Ticket::default(),
        })
    };
    for (name, entry) in file.mcp.iter().flatten() {
        let src = format!("{file_name}: `mcp.{name}`");
        let (url, ticket) = match entry {
            McpFileEntry::Url(u) => (u.as_str(), None),
            McpFileEntry::Table(t) => (t.url.as_str(), t.ticket),
        };
        let mut s = server(name, url, &src)?;
        s.ticket = ticket.unwrap_or_default();
        c.mcp.insert(name.clone(), s);
    }
    let list = |flag: &[String], var: &'static str| -> Vec<(String, &'static str)> {
        if !flag.is_empty() {
            flag.iter().map(|p| (p.clone(), "flag")).collect()
        } else {
            env(var)
                .map(|v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(|s| (s.to_owned(), var))
                        .collect()
                })
                .unwrap_or_default()
        }
    };
    for (pair, src) in list(&flags.mcp, "TURNGUARD_MCP") {
        let src = if src == "flag" { "--mcp" } else { src };
        let (name, url) = pair
            .split_once('=')
            .ok_or_else(|| value_err(src, format!("`{pair}` is not NAME=URL")))?;
        let ticket = c.mcp.get(name).map(|s| s.ticket).unwrap_or_default();
        let mut s = server(name, url, src)?;
        s.ticket = ticket;
        c.mcp.insert(name.to_owned(), s);
    }
    for (pair, src) in list(&flags.mcp_ticket, "TURNGUARD_MCP_TICKET") {
        let src = if src == "flag" { "--mcp-ticket" } else { src };
        let (name, value) = pair
            .split_once('=')
            .ok_or_else(|| value_err(src, format!("`{pair}` is not NAME=required|optional")))?;
        let ticket = Ticket::parse(value)
            .ok_or_else(|| value_err(src, format!("`{value}` is not `required` or `optional`")))?;
        let s = c
            .mcp
            .get_mut(name)
            .ok_or_else(|| value_err(src, format!("no MCP server named `{name}` is configured")))?;
        s.ticket = ticket;
    }
    Ok(())
}

fn value_err(src: &str, reason: String) -> ConfigError {
    ConfigError::Value {
        source_name: src.to_owned(),
        reason,
    }
}

fn resolve_path(
    target: &mut PathBuf,
    flag: &Option<PathBuf>,
    env: Option<String>,
    file: &Option<PathBuf>,
    same: impl Fn(PathBuf, &str) -> Result<PathBuf, ConfigError>,
    from_env: impl Fn(String, &str) -> Result<PathBuf, ConfigError>,
) -> Result<(), ConfigError> {
    if let Some(v) = flag {
        *target = same(v.clone(), "flag")?;
    } else if let Some(v) = env {
        *target = from_env(v, "env")?;
    } else if let Some(v) = file {
        *target = same(v.clone(), "file")?;
    }
    Ok(())
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        file: path.to_owned(),
        reason: e.to_string(),
    })?;
    let de = toml::Deserializer::new(&text);
    serde_path_to_error::deserialize(de).map_err(|e| ConfigError::File {
        file: path.to_owned(),
        path: e.path().to_string(),
        reason: e.inner().message().to_owned(),
    })
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
            ("--max-connections", n(d.max_connections)),
            ("--journal-busy-timeout-ms", d.journal_busy_timeout_ms),
            ("--max-concurrent-requests", n(d.max_concurrent_requests)),
            ("--shed-retry-after-s", d.shed_retry_after_s),
            ("--shutdown-delay-ms", d.shutdown_delay_ms),
            ("--shutdown-grace-ms", d.shutdown_grace_ms),
            ("--approval-timeout-ms", d.approval_timeout_ms),
            ("--approval-keepalive-ms", d.approval_keepalive_ms),
            ("--journal-retention-days", d.journal_retention_days),
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
