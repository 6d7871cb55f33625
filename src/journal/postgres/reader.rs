//! The journal's reads on PostgreSQL: the same queries as the SQLite reader
//! ([`super::super::SqliteReader`], [`super::super::McpReader`]) over the shared pool, with
//! the same results. Integers are `BIGINT`, 0/1 flags too.

use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::super::reader::{DeclaredToolRow, EffectRow, EventRow, LearnRows, RunSummary};
use super::super::{JournalError, Recorded, ServedCall, ServedRecord, TicketRow};
use super::{pool_err, read_err};
use crate::model::{ChainLink, StoredItemRow};
use crate::policy::bundle::ContentTrust;

async fn query(
    pool: &Pool,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, JournalError> {
    let client = pool.get().await.map_err(pool_err)?;
    let st = client.prepare_cached(sql).await.map_err(read_err)?;
    client.query(&st, params).await.map_err(read_err)
}

async fn query_opt(
    pool: &Pool,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Option<Row>, JournalError> {
    Ok(query(pool, sql, params).await?.into_iter().next())
}

/// A column's value (a type mismatch is an error, never a default).
pub(super) fn get<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    i: usize,
) -> Result<T, JournalError> {
    row.try_get(i).map_err(read_err)
}

/// A `BIGINT` column holding a `u32` (out of range: the largest value).
pub(super) fn u32_of(v: i64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// A stored `contentTrust`: a value outside the vocabulary fails the read.
pub(super) fn trust(v: Option<String>) -> Result<Option<ContentTrust>, JournalError> {
    v.map(|s| s.parse::<ContentTrust>().map_err(JournalError::Unreadable))
        .transpose()
}

pub(crate) async fn served(
    pool: &Pool,
    run: &str,
    node: &str,
    attempt: u32,
    round: u32,
) -> Result<Option<ServedRecord>, JournalError> {
    let Some(r) = query_opt(
        pool,
        "SELECT request_digest, request_id, status, content_type, body, body_bytes, body_digest, truncated, calls, at_ms, redacted, reader
         FROM served WHERE run_id = $1 AND node_id = $2 AND attempt = $3 AND round_index = $4",
        &[&run, &node, &i64::from(attempt), &i64::from(round)],
    )
    .await?
    else {
        return Ok(None);
    };
    let calls: String = get(&r, 8)?;
    Ok(Some(ServedRecord {
        run_id: run.to_owned(),
        node_id: node.to_owned(),
        attempt,
        round_index: round,
        request_digest: get(&r, 0)?,
        request_id: get(&r, 1)?,
        status: u16::try_from(get::<i64>(&r, 2)?).unwrap_or(500),
        content_type: get(&r, 3)?,
        body: Recorded::stored(
            get::<Option<Vec<u8>>>(&r, 4)?.unwrap_or_default(),
            get::<i64>(&r, 5)? as u64,
            get(&r, 6)?,
            get::<i64>(&r, 7)? != 0,
            get::<i64>(&r, 10)? != 0,
        ),
        calls: serde_json::from_str::<Vec<ServedCall>>(&calls).unwrap_or_default(),
        claims: Vec::new(),
        at_ms: get(&r, 9)?,
        reader: get(&r, 11)?,
    }))
}

pub(crate) async fn token_seen(pool: &Pool, fingerprint: &str) -> Result<bool, JournalError> {
    let r = query_opt(
        pool,
        "SELECT 1::BIGINT FROM principal_tokens WHERE fingerprint = $1",
        &[&fingerprint],
    )
    .await?;
    Ok(r.is_some())
}

pub(crate) async fn latest_attempt(
    pool: &Pool,
    run: &str,
    node: &str,
    round: u32,
) -> Result<Option<u32>, JournalError> {
    let r = query_opt(
        pool,
        "SELECT max(attempt) FROM served WHERE run_id = $1 AND node_id = $2 AND round_index = $3",
        &[&run, &node, &i64::from(round)],
    )
    .await?;
    match r {
        Some(r) => Ok(get::<Option<i64>>(&r, 0)?.map(u32_of)),
        None => Ok(None),
    }
}

pub(crate) async fn tool_result(
    pool: &Pool,
    run: &str,
    call_id: &str,
) -> Result<Option<Option<(String, bool)>>, JournalError> {
    let scope = format!("run:{run}");
    let Some(r) = query_opt(
        pool,
        "SELECT content, truncated, is_error FROM tool_results WHERE scope = $1 AND tool_call_id = $2 ORDER BY id LIMIT 1",
        &[&scope, &call_id],
    )
    .await?
    else {
        return Ok(None);
    };
    let truncated = get::<i64>(&r, 1)? != 0;
    let content: Option<Vec<u8>> = get(&r, 0)?;
    let is_error = get::<i64>(&r, 2)? != 0;
    Ok(Some(if truncated {
        None
    } else {
        Some((
            String::from_utf8_lossy(&content.unwrap_or_default()).into_owned(),
            is_error,
        ))
    }))
}

pub(crate) async fn stored_items(
    pool: &Pool,
    ids: &[String],
) -> Result<Vec<StoredItemRow>, JournalError> {
    let mut rows = Vec::new();
    for id in ids {
        if let Some(r) = query_opt(
            pool,
            "SELECT i.response_id, i.provider_executed, r.status, r.content_trust, i.item_type
             FROM response_items i JOIN responses r ON r.response_id = i.response_id
             WHERE i.item_id = $1",
            &[id],
        )
        .await?
        {
            rows.push(StoredItemRow {
                item_id: id.clone(),
                response_id: get(&r, 0)?,
                provider_executed: get::<i64>(&r, 1)? != 0,
                status: get(&r, 2)?,
                content_trust: trust(get(&r, 3)?)?,
                item_type: get(&r, 4)?,
            });
        }
    }
    Ok(rows)
}

pub(crate) async fn response_chain(
    pool: &Pool,
    previous: &str,
    max: usize,
) -> Result<Vec<ChainLink>, JournalError> {
    let mut links: Vec<ChainLink> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut next = Some(previous.to_owned());
    while let Some(id) = next.take() {
        if links.len() >= max || !seen.insert(id.clone()) {
            break;
        }
        let Some(r) = query_opt(
            pool,
            "SELECT request_id, previous_response_id, status, provider_executed, content_trust,
                    next_round_index, calls_so_far
             FROM responses WHERE response_id = $1",
            &[&id],
        )
        .await?
        else {
            break;
        };
        let link = ChainLink {
            response_id: id.clone(),
            request_id: get(&r, 0)?,
            previous_response_id: get(&r, 1)?,
            status: get(&r, 2)?,
            provider_executed: get::<i64>(&r, 3)? != 0,
            content_trust: trust(get(&r, 4)?)?,
            next_round_index: get::<Option<i64>>(&r, 5)?.map(u32_of),
            calls_so_far: get::<Option<String>>(&r, 6)?.and_then(|c| serde_json::from_str(&c).ok()),
        };
        next = link.previous_response_id.clone();
        links.push(link);
    }
    Ok(links)
}

pub(crate) async fn call_name(
    pool: &Pool,
    request_id: &str,
    call_id: &str,
) -> Result<Option<String>, JournalError> {
    match query_opt(
        pool,
        "SELECT name FROM tool_calls WHERE request_id = $1 AND call_id = $2 ORDER BY id LIMIT 1",
        &[&request_id, &call_id],
    )
    .await?
    {
        Some(r) => Ok(Some(get(&r, 0)?)),
        None => Ok(None),
    }
}

pub(crate) async fn released_calls(pool: &Pool, run: &str) -> Result<u32, JournalError> {
    let r = query_opt(
        pool,
        "SELECT count(*) FROM rounds r JOIN tool_calls t ON t.request_id = r.request_id
         WHERE r.run_id = $1 AND t.outcome = 'executed'",
        &[&run],
    )
    .await?;
    match r {
        Some(r) => Ok(u32_of(get(&r, 0)?)),
        None => Ok(0),
    }
}

pub(crate) async fn run_untrusted(pool: &Pool, run: &str) -> Result<bool, JournalError> {
    let r = query_opt(
        pool,
        "SELECT count(*) FROM run_trust WHERE run_id = $1 AND trust = 'untrusted'",
        &[&run],
    )
    .await?;
    match r {
        Some(r) => Ok(get::<i64>(&r, 0)? > 0),
        None => Ok(false),
    }
}

pub(crate) async fn replay_cursor(pool: &Pool, run: &str, node: &str) -> Result<u32, JournalError> {
    match query_opt(
        pool,
        "SELECT skipped FROM replay_cursor WHERE run_id = $1 AND node_id = $2",
        &[&run, &node],
    )
    .await?
    {
        Some(r) => Ok(u32_of(get(&r, 0)?)),
        None => Ok(0),
    }
}

pub(crate) async fn effects(pool: &Pool, run: &str) -> Result<Vec<EffectRow>, JournalError> {
    query(
        pool,
        "SELECT effect_id, tool_id, node_id, attempt, keying, state, at_ms FROM effects WHERE run_id = $1 ORDER BY at_ms, effect_id",
        &[&run],
    )
    .await?
    .iter()
    .map(|r| {
        Ok(EffectRow {
            effect_id: get(r, 0)?,
            tool_id: get(r, 1)?,
            node_id: get(r, 2)?,
            attempt: get::<Option<i64>>(r, 3)?.map(u32_of),
            keying: get(r, 4)?,
            state: get(r, 5)?,
            at_ms: get(r, 6)?,
        })
    })
    .collect()
}

pub(crate) async fn events(pool: &Pool, run: &str) -> Result<Vec<EventRow>, JournalError> {
    let scope = format!("run:{run}");
    query(
        pool,
        "SELECT sequence, type, payload, at_ms, node_id FROM events WHERE scope = $1 ORDER BY sequence",
        &[&scope],
    )
    .await?
    .iter()
    .map(|r| {
        Ok(EventRow {
            sequence: get(r, 0)?,
            kind: get(r, 1)?,
            payload: get(r, 2)?,
            at_ms: get(r, 3)?,
            node_id: get(r, 4)?,
        })
    })
    .collect()
}

pub(crate) async fn runs(pool: &Pool) -> Result<Vec<RunSummary>, JournalError> {
    query(
        pool,
        "SELECT r.run_id, count(DISTINCT r.id), count(t.id), min(r.at_ms), max(r.at_ms)
         FROM rounds r LEFT JOIN tool_calls t ON t.request_id = r.request_id
         WHERE r.run_id IS NOT NULL GROUP BY r.run_id ORDER BY max(r.at_ms) DESC",
        &[],
    )
    .await?
    .iter()
    .map(|r| {
        Ok(RunSummary {
            run_id: get(r, 0)?,
            rounds: get(r, 1)?,
            calls: get(r, 2)?,
            first_ms: get(r, 3)?,
            last_ms: get(r, 4)?,
            client_request_id: None,
        })
    })
    .collect()
}

pub(crate) async fn chat_turns(pool: &Pool, limit: usize) -> Result<Vec<RunSummary>, JournalError> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    query(
        pool,
        "SELECT CASE WHEN strpos(r.request_id, '#repair-') > 0
                     THEN substr(r.request_id, 1, strpos(r.request_id, '#repair-') - 1)
                     ELSE r.request_id END AS turn,
                count(DISTINCT r.id), count(t.id), min(r.at_ms), max(r.at_ms),
                max(r.client_request_id)
         FROM rounds r LEFT JOIN tool_calls t ON t.request_id = r.request_id
         WHERE r.run_id IS NULL GROUP BY turn ORDER BY max(r.at_ms) DESC LIMIT $1",
        &[&limit],
    )
    .await?
    .iter()
    .map(|r| {
        Ok(RunSummary {
            run_id: format!("chat:{}", get::<String>(r, 0)?),
            rounds: get(r, 1)?,
            calls: get(r, 2)?,
            first_ms: get(r, 3)?,
            last_ms: get(r, 4)?,
            client_request_id: get(r, 5)?,
        })
    })
    .collect()
}

pub(crate) async fn show(pool: &Pool, run: &str) -> Result<Vec<serde_json::Value>, JournalError> {
    let (filter, key) = match run.strip_prefix("chat:") {
        Some(request) => (
            "r.run_id IS NULL AND (r.request_id = $1 OR r.client_request_id = $1 OR substr(r.request_id, 1, length($1) + 8) = $1 || '#repair-')",
            request,
        ),
        None => ("r.run_id = $1", run),
    };
    let rounds = query(
        pool,
        &format!(
            "SELECT r.request_id, r.node_id, r.attempt, r.round_index, r.api, r.model, r.state, r.completion,
                    r.upstream_status, r.at_ms, r.client_request_id
             FROM rounds r WHERE {filter} ORDER BY r.at_ms, r.id"
        ),
        &[&key],
    )
    .await?;
    let mut out = Vec::with_capacity(rounds.len());
    for r in &rounds {
        let id: String = get(r, 0)?;
        let calls = query(
            pool,
            "SELECT call_id, name, outcome, stage, reason, args_hash, redacted_args, logical_invocation_id
             FROM tool_calls WHERE request_id = $1 ORDER BY choice, ordinal",
            &[&id],
        )
        .await?
        .iter()
        .map(|c| {
            Ok(serde_json::json!({
                "callId": get::<String>(c, 0)?, "name": get::<String>(c, 1)?, "outcome": get::<String>(c, 2)?,
                "stage": get::<String>(c, 3)?, "reason": get::<String>(c, 4)?,
                "argsHash": get::<Option<String>>(c, 5)?,
                "arguments": get::<Option<String>>(c, 6)?.and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok()),
                "logicalInvocationId": get::<Option<String>>(c, 7)?,
            }))
        })
        .collect::<Result<Vec<_>, JournalError>>()?;
        out.push(serde_json::json!({
            "requestId": id, "nodeId": get::<Option<String>>(r, 1)?,
            "attempt": get::<Option<i64>>(r, 2)?, "round": get::<i64>(r, 3)?, "api": get::<String>(r, 4)?,
            "model": get::<Option<String>>(r, 5)?, "state": get::<String>(r, 6)?,
            "completion": get::<Option<String>>(r, 7)?, "upstreamStatus": get::<Option<i64>>(r, 8)?,
            "atMs": get::<i64>(r, 9)?,
            "clientRequestId": get::<Option<String>>(r, 10)?,
            "calls": calls,
        }));
    }
    Ok(out)
}

