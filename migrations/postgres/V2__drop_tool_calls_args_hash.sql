-- The index of tool_calls by args_hash is dropped (the SQLite journal's schema step 10, same
-- reason): its key is a SHA-256, so every record lands on a random leaf page. The one query it
-- served, the MCP ticket lookup, is scoped to a run and starts from rounds_run.
DROP INDEX IF EXISTS tool_calls_args_hash;
