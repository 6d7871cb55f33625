//! The PostgreSQL writer task: the queued [`Op`]s of one replica, committed in groups, each
//! job in its own savepoint (see the [`super`] module docs for what makes each operation
//! atomic across replicas).
//!
//! Round trips, not the server, bound a writer whose statements each wait for their reply
//! (about ten per chat round: 440 ms per 470-record batch with the server on a busy core).
//! So a job whose statements read no reply is *planned* ([`plan`]: its [`Stmt`]s) and its
//! statements are pipelined ([`run_stmts`]: every request sent, in order, before the first
//! reply is awaited); consecutive planned jobs go as one group under one savepoint. A group
//! that fails is rolled back and its jobs are run again one by one, each in its own savepoint,
//! so one bad record still fails alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::{Pool, Transaction};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::super::interrupts::{
    self, reply, Answer, InterruptRecord, InterruptRow, Replies, Resolution, Resolved, Selector,
};
use super::super::{
    BeforeUpstream, Claim, DeclaredToolsRecord, EffectClaim, EventRecord, InterruptState, Job,
    JournalError, JournalHealth, Op, RoundCommit, RoundRecord, RunKey, ServedRecord,
    ToolResultRecord, UnknownValue, CLAIM_LEASE_MS, MAX_BATCH,
};
use super::reader::u32_of;
use super::{describe, store_failure, CHANNEL};
use crate::metrics::Metrics;

/// Claims this replica holds, by (effect id, call id): the epoch each claim returned. A
/// confirm or release must match it (the fence).
type Held = hashlink::LruCache<(String, String), i64>;

/// Claims remembered at most (the oldest are forgotten first; a forgotten claim can no longer
/// be confirmed: fail closed).
const HELD_CLAIMS: usize = 65_536;

/// A batch that has not committed within this long fails (its callers get 503) and marks the
/// journal failing.
const COMMIT_DEADLINE: Duration = Duration::from_secs(5);

/// Why one job failed.
enum JobErr {
    Db(tokio_postgres::Error),
    Fenced(String),
    Other(String),
}

impl From<tokio_postgres::Error> for JobErr {
    fn from(e: tokio_postgres::Error) -> Self {
        JobErr::Db(e)
    }
}

impl From<JobErr> for JournalError {
    fn from(e: JobErr) -> Self {
        match e {
            JobErr::Db(e) => JournalError::Write(describe(&e)),
            JobErr::Fenced(id) => JournalError::Fenced(id),
            JobErr::Other(reason) => JournalError::Write(reason),
        }
    }
}

/// Why a whole batch failed: the store itself (marks the journal failing) or a statement.
enum BatchErr {
    Store(String),
    Record(String),
}

fn batch_err(e: tokio_postgres::Error) -> BatchErr {
    if store_failure(&e) {
        BatchErr::Store(describe(&e))
    } else {
        BatchErr::Record(describe(&e))
    }
}

type Params<'a> = [&'a (dyn ToSql + Sync)];

/// A parameter as the writer sends it: PostgreSQL text cannot hold U+0000, and a value that
/// carries one (a model-chosen tool name, an agent-chosen model name) would fail its whole
/// job, so in a text-typed parameter each NUL is sent as U+FFFD. Every other value, and every
/// other type, is sent as the value itself encodes it.
#[derive(Debug)]
struct NulSafe<'a>(&'a (dyn ToSql + Sync));

impl ToSql for NulSafe<'_> {
    fn to_sql(
        &self,
        ty: &tokio_postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        use tokio_postgres::types::{IsNull, Type};
        let start = out.len();
        let written = self.0.to_sql_checked(ty, out)?;
        let text = matches!(
            *ty,
            Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME | Type::UNKNOWN
        );
        if matches!(written, IsNull::No) && text && out.get(start..).is_some_and(|b| b.contains(&0))
        {
            let encoded = out.split_off(start);
            for (i, piece) in encoded.as_ref().split(|b| *b == 0).enumerate() {
                if i > 0 {
                    out.extend_from_slice("\u{FFFD}".as_bytes());
                }
                out.extend_from_slice(piece);
            }
        }
        Ok(written)
    }

    /// The wrapped value checks its own type in [`ToSql::to_sql_checked`].
    fn accepts(_: &tokio_postgres::types::Type) -> bool {
        true
    }

    fn to_sql_checked(
        &self,
        ty: &tokio_postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        self.to_sql(ty, out)
    }
}

/// `params` as the writer sends them ([`NulSafe`]).
fn nul_safe<'a>(params: &'a Params<'a>) -> Vec<NulSafe<'a>> {
    params.iter().map(|p| NulSafe(*p)).collect()
}

fn as_params<'a>(safe: &'a [NulSafe<'a>]) -> Vec<&'a (dyn ToSql + Sync)> {
    safe.iter().map(|p| p as &(dyn ToSql + Sync)).collect()
}

async fn exec(tx: &Transaction<'_>, sql: &str, params: &Params<'_>) -> Result<u64, JobErr> {
    let st = tx.prepare_cached(sql).await?;
    let safe = nul_safe(params);
    Ok(tx.execute(&st, &as_params(&safe)).await?)
}

async fn query(tx: &Transaction<'_>, sql: &str, params: &Params<'_>) -> Result<Vec<Row>, JobErr> {
    let st = tx.prepare_cached(sql).await?;
    let safe = nul_safe(params);
    Ok(tx.query(&st, &as_params(&safe)).await?)
}

async fn query_opt(
    tx: &Transaction<'_>,
    sql: &str,
    params: &Params<'_>,
) -> Result<Option<Row>, JobErr> {
    Ok(query(tx, sql, params).await?.into_iter().next())
}

fn flag(b: bool) -> i64 {
    i64::from(b)
}

/// One statement planned without reading any reply: its SQL and parameters (borrowed from
/// the job, or computed).
struct Stmt<'a> {
    sql: &'static str,
    params: Vec<Box<dyn ToSql + Sync + Send + 'a>>,
}