pub(crate) async fn learn_rows(pool: &Pool) -> Result<LearnRows, JournalError> {
    let mut out = LearnRows::default();
    for r in query(
        pool,
        "SELECT d.name, count(DISTINCT d.request_id), count(DISTINCT d.schema_digest),
                (SELECT s.schema FROM declared_tools d2 JOIN tool_schemas s ON s.schema_digest = d2.schema_digest
                 WHERE d2.name = d.name GROUP BY s.schema_digest ORDER BY count(*) DESC, max(d2.at_ms) DESC LIMIT 1),
                (SELECT d3.api FROM declared_tools d3 WHERE d3.name = d.name ORDER BY d3.at_ms DESC, d3.id DESC LIMIT 1)
         FROM declared_tools d GROUP BY d.name ORDER BY d.name",
        &[],
    )
    .await?
    .iter()
    {
        out.declared.push(DeclaredToolRow {
            name: get(r, 0)?,
            requests: get(r, 1)?,
            schemas: get(r, 2)?,
            schema: get(r, 3)?,
            api: get::<Option<String>>(r, 4)?.unwrap_or_default(),
        });
    }
    for r in query(
        pool,
        "SELECT name, outcome, enforced, count(*) FROM tool_calls GROUP BY name, outcome, enforced ORDER BY name, outcome",
        &[],
    )
    .await?
    .iter()
    {
        out.calls
            .push((get(r, 0)?, get(r, 1)?, get::<i64>(r, 2)? != 0, get(r, 3)?));
    }
    let results = query(
        pool,
        "SELECT tool_name, first_request_id FROM tool_results WHERE tool_name IS NOT NULL ORDER BY id",
        &[],
    )
    .await?;
    for r in &results {
        let (tool, request): (String, String) = (get(r, 0)?, get(r, 1)?);
        let names = query(
            pool,
            "SELECT name FROM tool_calls WHERE request_id = $1 ORDER BY choice, ordinal",
            &[&request],
        )
        .await?
        .iter()
        .map(|n| get::<String>(n, 0))
        .collect::<Result<Vec<_>, _>>()?;
        out.followups.push((tool, names));
    }
    Ok(out)
}

