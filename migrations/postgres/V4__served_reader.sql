-- Who may read a served record or a recorded tool result again (`person:<sub>`, or the agent
-- when no verified person acted), as `effects.reader` is for a claimed effect (the SQLite
-- journal's schema step 15, same change). Recovery and replay serve a record, and the MCP
-- front a recorded result, only to its reader; rows from before this step have none and are
-- served to nobody.
ALTER TABLE served ADD COLUMN reader TEXT;
ALTER TABLE tool_results ADD COLUMN reader TEXT;
