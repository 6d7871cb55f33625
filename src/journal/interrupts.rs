//! Journal records of tool-turn contract §C: approval interrupts and the sticky trust bit of
//! each run.
//!
//! An interrupt is inserted if absent on its deterministic key (raised at most once per key)
//! and leaves `pending` only by a compare-and-set in the single writer, so of two concurrent
//! resolutions exactly one wins. `interrupt.requested` / `interrupt.resolved` events are
//! appended in the same transaction as the state change they report.

use rusqlite::{params, OptionalExtension};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use super::{
    insert_event, scopes::EventScopes, EventRecord, InterruptState, Journal, JournalError, RunKey,
};

/// An interrupt to raise.
#[derive(Debug, Clone)]
pub struct InterruptRecord {
    /// `int_` + 32 hex of SHA-256 of the key.
    pub interrupt_id: String,
    /// The deterministic re-entry key (1–256 characters).
    pub key: String,
    /// OpenWOP interrupt kind (`approval`).
    pub kind: &'static str,
    pub run: RunKey,
    /// The agent request that raised it.
    pub request_id: String,
    /// The bound person (`sub`); `None`: the agent acts and nobody may resolve it.
    pub principal: Option<String>,
    /// The policy revision the held decisions were taken under.
    pub policy_revision: String,
    /// The OpenWOP `InterruptPayload` (`kind`, `key`, `data`, `timeoutMs`).
    pub payload: Value,
    /// The held calls: `[{callId, toolName, toolId, argsHash, arguments (redacted), held}]`.
    pub calls: Value,
    pub requested_at_ms: i64,
    pub expires_at_ms: i64,
}

/// An interrupt as journaled.
#[derive(Debug, Clone)]
pub struct InterruptRow {
    pub record: InterruptRecord,
    /// Where it stands (read from `interrupts.state`; a stored value outside the
    /// vocabulary makes the read fail with [`JournalError::Unreadable`]).
    pub state: InterruptState,
    /// Who resolved it (`sub`); `None` for the host (timeout, no approver) or pending.
    pub resolved_by: Option<String>,
    pub resolved_at_ms: Option<i64>,
    /// The OpenWOP `resumeValue` it was resolved with.
    pub resume_value: Option<Value>,
    /// The agent request that used an accepted approval (single use).
    pub consumed_by: Option<String>,
    /// The person's edited arguments (`edit-accept`): `[{callId, choice, index, arguments
    /// (redacted), argsHash, modelArgsHash, editedBy, editedAt}]`; `None` when accepted as
    /// raised, rejected or pending.
    pub edits: Option<Value>,
    /// This call inserted the row (it was not raised before under this key).
    pub inserted: bool,
}

/// Which interrupt a resolution addresses: always one interrupt by its id, the one the
/// person reviewed (tool-turn contract §C).
#[derive(Debug, Clone)]
pub enum Selector {
    /// `POST /approvals/{interruptId}`.
    Id(String),
    /// `POST /runs/{runId}/interrupts/{nodeId}` with `interruptId` in the body: that
    /// interrupt, if it belongs to this run and node (else not found). Never "the node's
    /// newest": a call raised after the person looked must not be approved in place of the
    /// one they reviewed.
    Node {
        run_id: String,
        node_id: String,
        interrupt_id: String,
    },
}

/// A resolution attempt.
#[derive(Debug, Clone)]
pub struct Resolution {
    pub selector: Selector,
    /// The verified person resolving it; `None` for the host itself (timeout, no approver),
    /// which skips the principal and expiry checks.
    pub by: Option<String>,
    /// The claims fingerprint of the resolver's token ([`crate::identity::TokenId`]): a
    /// token presented on the data plane (table `principal_tokens`) never resolves.
    pub by_token: Option<String>,
    /// [`InterruptState::Accepted`], [`InterruptState::Rejected`] or
    /// [`InterruptState::Expired`].
    pub state: InterruptState,
    /// The OpenWOP `resumeValue` (`{action, feedback?, decidedAt}`; for `edit-accept` the
    /// edited calls by `callId` and `argsHash` only — never their arguments, which the
    /// `interrupt.resolved` event carries).
    pub resume_value: Value,
    /// The person's edited calls (`edit-accept`, redacted), kept in `interrupts.edits`.
    pub edits: Option<Value>,
    pub now_ms: i64,
}