impl<'a> Stmt<'a> {
    fn new(sql: &'static str) -> Self {
        Self {
            sql,
            params: Vec::new(),
        }
    }

    /// Appends the next parameter (`$1`, `$2`, … in order).
    fn arg(mut self, v: impl ToSql + Sync + Send + 'a) -> Self {
        self.params.push(Box::new(v));
        self
    }

    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.params
            .iter()
            .map(|p| &**p as &(dyn ToSql + Sync))
            .collect()
    }
}

/// Runs `stmts` in order, pipelined: each is prepared (a cache hit after the first time),
/// then every request is sent before any reply is awaited (tokio-postgres sends a request on
/// its future's first poll, and the server runs one connection's requests in the order they
/// arrive). Errors: the first statement's, in order, that failed (those after it fail too:
/// the transaction is aborted until the caller rolls back to its savepoint).
async fn run_stmts(tx: &Transaction<'_>, stmts: &[Stmt<'_>]) -> Result<(), JobErr> {
    use std::future::Future;
    use std::task::Poll;
    let mut prepared = Vec::with_capacity(stmts.len());
    for st in stmts {
        prepared.push(tx.prepare_cached(st.sql).await?);
    }
    let raw: Vec<Vec<&(dyn ToSql + Sync)>> = stmts.iter().map(Stmt::params).collect();
    let safe: Vec<Vec<NulSafe<'_>>> = raw.iter().map(|p| nul_safe(p)).collect();
    let params: Vec<Vec<&(dyn ToSql + Sync)>> = safe.iter().map(|p| as_params(p)).collect();
    let mut pending: Vec<_> = prepared
        .iter()
        .zip(&params)
        .map(|(st, p)| Some(Box::pin(tx.execute(st, p))))
        .collect();
    let mut errors: Vec<Option<tokio_postgres::Error>> = Vec::new();
    errors.resize_with(pending.len(), || None);
    // The first poll of each, in order, sends its request.
    std::future::poll_fn(|cx| {
        for (slot, error) in pending.iter_mut().zip(errors.iter_mut()) {
            if let Some(f) = slot {
                if let Poll::Ready(r) = f.as_mut().poll(cx) {
                    *slot = None;
                    *error = r.err();
                }
            }
        }
        Poll::Ready(())
    })
    .await;
    for (slot, error) in pending.into_iter().zip(errors.iter_mut()) {
        if let Some(f) = slot {
            *error = f.await.err();
        }
    }
    match errors.into_iter().flatten().next() {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// The statements of `op` when none of them depends on a reply, so they can be pipelined;
/// `None` for the operations that read what they write (claims and their confirms, tool
/// results, interrupts, released claims) and for the prune.
fn plan<'a>(op: &'a Op, instance: &'a str) -> Option<Vec<Stmt<'a>>> {
    let mut out = Vec::new();
    match op {
        Op::Events(list) => list.iter().for_each(|e| plan_event(&mut out, e)),
        Op::DeclaredTools(d) => plan_declared_tools(&mut out, d),
        Op::BeforeUpstream(u) if u.tool_results.is_empty() => plan_before_upstream(&mut out, u),
        Op::RoundCommit(u)
            if u.claims.is_empty() && u.served.as_ref().is_none_or(|r| r.claims.is_empty()) =>
        {
            plan_round_commit(&mut out, u);
        }
        Op::Cursor {
            run_id,
            node_id,
            skipped,
        } => out.push(
            Stmt::new(
                "INSERT INTO replay_cursor (run_id, node_id, skipped) VALUES ($1, $2, $3)
                 ON CONFLICT (run_id, node_id) DO UPDATE SET skipped = excluded.skipped",
            )
            .arg(run_id)
            .arg(node_id)
            .arg(i64::from(*skipped)),
        ),
        Op::Token {
            fingerprint,
            expires_at_ms,
            at_ms,
        } => out.push(
            Stmt::new(
                "INSERT INTO principal_tokens (fingerprint, expires_at_ms, first_seen_ms)
                 VALUES ($1, $2, $3) ON CONFLICT (fingerprint) DO NOTHING",
            )
            .arg(fingerprint)
            .arg(*expires_at_ms)
            .arg(*at_ms),
        ),
        Op::Probe => out.push(
            Stmt::new(
                "INSERT INTO instances (instance, heartbeat_ms) VALUES ($1, $2)
                 ON CONFLICT (instance) DO UPDATE SET heartbeat_ms = excluded.heartbeat_ms",
            )
            .arg(instance)
            .arg(crate::clock::now_ms()),
        ),
        Op::ConfirmClaims(_)
        | Op::Prune { .. }
        | Op::ReleaseClaim { .. }
        | Op::ToolResults(_)
        | Op::BeforeUpstream(_)
        | Op::RoundCommit(_)
        | Op::Claims(..)
        | Op::Interrupt(_) => return None,
    }
    Some(out)
}

/// The probe write: this replica's heartbeat row (`instances`), committed durably.
pub(super) async fn heartbeat(pool: &Pool, instance: &str) -> Result<(), String> {
    let client = pool
        .get()
        .await
        .map_err(|e| format!("no journal connection: {e}"))?;
    client
        .execute(
            "INSERT INTO instances (instance, heartbeat_ms) VALUES ($1, $2)
             ON CONFLICT (instance) DO UPDATE SET heartbeat_ms = excluded.heartbeat_ms",
            &[&instance, &crate::clock::now_ms()],
        )
        .await
        .map(|_| ())
        .map_err(|e| describe(&e))
}

/// The writer task: takes the queue in batches until every [`super::super::Journal`] handle
/// is gone, then removes this replica's heartbeat row.
pub(super) async fn run(
    pool: Pool,
    mut rx: mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
    health: Arc<JournalHealth>,
    instance: String,
) {
    let mut held = Held::new(HELD_CLAIMS);
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        for job in &mut batch {
            job.queued = None;
        }
        let durable = batch.iter().any(|j| j.durable);
        let started = Instant::now();
        let outcome = match tokio::time::timeout(
            COMMIT_DEADLINE,
            commit(&pool, &mut batch, durable, &instance, &mut held),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(BatchErr::Store(format!(
                "the commit did not finish within {} s",
                COMMIT_DEADLINE.as_secs()
            ))),
        };
        match &outcome {
            Ok(_) => health.set(None),
            Err(BatchErr::Store(reason)) => health.set(Some(reason.clone())),
            Err(BatchErr::Record(_)) => {}
        }
        metrics
            .journal_commit_latency
            .observe(started.elapsed().as_secs_f64());
        metrics.journal_batch_size.observe(batch.len() as f64);
        if outcome.is_ok() {
            super::super::count_commit(&metrics, &batch);
        }
        match outcome {
            Ok(results) => {
                for (job, result) in batch.into_iter().zip(results) {
                    if let Err(e) = &result {
                        metrics.journal_write_failures.inc();
                        tracing::error!(error = %e, "journal record failed");
                    }
                    if let Some(ack) = job.ack {
                        let _ = ack.send(result);
                    }
                }
            }
            Err(BatchErr::Store(reason) | BatchErr::Record(reason)) => {
                metrics.journal_write_failures.inc_by(batch.len() as u64);
                tracing::error!(error = %reason, records = batch.len(), "journal batch failed");
                for job in batch {
                    if let Some(ack) = job.ack {
                        let _ = ack.send(Err(JournalError::Write(reason.clone())));
                    }
                }
            }
        }
    }
    if let Ok(client) = pool.get().await {
        let _ = client
            .execute("DELETE FROM instances WHERE instance = $1", &[&instance])
            .await;
    }
}

async fn commit(
    pool: &Pool,
    batch: &mut [Job],
    durable: bool,
    instance: &str,
    held: &mut Held,
) -> Result<Vec<Result<(), JournalError>>, BatchErr> {
    let mut client = pool
        .get()
        .await
        .map_err(|e| BatchErr::Store(format!("no journal connection: {e}")))?;
    let tx = client.transaction().await.map_err(batch_err)?;
    // Durable: the commit returns once the WAL is flushed (whatever the server's default);
    // relaxed: batched, may be lost on a server crash, never half-applied.
    tx.batch_execute(if durable {
        "SET LOCAL synchronous_commit = on"
    } else {
        "SET LOCAL synchronous_commit = off"
    })
    .await
    .map_err(batch_err)?;
    let mut results = Vec::with_capacity(batch.len());
    let mut replies: Replies = Vec::new();
    let mut at = 0;
    while at < batch.len() {
        // The planned jobs from here on, pipelined as one group.
        let group = match planned_group(&tx, &batch[at..], instance).await? {
            Head::Done(done) => {
                at += done.len();
                results.extend(done);
                continue;
            }
            Head::OneByOne(n) => n,
        };
        for job in &mut batch[at..at + group] {
            results.push(one_job(&tx, job, instance, held, &mut replies).await?);
        }
        at += group;
    }
    tx.commit().await.map_err(batch_err)?;
    for r in replies {
        r();
    }
    Ok(results)
}

/// What [`planned_group`] did with the head of a batch.
enum Head {
    /// These jobs were applied, one result each, in order.
    Done(Vec<Result<(), JournalError>>),
    /// Run the next `n` jobs one by one ([`one_job`]): the head job reads replies, or a group
    /// of several failed and was rolled back.
    OneByOne(usize),
}

/// Pipelines the longest run of planned jobs at the head of `jobs` under one savepoint, each
/// job planned once. A group of one is that job in its own savepoint, its error its own; a
/// group of several that fails is rolled back for the caller to run one by one.
async fn planned_group(
    tx: &Transaction<'_>,
    jobs: &[Job],
    instance: &str,
) -> Result<Head, BatchErr> {
    let plans: Vec<Vec<Stmt<'_>>> = jobs.iter().map_while(|j| plan(&j.op, instance)).collect();
    let n = plans.len();
    if n == 0 {
        return Ok(Head::OneByOne(1));
    }
    let stmts: Vec<Stmt<'_>> = plans.into_iter().flatten().collect();
    tx.batch_execute("SAVEPOINT job").await.map_err(batch_err)?;
    match run_stmts(tx, &stmts).await {
        Ok(()) => {
            tx.batch_execute("RELEASE SAVEPOINT job")
                .await
                .map_err(batch_err)?;
            Ok(Head::Done((0..n).map(|_| Ok(())).collect()))
        }
        Err(JobErr::Db(e)) if store_failure(&e) => Err(BatchErr::Store(describe(&e))),
        Err(e) => {
            tx.batch_execute("ROLLBACK TO SAVEPOINT job")
                .await
                .map_err(batch_err)?;
            Ok(if n == 1 {
                Head::Done(vec![Err(e.into())])
            } else {
                Head::OneByOne(n)
            })
        }
    }
}

/// One job in its own savepoint: its result, its replies appended once it holds.
async fn one_job(
    tx: &Transaction<'_>,
    job: &mut Job,
    instance: &str,
    held: &mut Held,
    replies: &mut Replies,
) -> Result<Result<(), JournalError>, BatchErr> {
    tx.batch_execute("SAVEPOINT job").await.map_err(batch_err)?;
    let mut mine: Replies = Vec::new();
    match apply(tx, &mut job.op, instance, held, &mut mine).await {
        Ok(()) => {
            tx.batch_execute("RELEASE SAVEPOINT job")
                .await
                .map_err(batch_err)?;
            replies.append(&mut mine);
            Ok(Ok(()))
        }
        Err(JobErr::Db(e)) if store_failure(&e) => Err(BatchErr::Store(describe(&e))),
        Err(e) => {
            tx.batch_execute("ROLLBACK TO SAVEPOINT job")
                .await
                .map_err(batch_err)?;
            Ok(Err(e.into()))
        }
    }
}

async fn apply(
    tx: &Transaction<'_>,
    op: &mut Op,
    instance: &str,
    held: &mut Held,
    replies: &mut Replies,
) -> Result<(), JobErr> {
    if let Some(stmts) = plan(op, instance) {
        return run_stmts(tx, &stmts).await;
    }
    match op {
        Op::ConfirmClaims(list) => confirm(tx, list, instance, held).await?,
        Op::Prune { before_ms } => prune(tx, *before_ms).await?,
        Op::BeforeUpstream(u) => before_upstream(tx, u).await?,
        Op::RoundCommit(u) => round_commit(tx, u, instance, held).await?,
        Op::ReleaseClaim { effect_id, call_id } => {
            let key = (effect_id.clone(), call_id.clone());
            // Only the claim this replica holds, at the epoch it holds: a claim taken over
            // since is someone else's and stays.
            if let Some(epoch) = held.remove(&key) {
                exec(
                    tx,
                    "DELETE FROM effects WHERE effect_id = $1 AND call_id = $2 AND state = 'claimed'
                     AND instance = $3 AND epoch = $4",
                    &[&*effect_id, &*call_id, &instance, &epoch],
                )
                .await?;
            }
        }
        Op::ToolResults(list) => {
            for t in list.iter() {
                insert_tool_result(tx, t).await?;
            }
        }
        Op::Claims(list, answer) => {
            let mut results = Vec::with_capacity(list.len());
            for c in list.iter() {
                match claim(tx, c, instance, held).await {
                    Ok(r) => results.push(r),
                    Err(e) => {
                        // The job's savepoint rolls back the claims taken before this one:
                        // they are not held either.
                        for c in &list[..results.len()] {
                            held.remove(&(c.effect_id.clone(), c.call_id.clone()));
                        }
                        return Err(e);
                    }
                }
            }
            let (dummy, _) = oneshot::channel();
            let answer = std::mem::replace(answer, dummy);
            replies.push(Box::new(move || {
                let _ = answer.send(results);
            }));
        }
        Op::Interrupt(op) => apply_interrupt(tx, op, replies).await?,
        // Planned above: their statements read no reply.
        Op::Cursor { .. } | Op::Events(_) | Op::DeclaredTools(_) | Op::Token { .. } | Op::Probe => {
        }
    }
    Ok(())
}

async fn prune(tx: &Transaction<'_>, t: i64) -> Result<(), JobErr> {
    exec(
        tx,
        "DELETE FROM tool_calls WHERE request_id IN (SELECT request_id FROM rounds WHERE at_ms < $1)",
        &[&t],
    )
    .await?;
    for table in ["rounds", "tool_results", "effects", "events", "served"] {
        exec(tx, &format!("DELETE FROM {table} WHERE at_ms < $1"), &[&t]).await?;
    }
    exec(tx, "DELETE FROM declared_tools WHERE at_ms < $1", &[&t]).await?;
    exec(
        tx,
        "DELETE FROM tool_schemas WHERE at_ms < $1 AND schema_digest NOT IN (SELECT schema_digest FROM declared_tools WHERE schema_digest IS NOT NULL)",
        &[&t],
    )
    .await?;
    exec(
        tx,
        "DELETE FROM principal_tokens WHERE expires_at_ms < $1",
        &[&t],
    )
    .await?;
    exec(
        tx,
        "DELETE FROM instances WHERE heartbeat_ms < $1",
        &[&(crate::clock::now_ms() - 24 * 3_600_000)],
    )
    .await?;
    Ok(())
}

/// What a request records before it goes upstream ([`BeforeUpstream`]), in the batch's
/// transaction: its tool results one by one (each reads what it wrote), then the rest.
async fn before_upstream(tx: &Transaction<'_>, u: &BeforeUpstream) -> Result<(), JobErr> {
    for t in &u.tool_results {
        insert_tool_result(tx, t).await?;
    }
    let mut rest = Vec::new();
    plan_before_upstream(&mut rest, u);
    run_stmts(tx, &rest).await
}

/// [`BeforeUpstream`] but its tool results: the run's untrusted mark and the declared tools.
fn plan_before_upstream<'a>(out: &mut Vec<Stmt<'a>>, u: &'a BeforeUpstream) {
    if let Some(r) = &u.run_untrusted {
        out.push(
            Stmt::new(
                "INSERT INTO run_trust (run_id, trust, request_id, at_ms)
                 VALUES ($1, 'untrusted', $2, $3) ON CONFLICT (run_id) DO NOTHING",
            )
            .arg(&r.run_id)
            .arg(&r.request_id)
            .arg(r.at_ms),
        );
    }
    if let Some(d) = &u.declared_tools {
        plan_declared_tools(out, d);
    }
}

