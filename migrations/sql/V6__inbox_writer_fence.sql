-- The inbox consumer's lease, fenced where the writes land. One instance per side consumes
-- (a Redis lease), but a holder paused past its lease (a stall, SIGSTOP) could still write
-- a batch after the next holder started. Each holder, once it has the lease, bumps `epoch`
-- here; every inbox write locks this row FOR SHARE and checks the epoch in the same
-- statement. A new holder's bump waits for the old holder's in-flight write, and any later
-- write of the old holder finds a newer epoch and writes nothing.
CREATE TABLE consumers.inbox_writer (
  only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
  holder   text    NOT NULL,
  epoch    bigint  NOT NULL
);
CREATE TABLE workers.inbox_writer (
  only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
  holder   text    NOT NULL,
  epoch    bigint  NOT NULL
);
INSERT INTO consumers.inbox_writer (holder, epoch) VALUES ('', 0);
INSERT INTO workers.inbox_writer (holder, epoch) VALUES ('', 0);
ALTER TABLE consumers.inbox_writer OWNER TO consumers;
ALTER TABLE workers.inbox_writer   OWNER TO workers;
