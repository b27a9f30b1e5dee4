// node-inbox: an example Node service on the receiving end of a cdc-relay stream (the shape
// of the original design's Workers). It consumes the chat's messages from a stream into its
// own inbox table, each once and in order per shard, through crashes and restarts, and
// shows the table live. Everything about the stream (lease, fence, claims, acknowledgement
// after the commit, dead letters) is the `outbox-stream-consumer` package's; this file wires
// it up. See README.md.
//
// Invariants: the tables exist before the consumer starts; on SIGTERM/SIGINT the consumer
// stops first (its batch committed and acknowledged, its shards released to the other
// instances), then the page's streams, then the pool.
import pg from "pg";
import { Consumer, PgFence } from "outbox-stream-consumer";
import { ConfigError, load, type Config } from "./config.js";
import { Feed, inbox, migrations } from "./inbox.js";
import { show } from "./http.js";

function log(level: "info" | "warn" | "error", message: string, fields: Record<string, unknown> = {}): void {
  console.error(JSON.stringify({ time: new Date().toISOString(), level, message, ...fields }));
}

/** The database URL with the password from its file (pg reads a URL's password, even an
 * empty one, over a separate one). */
function databaseUrl(config: Config): string {
  if (config.databasePassword === undefined) return config.databaseUrl;
  const url = new URL(config.databaseUrl);
  url.password = encodeURIComponent(config.databasePassword);
  return url.toString();
}

function pool(config: Config, max: number): pg.Pool {
  return new pg.Pool({
    connectionString: databaseUrl(config),
    max,
    connectionTimeoutMillis: 5_000,
    // A holder paused inside its transaction must not hold the fence's row for long.
    options: "-c lock_timeout=2s -c statement_timeout=5s -c idle_in_transaction_session_timeout=10s",
  });
}

async function main(): Promise<void> {
  let config: Config;
  try {
    config = load();
  } catch (e) {
    if (e instanceof ConfigError) {
      log("error", `refusing to start: ${e.message}`);
      process.exit(2);
    }
    throw e;
  }
  // The consumer's connections and the page's apart: a busy page never starves recording.
  const db = pool(config, 6);
  const pageDb = pool(config, 4);
  for (const p of [db, pageDb]) {
    p.on("error", (e) => log("warn", "an idle database connection failed", { error: e.message }));
  }
  const fence = new PgFence(`${config.schema}.inbox_fence`);
  for (const statement of migrations(config.schema, fence)) await db.query(statement);

  const feed = new Feed();
  const listening = feed.listen(
    () => new pg.Client({ connectionString: databaseUrl(config) }),
    config.schema,
    (message, error) => log(error === null ? "info" : "warn", message, error === null ? {} : { error: String(error) }),
  );
  const page = show(pageDb, config.schema, feed, config.host, config.port);
  await new Promise<void>((resolve, reject) => {
    page.server.once("error", reject);
    page.server.listen(config.port, config.host, resolve);
  });
  const address = page.server.address();
  log("info", "showing the inbox", { url: typeof address === "object" && address ? `http://${config.host}:${address.port}/` : undefined });

  const consumer = Consumer.start(
    {
      redisUrl: config.redisUrl,
      redis: {
        ...(config.redisPassword !== undefined ? { password: config.redisPassword } : {}),
        ...(config.redisCa !== undefined ? { tls: { ca: config.redisCa } } : {}),
      },
      stream: config.stream,
      shards: config.shards,
      group: config.group,
      consumer: config.consumer,
      log,
    },
    inbox(db, config.schema, fence, feed),
  );
  log("info", "consuming", { stream: config.stream, shards: config.shards, group: config.group, consumer: config.consumer });

  let stopping = false;
  const stop = (signal: string): void => {
    if (stopping) {
      log("warn", "stopping at once", { signal });
      process.exit(1);
    }
    stopping = true;
    log("info", "stopping (again to stop at once)", { signal });
    (async () => {
      await consumer.stop();
      page.closeStreams();
      page.server.close();
      await feed.stop();
      await listening;
      await Promise.all([db.end(), pageDb.end()]);
    })().then(
      () => process.exit(0),
      (e: unknown) => {
        log("error", "stopping failed", { error: String(e) });
        process.exit(1);
      },
    );
  };
  process.on("SIGTERM", () => stop("SIGTERM"));
  process.on("SIGINT", () => stop("SIGINT"));
}

main().catch((e: unknown) => {
  log("error", "failed", { error: e instanceof Error ? e.message : String(e) });
  process.exit(1);
});
