//! Graceful shutdown (issue 6): on SIGTERM, in this order,
//!
//! 1. readiness goes false (`/readyz` answers 503) and the edge starts shedding new requests
//!    with 503 `shutting_down`;
//! 2. after `shutdown_delay_ms` (time for a load balancer to notice), the listeners stop
//!    accepting; idle keep-alive connections are closed;
//! 3. in-flight requests and streams get `shutdown_grace_ms` to finish; past that deadline
//!    every stream still open is cut (the agent gets the provider-shaped error event, held
//!    calls are never released) and its round is journaled as `failed`;
//! 4. the journal queue is flushed and the writer thread joined.
//!
//! The outcome is a [`ShutdownReport`]; `main` exits 0 when the journal was flushed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::journal::WriterThread;
use crate::state::AppState;
pub use crate::state::Lifecycle;

/// How long the listeners get to close after streams were cut at the deadline.
const AFTER_CUT: Duration = Duration::from_secs(5);
/// How long the journal gets to flush its queue once every request has ended.
const FLUSH: Duration = Duration::from_secs(10);

/// What happened during shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Every in-flight request and stream finished before the deadline.
    pub drained: bool,
    /// The journal writer flushed its queue and stopped.
    pub journal_flushed: bool,
}

/// Runs the shutdown sequence of the module docs.
pub(crate) async fn sequence(
    state: Arc<AppState>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    writer: WriterThread,
) -> ShutdownReport {
    state.ready.store(false, Ordering::SeqCst);
    state.lifecycle.draining.store(true, Ordering::SeqCst);
    let delay = Duration::from_millis(state.config.shutdown_delay_ms);
    if !delay.is_zero() {
        tracing::info!(
            delay_ms = delay.as_millis() as u64,
            "readiness false; waiting before closing the listeners"
        );
        tokio::time::sleep(delay).await;
    }
    let _ = stop.send(true);
    let grace = Duration::from_millis(state.config.shutdown_grace_ms);
    let inflight = state.metrics.inflight_streams.get();
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        streams = inflight,
        "listeners closed; draining in-flight requests"
    );

    let mut tasks = tasks;
    let drained = wait_all(&mut tasks, grace).await;
    if !drained {
        tracing::warn!(
            grace_ms = grace.as_millis() as u64,
            streams = state.metrics.inflight_streams.get(),
            "drain deadline passed: cutting open streams"
        );
        let _ = state.lifecycle.cut.send(true);
        if !wait_all(&mut tasks, AFTER_CUT).await {
            for t in &tasks {
                t.abort();
            }
        }
    }
    drop(state);
    // The writer exits once every journal handle (held by the state and by relays still
    // recording their round) is dropped; join it off the async threads, bounded.
    let joined = tokio::time::timeout(FLUSH, tokio::task::spawn_blocking(move || writer.join()));
    let journal_flushed = matches!(joined.await, Ok(Ok(())));
    if journal_flushed {
        tracing::info!(drained, "journal flushed; shutdown complete");
    } else {
        tracing::error!(
            drained,
            "the journal did not flush within {} s",
            FLUSH.as_secs()
        );
    }
    ShutdownReport {
        drained,
        journal_flushed,
    }
}

/// Waits for every task, at most `limit`; true when all finished. Finished tasks are removed.
async fn wait_all(tasks: &mut Vec<JoinHandle<()>>, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while let Some(t) = tasks.last_mut() {
        match tokio::time::timeout_at(deadline, t).await {
            Ok(_) => {
                tasks.pop();
            }
            Err(_) => return false,
        }
    }
    true
}
