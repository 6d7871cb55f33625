-- Declared schemas were stored as the agent sent them, before turnguard redacted them (the
-- SQLite journal's schema step 14, same fix): their text is cleared, the digests stay, and the
-- next declaration of a schema stores its redacted text again (the insert fills a cleared row).
UPDATE tool_schemas SET schema = NULL;
