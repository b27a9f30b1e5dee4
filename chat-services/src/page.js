"use strict";
// Messages are rendered with textContent only: a body is text, never markup.
const side = document.getElementById("side").textContent;
const list = document.getElementById("messages");
const statusEl = document.getElementById("status");
const errorEl = document.getElementById("error");
const whoEl = document.getElementById("who");
const signinForm = document.getElementById("signin");
const fragment = new URLSearchParams(location.hash.slice(1));
let chatId = Number(fragment.get("chat")) || 7;
let source = null;
// The feed position this page has everything up to (history, then the event stream).
let lastPos = 0;
let shown = new Set();
let reopenTimer = null;
// A stream that says nothing (no message, no heartbeat) for this long is taken for dead: its
// instance froze, or something between forwards nothing. The server says how often it
// beats (one and a half beats, and half a second, is the limit); until it has, five seconds.
let silenceTimer = null;
let silenceLimit = 5000;
// A stream that does not open within this long is given up too (the request may have gone
// out on a kept-alive connection to the instance that froze).
const OPEN_LIMIT = 2000;
// Which open() is current: what an earlier one had in flight (its history, a send's
// answer) is dropped when it lands, never drawn into the chat shown now.
let generation = 0;
let historyRequest = null;

function setStatus(text, cls) { statusEl.textContent = text; statusEl.className = cls || ""; }

// Items are placed by their feed position, so every tab shows the order history shows.
function show(message, fromFeed) {
  if (fromFeed && message.pos > lastPos) lastPos = message.pos;
  if (shown.has(message.id)) return;
  shown.add(message.id);
  const item = document.createElement("div");
  item.className = "message " + (message.side === side ? "sent" : "received");
  item.dataset.id = message.id;
  item.dataset.pos = message.pos;
  const meta = document.createElement("div");
  meta.className = "meta";
  // The sender's name where the message has one (a service run with --allow-anonymous
  // sends none), in its own <bdi>: a name written right to left cannot reorder the side
  // and time after it. Then always the side.
  if (message.sender) {
    const sender = document.createElement("bdi");
    sender.className = "sender";
    sender.textContent = message.sender;
    meta.append(sender, " · ");
  }
  meta.append(message.side + " · " + new Date(message.created_at).toLocaleTimeString());
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = message.body;
  item.append(meta, body);
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  let before = null;
  for (let next = list.lastElementChild; next && Number(next.dataset.pos) > message.pos; next = next.previousElementSibling) {
    before = next;
  }
  list.insertBefore(item, before);
  if (atBottom || message.side === side) list.scrollTop = list.scrollHeight;
}

// Heard from the stream: it lives. Silent past the limit: open another (on whatever
// instance the address reaches now), from what was shown: at once the first time, then a
// little later each time nothing was heard in between (jittered, four seconds apart at
// most), so a fleet of tabs does not pile onto a service that is slow, not gone.
let silentReopens = 0;
function alive(limit) {
  clearTimeout(silenceTimer);
  silenceTimer = setTimeout(() => {
    setStatus("reconnecting", "reconnecting");
    const wait = silentReopens === 0 ? 0 : Math.min(500 * 2 ** (silentReopens - 1), 4000);
    silentReopens += 1;
    clearTimeout(reopenTimer);
    if (source) source.close();
    reopenTimer = setTimeout(listen, wait * (0.5 + Math.random()));
  }, limit || silenceLimit);
}
function heard() { silentReopens = 0; alive(); }

