//! The `turnguard` command: `serve`, and `mock-provider` for tests and the offline demo.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use turnguard::config::{Config, LogFormat, ServeArgs};

#[derive(Parser)]
#[command(
    name = "turnguard",
    version,
    about = "Sidecar proxy and tool-call firewall for LLM agents"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy: data plane (provider APIs) and admin plane (metrics, health).
    Serve(Box<ServeArgs>),
    /// Policy author tools: check, test, explain, schema.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Read the journal (safe while `serve` runs): runs, and one run's rounds, calls,
    /// effects and events (arguments only in redacted form).
    #[command(subcommand)]
    Journal(JournalCommand),
    /// Held calls waiting for you: list, accept, reject (the admin plane's approval API,
    /// with your own token).
    Approvals(turnguard::approval_ui::cli::ApprovalsArgs),
    /// Run a scripted OpenAI/Anthropic-compatible model (tests, offline demo).
    MockProvider {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:9900")]
        listen: SocketAddr,
        /// Script file (JSON; see README "Mock provider").
        #[arg(long)]
        script: Option<PathBuf>,
    },
    /// Run a scripted MCP server (Streamable HTTP; tests, offline demo): serves the script's
    /// tools and counts executions (`GET /_mock/calls`).
    MockMcp {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:9901")]
        listen: SocketAddr,
        /// Script file (JSON; see README "Put your MCP servers behind turnguard").
        #[arg(long)]
        script: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum JournalCommand {
    /// List runs, then chat turns (requests without `Turnguard-Run`, as `chat:<request id>`),
    /// with their round and call counts, most recent first.
    Runs {
        /// Journal: a SQLite file or a `postgres://` URL.
        #[arg(long, default_value = "./turnguard.db")]
        journal: turnguard::journal::JournalLocation,
        /// Most chat turns listed.
        #[arg(long, default_value_t = 50)]
        chat_limit: usize,
    },
    /// Print one run (or chat turn, `chat:<request id>`) as JSON: rounds with their calls
    /// and decisions, effects, events.
    Show {
        /// Run id (`Turnguard-Run`), or `chat:<request id>` from `journal runs`.
        run: String,
        /// Journal: a SQLite file or a `postgres://` URL.
        #[arg(long, default_value = "./turnguard.db")]
        journal: turnguard::journal::JournalLocation,
    },
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Validate a bundle exactly as `serve` does at start; exit 1 with file:line errors.
    Check {
        /// Bundle directory.
        dir: PathBuf,
        /// Shipped catalogs to include instead of the bundle's `catalogs` (as `serve --catalog`).
        #[arg(long, value_name = "NAMES", value_delimiter = ',')]
        catalog: Option<Vec<String>>,
    },
    /// Run the bundle's test cases (`tests/*.toml`); exit 1 on any failure.
    Test {
        /// Bundle directory.
        dir: PathBuf,
        /// Shipped catalogs to include instead of the bundle's `catalogs` (as `serve --catalog`).
        #[arg(long, value_name = "NAMES", value_delimiter = ',')]
        catalog: Option<Vec<String>>,
    },
    /// Print each admission stage's decision for each tool call of a response.
    Explain {
        /// Request body (JSON).
        #[arg(long)]
        request: PathBuf,
        /// Non-stream response body (JSON).
        #[arg(long)]
        response: PathBuf,
        /// Bundle directory [default: ./policy, else the embedded bundle].
        #[arg(long, default_value = "./policy")]
        policy: PathBuf,
        /// `openai_chat` or `anthropic_messages` [default: from the response shape].
        #[arg(long)]
        api: Option<String>,
        /// Acting person (`sub`) to authorize as.
        #[arg(long)]
        principal: Option<String>,
    },
    /// Propose a catalog from a journal (best: of a shadow-mode run): every tool the agent
    /// declared or the model called that the bundle does not catalogue, with its declared
    /// schema, a guessed safetyTier and how often its results were followed by writes.
    Learn {
        /// Journal: a SQLite file or a `postgres://` URL.
        #[arg(long, default_value = "./turnguard.db")]
        journal: turnguard::journal::JournalLocation,
        /// The bundle the catalog is for (tools it already catalogues are left out)
        /// [default: ./policy, else the embedded bundle].
        #[arg(long, default_value = "./policy")]
        policy: PathBuf,
        /// Shipped catalogs to include instead of the bundle's `catalogs` (as `serve --catalog`).
        #[arg(long, value_name = "NAMES", value_delimiter = ',')]
        catalog: Option<Vec<String>>,
        /// Write the catalog here (a `tools/*.toml` file) instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Print (or write into DIR) the JSON Schemas of the bundle file formats.
    Schema {
        /// Write `turnguard.schema.json`, `tools.schema.json`, `tests.schema.json` here.
        #[arg(long)]
        write: Option<PathBuf>,
    },
}

/// Installs the log subscriber: `format` lines on stderr through the buffered
/// [`turnguard::logs::LogSink`] (a line waits at most `flush_after`; zero writes each at
/// once). The guard writes what is left when dropped, and a panic writes it first.
fn init_logs(format: LogFormat, flush_after: std::time::Duration) -> turnguard::logs::LogGuard {
    let filter =
        EnvFilter::try_from_env("TURNGUARD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let (sink, guard) = turnguard::logs::LogSink::new(Box::new(std::io::stderr()), flush_after);
    let on_panic = sink.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        on_panic.flush_now();
        previous(info);
    }));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(sink);
    match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .event_format(turnguard::logs::JsonLines::default())
            .init(),
        LogFormat::Text => builder.init(),
    }
    guard
}

