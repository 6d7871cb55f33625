//! `turnguard approvals list|accept|reject`: a developer's client of the admin plane's
//! approval API, acting with the person's own token (`--token-file FILE`, or the
//! `TURNGUARD_APPROVER_TOKEN` environment variable read by `main`). It sends exactly what a
//! person's app would (`GET /approvals`, `POST /approvals/{interruptId}`); the admin plane
//! decides (a token the agent presented, a delegated token or another person's is refused).

use crate::strict_json::Lookup as _;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use clap::{Args, Subcommand};
use http::{header, Request};
use http_body_util::Full;
use serde_json::{json, Value};

use crate::body::read_capped;

/// `turnguard approvals …`.
#[derive(Debug, Clone, Args)]
pub struct ApprovalsArgs {
    /// The admin plane's base URL [default: $TURNGUARD_ADMIN_URL, else http://127.0.0.1:8788].
    #[arg(long, global = true, value_name = "URL")]
    pub admin: Option<String>,
    /// File holding the person's JWT [default: $TURNGUARD_APPROVER_TOKEN].
    #[arg(long, global = true, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    #[command(subcommand)]
    pub command: ApprovalsCommand,
}

/// What to do.
#[derive(Debug, Clone, Subcommand)]
pub enum ApprovalsCommand {
    /// List the calls waiting for your approval.
    List {
        /// Print the admin plane's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Accept a held call; with `--edit`, accept with edited arguments (`edit-accept`).
    Accept {
        /// The interrupt id (`int_…`, from `list`).
        interrupt_id: String,
        /// Feedback recorded with the resolution.
        #[arg(long)]
        feedback: Option<String>,
        /// `CALL_ID=JSON`: run that call with these arguments instead (its tool must allow
        /// edits: catalog `approval_edit`). Repeatable.
        #[arg(long = "edit", value_name = "CALL_ID=JSON")]
        edits: Vec<String>,
    },
    /// Reject a held call.
    Reject {
        /// The interrupt id (`int_…`, from `list`).
        interrupt_id: String,
        /// Feedback recorded with the resolution.
        #[arg(long)]
        feedback: Option<String>,
    },
}

/// What the command printed and its exit code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

fn fail(msg: String) -> Report {
    Report {
        code: 1,
        stdout: String::new(),
        stderr: msg + "\n",
    }
}

/// Runs the command. `env` looks up `TURNGUARD_ADMIN_URL` and `TURNGUARD_APPROVER_TOKEN`
/// (the caller passes the process environment; tests pass their own).
pub async fn run(args: &ApprovalsArgs, env: &dyn Fn(&str) -> Option<String>) -> Report {
    let base = args
        .admin
        .clone()
        .or_else(|| env("TURNGUARD_ADMIN_URL"))
        .unwrap_or_else(|| "http://127.0.0.1:8788".into());
    let base = base.trim_end_matches('/').to_owned();
    let token = match &args.token_file {
        Some(f) => match std::fs::read_to_string(f) {
            Ok(t) => t.trim().to_owned(),
            Err(e) => return fail(format!("cannot read {}: {e}", f.display())),
        },
        None => match env("TURNGUARD_APPROVER_TOKEN") {
            Some(t) => t.trim().to_owned(),
            None => {
                return fail(
                    "no token: pass --token-file FILE or set TURNGUARD_APPROVER_TOKEN (the person's own JWT, never the agent's)".into(),
                )
            }
        },
    };
    match &args.command {
        ApprovalsCommand::List { json } => {
            let (status, body) = match call(&base, &token, "GET", "/approvals", None).await {
                Ok(x) => x,
                Err(e) => return fail(e),
            };
            if status != 200 {
                return refused(status, &body);
            }
            let text = if *json {
                serde_json::to_string_pretty(&body).unwrap_or_default() + "\n"
            } else {
                table(&body)
            };
            Report {
                code: 0,
                stdout: text,
                stderr: String::new(),
            }
        }
        ApprovalsCommand::Accept {
            interrupt_id,
            feedback,
            edits,
        } => {
            let mut calls = Vec::new();
            for e in edits {
                let Some((call_id, args)) = e.split_once('=') else {
                    return fail(format!("--edit `{e}` is not CALL_ID=JSON"));
                };
                let arguments: Value = match serde_json::from_str(args) {
                    Ok(v) => v,
                    Err(err) => return fail(format!("--edit {call_id}: not JSON: {err}")),
                };
                calls.push(json!({"callId": call_id, "arguments": arguments}));
            }
            let mut resume = if calls.is_empty() {
                json!({"action": "accept"})
            } else {
                json!({"action": "edit-accept", "editedArtifactData": {"calls": calls}})
            };
            if let Some(f) = feedback {
                if let Some(o) = resume.as_object_mut() {
                    o.insert("feedback".into(), json!(f));
                }
            }
            resolve(&base, &token, interrupt_id, resume).await
        }
        ApprovalsCommand::Reject {
            interrupt_id,
            feedback,
        } => {
            let mut resume = json!({"action": "reject"});
            if let Some(f) = feedback {
                if let Some(o) = resume.as_object_mut() {
                    o.insert("feedback".into(), json!(f));
                }
            }
            resolve(&base, &token, interrupt_id, resume).await
        }
    }
}

async fn resolve(base: &str, token: &str, id: &str, resume: Value) -> Report {
    if !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return fail(format!("`{id}` is not an interrupt id (int_…)"));
    }
    let body = json!({"resumeValue": resume});
    match call(
        base,
        token,
        "POST",
        &format!("/approvals/{id}"),
        Some(&body),
    )
    .await
    {
        Ok((200, v)) => Report {
            code: 0,
            stdout: format!(
                "{} {}\n",
                v.get("interruptId").and_then(Value::as_str).unwrap_or(id),
                v.get("state").and_then(Value::as_str).unwrap_or("")
            ),
            stderr: String::new(),
        },
        Ok((status, v)) => refused(status, &v),
        Err(e) => fail(e),
    }
}

