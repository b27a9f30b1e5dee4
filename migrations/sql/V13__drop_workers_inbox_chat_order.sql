-- workers.inbox's index by sender timestamp (inbox_chat_order, from V4): nothing reads it since feeds
-- are ordered by position (V7), yet every row written paid an index insert and its WAL.
-- One table per migration (V10 to V13), so each transaction holds one table's lock, only
-- for the drop; the wait for it is bounded, so a long reader makes the migration fail (and
-- be run again) rather than queue that table's writes behind it for long.
SET LOCAL lock_timeout = '2s';
DROP INDEX IF EXISTS workers.inbox_chat_order;
