// What the application gives the consumer: how to decode an entry, how to claim a shard's
// fence and record a batch under it, and the errors that tell the consumer what to do.

import type { Entry } from "./contract.js";

/** The shard's fence: the epoch this consumer claimed when it took the shard's lease. A
 * write must check, in its own transaction, that the shard's epoch is still this one. */
export interface Fence {
  shard: number;
  epoch: number;
}

/** Why recording failed, classified once: the consumer's answer to each is fixed.
 * - `fenced`: another instance claimed the shard since: give it up, record nothing.
 * - `refused`: the data's fault (a constraint or data error): the entry is dead-lettered
 *   (a batch is retried entry by entry to find it).
 * - `busy`: a lock or statement timeout: retried (a batch in halves), nobody's fault.
 * - `unavailable`: the database cannot be reached: retried with backoff.
 * - `state`: anything else the database said: retried with backoff, counting nothing. */
export type RecordErrorKind = "fenced" | "refused" | "busy" | "unavailable" | "state";

export class RecordError extends Error {
  constructor(
    readonly kind: RecordErrorKind,
    message: string,
  ) {
    super(message);
    this.name = "RecordError";
  }
}

/** One entry with what the application decoded of it. */
export interface Decoded<Item> {
  entry: Entry;
  item: Item;
}

/** The application's side. */
export interface Inbox<Item> {
  /** Decode an entry; throw (any error) for one that cannot be: it is dead-lettered with the
   * error's message as its reason. */
  decode(entry: Entry): Item;
  /** Claim shard `shard` for `consumer` where the writes land: its epoch goes up by one
   * (see `PgFence.claim`). */
  claimFence(consumer: string, shard: number): Promise<number>;
  /** Record `batch` in one transaction that first checks `fence` (see `PgFence.check`);
   * throw a `RecordError` (see `classifyPgError`). Entries may come again (at least once):
   * record each idempotently. */
  record(batch: readonly Decoded<Item>[], fence: Fence): Promise<void>;
  /** After the commit (before the acknowledgement): show what was recorded. */
  committed?(batch: readonly Decoded<Item>[]): void;
}