// The global allocator: jemalloc (the default `jemalloc` feature: ~10 % fewer instructions
// per request than the system allocator), mimalloc with `--features mimalloc`, the system's
// with `--no-default-features` (bench/README.md, "Allocator", has the measurements).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The command line. `serve`'s flags declare their `TURNGUARD_*` variables (clap `env`,
/// listed in `--help` without their values, which may hold credentials), but the variables
/// are read by `Config::resolve`, so that an error names the variable it came from: the
/// command line is parsed alone, and only help is rendered from the declaring command.
fn parse_cli() -> Cli {
    let declared =
        Cli::command().mut_subcommand("serve", |s| s.mut_args(|a| a.hide_env_values(true)));
    let line_only = declared
        .clone()
        .mut_subcommand("serve", |s| s.mut_args(|a| a.env(None::<&str>)));
    let parsed = line_only
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m));
    match parsed {
        Ok(cli) => cli,
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => {
            match declared.try_get_matches() {
                Err(help) => help.exit(),
                Ok(_) => e.exit(),
            }
        }
        Err(e) => e.exit(),
    }
}

/// Parses the command line, reads `serve`'s configuration (its `worker_threads` sizes the
/// runtime, so it is read first), then runs the command on a tokio runtime: current-thread
/// for one worker, multi-thread for more.
fn main() -> anyhow::Result<()> {
    let cli = parse_cli();
    let config = match &cli.command {
        Command::Serve(args) => Some(Config::resolve(args, &|k| std::env::var(k).ok())?),
        _ => None,
    };
    let workers = config
        .as_ref()
        .map_or_else(turnguard::config::default_worker_threads, |c| {
            c.worker_threads
        });
    // One worker: a current-thread runtime, the main thread polling every task. A
    // multi-thread runtime of one worker does the same work with its stealing and remote
    // wake-up machinery on top (bench/RESULTS.md, "Issue 13 run 8": 12 % less CPU a request
    // at c=64 on one CPU).
    let mut builder = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(workers);
        b
    };
    builder
        .thread_name("turnguard-worker")
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(run(cli, config))
}

