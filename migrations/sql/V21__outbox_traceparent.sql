-- Trace context through the outbox: the sending request's W3C `traceparent` (its span, or the
-- one it continued), written with the event; the relay carries it into the stream entry, so
-- the receiving side's spans join the same trace (outbox_core::telemetry). NULL: no trace
-- (spans off and none sent, or rows from before). Nullable without a default: adding it
-- rewrites nothing, and relays before it ignore the column (they find columns by name).
ALTER TABLE consumers.outbox ADD COLUMN traceparent text;
ALTER TABLE workers.outbox   ADD COLUMN traceparent text;
