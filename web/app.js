// tokenspout web chat: one session, its messages POSTed, its event stream read with EventSource.
//
// Everything the model or the person writes reaches the page through textContent only: the
// renderer below builds elements for a few markdown-ish forms and never parses HTML.
//
// The session (id, token), the id of the last event applied and the reply in progress are kept
// in sessionStorage together, in one write per event, so a reload can show the history (GET),
// put the partial reply back and resume the stream right after the last event it applied.
//
// A reply resumed after a reload cannot time its first token again, and its remaining events
// may arrive as one fast replay: its time to first token is the one measured before the
// reload (if a token had come), and its rate is taken from the event ids, which are the
// Redis server's clock in ms, so a replay does not inflate it.
//
// A gateway with API keys answers 401 to creating a session without one: the page then asks
// for the key (a password field), keeps it in sessionStorage (this tab only) and sends it as
// `Authorization: Bearer` when it creates a session. The session's own requests need only
// its token.
"use strict";

const STORE_KEY = "tokenspout.chat.v1";
const API_KEY_STORE = "tokenspout.apiKey.v1";
const MODEL_STORE = "tokenspout.model.v1"; // the model picked last (several served)
const EVENT_TYPES = ["queued", "started", "token", "resumed", "done", "cancelled", "error"];
const FINAL_TYPES = new Set(["done", "cancelled", "error"]);
const RECONNECT_MAX_MS = 8000;
const OFFLINE_AFTER_FAILURES = 3;

const query = new URLSearchParams(location.search);
const MAX_TOKENS = positiveInt(query.get("max_tokens"));

const ui = {
  log: byId("log"),
  messages: byId("messages"),
  empty: byId("empty"),
  form: byId("composer"),
  input: byId("input"),
  send: byId("send"),
  stop: byId("stop"),
  conn: byId("conn"),
  connLabel: byId("conn-label"),
  model: byId("model-name"),
  picker: byId("model-picker"),
  banner: byId("banner"),
  bannerText: byId("banner-text"),
  bannerRetry: byId("banner-retry"),
  bannerClose: byId("banner-close"),
  newChat: byId("new-chat"),
  keyForm: byId("key-form"),
  keyInput: byId("api-key"),
  keyError: byId("key-error"),
};

const chat = {
  session: null, // {id, token}
  lastEventId: null, // the id of the last event applied to the page
  source: null, // the EventSource
  failures: 0, // failed connection attempts in a row
  reconnectTimer: null,
  turns: new Map(), // generation id -> Turn
  waiting: [], // turns sent whose generation id is not known yet
  active: null, // the turn whose reply runs (queued or streaming)
  sending: false,
  model: "", // the model that served the last reply (or the one the workers serve)
  storageWarned: false, // a failed sessionStorage write was shown once already
  apiKey: null, // the API key given in this page (also in sessionStorage when it takes it)
};

function byId(id) {
  return document.getElementById(id);
}

function positiveInt(value) {
  const n = Number.parseInt(value ?? "", 10);
  return Number.isFinite(n) && n > 0 ? n : null;
}

// ---- event ids ------------------------------------------------------------------------------

// Redis stream ids: "<ms>-<seq>". True when a comes strictly after b.
function idAfter(a, b) {
  const [am, as] = a.split("-").map(BigInt);
  const [bm, bs] = b.split("-").map(BigInt);
  return am > bm || (am === bm && as > bs);
}

// The Redis server's time (ms) an event was written, from its id; null without one.
function idMs(id) {
  const ms = Number.parseInt((id ?? "").split("-")[0], 10);
  return Number.isFinite(ms) ? ms : null;
}

// ---- storage --------------------------------------------------------------------------------

function loadSaved() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(STORE_KEY) ?? "null");
    return saved && saved.id && saved.token ? saved : null;
  } catch (err) {
    console.warn("ignoring an unreadable saved session", err);
    return null;
  }
}

function persist() {
  if (!chat.session) return;
  const turn = chat.active;
  const active = turn && turn.gid ? turn.saved() : null;
  store(
    STORE_KEY,
    JSON.stringify({ ...chat.session, lastEventId: chat.lastEventId, model: chat.model, active }),
  );
}

