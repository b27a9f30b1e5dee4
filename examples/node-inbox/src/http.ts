// What the example shows: a page listing the inbox live, fed by Server-Sent Events that
// resume where the page left off (`Last-Event-ID`: the last `seq` it got), and the same
// rows as JSON.
//
// Invariants: a stream sends each row once and in `seq` order — the backlog from the table
// first, then rows recorded meanwhile (held until the backlog is out, then those past it);
// open streams and backlog reads are bounded, so no client holds more than its share.
import http from "node:http";
import type pg from "pg";
import { ROW_COLUMNS, toRow, type Feed, type Row } from "./inbox.js";

const MAX_STREAMS = 100;
const PAGE_ROWS = 500;
const HEARTBEAT_MS = 15_000;
/** Rows a stream may hold for a page that does not read them before it is closed. */
const MAX_QUEUED = 10_000;

export interface Shown {
  server: http.Server;
  /** Close every open stream (on shutdown). */
  closeStreams(): void;
}

function json(res: http.ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(text) });
  res.end(text);
}

/** `Last-Event-ID` or `?after=`: the last `seq` the client has (0: none). */
function resumeFrom(req: http.IncomingMessage, url: URL): number | string {
  const raw = req.headers["last-event-id"] ?? url.searchParams.get("after") ?? "0";
  const text = Array.isArray(raw) ? raw[0] ?? "0" : raw;
  if (!/^[0-9]{1,15}$/.test(text)) return `'${text.slice(0, 40)}' is not a row's seq (a non-negative integer)`;
  return Number(text);
}

export function show(pool: pg.Pool, schema: string, feed: Feed): Shown {
  const streams = new Set<http.ServerResponse>();

  async function rowsAfter(after: number, limit: number): Promise<Row[]> {
    const r = await pool.query(`SELECT ${ROW_COLUMNS} FROM ${schema}.inbox WHERE seq > $1 ORDER BY seq LIMIT $2`, [after, limit]);
    return r.rows.map(toRow);
  }

  async function events(req: http.IncomingMessage, res: http.ServerResponse, after: number): Promise<void> {
    if (streams.size >= MAX_STREAMS) {
      json(res, 503, { error: `too many open streams (${MAX_STREAMS}); try again later` });
      return;
    }
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-store", connection: "keep-alive" });
    // Headers now, with the reconnection delay: the page is connected even while the
    // backlog is empty.
    res.write("retry: 1000\n\n");
    streams.add(res);
    let last = after;
    let live = false;
    const held: Row[] = [];
    const send = (rows: Row[]): void => {
      for (const row of rows) {
        if (row.seq <= last) continue;
        res.write(`id: ${row.seq}\nevent: message\ndata: ${JSON.stringify(row)}\n\n`);
        last = row.seq;
      }
    };
    const onRows = (rows: Row[]): void => {
      if (live) {
        send(rows);
      } else if (held.length + rows.length <= MAX_QUEUED) {
        held.push(...rows);
      } else {
        res.destroy(); // The page reconnects and resumes from the table.
      }
    };
    // Listening before reading the table: a row recorded meanwhile is in one or the other.
    feed.on("rows", onRows);
    const heartbeat = setInterval(() => res.write(": keep-alive\n\n"), HEARTBEAT_MS);
    const done = (): void => {
      feed.off("rows", onRows);
      clearInterval(heartbeat);
      streams.delete(res);
    };
    res.on("close", done);
    try {
      for (;;) {
        const rows = await rowsAfter(last, PAGE_ROWS);
        send(rows);
        if (rows.length < PAGE_ROWS || res.destroyed) break;
      }
      live = true;
      send(held.splice(0).sort((a, b) => a.seq - b.seq));
    } catch (e) {
      console.error(JSON.stringify({ level: "warn", message: "a stream's backlog could not be read", error: String(e) }));
      res.destroy();
    }
  }

  const server = http.createServer((req, res) => {
    const url = new URL(req.url ?? "/", "http://localhost");
    if (req.method !== "GET") {
      json(res, 405, { error: `${req.method} is not allowed: this service only shows its inbox (GET)` });
      return;
    }
    const after = resumeFrom(req, url);
    switch (url.pathname) {
      case "/":
        res.writeHead(200, { "content-type": "text/html; charset=utf-8", "content-security-policy": CSP });
        res.end(PAGE);
        return;
      case "/page.js":
        res.writeHead(200, { "content-type": "text/javascript; charset=utf-8", "content-security-policy": CSP });
        res.end(SCRIPT);
        return;
      case "/healthz":
        json(res, 200, { ok: true });
        return;
      case "/messages":
        if (typeof after === "string") return json(res, 400, { error: after });
        rowsAfter(after, PAGE_ROWS).then(
          (rows) => json(res, 200, { messages: rows }),
          (e) => json(res, 503, { error: `the inbox cannot be read: ${String(e)}` }),
        );
        return;
      case "/events":
        if (typeof after === "string") return json(res, 400, { error: after });
        void events(req, res, after);
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
