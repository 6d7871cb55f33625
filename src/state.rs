//! The state every request of both planes shares, and the vocabulary it holds: [`AppState`]
//! (configuration, upstream client, journal, metrics, policy, limits, identity), the shutdown
//! [`Lifecycle`], the in-process approval waiters ([`Approvals`]) and the [`AdminToken`].
//!
//! It sits below the request path (issue 13 item 1): the request path (`proxy`, `mcp`),
//! `approvals`, the admin plane and `server` import it; it imports only the layers below
//! (configuration, journal, identity, policy, metrics). `server` builds it and starts the
//! listeners. The layering is in `ARCHITECTURE.md` and pinned by `source_lints`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::admission::{LimitState, SchemaCache};
pub use crate::client::HttpClient;
use crate::config::Config;
use crate::identity::Identity;
use crate::journal::{InterruptState, Journal, JournalReader};
use crate::metrics::Metrics;
use crate::notify::Notifier;
use crate::reload::PolicyHandle;

/// State shared by every request of both planes.
pub struct AppState {
    /// The resolved configuration.
    pub config: Config,
    /// The pooled upstream client.
    pub client: HttpClient,
    /// The journal writer handle.
    pub journal: Journal,
    /// The journal's reads (recovery, replay, admin plane), on either backend.
    pub reader: Arc<JournalReader>,
    /// The metrics registry handle.
    pub metrics: Arc<Metrics>,
    /// Compiled argument schemas, by schema hash.
    pub schemas: Arc<SchemaCache>,
    /// Declared tools as read before, by their exact text
    /// ([`crate::strict_json::request_from_slice`]): 256 KiB of text a generation.
    pub declared_tools: crate::strict_json::ValueCache,
    /// The active policy bundle; each request takes one snapshot.
    pub policy: Arc<PolicyHandle>,
    /// Limits-stage state (token buckets, per-run counters).
    pub limits: LimitState,
    /// Shutdown state: draining (shed new requests) and the stream cut signal.
    pub lifecycle: Lifecycle,
    /// Readiness: true once both planes listen, false again when shutdown starts.
    pub ready: AtomicBool,
    /// Verifies the acting person and approvers (tool-turn contract §C).
    pub identity: Identity,
    /// Requests waiting for approvals in this process.
    pub approvals: Approvals,
    /// The admin token (`admin_token_file`) that may read run data, if configured.
    pub admin_token: Option<AdminToken>,
    /// Notifications of approval interrupts (webhook, SSE): handed every interrupt raised
    /// and resolved, never waits.
    pub notifier: Notifier,
}

/// Shutdown state every request can see: "draining" for the edge, "cut" for the relays.
#[derive(Debug)]
pub struct Lifecycle {
    pub(crate) draining: AtomicBool,
    pub(crate) cut: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            draining: AtomicBool::new(false),
            cut: watch::channel(false).0,
        }
    }
}

impl Lifecycle {
    /// True once shutdown has started: new requests are shed.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// A receiver that turns true when the drain deadline passed and open streams must end.
    pub fn cut_signal(&self) -> watch::Receiver<bool> {
        self.cut.subscribe()
    }
}

/// In-process waiters: the agent requests waiting on each interrupt. The journal decides;
/// this only wakes the waiters early.
#[derive(Default)]
pub struct Approvals {
    waiters: Mutex<HashMap<String, watch::Sender<Option<InterruptState>>>>,
}

/// One waiting request's subscription; removes the entry when the last waiter leaves.
pub(crate) struct Waiter<'a> {
    approvals: &'a Approvals,
    id: String,
    pub(crate) rx: watch::Receiver<Option<InterruptState>>,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if let Ok(mut map) = self.approvals.waiters.lock() {
            if map.get(&self.id).is_some_and(|tx| tx.receiver_count() <= 1) {
                map.remove(&self.id);
            }
        }
    }
}

impl Approvals {
    /// Subscribes to `id`'s final state; `None` when the registry is poisoned.
    pub(crate) fn subscribe(&self, id: &str) -> Option<Waiter<'_>> {
        let mut map = self.waiters.lock().ok()?;
        let rx = map
            .entry(id.to_owned())
            .or_insert_with(|| watch::channel(None).0)
            .subscribe();
        Some(Waiter {
            approvals: self,
            id: id.to_owned(),
            rx,
        })
    }

    /// Wakes the requests waiting on `id` with its final state.
    pub(crate) fn notify(&self, id: &str, state: InterruptState) {
        if let Ok(map) = self.waiters.lock() {
            if let Some(tx) = map.get(id) {
                tx.send_replace(Some(state));
            }
        }
    }

    /// Interrupts with a request waiting in this process.
    pub fn waiting(&self) -> usize {
        self.waiters.lock().map(|m| m.len()).unwrap_or(0)
    }
}

/// The admin token (`admin_token_file`): a bearer that may read run data. Kept as its
/// SHA-256 only; compared digest to digest.
#[derive(Clone)]
pub struct AdminToken([u8; 32]);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

/// The shortest admin token accepted, characters.
const MIN_ADMIN_TOKEN: usize = 16;

impl AdminToken {
    /// Reads the token file (surrounding whitespace trimmed). `None` when no file is set.
    ///
    /// Errors: [`AdminTokenError`] when the file cannot be read or the token is shorter
    /// than 16 characters.
    pub fn load(file: Option<&std::path::Path>) -> Result<Option<Self>, AdminTokenError> {
        let Some(file) = file else { return Ok(None) };
        let err = |reason: String| AdminTokenError {
            file: file.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(file).map_err(|e| err(e.to_string()))?;
        let token = text.trim();
        if token.len() < MIN_ADMIN_TOKEN {
            return Err(err(format!(
                "the token must be at least {MIN_ADMIN_TOKEN} characters"
            )));
        }
        Ok(Some(Self(Self::digest(token))))
    }

    fn digest(token: &str) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        Sha256::digest(token.as_bytes()).into()
    }

    /// True when `token` is the admin token.
    pub(crate) fn matches(&self, token: &str) -> bool {
        Self::digest(token) == self.0
    }
}

/// Why the admin token file cannot be used (a start-up error).
#[derive(Debug, Clone, thiserror::Error)]
#[error("admin_token_file {file}: {reason}")]
pub struct AdminTokenError {
    /// The file named by `admin_token_file`.
    pub file: String,
    /// What was wrong with it.
    pub reason: String,
}
