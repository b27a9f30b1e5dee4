// What the example shows: a page listing the inbox live, fed by Server-Sent Events that
// resume where the page left off (`Last-Event-ID`: the last `seq` it got), and the same
// rows as JSON.
//
// Invariants: a stream sends rows only as read from the table, each once and in `seq`
// order (`seq` follows commit order, see inbox.ts): a wake-up (a commit of this instance or
// of any other, through the `Feed`) makes it read what is past the last row it sent, so
// no row is skipped whoever recorded it. Only requests naming this service's own address
// are answered (a page of another site rebinding its name to loopback reads nothing).
// Streams, page queries and unread output are bounded: a stranger holds no more than its share.
import http from "node:http";
import type pg from "pg";
import { ROW_COLUMNS, toRow, type Feed, type Row } from "./inbox.js";

const MAX_STREAMS = 50;
const MAX_QUERIES = 4;
const PAGE_ROWS = 500;
const HEARTBEAT_MS = 15_000;

export interface Shown {
  server: http.Server;
  /** Close every open stream (on shutdown). */
  closeStreams(): void;
}

function json(res: http.ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, {
    "content-type": "application/json",
    "content-length": Buffer.byteLength(text),
    "x-content-type-options": "nosniff",
  });
  res.end(text);
}

/** `Last-Event-ID` or `?after=`: the last `seq` the client has (0: none). */
function resumeFrom(req: http.IncomingMessage, url: URL): number | string {
  const raw = req.headers["last-event-id"] ?? url.searchParams.get("after") ?? "0";
  const text = Array.isArray(raw) ? raw[0] ?? "0" : raw;
  if (!/^[0-9]{1,15}$/.test(text)) return `'${text.slice(0, 40)}' is not a row's seq (a non-negative integer)`;
  return Number(text);
}

/** The `Host` values naming this service: its address, and `localhost` on its port. */
function ownHosts(host: string, port: number): Set<string> {
  const literal = host.includes(":") ? `[${host}]` : host;
  return new Set([`${literal}:${port}`, `localhost:${port}`]);
}

/** The page and its streams, reading through `pool` (the page's own, apart from the
 * consumer's: a busy page never starves the recording). */
