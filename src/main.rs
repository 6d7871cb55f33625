//! The `turnguard` command: `serve`, and `mock-provider` for tests and the offline demo.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
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
    /// Run a scripted OpenAI/Anthropic-compatible model (tests, offline demo).
    MockProvider {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:9900")]
        listen: SocketAddr,
        /// Script file (JSON; see README "Mock provider").
        #[arg(long)]
        script: Option<PathBuf>,
    },
}

fn init_logs(format: LogFormat) {
    let filter =
        EnvFilter::try_from_env("TURNGUARD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.init(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let config = Config::resolve(&args, &|k| std::env::var(k).ok())?;
            init_logs(config.log_format);
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
        Command::MockProvider { listen, script } => {
            init_logs(LogFormat::Text);
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
    }
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
