-- Who wrote each message (issue 24): the subject (`sub`) of the token it was sent with,
-- carried in the outbox event to the other side's inbox. NULL for messages from before, or
-- from a service run with --allow-anonymous. A nullable column without a default changes
-- only the catalog; one table per migration, its lock wait bounded (as V10 to V13).
SET LOCAL lock_timeout = '2s';
ALTER TABLE workers.inbox ADD COLUMN IF NOT EXISTS sender text
  CHECK (sender IS NULL OR length(sender) BETWEEN 1 AND 255);
