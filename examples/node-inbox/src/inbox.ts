// The inbox: what the example makes of a stream entry (a chat message), and how it records
// a batch — once each, under the shard's fence — and tells the page after the commit.
//
// Invariants: a row is written only by the consumer that holds its shard's fence (checked
// first in the same transaction); a message is recorded once however often it comes
// (`message_id` is unique); rows get their `seq` in commit order (one recording transaction
// at a time, by a transaction-level advisory lock), so a page resuming after `seq` n misses
// nothing committed later with a smaller one; every commit wakes the pages of every
// instance (a notification on the schema's channel, sent at commit) — a hint to read the
// table, never the rows themselves.
import { EventEmitter } from "node:events";
import type pg from "pg";
import { PgFence, RecordError, classifyPgError, textField, type Decoded, type Entry, type Fence, type Inbox } from "outbox-stream-consumer";

/** A chat message as the sending side's outbox event carries it (`message.created`). */
export interface Message {
  id: string;
  chatId: number;
  body: string;
  sender: string | null;
  createdAt: string;
}

/** A recorded message, as the page shows it. */
export interface Row extends Message {
  seq: number;
  streamId: string;
  receivedAt: string;
}

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
const MAX_BODY_CHARS = 4000;

/** The message an entry carries; throws (the entry is dead-lettered with the reason) for
 * anything else. */
export function decode(entry: Entry): Message {
  const event = textField(entry, "event");
  const payload = textField(entry, "payload");
  if (event === null || payload === null) throw new Error("entry has no 'event' or 'payload' text field");
  if (event !== "message.created") throw new Error(`unknown event type '${event.slice(0, 100)}'`);
  let p: unknown;
  try {
    p = JSON.parse(payload);
  } catch (e) {
    throw new Error(`payload is not JSON: ${(e as Error).message}`);
  }
  if (typeof p !== "object" || p === null) throw new Error("payload is not a JSON object");
  const o = p as Record<string, unknown>;
  const { id, chat_id, body, sender, created_at } = o;
  if (typeof id !== "string" || !UUID.test(id)) throw new Error("payload's 'id' is not a UUID");
  if (typeof chat_id !== "number" || !Number.isSafeInteger(chat_id) || chat_id <= 0) {
    throw new Error("payload's 'chat_id' is not a positive integer");
  }
  if (typeof body !== "string" || body.includes("\0") || [...body].length > MAX_BODY_CHARS) {
    throw new Error("payload's 'body' is not text of at most 4000 characters without NUL");
  }
  if (sender !== undefined && sender !== null && typeof sender !== "string") {
    throw new Error("payload's 'sender' is not text");
  }
  if (typeof created_at !== "string" || Number.isNaN(Date.parse(created_at))) {
    throw new Error("payload's 'created_at' is not a timestamp");
  }
  return { id, chatId: chat_id, body, sender: sender ?? null, createdAt: created_at };
}

/** The tables, made if missing. */
export function migrations(schema: string, fence: PgFence): string[] {
  return [
    `CREATE SCHEMA IF NOT EXISTS ${schema}`,
    `CREATE TABLE IF NOT EXISTS ${schema}.inbox (
       seq         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
       message_id  uuid NOT NULL UNIQUE,
       chat_id     bigint NOT NULL,
       sender      text,
       body        text NOT NULL,
       created_at  timestamptz NOT NULL,
       stream_id   text NOT NULL,
       received_at timestamptz NOT NULL DEFAULT now()
     )`,
    fence.migration(),
  ];
}

/** Wakes the page's open streams when rows were recorded here or by another instance. */
export class Feed extends EventEmitter<{ recorded: [] }> {
  private stopped = false;
  private client: pg.Client | undefined;

  /** Listen on `channel` through clients from `connect`, again after every loss (waking
   * the streams then: a notification may have been missed). */
  async listen(connect: () => pg.Client, channel: string, log: (message: string, error: unknown) => void): Promise<void> {
    let delay = 100;
    while (!this.stopped) {
      const client = connect();
      this.client = client;
      const lost = new Promise<unknown>((resolve) => {
        client.on("error", resolve);
        client.on("end", () => resolve(new Error("connection ended")));
      });
      try {
        await client.connect();
        client.on("notification", () => this.emit("recorded"));
        await client.query(`LISTEN ${channel}`);
        delay = 100;
        this.emit("recorded");
        log("listening for recorded rows", null);
        const error = await lost;
        if (!this.stopped) log("the notification connection was lost; connecting again", error);
      } catch (e) {
        if (!this.stopped) log("cannot listen for recorded rows; retrying", e);
      }
      await client.end().catch(() => {});
      await new Promise((r) => setTimeout(r, delay));
      delay = Math.min(delay * 2, 5_000);
    }
  }

  async stop(): Promise<void> {
    this.stopped = true;
    await this.client?.end().catch(() => {});
  }
}

interface RowRecord {
  seq: string;
  message_id: string;
  chat_id: string;
  sender: string | null;
  body: string;
  created_at: Date;
  stream_id: string;
  received_at: Date;
}

export function toRow(r: RowRecord): Row {
  return {
    seq: Number(r.seq),
    id: r.message_id,
    chatId: Number(r.chat_id),
    sender: r.sender,
    body: r.body,
    createdAt: r.created_at.toISOString(),
    streamId: r.stream_id,
    receivedAt: r.received_at.toISOString(),
  };
}

export const ROW_COLUMNS = "seq, message_id, chat_id, sender, body, created_at, stream_id, received_at";

/** The consumer's side of recording: decode, claim a shard's fence, record under it. */
export function inbox(pool: pg.Pool, schema: string, fence: PgFence, feed: Feed): Inbox<Message> {
  const connect = async (): Promise<pg.PoolClient> => {
    try {
      return await pool.connect();
    } catch (e) {
      throw classifyPgError(e);
    }
  };
  return {
    decode,
    async claimFence(consumer, shard) {
      const client = await connect();
      try {
        return await fence.claim(client, consumer, shard);
      } catch (e) {
        throw classifyPgError(e);
      } finally {
        client.release();
      }
    },
    async record(batch: readonly Decoded<Message>[], f: Fence) {
      const client = await connect();
      try {
        await client.query("BEGIN");
        // First: a consumer that lost the shard writes nothing.
        await fence.check(client, f);
        // One recording transaction at a time (every shard, every instance): `seq` then
        // follows commit order, which the page's resumption relies on.
        await client.query("SELECT pg_advisory_xact_lock(hashtext($1))", [`${schema}.inbox`]);
        // Delivered at the commit, to every instance's pages (and only then).
        await client.query("SELECT pg_notify($1, '')", [schema]);
        await client.query(
          `INSERT INTO ${schema}.inbox (message_id, chat_id, sender, body, created_at, stream_id)
           SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[], $5::timestamptz[], $6::text[])
           ON CONFLICT (message_id) DO NOTHING`,
          [
            batch.map((d) => d.item.id),
            batch.map((d) => d.item.chatId),
            batch.map((d) => d.item.sender),
            batch.map((d) => d.item.body),
            batch.map((d) => d.item.createdAt),
            batch.map((d) => d.entry.id),
          ],
        );
        await client.query("COMMIT");
      } catch (e) {
        await client.query("ROLLBACK").catch(() => {});
        throw e instanceof RecordError ? e : classifyPgError(e);
      } finally {
        client.release();
      }
      // This instance's pages at once (the notification follows).
      feed.emit("recorded");
    },
  };
}
