// The example's configuration, from the environment, checked at start: a missing or bad
// value stops the service with a message naming the variable and what to change.
import { readFileSync } from "node:fs";
import { hostname } from "node:os";
import { isIP } from "node:net";

export interface Config {
  databaseUrl: string;
  databasePassword: string | undefined;
  redisUrl: string;
  redisPassword: string | undefined;
  redisCa: string | undefined;
  stream: string;
  shards: number;
  group: string;
  consumer: string;
  schema: string;
  host: string;
  port: number;
}

export class ConfigError extends Error {
  override name = "ConfigError";
}

function required(env: NodeJS.ProcessEnv, name: string, what: string): string {
  const value = env[name];
  if (value === undefined || value === "") throw new ConfigError(`${name} is not set: ${what}`);
  return value;
}

/** A secret from the file a `*_FILE` variable names (trailing newline dropped). */
function secretFile(env: NodeJS.ProcessEnv, name: string): string | undefined {
  const path = env[name];
  if (path === undefined || path === "") return undefined;
  try {
    return readFileSync(path, "utf8").replace(/\r?\n$/, "");
  } catch (e) {
    throw new ConfigError(`${name}=${path} cannot be read: ${(e as Error).message}`);
  }
}

function plainName(value: string, name: string): string {
  // Lower case: as Postgres folds an unquoted name, so the name is the table's exactly.
  if (!/^[a-z_][a-z0-9_]{0,62}$/.test(value)) {
    throw new ConfigError(`${name}='${value}' must be lower-case letters, digits and underscores (a Postgres identifier)`);
  }
  return value;
}

/** Every setting, or a `ConfigError` saying which to change. */
export function load(env: NodeJS.ProcessEnv = process.env): Config {
  const shards = Number(env.STREAM_SHARDS ?? "1");
  if (!Number.isInteger(shards) || shards < 1 || shards > 1024) {
    throw new ConfigError(`STREAM_SHARDS='${env.STREAM_SHARDS}' must be the relay's --stream-shards (1..1024)`);
  }
  const listen = env.LISTEN ?? "127.0.0.1:8083";
  const at = listen.lastIndexOf(":");
  const host = listen.slice(0, at).replace(/^\[(.*)\]$/, "$1");
  const port = Number(listen.slice(at + 1));
  if (at < 0 || isIP(host) === 0 || !Number.isInteger(port) || port < 0 || port > 65535) {
    throw new ConfigError(`LISTEN='${listen}' must be <ip>:<port>, like 127.0.0.1:8083`);
  }
  // The page shows every chat's messages to whoever reaches it: no sign-in (the chat's
  // services do that). Loopback only, so it is never a way around the chat's membership.
  if (!(host === "::1" || host.startsWith("127."))) {
    throw new ConfigError(`LISTEN='${listen}': this example has no authentication; listen on a loopback address`);
  }
  const group = env.GROUP ?? "node-inbox";
  if (!/^[A-Za-z0-9_.-]{1,64}$/.test(group)) {
    throw new ConfigError(`GROUP='${group}' must be 1 to 64 letters, digits, '_', '.' or '-'`);
  }
  return {
    // TLS as libpq says it: ?sslmode=verify-full&sslrootcert=<CA file>.
    databaseUrl: required(env, "DATABASE_URL", "the example's Postgres database, postgres://user@host:port/db"),
    databasePassword: secretFile(env, "DATABASE_PASSWORD_FILE"),
    redisUrl: required(env, "REDIS_URL", "the Redis the relay publishes to, redis://… or rediss://user@host:port"),
    redisPassword: secretFile(env, "REDIS_PASSWORD_FILE"),
    redisCa: secretFile(env, "REDIS_CA_FILE"),
    stream: env.STREAM ?? "outbox:consumers",
    shards,
    group,
    consumer: env.CONSUMER_NAME ?? hostname(),
    schema: plainName(env.INBOX_SCHEMA ?? "node_inbox", "INBOX_SCHEMA"),
    host,
    port,
  };
}
