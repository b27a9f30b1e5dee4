-- Feed positions (V7) at half the statements: every send and every received message ran
-- four statements in the trigger (insert-if-missing the chat's counter, lock it, check for a
-- duplicate, bump it). The counter is now bumped first, which locks it just the same; the
-- insert runs only for a chat's first message, and a duplicate found after the bump gives
-- its position back. Same positions and waits as V7, no new holes (V7's one remains: a row
-- the insert's ON CONFLICT skips after the trigger ran, such as one key sent to two chats
-- at once). And its lookups always use their indexes (see below).

CREATE OR REPLACE FUNCTION consumers.assign_feed_position() RETURNS trigger
LANGUAGE plpgsql
-- Its lookups go by primary and unique keys. A plan cached while a table was (nearly)
-- empty and analyzed so scans the whole table on every insert until the next analyze (seen:
-- the messages check scanning 20,000 rows per send in the lab); an index probe is right at
-- any size.
SET enable_seqscan = off
AS $$
BEGIN
  -- The chat's next position, its counter row locked to the end of the transaction.
  UPDATE consumers.chats SET last_pos = last_pos + 1 WHERE chat_id = NEW.chat_id
    RETURNING last_pos INTO NEW.pos;
  IF NOT FOUND THEN
    INSERT INTO consumers.chats (chat_id, last_pos) VALUES (NEW.chat_id, 0)
      ON CONFLICT (chat_id) DO NOTHING;
    UPDATE consumers.chats SET last_pos = last_pos + 1 WHERE chat_id = NEW.chat_id
      RETURNING last_pos INTO NEW.pos;
  END IF;
  -- A concurrent insert of the same message (a send rerun while the first attempt still
  -- ran) waited on that row, and this statement's new snapshot sees it: skip the row and
  -- give the position back. Nobody took a later one: the counter row is ours until commit.
  IF TG_TABLE_NAME = 'messages' THEN
    IF EXISTS (SELECT 1 FROM consumers.messages
                WHERE id = NEW.id OR idempotency_key = NEW.idempotency_key) THEN
      UPDATE consumers.chats SET last_pos = last_pos - 1 WHERE chat_id = NEW.chat_id;
      RETURN NULL;
    END IF;
  ELSIF EXISTS (SELECT 1 FROM consumers.inbox WHERE message_id = NEW.message_id) THEN
    UPDATE consumers.chats SET last_pos = last_pos - 1 WHERE chat_id = NEW.chat_id;
    RETURN NULL;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION workers.assign_feed_position() RETURNS trigger
LANGUAGE plpgsql
-- Its lookups go by primary and unique keys. A plan cached while a table was (nearly)
-- empty and analyzed so scans the whole table on every insert until the next analyze (seen:
-- the messages check scanning 20,000 rows per send in the lab); an index probe is right at
-- any size.
SET enable_seqscan = off
AS $$
BEGIN
  -- The chat's next position, its counter row locked to the end of the transaction.
  UPDATE workers.chats SET last_pos = last_pos + 1 WHERE chat_id = NEW.chat_id
    RETURNING last_pos INTO NEW.pos;
  IF NOT FOUND THEN
    INSERT INTO workers.chats (chat_id, last_pos) VALUES (NEW.chat_id, 0)
      ON CONFLICT (chat_id) DO NOTHING;
    UPDATE workers.chats SET last_pos = last_pos + 1 WHERE chat_id = NEW.chat_id
      RETURNING last_pos INTO NEW.pos;
  END IF;
  -- A concurrent insert of the same message (a send rerun while the first attempt still
  -- ran) waited on that row, and this statement's new snapshot sees it: skip the row and
  -- give the position back. Nobody took a later one: the counter row is ours until commit.
  IF TG_TABLE_NAME = 'messages' THEN
    IF EXISTS (SELECT 1 FROM workers.messages
                WHERE id = NEW.id OR idempotency_key = NEW.idempotency_key) THEN
      UPDATE workers.chats SET last_pos = last_pos - 1 WHERE chat_id = NEW.chat_id;
      RETURN NULL;
    END IF;
  ELSIF EXISTS (SELECT 1 FROM workers.inbox WHERE message_id = NEW.message_id) THEN
    UPDATE workers.chats SET last_pos = last_pos - 1 WHERE chat_id = NEW.chat_id;
    RETURN NULL;
  END IF;
  RETURN NEW;
END $$;
