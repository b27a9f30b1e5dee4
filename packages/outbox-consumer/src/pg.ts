// The Postgres side of the fence, and the classification of Postgres errors for recording.
//
// A consumer that took a shard's lease claims the shard here (`claim`: the epoch goes up by
// one, after waiting for any write that holds the row). Every write that records entries
// checks the epoch in its own transaction first (`check`: the row locked FOR SHARE, so a
// claim waits for the write and the write for the claim). A holder paused past its lease
// thus finds a newer epoch when it wakes and writes nothing.

import type { ClientBase } from "pg";

import { RecordError, type Fence } from "./inbox.js";

/** A fence table `(shard integer primary key, holder text, epoch bigint)`. */
export class PgFence {
  readonly table: string;

  /** `table`: `table` or `schema.table` of letters, digits and underscores. */
  constructor(table: string) {
    const plain = (p: string): boolean => /^[A-Za-z_][A-Za-z0-9_]*$/.test(p);
    const parts = table.split(".");
    if (parts.length > 2 || !parts.every(plain)) {
      throw new Error(`fence table '${table}' must be \`table\` or \`schema.table\` of letters, digits and underscores`);
    }
    this.table = table;
  }

  /** The statement that makes the table if it is missing. */
  migration(): string {
    return `CREATE TABLE IF NOT EXISTS ${this.table} (
  shard  integer PRIMARY KEY CHECK (shard >= 0),
  holder text    NOT NULL,
  epoch  bigint  NOT NULL
);`;
  }

  /** Claim `shard` for `holder`: its epoch, one more than before (the first claim: 1). */
  async claim(client: ClientBase, holder: string, shard: number): Promise<number> {
    const r = await client.query<{ epoch: string }>(
      `INSERT INTO ${this.table} AS f (shard, holder, epoch) VALUES ($2, $1, 1)
       ON CONFLICT (shard) DO UPDATE SET holder = $1, epoch = f.epoch + 1
       RETURNING epoch`,
      [holder, shard],
    );
    return Number(r.rows[0]!.epoch);
  }

  /** Inside the transaction that records, first: lock the shard's row and check `fence` is
   * still its epoch; a `fenced` RecordError otherwise (roll back). */
  async check(client: ClientBase, fence: Fence): Promise<void> {
    let current = 0;
    try {
      const r = await client.query<{ epoch: string }>(
        `SELECT epoch FROM ${this.table} WHERE shard = $1 FOR SHARE`,
        [fence.shard],
      );
      current = r.rows[0] ? Number(r.rows[0].epoch) : 0;
    } catch (e) {
      throw classifyPgError(e);
    }
    if (current !== fence.epoch) {
      throw new RecordError("fenced", `the shard's epoch is ${current}, this consumer's ${fence.epoch}`);
    }
  }
}

/** What a Postgres error means for recording: a lock or statement timeout `busy`; a
 * connection, resource, shutdown or serialization failure `unavailable`; a data exception
 * or constraint violation (a unique violation excepted) `refused`; anything else `state`. */
export function classifyPgError(e: unknown): RecordError {
  if (e instanceof RecordError) return e;
  const code = typeof e === "object" && e !== null && "code" in e ? String((e as { code: unknown }).code) : "";
  const message = e instanceof Error ? e.message : String(e);
  const text = code ? `postgres ${code}: ${message}` : message;
  if (code === "57014" || code === "55P03") return new RecordError("busy", text);
  if (/^[0-9A-Z]{5}$/.test(code)) {
    const cls = code.slice(0, 2);
    if (["08", "53", "57", "58", "40"].includes(cls)) return new RecordError("unavailable", text);
    if ((cls === "22" || cls === "23") && code !== "23505") return new RecordError("refused", text);
    return new RecordError("state", text);
  }
  return new RecordError("unavailable", text);
}