/// A decided round's unit of work ([`RoundCommit`]). Claims first: a claim taken over since
/// fails the unit (fenced) before anything of it is written.
async fn round_commit(
    tx: &Transaction<'_>,
    u: &RoundCommit,
    instance: &str,
    held: &mut Held,
) -> Result<(), JobErr> {
    confirm(tx, &u.claims, instance, held).await?;
    if let Some(r) = &u.served {
        confirm(tx, &r.claims, instance, held).await?;
    }
    let mut rest = Vec::new();
    plan_round_commit(&mut rest, u);
    run_stmts(tx, &rest).await
}

/// A [`RoundCommit`]'s rows once its claims hold: the served record, the round, its events.
fn plan_round_commit<'a>(out: &mut Vec<Stmt<'a>>, u: &'a RoundCommit) {
    if let Some(r) = &u.served {
        plan_served(out, r);
    }
    if let Some(r) = &u.round {
        plan_round(out, r);
    }
    for e in &u.events {
        plan_event(out, e);
    }
}

/// A served record, insert-if-absent on (run, node, attempt, round) (the first answer is the
/// record); its claims are confirmed first, in the same transaction ([`round_commit`]).
fn plan_served<'a>(out: &mut Vec<Stmt<'a>>, r: &'a ServedRecord) {
    out.push(
        Stmt::new(
            "INSERT INTO served (run_id, node_id, attempt, round_index, request_digest, request_id, status,
                content_type, body, body_bytes, body_digest, truncated, calls, at_ms, redacted, reader)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
             ON CONFLICT (run_id, node_id, attempt, round_index) DO NOTHING",
        )
        .arg(&r.run_id)
        .arg(&r.node_id)
        .arg(i64::from(r.attempt))
        .arg(i64::from(r.round_index))
        .arg(&r.request_digest)
        .arg(&r.request_id)
        .arg(i64::from(r.status))
        .arg(&r.content_type)
        .arg(&r.body.bytes)
        .arg(r.body.total_bytes as i64)
        .arg(&r.body.digest)
        .arg(flag(r.body.truncated))
        .arg(serde_json::to_string(&r.calls).unwrap_or_else(|_| "[]".into()))
        .arg(r.at_ms)
        .arg(flag(r.body.redacted))
        .arg(&r.reader),
    );
}