// sessionStorage refuses writes when it is full or blocked (private modes, policies): the
// page goes on, and says once that a reload will not bring the conversation back.
function store(key, value) {
  try {
    sessionStorage.setItem(key, value);
    return true;
  } catch (err) {
    console.warn("sessionStorage refused a write", key, err);
    if (!chat.storageWarned) {
      chat.storageWarned = true;
      showBanner(
        "This tab cannot save the conversation (browser storage is full or blocked): " +
          "it goes on, but a reload will not bring it back.",
      );
    }
    return false;
  }
}

// ---- HTTP -----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message, retryAfter) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

async function api(method, path, body, headers = {}) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: {
        ...(body === undefined ? {} : { "Content-Type": "application/json" }),
        ...(chat.session ? { "X-Session-Token": chat.session.token } : {}),
        ...headers,
      },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    throw new ApiError(0, "network", "The gateway cannot be reached. Check your connection.");
  }
  const payload = await response.json().catch(() => null);
  if (!response.ok) {
    const error = payload?.error ?? {};
    const retryAfter = Number.parseFloat(response.headers.get("Retry-After") ?? "");
    throw new ApiError(
      response.status,
      error.code ?? `http_${response.status}`,
      error.message ?? response.statusText,
      Number.isFinite(retryAfter) ? retryAfter : null,
    );
  }
  return payload;
}

function describeError(err) {
  switch (err.status) {
    case 0:
      return err.message;
    case 409:
      return "A reply is still running. Stop it or wait for it to finish.";
    case 429: {
      const wait = err.retryAfter ? ` Try again in ${Math.ceil(err.retryAfter)} s.` : "";
      return `The gateway is busy with other replies right now.${wait}`;
    }
    case 503:
      return `The service is unavailable for a moment (${err.message}).`;
    case 413:
      return "That message is too long.";
    default:
      return err.message || `The request failed (HTTP ${err.status}).`;
  }
}

function retryable(err) {
  return err.status === 0 || err.status === 429 || err.status >= 500;
}

// ---- banner and connection state -----------------------------------------------------------

function showBanner(text, retry) {
  ui.bannerText.textContent = text;
  ui.bannerRetry.hidden = !retry;
  ui.bannerRetry.onclick = retry
    ? () => {
        hideBanner();
        retry();
      }
    : null;
  ui.banner.hidden = false;
}

function hideBanner() {
  ui.banner.hidden = true;
}

const CONN_LABELS = {
  connecting: "Connecting…",
  connected: "Connected",
  reconnecting: "Reconnecting…",
  offline: "Offline",
  locked: "API key needed",
};

// The model in the top bar: the one that served the last reply, or before any reply in this
// tab, what the live workers serve (GET /v1/models).
function showModel(model) {
  chat.model = model;
  ui.model.textContent = model;
}

async function showServedModel() {
  if (chat.model) return;
  const key = apiKey();
  try {
    const auth = key ? { Authorization: `Bearer ${key}` } : {};
    const list = await api("GET", "/v1/models", undefined, auth);
    const ids = (list?.data ?? []).map((card) => card.id).filter(Boolean);
    if (!chat.model && ids.length) {
      ui.model.textContent = ids.join(", ");
    }
  } catch (err) {
    // Only a label: without it the page works the same; the next reply names its model.
    console.warn("could not list the served models", err);
  }
}

// ---- model picker ---------------------------------------------------------------------------
// With more than one model served, the top bar offers a choice; a session keeps its model, so
// choosing another starts a new conversation.

async function servedModels() {
  const key = apiKey();
  try {
    const auth = key ? { Authorization: `Bearer ${key}` } : {};
    const list = await api("GET", "/v1/models", undefined, auth);
    const roots = (list?.data ?? []).map((card) => card.root || card.id).filter(Boolean);
    return [...new Set(roots)].sort();
  } catch (err) {
    console.warn("could not list the served models", err);
    return [];
  }
}

async function refreshPicker() {
  const models = await servedModels();
  const keep = [chat.model, sessionStorage.getItem(MODEL_STORE)].find((m) => models.includes(m));
  ui.picker.replaceChildren(...models.map((model) => new Option(model, model)));
  if (keep) ui.picker.value = keep;
  ui.picker.hidden = models.length < 2;
  ui.model.hidden = !ui.picker.hidden; // the picker names the model itself
}

function pickedModel() {
  return ui.picker.hidden ? null : ui.picker.value || null;
}

function setConn(state) {
  if (ui.conn.dataset.state === state) return;
  ui.conn.dataset.state = state;
  ui.connLabel.textContent = CONN_LABELS[state];
}

