// The conformance driver's instance (see driver.ts): records every entry of the stream into
// the suite's inbox table under the shard's fence, one transaction per batch.

import pg from "pg";

import { Consumer } from "./consumer.js";
import { textField, type Entry } from "./contract.js";
import { RecordError, type Decoded, type Fence, type Inbox } from "./inbox.js";
import { PgFence, classifyPgError } from "./pg.js";

function env(name: string): string {
  const value = process.env[`CONFORMANCE_${name}`];
  if (value === undefined) throw new Error(`CONFORMANCE_${name} is not set`);
  return value;
}

interface Row {
  outboxId: string;
  key: string | null;
  payload: string;
}

/** Start an instance configured by the suite's environment; resolves to its stop. */
export function start(): () => Promise<void> {
  const schema = env("SCHEMA");
  const consumerName = env("CONSUMER");
  const fence = new PgFence(`${schema}.fence`);
  const pool = new pg.Pool({
    connectionString: env("POSTGRES_URL"),
    options: "-c lock_timeout=2s -c statement_timeout=5s -c idle_in_transaction_session_timeout=10s",
    max: 4,
  });
  pool.on("error", () => {});

  const inbox: Inbox<Row> = {
    decode(entry: Entry): Row {
      const outboxId = textField(entry, "outbox_id");
      if (outboxId === null) throw new Error("no outbox_id");
      return { outboxId, key: textField(entry, "key"), payload: textField(entry, "payload") ?? "" };
    },
    async claimFence(consumer: string, shard: number): Promise<number> {
      try {
        const client = await pool.connect();
        try {
          return await fence.claim(client, consumer, shard);
        } finally {
          client.release();
        }
      } catch (e) {
        throw classifyPgError(e);
      }
    },
    async record(batch: readonly Decoded<Row>[], f: Fence): Promise<void> {
      let client: pg.PoolClient;
      try {
        client = await pool.connect();
      } catch (e) {
        throw classifyPgError(e);
      }
      let broken = false;
      try {
        await client.query("BEGIN");
        await fence.check(client, f);
        for (const { entry, item } of batch) {
          await client.query(
            `INSERT INTO ${schema}.inbox (outbox_id, stream_id, shard, key, consumer, payload)
             VALUES ($1, $2, $3, $4, $5, $6::jsonb) ON CONFLICT (outbox_id) DO NOTHING`,
            [item.outboxId, entry.id, f.shard, item.key, consumerName, item.payload],
          );
        }
        await client.query("COMMIT");
      } catch (e) {
        await client.query("ROLLBACK").catch(() => {
          broken = true;
        });
        throw e instanceof RecordError ? e : classifyPgError(e);
      } finally {
        client.release(broken);
      }
    },
  };

  const consumer = Consumer.start(
    {
      redisUrl: env("REDIS_URL"),
      stream: env("STREAM"),
      shards: Number(env("SHARDS")),
      group: env("GROUP"),
      consumer: consumerName,
      leaseTtlMs: Number(env("LEASE_TTL_MS")),
      claimIdleMs: Number(env("CLAIM_IDLE_MS")),
      maxDeliveries: Number(env("MAX_DELIVERIES")),
    },
    inbox,
  );

  return async () => {
    await consumer.stop();
    await pool.end();
  };
}