async fn run(cli: Cli, config: Option<Config>) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(_) => {
            let config = config.context("serve's configuration was not read")?;
            let _logs = init_logs(
                config.log_format,
                std::time::Duration::from_millis(config.log_flush_ms),
            );
            let running = turnguard::server::start(config)
                .await
                .context("turnguard could not start")?;
            shutdown_signal().await;
            tracing::info!("shutting down");
            let report = running.shutdown().await;
            if !report.journal_flushed {
                anyhow::bail!("the journal was not flushed before exit");
            }
            Ok(())
        }
        Command::Policy(cmd) => {
            use turnguard::policy_cli as p;
            let report = match cmd {
                PolicyCommand::Check { dir, catalog } => p::check(&dir, catalog.as_deref()),
                PolicyCommand::Test { dir, catalog } => p::test(&dir, catalog.as_deref()),
                PolicyCommand::Explain {
                    request,
                    response,
                    policy,
                    api,
                    principal,
                } => p::explain(
                    &policy,
                    api.as_deref(),
                    &request,
                    &response,
                    principal.as_deref(),
                ),
                PolicyCommand::Learn {
                    journal,
                    policy,
                    catalog,
                    out,
                } => p::learn(&journal, &policy, catalog.as_deref(), out.as_deref()).await,
                PolicyCommand::Schema { write } => p::schema(write.as_deref()),
            };
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(report.text.as_bytes());
            let _ = out.flush();
            std::process::exit(report.code);
        }
        Command::Journal(cmd) => journal_command(cmd).await,
        Command::Approvals(args) => {
            use std::io::Write;
            let report = turnguard::approval_ui::cli::run(&args, &|k| std::env::var(k).ok()).await;
            let _ = std::io::stdout().lock().write_all(report.stdout.as_bytes());
            let _ = std::io::stderr().lock().write_all(report.stderr.as_bytes());
            std::process::exit(report.code);
        }
        Command::MockProvider { listen, script } => {
            let _logs = init_logs(LogFormat::Text, std::time::Duration::ZERO);
            let script = match script {
                Some(p) => turnguard::mock_provider::Script::load(&p)?,
                None => turnguard::mock_provider::Script::default(),
            };
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?;
            let handle = turnguard::mock_provider::spawn(listener, script)?;
            tracing::info!(addr = %handle.addr, "mock provider listening");
            shutdown_signal().await;
            handle.abort();
            Ok(())
        }
        Command::MockMcp { listen, script } => {
            let _logs = init_logs(LogFormat::Text, std::time::Duration::ZERO);
            let script = match script {
                Some(p) => turnguard::mock_mcp::McpScript::load(&p)?,
                None => turnguard::mock_mcp::McpScript::default(),
            };
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?;
            let handle = turnguard::mock_mcp::spawn(listener, script)?;
            tracing::info!(addr = %handle.addr, "mock MCP server listening");
            shutdown_signal().await;
            handle.abort();
            Ok(())
        }
    }
}

/// `turnguard journal runs|show`: the journal's runs (then chat turns) as a table, or one
/// run's rounds, effects and events as JSON, on stdout.
async fn journal_command(cmd: JournalCommand) -> anyhow::Result<()> {
    use std::io::Write;
    let text = match cmd {
        JournalCommand::Runs {
            journal,
            chat_limit,
        } => {
            let r = turnguard::journal::JournalReader::open_at(&journal).await?;
            let mut t = String::from("run\trounds\tcalls\tfirst\tlast\tclient_request_id\n");
            let chats = r.chat_turns(chat_limit).await?;
            for run in r.runs().await?.into_iter().chain(chats) {
                let at = |ms: i64| {
                    humantime::format_rfc3339_seconds(
                        std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64),
                    )
                    .to_string()
                };
                t.push_str(&format!(
                    "{}\t{}\t{}\t{}\t{}\t{}\n",
                    run.run_id,
                    run.rounds,
                    run.calls,
                    at(run.first_ms),
                    at(run.last_ms),
                    run.client_request_id.as_deref().unwrap_or("-")
                ));
            }
            t
        }
        JournalCommand::Show { run, journal } => {
            let r = turnguard::journal::JournalReader::open_at(&journal).await?;
            let effects: Vec<serde_json::Value> = r
                .effects(&run)
                .await?
                .into_iter()
                .map(|e| serde_json::json!({"effectId": e.effect_id, "toolId": e.tool_id, "nodeId": e.node_id, "attempt": e.attempt, "keying": e.keying, "state": e.state, "atMs": e.at_ms}))
                .collect();
            let events: Vec<serde_json::Value> = r
                .events(&run)
                .await?
                .into_iter()
                .map(|e| serde_json::json!({"sequence": e.sequence, "type": e.kind, "payload": serde_json::from_str::<serde_json::Value>(&e.payload).unwrap_or_default(), "atMs": e.at_ms}))
                .collect();
            let doc = serde_json::json!({"runId": run, "rounds": r.show(&run).await?, "effects": effects, "events": events});
            serde_json::to_string_pretty(&doc)? + "\n"
        }
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