// ---- rendering ------------------------------------------------------------------------------

// A few markdown-ish forms, built as elements: ``` fenced code ```, `code`, **bold**, blank
// lines between paragraphs, line breaks. Text only ever goes in through text nodes.
function renderRich(container, text) {
  const fragment = document.createDocumentFragment();
  const parts = text.split(/```/);
  parts.forEach((part, index) => {
    if (index % 2 === 1) {
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      const newline = part.indexOf("\n");
      const language = newline > 0 ? part.slice(0, newline).trim() : "";
      const body = language && /^[\w+-]+$/.test(language) ? part.slice(newline + 1) : part;
      if (language && body !== part) pre.dataset.language = language;
      code.textContent = body.replace(/^\n/, "");
      pre.append(code);
      fragment.append(pre);
      return;
    }
    for (const paragraph of part.split(/\n{2,}/)) {
      if (!paragraph.trim()) continue;
      const p = document.createElement("p");
      appendInline(p, paragraph.replace(/^\n+|\n+$/g, ""));
      fragment.append(p);
    }
  });
  container.replaceChildren(fragment);
}

function appendInline(parent, text) {
  const pattern = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\n)/g;
  let last = 0;
  for (const match of text.matchAll(pattern)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    const token = match[0];
    if (token === "\n") {
      parent.append(document.createElement("br"));
    } else {
      const element = document.createElement(token.startsWith("`") ? "code" : "strong");
      element.textContent = token.startsWith("`") ? token.slice(1, -1) : token.slice(2, -2);
      parent.append(element);
    }
    last = match.index + token.length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function scrollToEnd(force = false) {
  const log = ui.log;
  const nearEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 120;
  if (force || nearEnd) log.scrollTop = log.scrollHeight;
}

function addUserMessage(text) {
  ui.empty.hidden = true;
  const li = document.createElement("li");
  li.className = "msg user";
  const bubble = document.createElement("div");
  bubble.className = "bubble";
  bubble.textContent = text; // white-space: pre-wrap keeps the person's line breaks
  li.append(bubble);
  ui.messages.append(li);
  scrollToEnd(true);
  return li;
}

class Turn {
  constructor(prompt, { sentAt = null } = {}) {
    this.prompt = prompt;
    this.gid = null;
    this.text = "";
    this.count = 0;
    this.model = "";
    this.state = "waiting";
    this.sentAt = sentAt;
    this.firstAt = null;
    this.firstCount = 0;
    this.lastAt = null;
    this.ttftMs = null; // time to first token as measured live (kept across a reload)
    this.resumed = false; // put back after a reload: rate from the event ids' clock
    this.takeovers = 0; // times another engine worker took the reply over
    this.firstMs = null; // server time (ms) and count of the first token event
    this.firstMsCount = 0;
    this.lastMs = null;
    this.renderQueued = false;

    ui.empty.hidden = true;
    this.el = document.createElement("li");
    this.el.className = "msg assistant";
    this.el.setAttribute("aria-live", "polite");
    this.el.setAttribute("aria-busy", "true");
    const bubble = document.createElement("div");
    bubble.className = "bubble";
    this.content = document.createElement("div");
    this.content.className = "content";
    this.meta = document.createElement("div");
    this.meta.className = "meta";
    this.badge = document.createElement("span");
    this.badge.className = "badge";
    this.stats = document.createElement("span");
    this.stats.className = "stats";
    this.actions = document.createElement("span");
    this.actions.className = "actions";
    this.meta.append(this.badge, this.stats, this.actions);
    bubble.append(this.content, this.meta);
    this.el.append(bubble);
    ui.messages.append(this.el);
    this.setState("waiting");
    scrollToEnd(true);
  }

  bind(gid) {
    this.gid = gid;
    this.el.dataset.generationId = gid;
    chat.turns.set(gid, this);
  }

  get final() {
    return FINAL_TYPES.has(this.state) || this.state === "settled";
  }

  setState(state, label = null) {
    this.state = state;
    this.el.dataset.state = state;
    const labels = {
      waiting: "Sending…",
      queued: "Waiting for an engine…",
      streaming: "",
      done: "",
      settled: "",
      cancelled: "Stopped",
      error: "Failed",
    };
    this.badge.textContent = label ?? labels[state] ?? "";
    this.badge.hidden = !this.badge.textContent;
    if (this.final) this.el.setAttribute("aria-busy", "false");
  }

  setModel(model) {
    this.model = model;
    if (model) showModel(model);
    this.renderStats();
  }

  // What sessionStorage keeps of the reply in progress, for a reload to put it back.
  saved() {
    return {
      gid: this.gid,
      text: this.text,
      count: this.count,
      model: this.model,
      state: this.state,
      ttftMs: this.ttftMs,
      firstMs: this.firstMs,
      firstMsCount: this.firstMsCount,
    };
  }

  restore(partial) {
    this.resumed = true;
    this.text = partial.text;
    this.count = partial.count;
    this.firstCount = partial.count;
    this.ttftMs = partial.ttftMs ?? null;
    this.firstMs = partial.firstMs ?? null;
    this.firstMsCount = partial.firstMsCount ?? 0;
    this.lastMs = this.firstMs;
    this.setModel(partial.model ?? "");
  }

  addToken(text, count, at, serverMs) {
    if (count <= this.count) return; // already shown (a replayed event)
    if (this.firstAt === null) {
      this.firstAt = at;
      this.firstCount = count;
      if (this.sentAt !== null && this.ttftMs === null) this.ttftMs = at - this.sentAt;
    }
    if (serverMs !== null) {
      if (this.firstMs === null) {
        this.firstMs = serverMs;
        this.firstMsCount = count;
      }
      this.lastMs = serverMs;
    }
    this.lastAt = at;
    this.text += text;
    this.count = count;
    if (this.state !== "streaming") this.setState("streaming");
    this.scheduleRender();
  }

  scheduleRender() {
    if (this.renderQueued) return;
    this.renderQueued = true;
    requestAnimationFrame(() => {
      // A render since (the final event's) already drew this text, and maybe a note after
      // it that drawing again would wipe.
      if (this.renderQueued) this.render();
    });
  }

  render() {
    this.renderQueued = false;
    renderRich(this.content, this.text);
    this.renderStats();
    scrollToEnd();
  }

  renderStats() {
    const parts = [];
    if (this.model) parts.push(this.model);
    if (this.ttftMs !== null) {
      this.stats.dataset.ttftMs = this.ttftMs.toFixed(0);
      parts.push(`${(this.ttftMs / 1000).toFixed(2)} s to first token`);
    }
    const rate = this.rate();
    if (rate !== null) {
      this.stats.dataset.tokensPerS = rate.toFixed(1);
      parts.push(`${rate.toFixed(1)} tokens/s`);
    }
    if (this.count) parts.push(`${this.count} token${this.count === 1 ? "" : "s"}`);
    if (this.resumed) {
      this.stats.dataset.resumed = "true";
      parts.push("resumed after a reload");
    }
    if (this.takeovers) {
      this.stats.dataset.takeovers = String(this.takeovers);
      parts.push("continued on another engine");
    }
    this.stats.textContent = parts.join(" · ");
  }

  // Tokens per second after the first token. Live: the page's clock. Resumed: the event ids'
  // clock, since what arrives after a reload may be a replay of tokens made long before.
  rate() {
    if (this.resumed) {
      if (this.firstMs === null || !(this.lastMs > this.firstMs)) return null;
      return (this.count - this.firstMsCount) / ((this.lastMs - this.firstMs) / 1000);
    }
    if (this.count > this.firstCount && this.lastAt > this.firstAt) {
      return (this.count - this.firstCount) / ((this.lastAt - this.firstAt) / 1000);
    }
    return null;
  }

  addRetry(label = "Retry") {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "link";
    button.textContent = label;
    button.addEventListener("click", () => {
      button.remove();
      sendMessage(this.prompt);
    });
    this.actions.replaceChildren(button);
  }

  finish(type, data) {
    this.render();
    if (type === "done") {
      const note = data.finish_reason === "length" ? "Reached the token limit" : "";
      this.setState("done", note);
    } else if (type === "cancelled") {
      const why = {
        user: "Stopped",
        abandoned: "Stopped: nobody was reading",
        disconnected: "Stopped: the client left",
        shutdown: "Stopped: the engine shut down",
      };
      this.setState("cancelled", why[data.reason] ?? "Stopped");
    } else {
      this.setState("error", "Failed");
      const message = document.createElement("p");
      message.className = "error-text";
      message.textContent = `The engine could not finish this reply: ${data.message} (${data.code}).`;
      this.content.append(message);
      if (this.prompt !== null) this.addRetry();
    }
    scrollToEnd();
  }
}

// ---- the event stream -----------------------------------------------------------------------

function eventsUrl(after) {
  const url = new URL(`/v1/sessions/${encodeURIComponent(chat.session.id)}/events`, location.href);
  url.searchParams.set("token", chat.session.token);
  if (after) url.searchParams.set("last_event_id", after);
  return url;
}

function openEvents(after) {
  closeEvents();
  const source = new EventSource(eventsUrl(after));
  chat.source = source;
  source.onopen = () => {
    chat.failures = 0;
    setConn("connected");
  };
  // The server's own `error` events are MessageEvents; connection errors are plain Events.
  source.addEventListener("error", (event) => {
    if (event instanceof MessageEvent) return;
    if (source !== chat.source) return;
    chat.failures += 1;
    if (source.readyState === EventSource.CONNECTING) {
      // The browser reconnects by itself and sends Last-Event-ID.
      setConn(offlineNow() ? "offline" : "reconnecting");
    } else {
      scheduleReconnect();
    }
  });
  for (const type of EVENT_TYPES) source.addEventListener(type, onStreamEvent);
}

function closeEvents() {
  clearTimeout(chat.reconnectTimer);
  chat.reconnectTimer = null;
  if (chat.source) chat.source.close();
  chat.source = null;
}

function offlineNow() {
  return !navigator.onLine || chat.failures > OFFLINE_AFTER_FAILURES;
}

// The browser gave up on the stream (an HTTP error, or a failed reconnect). Find out why with
// a plain fetch, then open a new stream from the last event applied.
function scheduleReconnect() {
  closeEvents();
  setConn(offlineNow() ? "offline" : "reconnecting");
  const delay = Math.min(500 * 2 ** Math.min(chat.failures, 5), RECONNECT_MAX_MS);
  chat.reconnectTimer = setTimeout(reconnect, delay);
}

async function reconnect() {
  const url = eventsUrl(chat.lastEventId);
  const probe = new AbortController();
  let status;
  try {
    const response = await fetch(url, { signal: probe.signal });
    status = response.status;
  } catch (err) {
    chat.failures += 1;
    scheduleReconnect();
    return;
  } finally {
    probe.abort();
  }
  if (status === 200) {
    openEvents(chat.lastEventId);
  } else if (status === 410) {
    // The events after our last one were trimmed: show the stored history, follow new events.
    showBanner("Part of this reply was lost while offline; the saved conversation is shown.");
    await loadHistory({ partial: null });
    openEvents("$");
  } else if (status === 401 || status === 403 || status === 404) {
    showBanner("This conversation has expired. A new one was started.");
    await startNewSession();
  } else {
    chat.failures += 1;
    scheduleReconnect();
  }
}

function onStreamEvent(event) {
  const id = event.lastEventId;
  if (id && chat.lastEventId && !idAfter(id, chat.lastEventId)) return; // seen already
  let data;
  try {
    data = JSON.parse(event.data);
  } catch (err) {
    console.error("unreadable event", event.type, event.data, err);
    showBanner(
      `The gateway sent a ${event.type} event this page could not read; ` +
        "the reply shown may be incomplete. Reloading the page shows the saved conversation.",
    );
    return;
  }
  if (id) chat.lastEventId = id;
  const turn = turnFor(data.generation_id);
  if (!turn.final) applyEvent(turn, event.type, data, id);
  persist();
}

function turnFor(gid) {
  const known = chat.turns.get(gid);
  if (known) return known;
  // An event of a generation this page has not bound yet: the one it just sent (the stream
  // can be faster than the POST's answer), or one sent from elsewhere.
  const turn = chat.waiting.shift() ?? new Turn(null);
  turn.bind(gid);
  return turn;
}

function applyEvent(turn, type, data, id = null) {
  switch (type) {
    case "queued":
      if (turn.state === "waiting") turn.setState("queued");
      markActive(turn);
      break;
    case "started":
      turn.setModel(data.model);
      if (turn.state === "waiting" || turn.state === "queued") turn.setState("streaming");
      markActive(turn);
      break;
    case "token":
      markActive(turn);
      turn.addToken(data.text, data.count, performance.now(), idMs(id));
      break;
    case "resumed":
      // Its engine worker was lost or stopped; another goes on from the next token. Said
      // quietly, in the stats line: the reply itself is unchanged.
      markActive(turn);
      turn.takeovers = data.takeover;
      turn.renderStats();
      break;
    default:
      turn.finish(type, data);
      if (chat.active === turn) chat.active = null;
      updateComposer();
  }
}

function markActive(turn) {
  if (chat.active !== turn) {
    chat.active = turn;
    updateComposer();
  }
}

// ---- sending and stopping -------------------------------------------------------------------

function busy() {
  return chat.sending || chat.active !== null || chat.waiting.length > 0;
}

function updateComposer() {
  const running = busy();
  ui.stop.hidden = !running;
  ui.send.hidden = running;
  ui.stop.disabled = chat.active === null || chat.active.gid === null;
  ui.send.disabled = running || !chat.session || !ui.input.value.trim();
  ui.form.dataset.busy = String(running);
  if (!running && document.activeElement === ui.stop) ui.input.focus();
}

async function sendMessage(text) {
  if (busy() || !chat.session || !text.trim()) return;
  hideBanner();
  chat.sending = true;
  addUserMessage(text);
  const turn = new Turn(text, { sentAt: performance.now() });
  chat.waiting.push(turn);
  updateComposer();
  const body = { content: text };
  if (MAX_TOKENS) body.max_tokens = MAX_TOKENS;
  try {
    const accepted = await api(
      "POST",
      `/v1/sessions/${encodeURIComponent(chat.session.id)}/messages`,
      body,
      { "Idempotency-Key": crypto.randomUUID() },
    );
    if (turn.gid === null) {
      chat.waiting.splice(chat.waiting.indexOf(turn), 1);
      turn.bind(accepted.generation_id);
      if (turn.state === "waiting") turn.setState("queued");
      markActive(turn);
    }
    turn.cancelUrl = accepted.cancel_url;
    persist();
  } catch (err) {
    chat.waiting.splice(chat.waiting.indexOf(turn), 1);
    turn.setState("error", "Not sent");
    const message = document.createElement("p");
    message.className = "error-text";
    message.textContent = describeError(err);
    turn.content.replaceChildren(message);
    if (retryable(err)) turn.addRetry();
    if (err.status === 401 || err.status === 404) {
      showBanner("This conversation has expired.", () => startNewSession());
    }
  } finally {
    chat.sending = false;
    updateComposer();
  }
}

async function stopReply() {
  const turn = chat.active;
  if (!turn || !turn.gid) return;
  // A disabled button drops the focus to the page: keep a keyboard user in the box.
  if (document.activeElement === ui.stop) ui.input.focus();
  ui.stop.disabled = true;
  turn.setState(turn.state, "Stopping…");
  const path =
    turn.cancelUrl ??
    `/v1/sessions/${encodeURIComponent(chat.session.id)}/generations/${encodeURIComponent(turn.gid)}/cancel`;
  try {
    const result = await api("POST", path, {});
    // Normally the `cancelled` event has arrived by now; if the stream is down, the answer
    // tells how the reply ended.
    if (!turn.final && result.final) {
      const type = result.final.type ?? (result.state === "cancelled" ? "cancelled" : result.state);
      applyEvent(turn, FINAL_TYPES.has(type) ? type : "cancelled", result.final);
      persist();
    }
  } catch (err) {
    showBanner(`Could not stop the reply: ${describeError(err)}`, () => stopReply());
    ui.stop.disabled = false;
  }
}

// ---- sessions -------------------------------------------------------------------------------

async function startNewSession() {
  closeEvents();
  chat.session = null;
  chat.lastEventId = null;
  chat.turns.clear();
  chat.waiting = [];
  chat.active = null;
  ui.messages.replaceChildren();
  ui.empty.hidden = false;
  showModel("");
  sessionStorage.removeItem(STORE_KEY);
  updateComposer();
  setConn("connecting");
  const key = apiKey();
  await refreshPicker();
  const model = pickedModel();
  try {
    const created = await api(
      "POST",
      "/v1/sessions",
      model ? { model } : {},
      key ? { Authorization: `Bearer ${key}` } : {},
    );
    hideKeyForm();
    chat.session = { id: created.session_id, token: created.token };
    persist();
    openEvents(null); // a new session: its stream starts at its first event
    showServedModel();
  } catch (err) {
    if (err.status === 401) {
      if (key) forgetApiKey();
      askForKey(key ? "That API key was not accepted. Check it and try again." : "");
    } else {
      setConn(err.status === 0 ? "offline" : "reconnecting");
      showBanner(`Could not start a conversation. ${describeError(err)}`, () => startNewSession());
    }
  }
  updateComposer();
}

// ---- API key --------------------------------------------------------------------------------

// The key is kept in memory too, in case sessionStorage refuses it.
function apiKey() {
  return chat.apiKey ?? sessionStorage.getItem(API_KEY_STORE);
}

function forgetApiKey() {
  chat.apiKey = null;
  sessionStorage.removeItem(API_KEY_STORE);
}

function askForKey(problem) {
  setConn("locked");
  ui.keyError.textContent = problem;
  ui.keyError.hidden = !problem;
  ui.keyForm.hidden = false;
  ui.keyInput.focus();
}

function hideKeyForm() {
  ui.keyForm.hidden = true;
  ui.keyError.hidden = true;
  ui.keyInput.value = "";
}

ui.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const key = ui.keyInput.value.trim();
  if (!key) return;
  chat.apiKey = key;
  store(API_KEY_STORE, key);
  ui.keyInput.value = "";
  ui.keyError.hidden = true;
  hideBanner();
  startNewSession();
});

