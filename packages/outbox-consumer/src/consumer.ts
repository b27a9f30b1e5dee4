// The receiving protocol of the stream contract (docs/contract/v1.md), for one consumer
// group's instance: the shards shared among the live instances, one fenced consumer per
// shard, claims on takeover, acknowledgement only after the application's commit, dead
// letters with reasons, attempt records that tell a crash from a restart.
//
// Invariants (the contract's):
// - XACK only after `Inbox.record` resolved (its transaction committed); a crash before it
//   means redelivery, which the application's idempotent inbox absorbs.
// - A shard is consumed only while its lease is held, in id order, after every entry pending
//   in the group was claimed and finished; a batch's transaction checks the shard's fence.
// - An undecodable entry, one the database refuses for its own data, or one whose processing
//   ended its consumer more than `maxDeliveries` times goes to the dead letters atomically
//   with its XACK, and never blocks the entries after it.

import { randomBytes } from "node:crypto";

import { Redis, type RedisOptions } from "ioredis";

import {
  assign,
  decodeEntry,
  functionName,
  keys,
  libraries,
  shardKey,
  type Entry,
} from "./contract.js";
import { RecordError, type Decoded, type Fence, type Inbox } from "./inbox.js";

export interface ConsumerOptions {
  /** The Redis holding the stream (`redis://…`, `rediss://…` or `redis+unix:///path`). */
  redisUrl: string;
  /**
   * More of ioredis's connection options, for every connection the consumer makes: TLS
   * (`tls: { ca }` for a private CA), a username and password kept out of the URL. The
   * consumer's own timeouts and retry settings win over these.
   */
  redis?: RedisOptions;
  /** The stream's base name; with `shards` > 1 the consumer reads `<stream>:{k}`. */
  stream: string;
  shards: number;
  /** The consumer group: the receiving service (one group per stream). */
  group: string;
  /** This instance's consumer name: stable across its restarts, unique among live ones. */
  consumer: string;
  leaseTtlMs?: number;
  claimIdleMs?: number;
  maxDeliveries?: number;
  deadLetterMaxLen?: number;
  /** Check the stream's records say `shards` (default true). */
  checkLayout?: boolean;
  /** Where the consumer says what it does (default: stderr). */
  log?: (level: "info" | "warn" | "error", message: string, fields?: Record<string, unknown>) => void;
}

const READ_COUNT = 100;
const READ_BLOCK_MS = 1000;
const WANTED_POLL_MS = 200;
const VIEW_REFRESH_MS = 250;
const ALONE = "alone";

const LEASE_ACQUIRE = functionName("outbox_lease", "acquire");
const LEASE_RELEASE = functionName("outbox_lease", "release");
const MEMBERS = functionName("outbox_consumer", "members");
const RELEASE_ATTEMPTS = functionName("outbox_consumer", "release_attempts");

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

class LeaseLost extends Error {
  constructor() {
    super("lost the consumer lease");
  }
}

