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

use std::collections::{BTreeMap, HashSet};

use rusqlite::params;

use super::{exec, stored_schema_text, DeclaredToolsRecord, KnownSchemas};

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
        tx: &rusqlite::Connection,
        d: &DeclaredToolsRecord,
        known: &mut KnownSchemas,
    ) -> rusqlite::Result<()> {
        // A set, not a list: a body may declare tens of thousands of tools. None for one
        // tool, which cannot repeat.
        let mut seen: Option<HashSet<&str>> =
            (d.tools.len() > 1).then(|| HashSet::with_capacity(d.tools.len()));
        for tool in &d.tools {
            let name = &tool.name;
            if seen
                .as_mut()
                .is_some_and(|seen| !seen.insert(name.as_str()))
            {
                continue;
            }
            let digest = tool
                .schema
                .as_deref()
                .map(|schema| known.digest(tool.fingerprint, schema));
            if let (Some(digest), Some(schema)) = (&digest, &tool.schema) {
                if !known.contains(digest) {
                    known.pending.push(digest.clone());
                    let kept = stored_schema_text(schema, &d.redactor);
                    exec(
                        tx,
                        "INSERT INTO tool_schemas (schema_digest, schema, at_ms) VALUES (?1, ?2, ?3)
                         ON CONFLICT (schema_digest) DO UPDATE SET schema = excluded.schema
                            WHERE tool_schemas.schema IS NULL",
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
    pub(super) fn flush(self, tx: &rusqlite::Connection) -> rusqlite::Result<()> {
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

/// Every `declared_tool_counts` row as (name, schema digest, requests, first, last), in key
/// order: what the tests of this table and of schema step 12 compare.
#[cfg(test)]
pub(super) fn counts(conn: &rusqlite::Connection) -> Vec<(String, String, i64, i64, i64)> {
    conn.prepare(
        "SELECT name, schema_digest, requests, first_at_ms, last_at_ms
         FROM declared_tool_counts ORDER BY name, schema_digest, api",
    )
    .and_then(|mut st| {
        st.query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })?
        .collect()
    })
    .expect("declared_tool_counts is readable")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::journal::DeclaredSchema;

    fn record(at_ms: i64, tools: &[(&str, Option<serde_json::Value>)]) -> DeclaredToolsRecord {
        DeclaredToolsRecord {
            request_id: format!("r{at_ms}"),
            at_ms,
            run_id: None,
            api: "openai_chat",
            tools: tools
                .iter()
                .map(|(name, schema)| DeclaredSchema {
                    name: (*name).to_owned(),
                    schema: schema.clone().map(Arc::new),
                    fingerprint: None,
                })
                .collect(),
            redactor: Arc::new(
                crate::policy::Redactor::compile(&Default::default(), "t", "").unwrap(),
            ),
        }
    }

    /// A schema whose stored text was cleared (schema step 14: it was kept unredacted) is
    /// stored again, redacted, the next time it is declared.
    #[test]
    fn a_cleared_schema_is_stored_again_redacted() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        crate::journal::schema::migrate(&conn).unwrap();
        let schema = serde_json::json!({"type": "object", "description": "key sk-proj-abcdefghijklmnopqrstuvwxyz0123"});
        let digest = crate::admission::arguments::args_hash(&schema);
        conn.execute(
            "INSERT INTO tool_schemas (schema_digest, schema, at_ms) VALUES (?1, NULL, 1)",
            [&digest],
        )
        .unwrap();
        let tx = conn.transaction().unwrap();
        let mut counts = DeclaredCounts::default();
        let mut known = KnownSchemas::default();
        counts
            .add(&tx, &record(5, &[("probe", Some(schema))]), &mut known)
            .unwrap();
        counts.flush(&tx).unwrap();
        tx.commit().unwrap();
        let stored: String = conn
            .query_row(
                "SELECT schema FROM tool_schemas WHERE schema_digest = ?1",
                [&digest],
                |r| r.get(0),
            )
            .unwrap();
        assert!(
            stored.contains("[REDACTED:api-key]") && !stored.contains("sk-proj"),
            "{stored}"
        );
    }

    /// Two commits' declarations add up per (name, schema, API); a name declared twice in one
    /// request counts once, with its first schema; each schema is stored once.
    #[test]
    fn declarations_are_counted_per_request_and_summed_across_commits() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        crate::journal::schema::migrate(&conn).unwrap();
        let a = serde_json::json!({"type": "object", "properties": {"q": {"type": "string"}}});
        let b = serde_json::json!({"type": "object"});
        let mut known = KnownSchemas::default();
        for (at, tools) in [
            (
                10,
                vec![
                    ("lookup", Some(a.clone())),
                    ("lookup", Some(b.clone())),
                    ("ping", None),
                ],
            ),
            (20, vec![("lookup", Some(a.clone()))]),
        ] {
            let tx = conn.transaction().unwrap();
            let mut counts = DeclaredCounts::default();
            counts.add(&tx, &record(at, &tools), &mut known).unwrap();
            counts.flush(&tx).unwrap();
            tx.commit().unwrap();
            known.settle(true);
        }
        let rows = counts(&conn);
        let digest = crate::admission::arguments::args_hash(&a);
        assert_eq!(
            rows,
            [
                ("lookup".to_owned(), digest, 2, 10, 20),
                ("ping".to_owned(), String::new(), 1, 10, 10)
            ]
        );
        let schemas: i64 = conn
            .query_row("SELECT count(*) FROM tool_schemas", [], |r| r.get(0))
            .unwrap();
        assert_eq!(
            schemas, 1,
            "the second `lookup` schema of the first request is not used"
        );
    }
}