// Show the stored conversation. `partial` is the reply that was streaming when the page went
// away ({gid, text, count, model, state}); its remaining events follow on the stream.
async function loadHistory({ partial }) {
  const view = await api("GET", `/v1/sessions/${encodeURIComponent(chat.session.id)}`);
  ui.messages.replaceChildren();
  chat.turns.clear();
  chat.waiting = [];
  chat.active = null;
  let messages = view.messages;
  // The partial reply's user message is the last user message; an assistant message after it
  // is that same reply, finished while the page was away: the stream brings its end again.
  const lastUser = messages.map((m) => m.role).lastIndexOf("user");
  if (partial && lastUser >= 0) messages = messages.slice(0, lastUser + 1);
  let prompt = null;
  for (const message of messages) {
    if (message.role === "user") {
      prompt = message.content;
      addUserMessage(message.content);
    } else if (message.role === "assistant") {
      const turn = new Turn(prompt);
      turn.text = message.content;
      turn.render();
      turn.setState("settled");
    }
  }
  if (partial) {
    const turn = new Turn(prompt);
    turn.bind(partial.gid);
    turn.restore(partial);
    turn.setState(partial.state === "waiting" ? "queued" : partial.state);
    turn.render();
    chat.active = turn;
  }
  ui.empty.hidden = ui.messages.childElementCount > 0;
  scrollToEnd(true);
}