/// What a resolution attempt found.
#[derive(Debug, Clone)]
pub enum Resolved {
    /// No such interrupt.
    NotFound,
    /// The resolver is not the bound person.
    Forbidden(Box<InterruptRow>),
    /// The resolver's token was presented on the data plane (the agent holds it).
    HeldByAgent,
    /// It was resolved before (the row as it stands).
    AlreadyResolved(Box<InterruptRow>),
    /// It had expired: it is now resolved `expired` (the calls are refused).
    Expired(Box<InterruptRow>),
    /// This resolution won.
    Won(Box<InterruptRow>),
}

pub(super) enum Op {
    Raise(
        InterruptRecord,
        Option<oneshot::Sender<Answer<InterruptRow>>>,
    ),
    Resolve(Resolution, Option<oneshot::Sender<Answer<Resolved>>>),
    Consume {
        interrupt_id: String,
        request_id: String,
        answer: Option<oneshot::Sender<bool>>,
    },
    Pending {
        principal: String,
        now_ms: i64,
        answer: Option<oneshot::Sender<Answer<Vec<InterruptRow>>>>,
    },
    Get {
        interrupt_id: String,
        answer: Option<oneshot::Sender<Answer<Option<InterruptRow>>>>,
    },
    RunTrust {
        run_id: String,
        untrusted: bool,
        request_id: String,
        at_ms: i64,
        answer: Option<oneshot::Sender<bool>>,
    },
}

/// An operation's answer: [`JournalError::Unreadable`] when a row it read holds a value
/// outside its column's vocabulary (that operation is refused; the batch goes on).
pub(super) type Answer<T> = Result<T, JournalError>;

/// Deferred answers, sent only after the batch committed.
pub(super) type Replies = Vec<Box<dyn FnOnce() + Send>>;

pub(super) fn reply<T: Send + 'static>(
    replies: &mut Replies,
    tx: &mut Option<oneshot::Sender<T>>,
    v: T,
) {
    if let Some(tx) = tx.take() {
        replies.push(Box::new(move || {
            let _ = tx.send(v);
        }));
    }
}

impl Journal {
    /// Raises an interrupt: insert-if-absent on its key, committed before this returns, with
    /// its `interrupt.requested` event. Returns the row as it stands (the earlier one when the
    /// key was raised before: at most once per key).
    pub async fn raise_interrupt(
        &self,
        rec: InterruptRecord,
    ) -> Result<InterruptRow, JournalError> {
        let (tx, rx) = oneshot::channel();
        self.submit(super::Op::Interrupt(Box::new(Op::Raise(rec, Some(tx)))))
            .await?;
        rx.await.map_err(|_| JournalError::Closed)?
    }

    /// Resolves an interrupt by compare-and-set from `pending`; committed (with its
    /// `interrupt.resolved` event) before this returns.
    pub async fn resolve_interrupt(&self, r: Resolution) -> Result<Resolved, JournalError> {
        let (tx, rx) = oneshot::channel();
        self.submit(super::Op::Interrupt(Box::new(Op::Resolve(r, Some(tx)))))
            .await?;
        rx.await.map_err(|_| JournalError::Closed)?
    }

    /// Uses an accepted approval: `true` for the one request that may release its calls.
    pub async fn consume_approval(
        &self,
        interrupt_id: &str,
        request_id: &str,
    ) -> Result<bool, JournalError> {
        let (tx, rx) = oneshot::channel();
        self.submit(super::Op::Interrupt(Box::new(Op::Consume {
            interrupt_id: interrupt_id.to_owned(),
            request_id: request_id.to_owned(),
            answer: Some(tx),
        })))
        .await?;
        rx.await.map_err(|_| JournalError::Closed)
    }

    /// Pending, unexpired interrupts bound to `principal`, oldest first.
    pub async fn pending_interrupts(
        &self,
        principal: &str,
        now_ms: i64,
    ) -> Result<Vec<InterruptRow>, JournalError> {
        let (tx, rx) = oneshot::channel();
        self.submit(super::Op::Interrupt(Box::new(Op::Pending {
            principal: principal.to_owned(),
            now_ms,
            answer: Some(tx),
        })))
        .await?;
        rx.await.map_err(|_| JournalError::Closed)?
    }

    /// One interrupt as it stands now (read through the writer, so it sees every committed
    /// resolution).
    pub async fn interrupt(
        &self,
        interrupt_id: &str,
    ) -> Result<Option<InterruptRow>, JournalError> {
        let (tx, rx) = oneshot::channel();
        self.submit(super::Op::Interrupt(Box::new(Op::Get {
            interrupt_id: interrupt_id.to_owned(),
            answer: Some(tx),
        })))
        .await?;
        rx.await.map_err(|_| JournalError::Closed)?
    }