/// Confirms claims this replica holds: each must still be at the epoch its claim returned and
/// owned by this replica, else the claim was taken over and the job fails closed.
async fn confirm(
    tx: &Transaction<'_>,
    claims: &[(String, String)],
    instance: &str,
    held: &mut Held,
) -> Result<(), JobErr> {
    for (effect_id, call_id) in claims {
        let key = (effect_id.clone(), call_id.clone());
        let Some(epoch) = held.get(&key).copied() else {
            return Err(JobErr::Fenced(effect_id.clone()));
        };
        let n = exec(
            tx,
            "UPDATE effects SET released = 1 WHERE effect_id = $1 AND call_id = $2 AND instance = $3 AND epoch = $4",
            &[effect_id, call_id, &instance, &epoch],
        )
        .await?;
        if n != 1 {
            held.remove(&key);
            return Err(JobErr::Fenced(effect_id.clone()));
        }
    }
    Ok(())
}

async fn claim(
    tx: &Transaction<'_>,
    c: &EffectClaim,
    instance: &str,
    held: &mut Held,
) -> Result<Claim, JobErr> {
    let attempt = c.run.attempt.map(i64::from);
    let inserted = query_opt(
        tx,
        "INSERT INTO effects (effect_id, tool_id, call_id, run_id, node_id, attempt, keying, state, at_ms, instance, reader, epoch)
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'claimed', $8, $9, $10, 0)
         ON CONFLICT (effect_id) DO NOTHING RETURNING epoch",
        &[&c.effect_id, &c.tool_id, &c.call_id, &c.run.run_id, &c.run.node_id, &attempt, &c.keying, &c.at_ms, &instance, &c.reader],
    )
    .await?;
    if let Some(row) = inserted {
        held.insert((c.effect_id.clone(), c.call_id.clone()), row.try_get(0)?);
        return Ok(Claim::Claimed);
    }
    // Take over a claim whose call never reached the agent (not confirmed released) when its
    // lease ran out or its owner is dead (its replica's liveness lock is not held: the
    // session that held it ended): compare-and-set on the row, with a new epoch that fences
    // the old owner.
    let taken = query_opt(
        tx,
        "UPDATE effects SET call_id = $2, run_id = $3, node_id = $4, attempt = $5, at_ms = $6, instance = $7,
            reader = $9, epoch = epoch + 1
         WHERE effect_id = $1 AND released = 0 AND state = 'claimed'
           AND (at_ms < $8 OR (instance != $7 AND NOT EXISTS (
                SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                  AND l.classid = ((hashtextextended(effects.instance, 0) >> 32) & 4294967295)::oid
                  AND l.objid = (hashtextextended(effects.instance, 0) & 4294967295)::oid)))
         RETURNING epoch",
        &[&c.effect_id, &c.call_id, &c.run.run_id, &c.run.node_id, &attempt, &c.at_ms, &instance, &(c.at_ms - CLAIM_LEASE_MS), &c.reader],
    )
    .await?;
    if let Some(row) = taken {
        held.insert((c.effect_id.clone(), c.call_id.clone()), row.try_get(0)?);
        return Ok(Claim::Claimed);
    }
    let Some(row) = query_opt(
        tx,
        "SELECT call_id, run_id, reader FROM effects WHERE effect_id = $1",
        &[&c.effect_id],
    )
    .await?
    else {
        return Err(JobErr::Other(format!(
            "effect claim {}: the claim vanished while it was read (retry)",
            c.effect_id
        )));
    };
    let (call_id, run_id, reader): (String, Option<String>, Option<String>) =
        (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
    if reader.as_deref() != Some(c.reader.as_str()) || run_id != c.run.run_id {
        return Ok(Claim::Foreign);
    }
    let scope = run_id.map_or_else(|| "chat".to_owned(), |r| format!("run:{r}"));
    let result: Option<Vec<u8>> = query_opt(
        tx,
        "SELECT content FROM tool_results WHERE scope = $1 AND tool_call_id = $2 AND truncated = 0 ORDER BY id LIMIT 1",
        &[&scope, &call_id],
    )
    .await?
    .and_then(|r| r.try_get::<_, Option<Vec<u8>>>(0).ok().flatten());
    Ok(Claim::Existing {
        call_id,
        result: result.map(|b| String::from_utf8_lossy(&b).into_owned()),
    })
}