function listen() {
  clearTimeout(reopenTimer);
  clearTimeout(silenceTimer);
  if (source) source.close();
  // The browser resends Last-Event-ID on its own reconnects; `after` covers the first
  // connection and reopenings after the server refused one.
  const current = new EventSource(`/chats/${chatId}/events?after=p${lastPos}`);
  source = current;
  alive(OPEN_LIMIT);
  current.addEventListener("open", () => { reopenDelay = 500; setStatus("live", "live"); alive(); });
  current.addEventListener("heartbeat", (event) => {
    const every = JSON.parse(event.data).every_ms;
    if (every > 0) silenceLimit = Math.round(1.5 * every) + 500;
    heard();
  });
  // The stream starts nearer the tip than asked (the page was away for more messages than a
  // stream replays): what was shown ends before a gap, so it goes, and the chat is shown
  // from where the stream starts (older messages are in the history).
  current.addEventListener("skipped", (event) => {
    heard();
    if (current !== source) return;
    list.replaceChildren();
    shown = new Set();
    const until = Number(String(JSON.parse(event.data).until).slice(1));
    if (until > lastPos) lastPos = until;
    errorEl.textContent = "older messages are not shown here: this page was away for many";
  });
  current.addEventListener("message", (event) => {
    heard();
    const message = JSON.parse(event.data);
    if (message.chat_id === chatId) show(message, true);
  });
  current.addEventListener("error", () => {
    if (current !== source) return;
    setStatus("reconnecting", "reconnecting");
    // Refused (the session expired, or the user left the chat): ask who we are before
    // opening again, so an expired session shows the sign-in instead of retrying blind.
    // Soon, whatever happened before: a service back is a service to use now.
    if (current.readyState === EventSource.CLOSED) {
      clearTimeout(silenceTimer);
      reopenTimer = setTimeout(reopen, reopenDelay * (0.5 + Math.random()));
      reopenDelay = Math.min(reopenDelay * 2, 2000);
    }
  });
}

// The server refused the stream (EventSource does not say why): ask the history, whose
// answer does. Not a member (any more) or not signed in: say so and stop; anything else
// (an instance going away, a 503): open again, a little later each time, two seconds apart
// at most (jittered, so a fleet of tabs does not come back at once).
let reopenDelay = 500;
async function reopen() {
  const chat = chatId;
  try {
    const response = await fetch(`/chats/${chat}/messages?limit=1`);
    if (chat !== chatId) return;
    if (response.status === 401) { askToSignIn((await response.json()).error); return; }
    if (response.status === 404) {
      setStatus("closed");
      errorEl.textContent = `chat ${chat}: you are not a member (or it does not exist)`;
      return;
    }
  } catch (e) {
    // Unreachable: try again later, as for any other refusal.
  }
  if (chat === chatId) listen();
}

async function open(chat) {
  const mine = ++generation;
  if (historyRequest) historyRequest.abort();
  historyRequest = new AbortController();
  const { signal } = historyRequest;
  chatId = chat;
  location.hash = "chat=" + chat;
  document.getElementById("chat").value = chat;
  clearTimeout(reopenTimer);
  clearTimeout(silenceTimer);
  reopenDelay = 500;
  silentReopens = 0;
  if (source) source.close();
  source = null;
  list.replaceChildren();
  shown = new Set();
  lastPos = 0;
  errorEl.textContent = "";
  setStatus("connecting");
  try {
    const response = await fetch(`/chats/${chat}/messages?limit=200`, { signal });
    const data = await response.json();
    if (mine !== generation) return;
    if (response.status === 401) askToSignIn(data.error);
    if (!response.ok) throw new Error(data.error || response.statusText);
    data.messages.forEach((message) => show(message, true));
  } catch (e) {
    if (mine !== generation) return;
    errorEl.textContent = "history: " + e.message;
  }
  listen();
}

