//! The SQLite writer's side of `declared_tool_counts` (schema step 12): the tools agent
//! requests declared, counted per (tool name, schema digest, API) for `turnguard policy
//! learn`, and each distinct schema stored once in `tool_schemas`.
//!
//! A commit's declarations are summed in memory and written with one upsert per distinct
//! row, in key order, at the end of the batch: forty chat turns declaring the same tool are
//! one statement and one page, where per-request rows were forty rows and eighty index
//! entries. The counts are the one place the journal updates a row it wrote: a counter only
//! ever grows (`requests + n`, the earliest `first_at_ms`, the latest `last_at_ms`); no
//! record of a call, a round or a decision is ever changed.

use std::collections::BTreeMap;

use rusqlite::params;

use super::{exec, DeclaredToolsRecord, KnownSchemas, MAX_DECLARED_SCHEMA_BYTES};

/// One row's share of a batch: requests, earliest and latest `at_ms` (ms since the epoch).
struct Share {
    requests: i64,
    first_at_ms: i64,
    last_at_ms: i64,
}

/// A batch's declarations, keyed (tool name, schema digest or `''`, API).
#[derive(Default)]
pub(super) struct DeclaredCounts(BTreeMap<(String, String, &'static str), Share>);

impl DeclaredCounts {
    /// Adds one agent request's declarations (a tool name the request declares twice counts
    /// once, with its first schema, as the per-request rows' `UNIQUE (request_id, name)` did)
    /// and stores each schema not yet known to be in `tool_schemas`.
    pub(super) fn add(
        &mut self,
        tx: &rusqlite::Transaction<'_>,
        d: &DeclaredToolsRecord,
        known: &mut KnownSchemas,
    ) -> rusqlite::Result<()> {
        let mut seen: Vec<&str> = Vec::with_capacity(d.tools.len());
        for tool in &d.tools {
            let name = &tool.name;
            if seen.contains(&name.as_str()) {
                continue;
            }
            seen.push(name);
            let digest = tool
                .schema
                .as_deref()
                .map(|schema| known.digest(tool.fingerprint, schema));
            if let (Some(digest), Some(schema)) = (&digest, &tool.schema) {
                if !known.contains(digest) {
                    known.pending.push(digest.clone());
                    let text = schema.to_string();
                    let kept = (text.len() <= MAX_DECLARED_SCHEMA_BYTES).then_some(text);
                    exec(
                        tx,
                        "INSERT INTO tool_schemas (schema_digest, schema, at_ms) VALUES (?1, ?2, ?3)
                         ON CONFLICT (schema_digest) DO NOTHING",
                        params![digest, kept, d.at_ms],
                    )?;
                }
            }
            let key = (name.clone(), digest.unwrap_or_default(), d.api);
            let share = self.0.entry(key).or_insert(Share {
                requests: 0,
                first_at_ms: d.at_ms,
                last_at_ms: d.at_ms,
            });
            share.requests += 1;
            share.first_at_ms = share.first_at_ms.min(d.at_ms);
            share.last_at_ms = share.last_at_ms.max(d.at_ms);
        }
        Ok(())
    }

    /// Adds the batch's counts to `declared_tool_counts`, one upsert per row, in key order.
    pub(super) fn flush(self, tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<()> {
        for ((name, digest, api), s) in self.0 {
            exec(
                tx,
                "INSERT INTO declared_tool_counts (name, schema_digest, api, requests, first_at_ms, last_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (name, schema_digest, api) DO UPDATE SET
                    requests = requests + excluded.requests,
                    first_at_ms = min(first_at_ms, excluded.first_at_ms),
                    last_at_ms = max(last_at_ms, excluded.last_at_ms)",
                params![name, digest, api, s.requests, s.first_at_ms, s.last_at_ms],
            )?;
        }
        Ok(())
    }
}