    /// The run's sticky trust bit: records `untrusted` (insert-if-absent, durable) when this
    /// turn is untrusted, and answers whether the run is untrusted (tool-turn contract §C:
    /// once untrusted, always untrusted).
    pub async fn run_untrusted(
        &self,
        run_id: &str,
        untrusted: bool,
        request_id: &str,
        at_ms: i64,
    ) -> Result<bool, JournalError> {
        let (tx, rx) = oneshot::channel();
        self.submit(super::Op::Interrupt(Box::new(Op::RunTrust {
            run_id: run_id.to_owned(),
            untrusted,
            request_id: request_id.to_owned(),
            at_ms,
            answer: Some(tx),
        })))
        .await?;
        rx.await.map_err(|_| JournalError::Closed)
    }
}

pub(super) const COLUMNS: &str =
    "interrupt_id, key, kind, run_id, node_id, attempt, request_id, principal,
    policy_revision, payload, calls, requested_at_ms, expires_at_ms, state, resolved_by,
    resolved_at_ms, resume_value, consumed_by, edits";

fn row_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<InterruptRow> {
    let json = |s: Option<String>| s.and_then(|s| serde_json::from_str::<Value>(&s).ok());
    let kind: String = r.get(2)?;
    Ok(InterruptRow {
        record: InterruptRecord {
            interrupt_id: r.get(0)?,
            key: r.get(1)?,
            kind: if kind == "approval" {
                "approval"
            } else {
                "custom"
            },
            run: RunKey {
                run_id: r.get(3)?,
                node_id: r.get(4)?,
                attempt: r.get(5)?,
            },
            request_id: r.get(6)?,
            principal: r.get(7)?,
            policy_revision: r.get(8)?,
            payload: json(r.get(9)?).unwrap_or(Value::Null),
            calls: json(r.get(10)?).unwrap_or(Value::Null),
            requested_at_ms: r.get(11)?,
            expires_at_ms: r.get(12)?,
        },
        state: r.get(13)?,
        resolved_by: r.get(14)?,
        resolved_at_ms: r.get(15)?,
        resume_value: json(r.get(16)?),
        consumed_by: r.get(17)?,
        edits: json(r.get(18)?),
        inserted: false,
    })
}

fn by_id(tx: &rusqlite::Connection, id: &str) -> rusqlite::Result<Option<InterruptRow>> {
    tx.query_row(
        &format!("SELECT {COLUMNS} FROM interrupts WHERE interrupt_id = ?1"),
        params![id],
        row_of,
    )
    .optional()
}

pub(super) fn event(
    row: &InterruptRow,
    kind: &'static str,
    payload: Value,
    at_ms: i64,
) -> EventRecord {
    EventRecord {
        request_id: row.record.request_id.clone(),
        run: row.record.run.clone(),
        at_ms,
        kind,
        payload: crate::strict_json::to_text(&payload),
    }
}

pub(super) fn node_of(row: &InterruptRow) -> String {
    row.record
        .run
        .node_id
        .clone()
        .unwrap_or_else(|| "default".into())
}

/// The answer of an operation that reads interrupt rows: a row holding a value outside its
/// column's vocabulary refuses this operation ([`JournalError::Unreadable`]) without failing
/// the batch; any other error fails the batch as before.
fn guarded<T>(read: rusqlite::Result<T>) -> rusqlite::Result<Answer<T>> {
    match read {
        Ok(v) => Ok(Ok(v)),
        Err(e) => match super::states::unknown_value(&e) {
            Some(v) => {
                tracing::error!(error = %v, "interrupt row refused: its stored value is not one turnguard knows (fail closed)");
                Ok(Err(JournalError::Unreadable(v.clone())))
            }
            None => Err(e),
        },
    }
}