async function send(text) {
  // One key per message: a retried request returns the original instead of sending twice.
  const key = crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random();
  // The chat it was written in: a switch during the retries must not post it elsewhere.
  const chat = chatId;
  for (let attempt = 0; attempt < 5; attempt++) {
    let wait = 1000 * (attempt + 1);
    try {
      const response = await fetch(`/chats/${chat}/messages`, {
        method: "POST",
        headers: { "Content-Type": "application/json", "Idempotency-Key": key },
        body: JSON.stringify({ body: text }),
      });
      const data = await response.json();
      if (response.ok) {
        if (data.chat_id === chatId) show(data, false);
        if (chat === chatId) errorEl.textContent = "";
        return true;
      }
      if (response.status === 401) askToSignIn(data.error);
      // Too fast (429) or not taken (503): the same message again, with the same key,
      // once the server says (a new key would risk sending it twice).
      if (response.status !== 503 && response.status !== 429) return unsent(chat, text, data.error);
      const after = Number(response.headers.get("Retry-After"));
      if (after > 0) wait = Math.max(wait, after * 1000);
      if (chat === chatId) errorEl.textContent = data.error + " (retrying)";
    } catch (e) {
      if (chat === chatId) errorEl.textContent = "network error (retrying)";
    }
    await new Promise((resolve) => setTimeout(resolve, wait));
  }
  return unsent(chat, text, "not sent");
}

// A send that failed: its text goes back into the compose box if its chat is still open,
// or is named in the error line otherwise (never into another chat's box).
function unsent(chat, text, error) {
  if (chat === chatId) { errorEl.textContent = error; return false; }
  errorEl.textContent = `to chat ${chat}, not sent (${error}): ${text}`;
  return true;
}

document.getElementById("pick").addEventListener("submit", (event) => {
  event.preventDefault();
  const chat = Number(document.getElementById("chat").value);
  if (Number.isInteger(chat) && chat > 0) open(chat);
});

const bodyInput = document.getElementById("body");
document.getElementById("compose").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = bodyInput.value;
  if (!text.trim()) return;
  bodyInput.value = "";
  if (!(await send(text))) bodyInput.value = text;
  bodyInput.focus();
});
bodyInput.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    document.getElementById("compose").requestSubmit();
  }
});

// The session: the service keeps the token in an HttpOnly cookie (EventSource cannot send
// headers), so the page never stores it. A link from the identity provider (or
// deploy/local.sh) may carry it in the fragment, which is never sent to a server.
function askToSignIn(reason) {
  whoEl.textContent = "";
  setStatus("signed out");
  signinForm.classList.add("shown");
  if (reason) errorEl.textContent = reason;
}

async function whoami() {
  try {
    const response = await fetch("/session");
    const data = await response.json();
    if (!response.ok) { askToSignIn(data.error); return false; }
    signinForm.classList.remove("shown");
    whoEl.textContent = data.anonymous ? "anonymous" : "signed in as " + data.user;
    return true;
  } catch (e) {
    errorEl.textContent = "network error";
    return false;
  }
}

async function signIn(token) {
  const response = await fetch("/session", { method: "POST", headers: { Authorization: "Bearer " + token } });
  const data = await response.json();
  if (!response.ok) { askToSignIn("sign-in refused: " + data.error); return false; }
  errorEl.textContent = "";
  return whoami();
}

signinForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const input = document.getElementById("token");
  const token = input.value.trim();
  input.value = "";
  if (token && (await signIn(token))) open(chatId);
});

(async () => {
  const token = fragment.get("token");
  if (token) {
    // Out of the address bar and the history before anything else.
    history.replaceState(null, "", location.pathname + "#chat=" + chatId);
  }
  const signedIn = await whoami();
  if (token) {
    // Never signed in by a link alone: anyone can send a link carrying their own token
    // (the victim would then post where its sender reads). The token waits in the form
    // for the user to press sign in, saying whose it claims to be.
    signinForm.classList.add("shown");
    document.getElementById("token").value = token;
    errorEl.textContent = "This link signs you in as " + claimedUser(token) +
      (signedIn ? " instead of the current session" : "") + ": press sign in to accept.";
    if (!signedIn) return;
  }
  if (signedIn) open(chatId);
})();

// The subject a token claims (unverified: shown only so the user can decide).
function claimedUser(token) {
  try {
    const part = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
    return JSON.parse(atob(part)).sub || "someone";
  } catch (e) {
    return "someone";
  }
}