export function show(pool: pg.Pool, schema: string, feed: Feed, host: string, port: number): Shown {
  const streams = new Set<http.ServerResponse>();
  const hosts = ownHosts(host, port);
  let queries = 0;

  async function rowsAfter(after: number, limit: number): Promise<Row[]> {
    const r = await pool.query(`SELECT ${ROW_COLUMNS} FROM ${schema}.inbox WHERE seq > $1 ORDER BY seq LIMIT $2`, [after, limit]);
    return r.rows.map(toRow);
  }

  function events(res: http.ServerResponse, after: number): void {
    if (streams.size >= MAX_STREAMS) {
      json(res, 503, { error: `too many open streams (${MAX_STREAMS}); try again later` });
      return;
    }
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-store", "x-content-type-options": "nosniff" });
    // Headers now, with the reconnection delay: the page is connected even while the
    // inbox has nothing past `after`.
    res.write("retry: 1000\n\n");
    streams.add(res);
    let last = after;
    let reading = false;
    let again = false;
    // Read everything past `last`, a page at a time, waiting for a client that does not
    // read to drain before the next; a wake-up meanwhile reads once more after.
    const catchUp = async (): Promise<void> => {
      if (reading) {
        again = true;
        return;
      }
      reading = true;
      try {
        do {
          again = false;
          for (;;) {
            const rows = await rowsAfter(last, PAGE_ROWS);
            let room = true;
            for (const row of rows) {
              room = res.write(`id: ${row.seq}\nevent: message\ndata: ${JSON.stringify(row)}\n\n`);
              last = row.seq;
            }
            if (res.destroyed) return;
            if (!room) await new Promise((resolve) => res.once("drain", resolve).once("close", resolve));
            if (rows.length < PAGE_ROWS) break;
          }
        } while (again && !res.destroyed);
      } catch (e) {
        console.error(JSON.stringify({ level: "warn", message: "a stream's rows could not be read; it closes and the page resumes", error: String(e) }));
        res.destroy();
      } finally {
        reading = false;
      }
    };
    const wake = (): void => void catchUp();
    feed.on("recorded", wake);
    const heartbeat = setInterval(() => res.write(": keep-alive\n\n"), HEARTBEAT_MS);
    res.on("close", () => {
      feed.off("recorded", wake);
      clearInterval(heartbeat);
      streams.delete(res);
    });
    wake();
  }

  const server = http.createServer((req, res) => {
    if (!hosts.has(req.headers.host ?? "")) {
      json(res, 421, { error: `this service answers only as ${[...hosts].join(" or ")}` });
      return;
    }
    const url = new URL(req.url ?? "/", "http://localhost");
    if (req.method !== "GET") {
      json(res, 405, { error: `${req.method} is not allowed: this service only shows its inbox (GET)` });
      return;
    }
    const after = resumeFrom(req, url);
    switch (url.pathname) {
      case "/":
        res.writeHead(200, { "content-type": "text/html; charset=utf-8", "content-security-policy": CSP, "x-content-type-options": "nosniff" });
        res.end(PAGE);
        return;
      case "/page.js":
        res.writeHead(200, { "content-type": "text/javascript; charset=utf-8", "content-security-policy": CSP, "x-content-type-options": "nosniff" });
        res.end(SCRIPT);
        return;
      case "/healthz":
        json(res, 200, { ok: true });
        return;
      case "/messages":
        if (typeof after === "string") return json(res, 400, { error: after });
        if (queries >= MAX_QUERIES) return json(res, 503, { error: "too many queries at once; try again later" });
        queries += 1;
        rowsAfter(after, PAGE_ROWS)
          .then(
            (rows) => json(res, 200, { messages: rows }),
            (e) => {
              console.error(JSON.stringify({ level: "warn", message: "the inbox could not be read", error: String(e) }));
              json(res, 503, { error: "the inbox cannot be read right now; try again later" });
            },
          )
          .finally(() => (queries -= 1));
        return;
      case "/events":
        if (typeof after === "string") return json(res, 400, { error: after });
        events(res, after);
        return;
      default:
        json(res, 404, { error: `no such page: ${url.pathname.slice(0, 100)} (try /, /messages, /events)` });
    }
  });
  // A client that sends its request slowly holds a socket: bounded.
  server.headersTimeout = 10_000;
  server.requestTimeout = 10_000;
  server.maxConnections = MAX_STREAMS + 50;
  return {
    server,
    closeStreams() {
      for (const res of streams) res.end();
    },
  };
}

// The page: the inbox, newest last; text only through textContent (a message is never
// markup), and no script but the page's own.
const CSP = "default-src 'self'; style-src 'unsafe-inline'; frame-ancestors 'none'";

const PAGE = `<!doctype html>
<meta charset="utf-8">
<title>node-inbox</title>
<style>
  body { font: 15px system-ui, sans-serif; margin: 2rem auto; max-width: 48rem; }
  li { margin: .3rem 0; list-style: none; }
  .meta { color: #666; font-size: 12px; margin-right: .5rem; }
  #state { color: #666; font-size: 12px; }
</style>
<h1>Inbox of the Node service</h1>
<p id="state">connecting…</p>
<ul id="rows"></ul>
<script src="/page.js"></script>
`;

const SCRIPT = `const rows = document.getElementById("rows");
const state = document.getElementById("state");
// EventSource resends the last id it got (Last-Event-ID) when it reconnects: nothing is missed.
const source = new EventSource("/events");
source.onopen = () => { state.textContent = "live"; };
source.onerror = () => { state.textContent = "reconnecting…"; };
source.addEventListener("message", (e) => {
  const m = JSON.parse(e.data);
  const li = document.createElement("li");
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = "#" + m.seq + " chat " + m.chatId + " · " + (m.sender ?? "anonymous") + " · " + new Date(m.createdAt).toLocaleTimeString();
  const body = document.createElement("span");
  body.textContent = m.body;
  li.append(meta, body);
  rows.append(li);
});
`;