/// Appends an event at the next sequence of its scope; the scope's advisory lock (held to the
/// commit) keeps replicas from taking the same number.
async fn insert_event(tx: &Transaction<'_>, e: &EventRecord) -> Result<(), JobErr> {
    let mut stmts = Vec::new();
    plan_event(&mut stmts, e);
    run_stmts(tx, &stmts).await
}

/// An event, next in its scope's sequence: the scope's advisory lock (held to the commit, so
/// replicas number one scope in turn), then the insert that reads the next number.
fn plan_event<'a>(out: &mut Vec<Stmt<'a>>, e: &'a EventRecord) {
    let scope = match &e.run.run_id {
        Some(run) => format!("run:{run}"),
        None => format!("request:{}", e.request_id),
    };
    out.push(Stmt::new("SELECT pg_advisory_xact_lock(hashtextextended($1, 7))").arg(scope.clone()));
    out.push(
        Stmt::new(
            "INSERT INTO events (scope, run_id, node_id, request_id, sequence, type, payload, at_ms)
             SELECT $1, $2, $3, $4, coalesce(max(sequence), -1) + 1, $5, $6, $7 FROM events WHERE scope = $1",
        )
        .arg(scope)
        .arg(&e.run.run_id)
        .arg(&e.run.node_id)
        .arg(&e.request_id)
        .arg(e.kind)
        .arg(&e.payload)
        .arg(e.at_ms),
    );
}