/** A Redis connection from the contract's URL forms. */
function connect(url: string, options: RedisOptions): Redis {
  // No ready check: it runs INFO, which a least-privilege user may not.
  const base: RedisOptions = { ...options, maxRetriesPerRequest: 2, lazyConnect: false, enableReadyCheck: false };
  if (url.startsWith("redis+unix://") || url.startsWith("unix://")) {
    const u = new URL(url.replace(/^redis\+unix:/, "unix:"));
    return new Redis({ ...base, path: decodeURIComponent(u.pathname) });
  }
  // ioredis lets a URL's credentials win over the options', even an empty password next
  // to a user name: the options' go into the URL.
  // Encoded whole: the URL's setters leave `%` as it is, and ioredis decodes what it reads.
  if (options.username !== undefined || options.password !== undefined) {
    const u = /^rediss?:\/\/[^/?#]/.test(url) ? new URL(url) : null;
    if (u === null) throw new Error(`redisUrl '${url.replace(/\/\/[^@]*@/, "//…@")}' must be redis://host… or rediss://host… to take a user name or password`);
    if (options.username !== undefined) u.username = encodeURIComponent(options.username);
    if (options.password !== undefined) u.password = encodeURIComponent(options.password);
    url = u.toString();
  }
  return new Redis(url, base);
}

/** Call a contract function, loading the libraries first when Redis does not have them. */
async function fcall(redis: Redis, fn: string, key: string, args: (string | number)[]): Promise<unknown> {
  try {
    return await redis.call("FCALL", fn, 1, key, ...args.map(String));
  } catch (e) {
    if (!String(e).includes("Function not found")) throw e;
    for (const lib of libraries) {
      try {
        await redis.call("FUNCTION", "LOAD", lib.code);
      } catch (loadError) {
        if (!String(loadError).includes("already exists")) throw loadError;
      }
    }
    return await redis.call("FCALL", fn, 1, key, ...args.map(String));
  }
}

/** Fields of an XRANGE/XREADGROUP item (`null`: trimmed since delivered). */
function fieldsOf(raw: unknown): Map<string, Buffer> | null {
  if (!Array.isArray(raw)) return null;
  const fields = new Map<string, Buffer>();
  for (let i = 0; i + 1 < raw.length; i += 2) {
    fields.set(String(raw[i]), Buffer.from(raw[i + 1] as Buffer));
  }
  return fields;
}

/** Entries of an XREADGROUP reply read with Buffers. */
function entriesOf(reply: unknown): Entry[] {
  if (!Array.isArray(reply)) return [];
  const entries: Entry[] = [];
  for (const stream of reply) {
    const items = (stream as unknown[])[1];
    if (!Array.isArray(items)) continue;
    for (const item of items) {
      const [id, raw] = item as [Buffer, unknown];
      entries.push({ id: id.toString(), fields: fieldsOf(raw), deliveries: 1 });
    }
  }
  return entries;
}

/** A running consumer: `stop()` finishes what it holds, releases and leaves. */
export class Consumer<Item> {
  readonly runId = randomBytes(8).toString("hex");
  private readonly o: Required<Omit<ConsumerOptions, "log" | "redis">> & Pick<ConsumerOptions, "log" | "redis">;
  private readonly redis: Redis;
  private stopping = false;
  private assignment: boolean[];
  private readonly tasks: Promise<void>[] = [];
  /** Entries handed to this run (id → attempt number), per shard. */
  private readonly delivered = new Map<number, Map<string, number>>();

  private constructor(
    options: ConsumerOptions,
    private readonly inbox: Inbox<Item>,
  ) {
    this.o = {
      leaseTtlMs: 10_000,
      claimIdleMs: 30_000,
      maxDeliveries: 5,
      deadLetterMaxLen: 10_000,
      checkLayout: true,
      ...options,
    };
    if (!(this.o.shards >= 1 && this.o.shards <= 1024)) throw new Error("shards must be between 1 and 1024");
    if (!this.o.group || !this.o.consumer) throw new Error("the consumer group and the consumer name must not be empty");
    if (this.o.maxDeliveries < 1) throw new Error("maxDeliveries must be at least 1");
    if (this.o.leaseTtlMs < 300) throw new Error("a lease TTL under 300 ms is too short to renew in time");
    this.redis = connect(this.o.redisUrl, { ...this.o.redis, commandTimeout: 5000 });
    this.redis.on("error", () => {});
    this.assignment = new Array<boolean>(this.o.shards).fill(this.o.shards === 1);
  }

  /** Start consuming every shard this instance is assigned, until `stop()`. */
  static start<Item>(options: ConsumerOptions, inbox: Inbox<Item>): Consumer<Item> {
    const c = new Consumer(options, inbox);
    c.tasks.push(c.membership());
    for (let k = 0; k < c.o.shards; k++) c.tasks.push(c.shardLoop(k));
    return c;
  }

  /** Stop reading, finish what is held, release the leases, leave the member set. */
  async stop(): Promise<void> {
    this.stopping = true;
    await Promise.all(this.tasks);
    this.redis.disconnect();
  }

  private log(level: "info" | "warn" | "error", message: string, fields: Record<string, unknown> = {}): void {
    if (this.o.log) {
      this.o.log(level, message, fields);
    } else {
      process.stderr.write(`${new Date().toISOString()} ${level.toUpperCase()} ${message} ${JSON.stringify({ consumer: this.o.consumer, ...fields })}\n`);
    }
  }

  // --- Sharing the shards (v1.md 7) ---

  private async membership(): Promise<void> {
    const key = keys.members(this.o.group);
    let nextBeat = 0;
    while (!this.stopping) {
      const beat = Date.now() >= nextBeat;
      try {
        const reply = (await fcall(this.redis, MEMBERS, key, [
          this.o.consumer,
          this.o.leaseTtlMs,
          beat ? "1" : "2",
          0,
        ])) as unknown[];
        if (beat) nextBeat = Date.now() + this.o.leaseTtlMs / 3;
        const members = reply.slice(3).map(String);
        const mine = assign(this.o.shards, members, this.o.consumer);
        if (mine.join() !== this.assignment.join()) {
          this.log("info", "inbox members changed", {
            members,
            shards: mine.flatMap((m, k) => (m ? [k] : [])),
          });
        }
        this.assignment = mine;
      } catch (e) {
        this.log("warn", "inbox membership heartbeat failed; retrying", { error: String(e) });
      }
      await sleep(Math.min(VIEW_REFRESH_MS, this.o.leaseTtlMs / 3));
    }
    try {
      await fcall(this.redis, MEMBERS, key, [this.o.consumer, this.o.leaseTtlMs, "0", 0]);
    } catch (e) {
      this.log("warn", "could not leave the inbox member set", { error: String(e) });
    }
  }

  // --- One shard (v1.md 4, 5, 6) ---

  private async shardLoop(shard: number): Promise<void> {
    const leaseKey = shardKey(keys.leaseBase(this.o.group), shard, this.o.shards);
    const holder = `${this.o.consumer}/${randomBytes(6).toString("hex")}`;
    let backoff = 100;
    while (!this.stopping) {
      if (!this.assignment[shard]) {
        await sleep(WANTED_POLL_MS);
        continue;
      }
      let held = false;
      try {
        held = (await fcall(this.redis, LEASE_ACQUIRE, leaseKey, [holder, this.o.consumer, this.o.leaseTtlMs])) === 1;
      } catch (e) {
        this.log("warn", "the lease cannot be taken", { shard, error: String(e) });
      }
      if (!held) {
        await sleep(WANTED_POLL_MS);
        continue;
      }
      const blocking = connect(this.o.redisUrl, { ...this.o.redis, commandTimeout: READ_BLOCK_MS + 5000 });
      blocking.on("error", () => {});
      const session = new ShardSession(this, shard, leaseKey, holder, blocking);
      try {
        await session.consume();
        backoff = 100;
      } catch (e) {
        if (!(e instanceof LeaseLost)) {
          this.log("warn", "inbox consumer interrupted; retrying", { shard, error: String(e) });
          await sleep(backoff);
          backoff = Math.min(backoff * 2, 5000);
        } else {
          this.log("info", "lost the lease", { shard });
        }
      } finally {
        await session.releaseDelivered().catch(() => {});
        blocking.disconnect();
        await fcall(this.redis, LEASE_RELEASE, leaseKey, [holder]).catch(() => {});
      }
    }
  }

  /** @internal */
  get options(): Required<Omit<ConsumerOptions, "log" | "redis">> {
    return this.o;
  }
  /** @internal */
  get conn(): Redis {
    return this.redis;
  }
  /** @internal */
  get app(): Inbox<Item> {
    return this.inbox;
  }
  /** @internal */
  get isStopping(): boolean {
    return this.stopping;
  }
  /** @internal */
  wants(shard: number): boolean {
    return this.assignment[shard] === true;
  }
  /** @internal */
  deliveredOf(shard: number): Map<string, number> {
    let d = this.delivered.get(shard);
    if (!d) {
      d = new Map();
      this.delivered.set(shard, d);
    }
    return d;
  }
  /** @internal */
  say(level: "info" | "warn" | "error", message: string, fields: Record<string, unknown> = {}): void {
    this.log(level, message, fields);
  }
}

/** The consumer of one shard while it holds the lease. */
class ShardSession<Item> {
  private readonly stream: string;
  private readonly attemptsKey: string;
  private readonly deadLetters: string;
  private renewAt = 0;
  private fence: Fence = { shard: 0, epoch: 0 };
  /** Entries another run was processing when it lost the shard: processed alone. */
  private readonly suspects = new Set<string>();
  /** Entries pending under this name that this run was not handed (its previous process). */
  private inherited = new Set<string>();

  constructor(
    private readonly c: Consumer<Item>,
    private readonly shard: number,
    private readonly leaseKey: string,
    private readonly holder: string,
    private readonly blocking: Redis,
  ) {
    const o = c.options;
    this.stream = shardKey(o.stream, shard, o.shards);
    this.attemptsKey = shardKey(keys.attemptsBase(o.group), shard, o.shards);
    this.deadLetters = shardKey(keys.deadLetterBase(o.group), shard, o.shards);
  }

  private get redis(): Redis {
    return this.c.conn;
  }

  private get o(): Required<Omit<ConsumerOptions, "log" | "redis">> {
    return this.c.options;
  }

  async consume(): Promise<void> {
    this.renewAt = Date.now() + this.o.leaseTtlMs / 3;
    await this.checkLayout();
    this.fence = { shard: this.shard, epoch: await this.c.app.claimFence(this.o.consumer, this.shard) };
    this.c.say("info", "inbox consumer active", { shard: this.shard, epoch: this.fence.epoch });
    try {
      await this.redis.call("XGROUP", "CREATE", this.stream, this.o.group, "0", "MKSTREAM");
    } catch (e) {
      if (!String(e).includes("BUSYGROUP")) throw e;
    }
    this.inherited = await this.inheritedEntries();
    // Holding the lease: everything pending in the group is ours to finish first, in order.
    await this.claim(0);
    await this.drainOwnPending();
    let nextClaim = Date.now() + Math.max(this.o.claimIdleMs / 2, 100);
    for (;;) {
      if (this.c.isStopping) return;
      await this.renewIfDue();
      if (Date.now() >= nextClaim) {
        if ((await this.claim(this.o.claimIdleMs)).length > 0) await this.drainOwnPending();
        nextClaim = Date.now() + Math.max(this.o.claimIdleMs / 2, 100);
      }
      if (!this.c.wants(this.shard)) return; // another live instance wants it: hand it over
      const issued = Date.now();
      const entries = await this.read(">");
      // A read that outlasted its block was paused: check the lease before acting on it.
      if (Date.now() - issued > READ_BLOCK_MS + 500) await this.renew();
      if (entries.length > 0) {
        const ours = new Set(entries.map((e) => e.id));
        const claimed = await this.claim(0);
        if (claimed.some((id) => !ours.has(id))) {
          // A paused previous holder's read was served after the takeover: older first.
          await this.drainOwnPending();
          continue;
        }
        await this.process(entries);
      }
    }
  }

  /** The stream's records must say this consumer's shard count. */
  private async checkLayout(): Promise<void> {
    if (!this.o.checkLayout) return;
    // HMGET, as the Rust consumer: the services' Redis users may read the record with it alone.
    const [recorded] = await this.redis.hmget(keys.origin(this.stream), "shards");
    if (recorded !== null && recorded !== undefined && Number(recorded) !== this.o.shards) {
      throw new Error(`the stream's records say ${recorded} shards, this consumer is configured with ${this.o.shards}`);
    }
  }

  private async renew(): Promise<void> {
    const held = await fcall(this.redis, LEASE_ACQUIRE, this.leaseKey, [this.holder, this.o.consumer, this.o.leaseTtlMs]);
    if (held !== 1) throw new LeaseLost();
    this.renewAt = Date.now() + this.o.leaseTtlMs / 3;
  }

  private async renewIfDue(): Promise<void> {
    if (Date.now() >= this.renewAt) await this.renew();
  }

  /** XAUTOCLAIM (JUSTID) every pending entry idle at least `minIdle`: the claimed ids. */
  private async claim(minIdle: number): Promise<string[]> {
    let cursor = "0-0";
    const claimed: string[] = [];
    for (;;) {
      const reply = (await this.redis.call(
        "XAUTOCLAIM", this.stream, this.o.group, this.o.consumer, String(minIdle), cursor, "COUNT", String(READ_COUNT), "JUSTID",
      )) as [string, string[], string[]?];
      claimed.push(...reply[1].map(String));
      const deleted = (reply[2] ?? []).map(String);
      if (deleted.length > 0) {
        await this.redis.hdel(this.attemptsKey, ...deleted);
        this.c.say("error", "pending entries were trimmed from the stream before being recorded", { count: deleted.length });
      }
      cursor = String(reply[0]);
      if (cursor === "0-0") return claimed;
    }
  }

  private async inheritedEntries(): Promise<Set<string>> {
    const reply = (await this.redis.call("XPENDING", this.stream, this.o.group, "-", "+", "10000", this.o.consumer)) as unknown[];
    const ours = this.c.deliveredOf(this.shard);
    return new Set(reply.map((p) => String((p as unknown[])[0])).filter((id) => !ours.has(id)));
  }

  /** XREADGROUP from `after` (`>`: new ones, blocking briefly; else own pending ones). */
  private async read(after: string): Promise<Entry[]> {
    const args: (string | number)[] = ["GROUP", this.o.group, this.o.consumer, "COUNT", READ_COUNT];
    if (after === ">") args.push("BLOCK", READ_BLOCK_MS);
    args.push("STREAMS", this.stream, after);
    const conn = after === ">" ? this.blocking : this.redis;
    const reply = await conn.callBuffer("XREADGROUP", ...args.map(String));
    const entries = entriesOf(reply);
    const delivered = this.c.deliveredOf(this.shard);
    if (after === ">") {
      for (const e of entries) if (!delivered.has(e.id)) delivered.set(e.id, 1);
    } else if (entries.length > 0) {
      const pending = (await this.redis.call(
        "XPENDING", this.stream, this.o.group, entries[0]!.id, entries[entries.length - 1]!.id, String(entries.length), this.o.consumer,
      )) as unknown[];
      const counts = new Map(pending.map((p) => [String((p as unknown[])[0]), Number((p as unknown[])[3])]));
      for (const e of entries) e.deliveries = counts.get(e.id) ?? 1;
    }
    return entries;
  }

  private async drainOwnPending(): Promise<void> {
    let after = "0";
    for (;;) {
      const entries = await this.read(after);
      if (entries.length === 0) return;
      after = entries[entries.length - 1]!.id;
      await this.process(entries);
      if (this.c.isStopping) return;
    }
  }

  /** Each redelivered entry's attempt number (v1.md 6). */
  private async attempts(entries: Entry[]): Promise<Map<string, number>> {
    const redelivered = entries.filter((e) => e.deliveries > 1).map((e) => e.id);
    const out = new Map<string, number>();
    if (redelivered.length === 0) return out;
    const ours = this.c.deliveredOf(this.shard);
    const deadline = Date.now() + this.o.leaseTtlMs;
    let records: ([string, number, boolean] | null)[];
    for (;;) {
      const raw = await this.redis.hmget(this.attemptsKey, ...redelivered);
      records = raw.map((r) => {
        if (r === null) return null;
        const [run, n, alone] = r.split(" ");
        const count = Number(n);
        return run === undefined || !Number.isInteger(count) ? null : [run, count, alone === ALONE];
      });
      // Only an unreleased record of another run that processed the entry alone waits.
      const pendingVerdict = redelivered.some((id, i) => {
        const rec = records[i];
        return !this.inherited.has(id) && rec !== null && rec !== undefined && rec[2] && rec[0] !== "-" && rec[0] !== this.c.runId;
      });
      if (!pendingVerdict || Date.now() >= deadline) break;
      await sleep(200);
      await this.renewIfDue();
    }
    redelivered.forEach((id, i) => {
      const rec = records[i] ?? null;
      let n: number;
      if (rec === null) {
        const own = ours.get(id);
        if (own !== undefined) {
          n = own;
        } else {
          this.suspects.add(id);
          n = 1;
        }
      } else if (rec[0] === "-" || rec[0] === this.c.runId) {
        n = rec[1];
      } else if (rec[2]) {
        n = Math.max(rec[1] + 1, this.o.maxDeliveries + 1);
      } else {
        this.suspects.add(id);
        n = rec[1];
      }
      out.set(id, n);
    });
    return out;
  }

  private async beginAttempts(ids: string[], attempts: Map<string, number>, alone: boolean): Promise<void> {
    const args: string[] = [];
    // In this run's hands from now on, under the number its record says: a session that ends
    // without a crash releases it, or the next holder would read the record as this run having
    // died on it (and one processed alone as the entry having killed it).
    const delivered = this.c.deliveredOf(this.shard);
    for (const id of ids) {
      const n = attempts.get(id);
      if (n === undefined) continue;
      delivered.set(id, n);
      args.push(id, alone ? `${this.c.runId} ${n} ${ALONE}` : `${this.c.runId} ${n}`);
    }
    if (args.length > 0) await this.redis.hset(this.attemptsKey, ...args);
  }

  /** Mark what this run was handed and did not finish as released (the next processing is
   * not a new attempt). */
  async releaseDelivered(): Promise<void> {
    const delivered = this.c.deliveredOf(this.shard);
    if (delivered.size === 0) return;
    const args: (string | number)[] = [this.c.runId];
    for (const [id, n] of delivered) args.push(id, n);
    await fcall(this.redis, RELEASE_ATTEMPTS, this.attemptsKey, args);
    delivered.clear();
  }

  /** Record `entries` (in id order), acknowledge after each commit, dead-letter what must be. */
  private async process(entries: Entry[]): Promise<void> {
    const attempts = await this.attempts(entries);
    let batch: Decoded<Item>[] = [];
    const flush = async (): Promise<void> => {
      if (batch.length === 0) return;
      const part = batch;
      batch = [];
      await this.beginAttempts(part.map((d) => d.entry.id), attempts, part.length === 1);
      await this.recordPart(part);
    };
    for (const entry of entries) {
      if (entry.fields === null) {
        await flush();
        await this.ack([entry.id]);
        this.c.say("error", "an entry was trimmed from the stream before being recorded", { id: entry.id });
        continue;
      }
      const n = attempts.get(entry.id) ?? 1;
      if (n > this.o.maxDeliveries) {
        await flush();
        await this.deadLetter(entry, `its processing ended the consumer ${n - 1} times (max deliveries ${this.o.maxDeliveries})`);
        continue;
      }
      const decoded = decodeEntry(entry);
      let item: Item;
      try {
        if ("missing" in decoded) throw new Error(`entry has no '${decoded.missing}' field`);
        item = this.c.app.decode(entry);
      } catch (e) {
        await flush();
        await this.deadLetter(entry, `undecodable: ${e instanceof Error ? e.message : String(e)}`);
        continue;
      }
      if (this.suspects.has(entry.id)) {
        await flush();
        batch.push({ entry, item });
        await flush();
        this.suspects.delete(entry.id);
        continue;
      }
      batch.push({ entry, item });
    }
    await flush();
  }

  /** Record one part, retrying in place while that is nobody's entry's fault. */
  private async recordPart(part: Decoded<Item>[]): Promise<void> {
    let delay = 100;
    for (;;) {
      try {
        await this.c.app.record(part, this.fence);
        this.c.app.committed?.(part);
        await this.ack(part.map((d) => d.entry.id));
        return;
      } catch (e) {
        const err = e instanceof RecordError ? e : new RecordError("state", String(e));
        if (err.kind === "fenced") {
          this.c.say("warn", "another instance became the inbox writer; standing down", { shard: this.shard });
          throw new LeaseLost();
        }
        if (err.kind === "refused" || (err.kind === "busy" && part.length > 1)) {
          if (part.length === 1) {
            await this.deadLetter(part[0]!.entry, err.message);
            return;
          }
          // Find the one at fault (or make the parts small enough): one at a time.
          for (const one of part) await this.recordPart([one]);
          return;
        }
        this.c.say("warn", "inbox write failed for a reason that is not the entries' fault; retrying", {
          shard: this.shard,
          error: err.message,
        });
        await sleep(delay);
        delay = Math.min(delay * 2, 5000);
        await this.renewIfDue();
        if (this.c.isStopping) throw new LeaseLost();
      }
    }
  }

  private async ack(ids: string[]): Promise<void> {
    if (ids.length === 0) return;
    const result = await this.redis
      .pipeline()
      .xack(this.stream, this.o.group, ...ids)
      .hdel(this.attemptsKey, ...ids)
      .exec();
    const failed = result?.find(([err]) => err !== null);
    if (!result || failed) throw new Error(`acknowledging failed: ${String(failed?.[0] ?? "aborted")}`);
    const delivered = this.c.deliveredOf(this.shard);
    for (const id of ids) delivered.delete(id);
  }

  /** Move an entry to the dead letters with its reason, atomically with its XACK. */
  private async deadLetter(entry: Entry, reason: string): Promise<void> {
    const fields: (string | Buffer)[] = [
      "stream", this.stream, "id", entry.id, "reason", reason, "deliveries", String(entry.deliveries),
    ];
    for (const [k, v] of entry.fields ?? []) fields.push(`entry.${k}`, v);
    const result = await this.redis
      .multi()
      .xlen(this.deadLetters)
      .xadd(this.deadLetters, "MAXLEN", "=", String(this.o.deadLetterMaxLen), "*", ...fields)
      .xack(this.stream, this.o.group, entry.id)
      .hdel(this.attemptsKey, entry.id)
      .exec();
    const failed = result?.find(([err]) => err !== null);
    if (!result || failed) throw new Error(`dead-lettering failed: ${String(failed?.[0] ?? "aborted")}`);
    this.c.deliveredOf(this.shard).delete(entry.id);
    this.c.say("warn", "entry dead-lettered", { id: entry.id, reason, deadLetterStream: this.deadLetters });
  }
}