fn refused(status: u16, body: &Value) -> Report {
    fail(format!(
        "the admin plane answered {status} {}: {}",
        body.get("error").and_then(Value::as_str).unwrap_or(""),
        body.get("message").and_then(Value::as_str).unwrap_or("")
    ))
}

/// `interruptId  expires  tools  run/node  why`, one line per interrupt.
fn table(body: &Value) -> String {
    let mut out = String::from("interrupt\texpires_in_s\ttools\trun/node\twhy\n");
    let now = crate::clock::now_ms();
    for a in body
        .get("approvals")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let calls: Vec<&Value> = a
            .get("calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .collect();
        let tools: Vec<&str> = calls
            .iter()
            .filter_map(|c| c.get("toolName").and_then(Value::as_str))
            .collect();
        let why: Vec<&str> = calls
            .iter()
            .filter_map(|c| c.at("/heldBecause/reason").and_then(Value::as_str))
            .collect();
        let left = a
            .get("expiresAt")
            .and_then(Value::as_i64)
            .map_or(0, |e| (e - now).max(0) / 1000);
        out.push_str(&format!(
            "{}\t{left}\t{}\t{}/{}\t{}\n",
            a.get("interruptId").and_then(Value::as_str).unwrap_or(""),
            tools.join(","),
            a.get("runId").and_then(Value::as_str).unwrap_or("-"),
            a.get("nodeId").and_then(Value::as_str).unwrap_or("-"),
            why.join(",")
        ));
    }
    out
}

async fn call(
    base: &str,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value), String> {
    let url = format!("{base}{path}");
    let client = crate::client::client(&crate::config::Config::default());
    let req = Request::builder()
        .method(method)
        .uri(&url)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(
            body.map(Value::to_string).unwrap_or_default(),
        )))
        .map_err(|e| format!("`{url}`: {e}"))?;
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .map_err(|_| format!("{url}: no answer within 30 s"))?
        .map_err(|e| format!("{url}: {e}"))?;
    let status = resp.status().as_u16();
    let bytes = read_capped(resp.into_body(), 16 << 20)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok((status, v))
}
