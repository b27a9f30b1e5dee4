// The contract's test vectors (docs/contract/vectors-v1.json), computed by this package.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";

import {
  assign,
  compareEntryIds,
  decodeEntry,
  fnv1a64,
  keys,
  libraries,
  parseEntryId,
  shardKey,
  shardOf,
  shardOfKey,
  weight,
  type Entry,
} from "../src/contract.js";

// dist/test/ → the repository's docs/contract/.
const path = fileURLToPath(new URL("../../../../docs/contract/vectors-v1.json", import.meta.url));
const v = JSON.parse(readFileSync(path, "utf8")) as Vectors;

interface Value {
  text?: string;
  hex?: string;
}
interface Vectors {
  contract: number;
  fnv1a64: { input_hex: string; fnv1a64: string }[];
  shard_of: { key: string | null; shard_by_count: Record<string, number> }[];
  keys: {
    layouts: {
      stream: string;
      group: string;
      shards: number;
      streams: string[];
      records: string[];
      leases: string[];
      attempts: string[];
      dead_letters: string[];
      members: string;
    }[];
    shard_of_key: { key: string; shard: number }[];
  };
  entry_ids: {
    valid: { text: string; commit_lsn: string; seq: string }[];
    invalid: string[];
    ascending: string[];
  };
  entries: {
    case: string;
    id: string;
    fields: [string, Value][] | null;
    expect: Record<string, unknown>;
  }[];
  assign: {
    cases: { shards: number; members: string[]; wanted: Record<string, number[]>; not_a_member: number[] }[];
    weights: { member: string; shard: number; weight: string }[];
  };
  dead_letter_fields: string[];
  dead_letter_entry_prefix: string;
  libraries: { name: string; code: string }[];
}

const bytesOf = (value: Value): Buffer =>
  value.hex !== undefined ? Buffer.from(value.hex, "hex") : Buffer.from(value.text ?? "", "utf8");

test("the contract is version 1", () => assert.equal(v.contract, 1));

test("FNV-1a 64", () => {
  for (const c of v.fnv1a64) {
    assert.equal(fnv1a64(Buffer.from(c.input_hex, "hex")).toString(16).padStart(16, "0"), c.fnv1a64);
  }
});

test("shards of keys", () => {
  for (const c of v.shard_of) {
    for (const [n, shard] of Object.entries(c.shard_by_count)) {
      assert.equal(shardOf(c.key, Number(n)), shard, `${c.key} over ${n}`);
    }
  }
});

test("key names", () => {
  for (const l of v.keys.layouts) {
    const per = (base: string): string[] => [...Array(l.shards).keys()].map((k) => shardKey(base, k, l.shards));
    assert.deepEqual(per(l.stream), l.streams);
    assert.deepEqual(per(l.stream).map(keys.origin), l.records);
    assert.deepEqual(per(keys.leaseBase(l.group)), l.leases);
    assert.deepEqual(per(keys.attemptsBase(l.group)), l.attempts);
    assert.deepEqual(per(keys.deadLetterBase(l.group)), l.dead_letters);
    assert.equal(keys.members(l.group), l.members);
  }
  for (const c of v.keys.shard_of_key) assert.equal(shardOfKey(c.key), c.shard, c.key);
});

test("entry ids", () => {
  for (const c of v.entry_ids.valid) {
    const id = parseEntryId(c.text);
    assert.ok(id, c.text);
    assert.equal(id.commitLsn.toString(), c.commit_lsn);
    assert.equal(id.seq.toString(), c.seq);
  }
  for (const t of v.entry_ids.invalid) assert.equal(parseEntryId(t), null, JSON.stringify(t));
  const ids = v.entry_ids.ascending.map((t) => parseEntryId(t)!);
  for (let i = 1; i < ids.length; i++) assert.equal(compareEntryIds(ids[i - 1]!, ids[i]!), -1);
});

test("entries", () => {
  for (const c of v.entries) {
    const entry: Entry = {
      id: c.id,
      fields: c.fields === null ? null : new Map(c.fields.map(([k, val]) => [k, bytesOf(val)])),
      deliveries: 1,
    };
    const e = c.expect;
    if (e["trimmed"] === true) {
      assert.equal(entry.fields, null, c.case);
      continue;
    }
    const decoded = decodeEntry(entry);
    if ("missing" in decoded) {
      assert.equal(decoded.missing, e["missing"], c.case);
      if (typeof e["payload_bytes_hex"] === "string") {
        assert.equal(entry.fields?.get("payload")?.toString("hex"), e["payload_bytes_hex"], c.case);
      }
      continue;
    }
    assert.equal(decoded.event, e["event"], c.case);
    assert.deepEqual({ text: decoded.payload }, e["payload"], c.case);
    assert.equal(decoded.outboxId, e["outbox_id"], c.case);
    assert.equal(decoded.createdAt, e["created_at"], c.case);
    assert.equal(decoded.traceparent, e["traceparent"], c.case);
    assert.equal(decoded.key, e["key"], c.case);
    assert.equal(decoded.publishedAtMicros, e["published_at_micros"], c.case);
  }
});

test("shards shared by balanced rendezvous hashing", () => {
  for (const w of v.assign.weights) {
    assert.equal(weight(w.member, w.shard).toString(16).padStart(16, "0"), w.weight);
  }
  for (const c of v.assign.cases) {
    const wanted = (me: string): number[] =>
      assign(c.shards, c.members, me).flatMap((mine, k) => (mine ? [k] : []));
    for (const m of c.members) assert.deepEqual(wanted(m), c.wanted[m], `${m} of ${c.members}`);
    assert.deepEqual(wanted("not-a-member"), c.not_a_member);
  }
});

test("the function libraries are the contract's", () => {
  assert.deepEqual(
    libraries.map((l) => ({ name: l.name, code: l.code })),
    v.libraries,
    "src/libraries.generated.ts is stale: npm run generate",
  );
});

test("dead letters", () => {
  assert.deepEqual(v.dead_letter_fields, ["stream", "id", "reason", "deliveries"]);
  assert.equal(v.dead_letter_entry_prefix, "entry.");
});