pub(crate) async fn tickets(
    pool: &Pool,
    run: &str,
    args_hash: &str,
    names: &[String],
) -> Result<Vec<TicketRow>, JournalError> {
    let rows = query(
        pool,
        // The run's rounds (`rounds_run`), then each round's calls by `request_id`: there is no
        // index on `args_hash` (migration V2).
        "SELECT c.id, c.request_id, c.call_id, c.name, r.node_id, r.attempt, r.content_trust
         FROM rounds r JOIN tool_calls c ON c.request_id = r.request_id
         WHERE r.run_id = $1 AND r.api != 'mcp' AND c.args_hash = $2
           AND (c.outcome = 'executed' OR c.enforced = 0)
         ORDER BY c.id",
        &[&run, &args_hash],
    )
    .await?;
    let mut out = Vec::new();
    for r in &rows {
        let t = TicketRow {
            row: get(r, 0)?,
            request_id: get(r, 1)?,
            call_id: get(r, 2)?,
            name: get(r, 3)?,
            node_id: get(r, 4)?,
            attempt: get::<Option<i64>>(r, 5)?.map(u32_of),
            content_trust: trust(get(r, 6)?)?,
        };
        if names.contains(&t.name) {
            out.push(t);
        }
    }
    Ok(out)
}

pub(crate) async fn effect_state(
    pool: &Pool,
    effect_id: &str,
) -> Result<Option<String>, JournalError> {
    match query_opt(
        pool,
        "SELECT state FROM effects WHERE effect_id = $1",
        &[&effect_id],
    )
    .await?
    {
        Some(r) => Ok(Some(get(&r, 0)?)),
        None => Ok(None),
    }
}

pub(crate) async fn recorded(
    pool: &Pool,
    run: Option<&str>,
    call_id: &str,
    reader: &str,
) -> Result<Option<String>, JournalError> {
    let scope = run.map_or_else(|| "chat".to_owned(), |r| format!("run:{r}"));
    match query_opt(
        pool,
        "SELECT content FROM tool_results WHERE scope = $1 AND tool_call_id = $2 AND truncated = 0
         AND reader = $3 ORDER BY id LIMIT 1",
        &[&scope, &call_id, &reader],
    )
    .await?
    {
        Some(r) => {
            Ok(get::<Option<Vec<u8>>>(&r, 0)?.map(|b| String::from_utf8_lossy(&b).into_owned()))
        }
        None => Ok(None),
    }
}