pub(super) fn apply(
    tx: &rusqlite::Connection,
    op: &mut Op,
    replies: &mut Replies,
    scopes: &mut EventScopes,
) -> rusqlite::Result<()> {
    match op {
        Op::Raise(rec, answer) => {
            let row = guarded(raise(tx, rec, scopes))?;
            reply(replies, answer, row);
        }
        Op::Resolve(r, answer) => {
            let outcome = guarded(resolve(tx, r, scopes))?;
            reply(replies, answer, outcome);
        }
        Op::Consume {
            interrupt_id,
            request_id,
            answer,
        } => {
            let used = tx.execute(
                "UPDATE interrupts SET consumed_by = ?2
                 WHERE interrupt_id = ?1 AND state = 'accepted' AND consumed_by IS NULL",
                params![&*interrupt_id, &*request_id],
            )? == 1;
            reply(replies, answer, used);
        }
        Op::Pending {
            principal,
            now_ms,
            answer,
        } => {
            let rows = guarded(pending(tx, principal, *now_ms))?;
            reply(replies, answer, rows);
        }
        Op::Get {
            interrupt_id,
            answer,
        } => {
            let row = guarded(by_id(tx, interrupt_id))?;
            reply(replies, answer, row);
        }
        Op::RunTrust {
            run_id,
            untrusted,
            request_id,
            at_ms,
            answer,
        } => {
            if *untrusted {
                tx.execute(
                    "INSERT INTO run_trust (run_id, trust, request_id, at_ms)
                     VALUES (?1, 'untrusted', ?2, ?3) ON CONFLICT (run_id) DO NOTHING",
                    params![&*run_id, &*request_id, *at_ms],
                )?;
            }
            let sticky: i64 = tx.query_row(
                "SELECT count(*) FROM run_trust WHERE run_id = ?1 AND trust = 'untrusted'",
                params![&*run_id],
                |r| r.get(0),
            )?;
            reply(replies, answer, sticky > 0);
        }
    }
    Ok(())
}

/// Insert-if-absent on the key, with its `interrupt.requested` event when inserted.
fn raise(
    tx: &rusqlite::Connection,
    rec: &InterruptRecord,
    scopes: &mut EventScopes,
) -> rusqlite::Result<InterruptRow> {
    let inserted = tx.execute(
        "INSERT INTO interrupts (interrupt_id, key, kind, run_id, node_id, attempt,
            request_id, principal, policy_revision, payload, calls, requested_at_ms,
            expires_at_ms, state)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, 'pending')
         ON CONFLICT DO NOTHING",
        params![
            rec.interrupt_id,
            rec.key,
            rec.kind,
            rec.run.run_id,
            rec.run.node_id,
            rec.run.attempt,
            rec.request_id,
            rec.principal,
            rec.policy_revision,
            rec.payload.to_string(),
            rec.calls.to_string(),
            rec.requested_at_ms,
            rec.expires_at_ms,
        ],
    )? == 1;
    let mut row = tx.query_row(
        &format!("SELECT {COLUMNS} FROM interrupts WHERE key = ?1"),
        params![rec.key],
        row_of,
    )?;
    row.inserted = inserted;
    if inserted {
        let mut payload = rec.payload.clone();
        payload["interruptId"] = json!(rec.interrupt_id);
        payload["nodeId"] = json!(node_of(&row));
        insert_event(
            tx,
            &event(&row, "interrupt.requested", payload, rec.requested_at_ms),
            scopes,
        )?;
    }
    Ok(row)
}

/// The compare-and-set from `pending`, with its `interrupt.resolved` event when it won.
fn resolve(
    tx: &rusqlite::Connection,
    r: &Resolution,
    scopes: &mut EventScopes,
) -> rusqlite::Result<Resolved> {
    let held_by_agent = match &r.by_token {
        Some(fp) => {
            tx.query_row(
                "SELECT count(*) FROM principal_tokens WHERE fingerprint = ?1",
                params![fp],
                |row| row.get::<_, i64>(0),
            )? > 0
        }
        None => false,
    };
    let found = match &r.selector {
        Selector::Id(id) => by_id(tx, id)?,
        Selector::Node {
            run_id,
            node_id,
            interrupt_id,
        } => by_id(tx, interrupt_id)?.filter(|row| {
            row.record.run.run_id.as_deref() == Some(run_id.as_str()) && node_of(row) == *node_id
        }),
    };
    Ok(match found {
        _ if held_by_agent => Resolved::HeldByAgent,
        None => Resolved::NotFound,
        Some(row) if r.by.is_some() && row.record.principal != r.by => {
            Resolved::Forbidden(Box::new(row))
        }
        Some(row) if row.state != InterruptState::Pending => {
            Resolved::AlreadyResolved(Box::new(row))
        }
        Some(row) => {
            let expired = r.by.is_some() && r.now_ms >= row.record.expires_at_ms;
            let (state, by, value, edits) = if expired {
                (
                    InterruptState::Expired,
                    None,
                    json!({"action": "reject", "decision": "rejected", "reason": "timeout",
                           "decidedAt": r.now_ms}),
                    None,
                )
            } else {
                (
                    r.state,
                    r.by.clone(),
                    r.resume_value.clone(),
                    r.edits.as_ref().map(Value::to_string),
                )
            };
            let changed = tx.execute(
                "UPDATE interrupts SET state = ?2, resolved_by = ?3, resolved_at_ms = ?4,
                    resume_value = ?5, edits = ?6
                 WHERE interrupt_id = ?1 AND state = 'pending'",
                params![
                    row.record.interrupt_id,
                    state,
                    by,
                    r.now_ms,
                    value.to_string(),
                    edits
                ],
            )?;
            match by_id(tx, &row.record.interrupt_id)? {
                Some(now) if changed == 1 => {
                    insert_event(
                        tx,
                        &event(
                            &now,
                            "interrupt.resolved",
                            json!({"nodeId": node_of(&now),
                                   "interruptId": now.record.interrupt_id,
                                   "kind": now.record.kind, "resumeValue": value}),
                            r.now_ms,
                        ),
                        scopes,
                    )?;
                    if expired {
                        Resolved::Expired(Box::new(now))
                    } else {
                        Resolved::Won(Box::new(now))
                    }
                }
                Some(now) => Resolved::AlreadyResolved(Box::new(now)),
                None => Resolved::NotFound,
            }
        }
    })
}