fn plan_declared_tools<'a>(out: &mut Vec<Stmt<'a>>, d: &'a DeclaredToolsRecord) {
    for tool in &d.tools {
        let name = &tool.name;
        let digest = tool
            .schema
            .as_deref()
            .map(crate::admission::arguments::args_hash);
        if let (Some(digest), Some(schema)) = (&digest, &tool.schema) {
            let kept = crate::journal::stored_schema_text(schema, &d.redactor);
            out.push(
                Stmt::new(
                    "INSERT INTO tool_schemas (schema_digest, schema, at_ms) VALUES ($1, $2, $3)
                     ON CONFLICT (schema_digest) DO UPDATE SET schema = excluded.schema
                        WHERE tool_schemas.schema IS NULL",
                )
                .arg(digest.clone())
                .arg(kept)
                .arg(d.at_ms),
            );
        }
        out.push(
            Stmt::new(
                "INSERT INTO declared_tools (request_id, run_id, api, name, schema_digest, at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (request_id, name) DO NOTHING",
            )
            .arg(&d.request_id)
            .arg(&d.run_id)
            .arg(d.api)
            .arg(name)
            .arg(digest)
            .arg(d.at_ms),
        );
    }
}

fn plan_round<'a>(out: &mut Vec<Stmt<'a>>, r: &'a RoundRecord) {
    let attempt = r.run.attempt.map(i64::from);
    out.push(
        Stmt::new(
            "INSERT INTO rounds (request_id, at_ms, api, model, stream, run_id, node_id, attempt,
                round_index, request_digest, completion, finish_reason, upstream_status, latency_ms,
                state, error, response, response_bytes, response_digest, response_truncated, channel,
                channel_result, content_trust, client_request_id, response_redacted)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25)
             ON CONFLICT (request_id) DO NOTHING",
        )
        .arg(&r.request_id)
        .arg(r.at_ms)
        .arg(r.api)
        .arg(&r.model)
        .arg(flag(r.stream))
        .arg(&r.run.run_id)
        .arg(&r.run.node_id)
        .arg(attempt)
        .arg(i64::from(r.round_index))
        .arg(&r.request_digest)
        .arg(&r.completion)
        .arg(&r.finish_reason)
        .arg(r.upstream_status.map(i64::from))
        .arg(r.latency_ms as i64)
        .arg(r.state.as_str())
        .arg(&r.error)
        .arg(&r.response.bytes)
        .arg(r.response.total_bytes as i64)
        .arg(&r.response.digest)
        .arg(flag(r.response.truncated))
        .arg(r.channel)
        .arg(&r.channel_result)
        .arg(r.content_trust.map(|t| t.as_str()))
        .arg(&r.client_request_id)
        .arg(flag(r.response.redacted)),
    );
    if let Some(link) = &r.response_link {
        out.push(
            Stmt::new(
                "INSERT INTO responses (response_id, request_id, previous_response_id, run_id,
                    node_id, attempt, api, status, provider_executed, provider_items, content_trust,
                    next_round_index, calls_so_far, at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
                 ON CONFLICT (response_id) DO NOTHING",
            )
            .arg(&link.response_id)
            .arg(&r.request_id)
            .arg(&link.previous_response_id)
            .arg(&r.run.run_id)
            .arg(&r.run.node_id)
            .arg(attempt)
            .arg(r.api)
            .arg(&link.status)
            .arg(flag(!link.provider_items.is_empty()))
            .arg(link.provider_items.join(","))
            .arg(link.content_trust.map(|t| t.as_str()))
            .arg(link.next_round_index.map(i64::from))
            .arg(
                link.calls_so_far
                    .as_ref()
                    .map(|c| crate::strict_json::to_text(&Value::from(c.clone()))),
            )
            .arg(r.at_ms),
        );
        for item in &link.items {
            out.push(
                Stmt::new(
                    "INSERT INTO response_items (item_id, response_id, item_type, provider_executed)
                     VALUES ($1, $2, $3, $4)
                     ON CONFLICT (item_id) DO NOTHING",
                )
                .arg(&item.id)
                .arg(&link.response_id)
                .arg(&item.item_type)
                .arg(flag(item.provider_executed)),
            );
        }
    }
    for c in &r.calls {
        out.push(
            Stmt::new(
                "INSERT INTO tool_calls (request_id, choice, ordinal, call_id, name, outcome, stage,
                    reason, args_hash, tool_id, enforced, rules, redacted_args, logical_invocation_id,
                    node_ordinal)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
                 ON CONFLICT (request_id, choice, ordinal) DO NOTHING",
            )
            .arg(&r.request_id)
            .arg(i64::from(c.choice))
            .arg(i64::from(c.ordinal))
            .arg(&c.call_id)
            .arg(&c.name)
            .arg(c.outcome)
            .arg(c.stage)
            .arg(c.reason)
            .arg(&c.args_hash)
            .arg(&c.tool_id)
            .arg(flag(c.enforced))
            .arg(&c.rules)
            .arg(&c.redacted_args)
            .arg(&c.logical_invocation_id)
            .arg(c.node_ordinal as i64),
        );
    }
}

