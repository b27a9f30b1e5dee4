-- Who may read and post in a chat, on each side (issue 24): a user (the token's subject)
-- is a member of a chat on this side or is not. Only members read a chat's history, follow
-- it and post to it; a non-member is answered as for a chat that does not exist. Each side
-- keeps its own members in its own schema: the two services share no table.
CREATE TABLE consumers.chat_members (
  chat_id  bigint      NOT NULL CHECK (chat_id > 0),
  user_id  text        NOT NULL CHECK (length(user_id) BETWEEN 1 AND 255),
  added_at timestamptz NOT NULL DEFAULT now(),
  added_by text        NOT NULL,
  PRIMARY KEY (chat_id, user_id)
);
CREATE TABLE workers.chat_members (
  chat_id  bigint      NOT NULL CHECK (chat_id > 0),
  user_id  text        NOT NULL CHECK (length(user_id) BETWEEN 1 AND 255),
  added_at timestamptz NOT NULL DEFAULT now(),
  added_by text        NOT NULL,
  PRIMARY KEY (chat_id, user_id)
);
ALTER TABLE consumers.chat_members OWNER TO consumers;
ALTER TABLE workers.chat_members   OWNER TO workers;
