-- Chat-sharded streams: the relay sends each outbox row to the shard its partition key
-- hashes to (one chat, one shard, so per-chat order holds), and one consumer per shard
-- records it, fenced per shard.
--
-- partition_key: the chat id for chat messages. NULL (rows of binaries before this
-- migration) goes to shard 0; a stream of one shard ignores it. Rows are immutable once
-- written, so no index: the relay reads it from the replication stream, and a rebuild reads
-- it with the rows it republishes.
ALTER TABLE consumers.outbox ADD COLUMN partition_key text;
ALTER TABLE workers.outbox   ADD COLUMN partition_key text;

-- The inbox writer's fence (V6), one row per shard: each shard's lease holder bumps its
-- shard's epoch, and every inbox write checks the epoch of the shard it came from. The
-- existing row is shard 0, which a one-shard stream keeps using.
ALTER TABLE consumers.inbox_writer
  DROP CONSTRAINT inbox_writer_pkey,
  DROP CONSTRAINT inbox_writer_only_row_check,
  ADD COLUMN shard integer NOT NULL DEFAULT 0 CHECK (shard >= 0),
  ADD PRIMARY KEY (shard);
ALTER TABLE workers.inbox_writer
  DROP CONSTRAINT inbox_writer_pkey,
  DROP CONSTRAINT inbox_writer_only_row_check,
  ADD COLUMN shard integer NOT NULL DEFAULT 0 CHECK (shard >= 0),
  ADD PRIMARY KEY (shard);