async fn insert_tool_result(tx: &Transaction<'_>, t: &ToolResultRecord) -> Result<(), JobErr> {
    let scope = match &t.run.run_id {
        Some(run) => format!("run:{run}"),
        None => "chat".to_owned(),
    };
    let inserted = exec(
        tx,
        "INSERT INTO tool_results (scope, run_id, node_id, attempt, tool_call_id, tool_name,
            is_error, content, content_bytes, content_digest, truncated, first_request_id, at_ms, reader)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
         ON CONFLICT (scope, tool_call_id, content_digest) DO NOTHING",
        &[
            &scope,
            &t.run.run_id,
            &t.run.node_id,
            &t.run.attempt.map(i64::from),
            &t.tool_call_id,
            &t.tool_name,
            &flag(t.is_error),
            &t.content.bytes,
            &(t.content.total_bytes as i64),
            &t.content.digest,
            &flag(t.content.truncated),
            &t.request_id,
            &t.at_ms,
            &t.reader,
        ],
    )
    .await?;
    if inserted == 1 {
        exec(
            tx,
            "UPDATE effects SET state = 'completed' WHERE call_id = $1 AND run_id IS NOT DISTINCT FROM $2 AND state = 'claimed'",
            &[&t.tool_call_id, &t.run.run_id],
        )
        .await?;
        let released_at: Option<i64> = query_opt(
            tx,
            "SELECT r.at_ms FROM tool_calls c JOIN rounds r ON r.request_id = c.request_id
             WHERE c.call_id = $1 AND r.run_id IS NOT DISTINCT FROM $2 AND c.outcome = 'executed' ORDER BY c.id DESC LIMIT 1",
            &[&t.tool_call_id, &t.run.run_id],
        )
        .await?
        .map(|r| r.try_get(0))
        .transpose()?;
        insert_event(tx, &t.returned_event(released_at)).await?;
    }
    Ok(())
}

// ---- interrupts and run trust (tool-turn contract §C) ----

/// A row read, or the value outside its vocabulary that refuses it.
enum Read<T> {
    Row(T),
    Unknown(UnknownValue),
}

fn row_of(r: &Row) -> Result<Read<InterruptRow>, JobErr> {
    let json = |s: Option<String>| s.and_then(|s| serde_json::from_str::<Value>(&s).ok());
    let kind: String = r.try_get(2)?;
    let state: String = r.try_get(13)?;
    let state = match state.parse::<InterruptState>() {
        Ok(s) => s,
        Err(v) => return Ok(Read::Unknown(v)),
    };
    Ok(Read::Row(InterruptRow {
        record: InterruptRecord {
            interrupt_id: r.try_get(0)?,
            key: r.try_get(1)?,
            kind: if kind == "approval" {
                "approval"
            } else {
                "custom"
            },
            run: RunKey {
                run_id: r.try_get(3)?,
                node_id: r.try_get(4)?,
                attempt: r.try_get::<_, Option<i64>>(5)?.map(u32_of),
            },
            request_id: r.try_get(6)?,
            principal: r.try_get(7)?,
            policy_revision: r.try_get(8)?,
            payload: json(r.try_get(9)?).unwrap_or(Value::Null),
            calls: json(r.try_get(10)?).unwrap_or(Value::Null),
            requested_at_ms: r.try_get(11)?,
            expires_at_ms: r.try_get(12)?,
        },
        state,
        resolved_by: r.try_get(14)?,
        resolved_at_ms: r.try_get(15)?,
        resume_value: json(r.try_get(16)?),
        consumed_by: r.try_get(17)?,
        edits: json(r.try_get(18)?),
        inserted: false,
    }))
}

/// `Err(Unreadable)` answers refuse the one operation ([`interrupts::Answer`]).
macro_rules! known {
    ($read:expr) => {
        match $read {
            Read::Row(r) => r,
            Read::Unknown(v) => {
                tracing::error!(error = %v, "interrupt row refused: its stored value is not one turnguard knows (fail closed)");
                return Ok(Err(JournalError::Unreadable(v)));
            }
        }
    };
}

async fn by_id(tx: &Transaction<'_>, id: &str) -> Result<Option<Read<InterruptRow>>, JobErr> {
    let sql = format!(
        "SELECT {} FROM interrupts WHERE interrupt_id = $1",
        interrupts::COLUMNS
    );
    match query_opt(tx, &sql, &[&id]).await? {
        Some(r) => Ok(Some(row_of(&r)?)),
        None => Ok(None),
    }
}

async fn apply_interrupt(
    tx: &Transaction<'_>,
    op: &mut interrupts::Op,
    replies: &mut Replies,
) -> Result<(), JobErr> {
    use interrupts::Op as I;
    match op {
        I::Raise(rec, answer) => {
            let row = raise(tx, rec).await?;
            reply(replies, answer, row);
        }
        I::Resolve(r, answer) => {
            let outcome = resolve(tx, r).await?;
            reply(replies, answer, outcome);
        }
        I::Consume {
            interrupt_id,
            request_id,
            answer,
        } => {
            let used = exec(
                tx,
                "UPDATE interrupts SET consumed_by = $2
                 WHERE interrupt_id = $1 AND state = 'accepted' AND consumed_by IS NULL",
                &[&*interrupt_id, &*request_id],
            )
            .await?
                == 1;
            reply(replies, answer, used);
        }
        I::Pending {
            principal,
            now_ms,
            answer,
        } => {
            let rows = pending(tx, principal, *now_ms).await?;
            reply(replies, answer, rows);
        }
        I::Get {
            interrupt_id,
            answer,
        } => {
            let row: Answer<Option<InterruptRow>> = match by_id(tx, interrupt_id).await? {
                None => Ok(None),
                Some(Read::Row(r)) => Ok(Some(r)),
                Some(Read::Unknown(v)) => Err(JournalError::Unreadable(v)),
            };
            reply(replies, answer, row);
        }
        I::RunTrust {
            run_id,
            untrusted,
            request_id,
            at_ms,
            answer,
        } => {
            if *untrusted {
                exec(
                    tx,
                    "INSERT INTO run_trust (run_id, trust, request_id, at_ms)
                     VALUES ($1, 'untrusted', $2, $3) ON CONFLICT (run_id) DO NOTHING",
                    &[&*run_id, &*request_id, &*at_ms],
                )
                .await?;
            }
            let sticky = query_opt(
                tx,
                "SELECT 1::BIGINT FROM run_trust WHERE run_id = $1 AND trust = 'untrusted'",
                &[&*run_id],
            )
            .await?
            .is_some();
            reply(replies, answer, sticky);
        }
    }
    Ok(())
}