async function resume(saved) {
  chat.session = { id: saved.id, token: saved.token };
  chat.lastEventId = saved.lastEventId ?? null;
  if (saved.model) showModel(saved.model);
  setConn("connecting");
  try {
    await loadHistory({ partial: saved.active ?? null });
  } catch (err) {
    if (err.status === 401 || err.status === 403 || err.status === 404) {
      await startNewSession();
      showBanner("The previous conversation has expired. A new one was started.");
      return;
    }
    setConn(err.status === 0 ? "offline" : "reconnecting");
    showBanner(`Could not load the conversation. ${describeError(err)}`, () => resume(saved));
    return;
  }
  updateComposer();
  openEvents(chat.lastEventId);
  showServedModel();
  refreshPicker();
}

// ---- wiring ---------------------------------------------------------------------------------

function autosize() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${Math.min(ui.input.scrollHeight, 200)}px`;
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.input.value;
  if (busy() || !text.trim()) return;
  ui.input.value = "";
  autosize();
  sendMessage(text);
});

ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.form.requestSubmit();
  }
});

ui.input.addEventListener("input", () => {
  autosize();
  updateComposer();
});

ui.stop.addEventListener("click", () => stopReply());
ui.picker.addEventListener("change", () => {
  store(MODEL_STORE, ui.picker.value);
  hideBanner();
  startNewSession();
  ui.input.focus();
});
ui.bannerClose.addEventListener("click", hideBanner);
ui.newChat.addEventListener("click", () => {
  hideBanner();
  startNewSession();
  ui.input.focus();
});

window.addEventListener("offline", () => setConn("offline"));
window.addEventListener("online", () => {
  if (chat.source && chat.source.readyState === EventSource.OPEN) setConn("connected");
  else if (chat.session && !chat.source) reconnect();
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && chat.active) stopReply();
});

const saved = loadSaved();
if (saved) resume(saved);
else startNewSession();
ui.input.focus();