/// Pending, unexpired interrupts bound to `principal`, oldest first (at most 500).
fn pending(
    tx: &rusqlite::Connection,
    principal: &str,
    now_ms: i64,
) -> rusqlite::Result<Vec<InterruptRow>> {
    let mut stmt = tx.prepare(&format!(
        "SELECT {COLUMNS} FROM interrupts
         WHERE state = 'pending' AND principal = ?1 AND expires_at_ms > ?2
         ORDER BY requested_at_ms LIMIT 500"
    ))?;
    let rows = stmt
        .query_map(params![principal, now_ms], row_of)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str) -> InterruptRecord {
        InterruptRecord {
            interrupt_id: format!("int_{key}"),
            key: key.to_owned(),
            kind: "approval",
            run: RunKey {
                run_id: Some("run-1".into()),
                node_id: Some("node-1".into()),
                attempt: Some(1),
            },
            request_id: "req-1".into(),
            principal: Some("alice".into()),
            policy_revision: "rev".into(),
            payload: json!({"kind": "approval", "key": key}),
            calls: json!([]),
            requested_at_ms: 1,
            expires_at_ms: i64::MAX,
        }
    }

    /// An interrupt whose stored state turnguard does not know is refused on every read and
    /// resolution with an error naming the value — never read as pending or accepted, never
    /// usable as an approval — and the refusal fails only that operation: the writer and the
    /// journal's health go on.
    #[tokio::test]
    async fn an_unknown_stored_state_is_refused_not_defaulted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.db");
        let metrics = std::sync::Arc::new(crate::metrics::Metrics::new());
        let (journal, writer) = Journal::open_sqlite(&path, metrics).unwrap();
        let row = journal.raise_interrupt(record("k1")).await.unwrap();
        assert_eq!(row.state, InterruptState::Pending);
        let id = row.record.interrupt_id.clone();
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute(
            "UPDATE interrupts SET state = 'approved' WHERE interrupt_id = ?1",
            params![id],
        )
        .unwrap();

        let err = journal.interrupt(&id).await.unwrap_err();
        assert!(
            matches!(&err, JournalError::Unreadable(v) if v.column == "interrupts.state" && v.value == "approved"),
            "{err}"
        );
        assert!(err.to_string().contains("`approved`"), "{err}");
        let accept = Resolution {
            selector: Selector::Id(id.clone()),
            by: Some("alice".into()),
            by_token: None,
            state: InterruptState::Accepted,
            resume_value: json!({"action": "accept", "decidedAt": 2}),
            edits: None,
            now_ms: 2,
        };
        assert!(matches!(
            journal.resolve_interrupt(accept).await,
            Err(JournalError::Unreadable(_))
        ));
        assert!(matches!(
            journal.raise_interrupt(record("k1")).await,
            Err(JournalError::Unreadable(_))
        ));
        assert!(!journal.consume_approval(&id, "req-2").await.unwrap());

        let other = journal.raise_interrupt(record("k2")).await.unwrap();
        let read = journal.interrupt(&other.record.interrupt_id).await.unwrap();
        assert_eq!(read.map(|r| r.state), Some(InterruptState::Pending));
        let stored: String = conn
            .query_row(
                "SELECT state FROM interrupts WHERE interrupt_id = ?1",
                params![id],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(stored, "approved", "nothing was written over it");
        drop(journal);
        writer.join();
    }
}
