-- What the chat services need beyond the base tables.
--   messages.idempotency_key: a retried POST with the same Idempotency-Key returns the
--     original message instead of sending twice (unique per side).
--   inbox.sent_at / stream_id: the sender's timestamp (history is ordered by it) and the
--     stream entry the message came in (for tracing a delivery back to the relay).
--   outbox.created_at index: retention deletes old rows in small batches.

ALTER TABLE consumers.messages ADD COLUMN idempotency_key text UNIQUE;
ALTER TABLE workers.messages   ADD COLUMN idempotency_key text UNIQUE;

ALTER TABLE consumers.inbox ADD COLUMN sent_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE consumers.inbox ALTER COLUMN sent_at DROP DEFAULT;
ALTER TABLE consumers.inbox ADD COLUMN stream_id text NOT NULL DEFAULT '';
ALTER TABLE consumers.inbox ALTER COLUMN stream_id DROP DEFAULT;
ALTER TABLE workers.inbox ADD COLUMN sent_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE workers.inbox ALTER COLUMN sent_at DROP DEFAULT;
ALTER TABLE workers.inbox ADD COLUMN stream_id text NOT NULL DEFAULT '';
ALTER TABLE workers.inbox ALTER COLUMN stream_id DROP DEFAULT;

CREATE INDEX messages_chat_order ON consumers.messages (chat_id, created_at, id);
CREATE INDEX messages_chat_order ON workers.messages (chat_id, created_at, id);
CREATE INDEX inbox_chat_seq   ON consumers.inbox (chat_id, seq);
CREATE INDEX inbox_chat_seq   ON workers.inbox (chat_id, seq);
CREATE INDEX inbox_chat_order ON consumers.inbox (chat_id, sent_at, message_id);
CREATE INDEX inbox_chat_order ON workers.inbox (chat_id, sent_at, message_id);
CREATE INDEX outbox_created_at ON consumers.outbox (created_at);
CREATE INDEX outbox_created_at ON workers.outbox (created_at);
