// The stream contract's pure parts (docs/contract/v1.md): the shard hash, key names, entry
// ids, entries, and which shards an instance tries. Checked against vectors-v1.json.

import { LIBRARIES } from "./libraries.generated.js";

const FNV_OFFSET = 0xcbf29ce484222325n;
const FNV_PRIME = 0x100000001b3n;
const MASK = (1n << 64n) - 1n;

/** FNV-1a, 64 bits, of `bytes`. */
export function fnv1a64(bytes: Uint8Array): bigint {
  let hash = FNV_OFFSET;
  for (const b of bytes) {
    hash ^= BigInt(b);
    hash = (hash * FNV_PRIME) & MASK;
  }
  return hash;
}

/** The shard of an entry with `key` (`null`: no key, shard 0) in a stream of `shards`. */
export function shardOf(key: string | Uint8Array | null, shards: number): number {
  if (shards <= 1 || key === null) return 0;
  const bytes = typeof key === "string" ? Buffer.from(key, "utf8") : key;
  return Number(fnv1a64(bytes) % BigInt(shards));
}

/** Shard `shard`'s key of any per-shard key named `base`. */
export function shardKey(base: string, shard: number, shards: number): string {
  return shards <= 1 ? base : `${base}:{${shard}}`;
}

/** The shard a per-shard key names (`outbox:x:{3}` → 3); a plain key is shard 0. */
export function shardOfKey(key: string): number {
  const m = /:\{(\d+)\}$/.exec(key);
  return m?.[1] !== undefined ? Number(m[1]) : 0;
}

export const keys = {
  origin: (stream: string): string => `${stream}:origin`,
  leaseBase: (group: string): string => `inbox-lease:${group}`,
  attemptsBase: (group: string): string => `inbox-attempts:${group}`,
  members: (group: string): string => `inbox-members:${group}`,
  deadLetterBase: (group: string): string => `deadletter:${group}`,
};

/** A stream entry id `<commit LSN>-<k>`, two unsigned 64-bit numbers. */
export interface EntryId {
  commitLsn: bigint;
  seq: bigint;
}

const U64_MAX = MASK;

/** Parse an entry id; `null` when the text is not one. */
export function parseEntryId(text: string): EntryId | null {
  const m = /^(\d+)-(\d+)$/.exec(text);
  if (!m || m[1] === undefined || m[2] === undefined) return null;
  const commitLsn = BigInt(m[1]);
  const seq = BigInt(m[2]);
  if (commitLsn > U64_MAX || seq > U64_MAX) return null;
  return { commitLsn, seq };
}

/** Order of two ids (as numbers, not text). */
export function compareEntryIds(a: EntryId, b: EntryId): number {
  if (a.commitLsn !== b.commitLsn) return a.commitLsn < b.commitLsn ? -1 : 1;
  if (a.seq !== b.seq) return a.seq < b.seq ? -1 : 1;
  return 0;
}

/** One entry as read: its id, its fields as bytes (`null`: trimmed before it was acknowledged). */
export interface Entry {
  id: string;
  fields: Map<string, Buffer> | null;
  /** How often the group delivered it (Redis's count). */
  deliveries: number;
}

/** The contract's fields of an entry, decoded; `event` and `payload` required as UTF-8. */
export interface EntryFields {
  event: string;
  payload: string;
  outboxId: string | null;
  createdAt: string | null;
  traceparent: string | null;
  key: string | null;
  publishedAtMicros: string | null;
}

/** A field's value as text, if it is UTF-8. */
export function textField(entry: Entry, name: string): string | null {
  const value = entry.fields?.get(name);
  if (value === undefined) return null;
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(value);
  } catch {
    return null;
  }
}

/** Decode the contract's fields; the name of the missing one when `event` or `payload` is
 * absent or not text (an undecodable entry: dead-lettered). */
export function decodeEntry(entry: Entry): EntryFields | { missing: string } {
  const event = textField(entry, "event");
  if (event === null) return { missing: "event" };
  const payload = textField(entry, "payload");
  if (payload === null) return { missing: "payload" };
  return {
    event,
    payload,
    outboxId: textField(entry, "outbox_id"),
    createdAt: textField(entry, "created_at"),
    traceparent: textField(entry, "traceparent"),
    key: textField(entry, "key"),
    publishedAtMicros: textField(entry, "published_at"),
  };
}

/** The rendezvous weight of `member` for shard `k`. */
export function weight(member: string, k: number): bigint {
  const m = Buffer.from(member, "utf8");
  const bytes = Buffer.alloc(m.length + 4);
  m.copy(bytes, 0);
  bytes.writeUInt32LE(k, m.length);
  return fnv1a64(bytes);
}

/** The shards `me` tries among `members`: balanced rendezvous hashing (v1.md 7); with no
 * members at all, every shard. */
export function assign(shards: number, members: readonly string[], me: string): boolean[] {
  if (members.length === 0) return new Array<boolean>(shards).fill(true);
  // Sorted by UTF-8 bytes, as Rust sorts strings.
  const sorted = [...new Set(members)].sort((a, b) => Buffer.compare(Buffer.from(a), Buffer.from(b)));
  const m = sorted.length;
  const floor = Math.floor(shards / m);
  const ranked = (k: number): number[] => {
    const w = sorted.map((s) => weight(s, k));
    // Stable: ties keep the sorted order.
    return [...sorted.keys()].sort((i, j) => {
      const a = w[i]!;
      const b = w[j]!;
      return a === b ? 0 : a > b ? -1 : 1;
    });
  };
  const count = new Array<number>(m).fill(0);
  const extra = new Array<boolean>(m).fill(false);
  const owner = new Array<number>(shards).fill(-1);
  const left: number[] = [];
  for (let k = 0; k < shards; k++) {
    const i = ranked(k).find((c) => count[c]! < floor);
    if (i === undefined) {
      left.push(k);
    } else {
      owner[k] = i;
      count[i]! += 1;
    }
  }
  for (const k of left) {
    const i = ranked(k).find((c) => !extra[c]);
    if (i !== undefined) {
      owner[k] = i;
      extra[i] = true;
    }
  }
  const mine = sorted.indexOf(me);
  return owner.map((o) => mine >= 0 && o === mine);
}

/** The function libraries a consumer loads and calls (exactly the Rust consumer's). */
export const libraries = LIBRARIES;

/** The callable name of `fn` of the library whose name starts with `prefix`. */
export function functionName(prefix: "outbox_lease" | "outbox_consumer", fn: string): string {
  const lib = LIBRARIES.find((l) => l.name.startsWith(`${prefix}_`));
  if (!lib) throw new Error(`no ${prefix} library in the contract's vectors`);
  return `${lib.name}_${fn}`;
}
