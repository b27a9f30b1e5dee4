-- The transaction that wrote each outbox row, as a full 64-bit id (pg_current_xact_id(): the
-- top-level transaction, also for a row written inside a savepoint). The relay catches a
-- shard that fell behind up from the outbox table (cdc-relay, recovery/catch_up.rs): it keeps
-- in the shard's record a snapshot taken before what the shard acknowledged, and the rows the
-- shard may lack are exactly those whose transaction that snapshot does not show
-- (pg_visible_in_snapshot). The index bounds that search to the rows written since the
-- snapshot's oldest running transaction, however many rows the table retains.
--
-- Added without a default first, then the default set: neither rewrites the table. Rows from
-- before stay NULL: they committed before this migration, so before any snapshot a relay that
-- reads the column takes. The partial index skips them, so building it only reads the table.
-- One table per migration (V23, V24), each waiting for its lock at most 2 s, as V21-V22.
SET LOCAL lock_timeout = '2s';
ALTER TABLE workers.outbox ADD COLUMN IF NOT EXISTS tx xid8;
ALTER TABLE workers.outbox ALTER COLUMN tx SET DEFAULT pg_current_xact_id();
CREATE INDEX IF NOT EXISTS outbox_tx ON workers.outbox (tx) WHERE tx IS NOT NULL;
