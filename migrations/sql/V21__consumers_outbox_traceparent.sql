-- Trace context through the outbox: the sending request's W3C `traceparent` (its span, or the
-- one it continued), written with the event; the relay carries it into the stream entry, so
-- the receiving side's spans join the same trace (outbox_core::telemetry). NULL: no trace
-- (spans off and none trusted, or rows from before). Nullable without a default: adding it
-- rewrites nothing, and relays before it ignore the column (they find columns by name).
-- One table per migration (V21, V22), each waiting for its lock at most 2 s: a long reader
-- (a rebuild's scan, retention) makes the migration fail and be run again rather than queue
-- that side's sends behind it.
SET LOCAL lock_timeout = '2s';
ALTER TABLE consumers.outbox ADD COLUMN IF NOT EXISTS traceparent text;
