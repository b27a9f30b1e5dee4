-- One feed per chat: sent and received messages share a per-chat position, the order this
-- side shows them in (history, and every SSE stream of the chat on every instance).
--
-- A trigger takes each new row's position from `chats.last_pos`, in the inserting
-- transaction. The counter row stays locked until that transaction ends, so positions of a
-- chat become visible in order: once position n is visible, every position below it is
-- final (committed or never to be). A reader that sees a jump reads the gap from these
-- tables and misses nothing. Positions are consecutive but for one case: the same
-- idempotency key sent to two chats at the same moment (a client error, answered 422) can
-- leave a hole in the second chat, which readers step over. Any writer gets a position,
-- including a binary older than this migration (rolling deploys). Existing rows are
-- numbered by their sender's timestamp, the order history used before.

-- Renumbering holds the tables; give up rather than queue sends behind a long wait.
SET LOCAL lock_timeout = '10s';

-- Consumers.
LOCK TABLE consumers.messages, consumers.inbox IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE consumers.chats (
  chat_id  bigint PRIMARY KEY,
  last_pos bigint NOT NULL
);
ALTER TABLE consumers.chats OWNER TO consumers;

ALTER TABLE consumers.messages ADD COLUMN pos bigint;
ALTER TABLE consumers.inbox    ADD COLUMN pos bigint;

CREATE TEMP TABLE feed_consumers ON COMMIT DROP AS
  SELECT id, received, chat_id,
         row_number() OVER (PARTITION BY chat_id ORDER BY at, id) AS pos
    FROM (SELECT id, false AS received, chat_id, created_at AS at FROM consumers.messages
          UNION ALL
          SELECT message_id, true, chat_id, sent_at FROM consumers.inbox) m;
UPDATE consumers.messages m SET pos = f.pos FROM feed_consumers f WHERE NOT f.received AND f.id = m.id;
UPDATE consumers.inbox i    SET pos = f.pos FROM feed_consumers f WHERE f.received AND f.id = i.message_id;
INSERT INTO consumers.chats (chat_id, last_pos) SELECT chat_id, max(pos) FROM feed_consumers GROUP BY chat_id;

ALTER TABLE consumers.messages ALTER COLUMN pos SET NOT NULL;
ALTER TABLE consumers.inbox    ALTER COLUMN pos SET NOT NULL;
CREATE UNIQUE INDEX messages_chat_pos ON consumers.messages (chat_id, pos);
CREATE UNIQUE INDEX inbox_chat_pos    ON consumers.inbox (chat_id, pos);

CREATE FUNCTION consumers.assign_feed_position() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- The chat's counter row first, locked to the end of the transaction: a concurrent
  -- insert of the same message into this chat (a send rerun while the first attempt still
  -- runs) waits here, then sees that row in the check below (each statement of a function
  -- takes a new snapshot) and is skipped before taking a position, so it leaves no hole.
  INSERT INTO consumers.chats (chat_id, last_pos) VALUES (NEW.chat_id, 0)
    ON CONFLICT (chat_id) DO NOTHING;
  PERFORM 1 FROM consumers.chats WHERE chat_id = NEW.chat_id FOR UPDATE;
  IF TG_TABLE_NAME = 'messages' THEN
    IF EXISTS (SELECT 1 FROM consumers.messages
                WHERE id = NEW.id OR idempotency_key = NEW.idempotency_key) THEN
      RETURN NULL;
    END IF;
  ELSIF EXISTS (SELECT 1 FROM consumers.inbox WHERE message_id = NEW.message_id) THEN
    RETURN NULL;
  END IF;
  UPDATE consumers.chats SET last_pos = last_pos + 1 WHERE chat_id = NEW.chat_id
    RETURNING last_pos INTO NEW.pos;
  RETURN NEW;
END $$;
ALTER FUNCTION consumers.assign_feed_position() OWNER TO consumers;
CREATE TRIGGER assign_feed_position BEFORE INSERT ON consumers.messages
  FOR EACH ROW EXECUTE FUNCTION consumers.assign_feed_position();
CREATE TRIGGER assign_feed_position BEFORE INSERT ON consumers.inbox
  FOR EACH ROW EXECUTE FUNCTION consumers.assign_feed_position();

-- Workers.
LOCK TABLE workers.messages, workers.inbox IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE workers.chats (
  chat_id  bigint PRIMARY KEY,
  last_pos bigint NOT NULL
);
ALTER TABLE workers.chats OWNER TO workers;

ALTER TABLE workers.messages ADD COLUMN pos bigint;
ALTER TABLE workers.inbox    ADD COLUMN pos bigint;

CREATE TEMP TABLE feed_workers ON COMMIT DROP AS
  SELECT id, received, chat_id,
         row_number() OVER (PARTITION BY chat_id ORDER BY at, id) AS pos
    FROM (SELECT id, false AS received, chat_id, created_at AS at FROM workers.messages
          UNION ALL
          SELECT message_id, true, chat_id, sent_at FROM workers.inbox) m;
UPDATE workers.messages m SET pos = f.pos FROM feed_workers f WHERE NOT f.received AND f.id = m.id;
UPDATE workers.inbox i    SET pos = f.pos FROM feed_workers f WHERE f.received AND f.id = i.message_id;
INSERT INTO workers.chats (chat_id, last_pos) SELECT chat_id, max(pos) FROM feed_workers GROUP BY chat_id;

ALTER TABLE workers.messages ALTER COLUMN pos SET NOT NULL;
ALTER TABLE workers.inbox    ALTER COLUMN pos SET NOT NULL;
CREATE UNIQUE INDEX messages_chat_pos ON workers.messages (chat_id, pos);
CREATE UNIQUE INDEX inbox_chat_pos    ON workers.inbox (chat_id, pos);

CREATE FUNCTION workers.assign_feed_position() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- The chat's counter row first, locked to the end of the transaction: a concurrent
  -- insert of the same message into this chat (a send rerun while the first attempt still
  -- runs) waits here, then sees that row in the check below (each statement of a function
  -- takes a new snapshot) and is skipped before taking a position, so it leaves no hole.
  INSERT INTO workers.chats (chat_id, last_pos) VALUES (NEW.chat_id, 0)
    ON CONFLICT (chat_id) DO NOTHING;
  PERFORM 1 FROM workers.chats WHERE chat_id = NEW.chat_id FOR UPDATE;
  IF TG_TABLE_NAME = 'messages' THEN
    IF EXISTS (SELECT 1 FROM workers.messages
                WHERE id = NEW.id OR idempotency_key = NEW.idempotency_key) THEN
      RETURN NULL;
    END IF;
  ELSIF EXISTS (SELECT 1 FROM workers.inbox WHERE message_id = NEW.message_id) THEN
    RETURN NULL;
  END IF;
  UPDATE workers.chats SET last_pos = last_pos + 1 WHERE chat_id = NEW.chat_id
    RETURNING last_pos INTO NEW.pos;
  RETURN NEW;
END $$;
ALTER FUNCTION workers.assign_feed_position() OWNER TO workers;
CREATE TRIGGER assign_feed_position BEFORE INSERT ON workers.messages
  FOR EACH ROW EXECUTE FUNCTION workers.assign_feed_position();
CREATE TRIGGER assign_feed_position BEFORE INSERT ON workers.inbox
  FOR EACH ROW EXECUTE FUNCTION workers.assign_feed_position();
