-- Two indexes nothing reads since feeds are ordered by position (V7): history by the
-- sender's timestamp (messages_chat_order, inbox_chat_order). Every send and every received
-- message still paid for them: an index insert each, with its WAL. inbox_chat_seq stays
-- (it turns a cursor of the previous event-id scheme into a position).
--
-- A short lock each (the drop waits for statements running on the table); bounded, so a
-- long reader makes the migration fail and be retried instead of queueing every send
-- behind it.
SET LOCAL lock_timeout = '10s';

DROP INDEX IF EXISTS consumers.messages_chat_order;
DROP INDEX IF EXISTS workers.messages_chat_order;
DROP INDEX IF EXISTS consumers.inbox_chat_order;
DROP INDEX IF EXISTS workers.inbox_chat_order;