async fn raise(
    tx: &Transaction<'_>,
    rec: &InterruptRecord,
) -> Result<Answer<InterruptRow>, JobErr> {
    let inserted = exec(
        tx,
        "INSERT INTO interrupts (interrupt_id, key, kind, run_id, node_id, attempt,
            request_id, principal, policy_revision, payload, calls, requested_at_ms,
            expires_at_ms, state)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, 'pending')
         ON CONFLICT DO NOTHING",
        &[
            &rec.interrupt_id,
            &rec.key,
            &rec.kind,
            &rec.run.run_id,
            &rec.run.node_id,
            &rec.run.attempt.map(i64::from),
            &rec.request_id,
            &rec.principal,
            &rec.policy_revision,
            &crate::strict_json::to_text(&rec.payload),
            &rec.calls.to_string(),
            &rec.requested_at_ms,
            &rec.expires_at_ms,
        ],
    )
    .await?
        == 1;
    let sql = format!(
        "SELECT {} FROM interrupts WHERE key = $1",
        interrupts::COLUMNS
    );
    let Some(found) = query_opt(tx, &sql, &[&rec.key]).await? else {
        return Err(JobErr::Other(format!(
            "interrupt {}: neither inserted nor found by its key",
            rec.interrupt_id
        )));
    };
    let mut row = known!(row_of(&found)?);
    row.inserted = inserted;
    if inserted {
        let mut payload = rec.payload.clone();
        if let Some(p) = payload.as_object_mut() {
            p.insert("interruptId".into(), json!(rec.interrupt_id));
            p.insert("nodeId".into(), json!(interrupts::node_of(&row)));
        }
        insert_event(
            tx,
            &interrupts::event(&row, "interrupt.requested", payload, rec.requested_at_ms),
        )
        .await?;
    }
    Ok(Ok(row))
}

async fn resolve(tx: &Transaction<'_>, r: &Resolution) -> Result<Answer<Resolved>, JobErr> {
    let held_by_agent = match &r.by_token {
        Some(fp) => query_opt(
            tx,
            "SELECT 1::BIGINT FROM principal_tokens WHERE fingerprint = $1",
            &[fp],
        )
        .await?
        .is_some(),
        None => false,
    };
    let found = match &r.selector {
        Selector::Id(id) => by_id(tx, id).await?,
        Selector::Node {
            run_id,
            node_id,
            interrupt_id,
        } => match by_id(tx, interrupt_id).await? {
            Some(Read::Row(row))
                if !(row.record.run.run_id.as_deref() == Some(run_id.as_str())
                    && interrupts::node_of(&row) == *node_id) =>
            {
                None
            }
            other => other,
        },
    };
    if held_by_agent {
        return Ok(Ok(Resolved::HeldByAgent));
    }
    let Some(found) = found else {
        return Ok(Ok(Resolved::NotFound));
    };
    let row = known!(found);
    if r.by.is_some() && row.record.principal != r.by {
        return Ok(Ok(Resolved::Forbidden(Box::new(row))));
    }
    if row.state != InterruptState::Pending {
        return Ok(Ok(Resolved::AlreadyResolved(Box::new(row))));
    }
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
    let changed = exec(
        tx,
        "UPDATE interrupts SET state = $2, resolved_by = $3, resolved_at_ms = $4,
            resume_value = $5, edits = $6
         WHERE interrupt_id = $1 AND state = 'pending'",
        &[
            &row.record.interrupt_id,
            &state.as_str(),
            &by,
            &r.now_ms,
            &value.to_string(),
            &edits,
        ],
    )
    .await?;
    let now = match by_id(tx, &row.record.interrupt_id).await? {
        None => return Ok(Ok(Resolved::NotFound)),
        Some(read) => known!(read),
    };
    if changed != 1 {
        return Ok(Ok(Resolved::AlreadyResolved(Box::new(now))));
    }
    insert_event(
        tx,
        &interrupts::event(
            &now,
            "interrupt.resolved",
            json!({"nodeId": interrupts::node_of(&now),
                   "interruptId": now.record.interrupt_id,
                   "kind": now.record.kind, "resumeValue": value}),
            r.now_ms,
        ),
    )
    .await?;
    // Delivered to every replica's LISTEN task when this transaction commits.
    exec(
        tx,
        "SELECT pg_notify($1, $2)",
        &[&CHANNEL, &now.record.interrupt_id],
    )
    .await?;
    Ok(Ok(if expired {
        Resolved::Expired(Box::new(now))
    } else {
        Resolved::Won(Box::new(now))
    }))
}

async fn pending(
    tx: &Transaction<'_>,
    principal: &str,
    now_ms: i64,
) -> Result<Answer<Vec<InterruptRow>>, JobErr> {
    let sql = format!(
        "SELECT {} FROM interrupts
         WHERE state = 'pending' AND principal = $1 AND expires_at_ms > $2
         ORDER BY requested_at_ms LIMIT 500",
        interrupts::COLUMNS
    );
    let mut out = Vec::new();
    for r in query(tx, &sql, &[&principal, &now_ms]).await? {
        out.push(known!(row_of(&r)?));
    }
    Ok(Ok(out))
}
