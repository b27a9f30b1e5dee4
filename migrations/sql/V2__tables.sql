-- The same three tables on each side.
--   messages: what this side sent.
--   outbox:   one event per sent message, written in the same transaction; read by the
--             relay through the logical replication slot (never polled).
--   inbox:    what this side received, once per message id; `seq` is the durable, increasing
--             position that SSE clients resume from (`Last-Event-ID`).

CREATE TABLE consumers.messages (
  id         uuid        PRIMARY KEY,
  chat_id    bigint      NOT NULL CHECK (chat_id > 0),
  body       text        NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE consumers.outbox (
  id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  event      text        NOT NULL,
  payload    jsonb       NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE consumers.inbox (
  message_id  uuid        PRIMARY KEY,
  seq         bigint      GENERATED ALWAYS AS IDENTITY UNIQUE,
  chat_id     bigint      NOT NULL,
  body        text        NOT NULL,
  received_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE workers.messages (
  id         uuid        PRIMARY KEY,
  chat_id    bigint      NOT NULL CHECK (chat_id > 0),
  body       text        NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE workers.outbox (
  id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  event      text        NOT NULL,
  payload    jsonb       NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE workers.inbox (
  message_id  uuid        PRIMARY KEY,
  seq         bigint      GENERATED ALWAYS AS IDENTITY UNIQUE,
  chat_id     bigint      NOT NULL,
  body        text        NOT NULL,
  received_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE consumers.messages OWNER TO consumers;
ALTER TABLE consumers.outbox   OWNER TO consumers;
ALTER TABLE consumers.inbox    OWNER TO consumers;
ALTER TABLE workers.messages   OWNER TO workers;
ALTER TABLE workers.outbox     OWNER TO workers;
ALTER TABLE workers.inbox      OWNER TO workers;
