// tokenspout.js: a browser client of tokenspout's session API, as one dependency-free ES
// module. Start a reply, read it token by token, resume after a reload or on another gateway
// replica (Last-Event-ID), stop it, and see a takeover (`resumed`):
//
//   import { Session } from "/tokenspout.js";
//   const session = await Session.create();              // or Session.open(id, { after })
//   session.connect();                                   // one EventSource for the session
//   const reply = await session.send("Name three colours.", { max_tokens: 64 });
//   reply.addEventListener("token", (e) => out.append(e.detail.text));  // text, never HTML
//   reply.addEventListener("resumed", () => console.log("another engine took over"));
//   stopButton.onclick = () => reply.stop();
//   const end = await reply.finished;                    // {type: "done" | "cancelled" | "error", ...}
//
// Opened again (a reload, another tab, another browser), `await session.resume()` reads the
// conversation and opens its stream where the running reply began: that reply comes whole,
// from its first word, whatever this page saw before.
//
// Served by the gateway, the page's owner cookie authorises its sessions, so no token goes in
// a URL. From elsewhere, pass { token } (Session.create gives one) and it goes as a header, or
// as ?token= on the EventSource, which cannot send headers. docs/web.md has the whole API.
// If Redis lost the events after the resume point, the session says `reset` and the stream
// starts over from the session's beginning (its finished replies come again).

const EVENT_TYPES = ["queued", "started", "token", "resumed", "done", "cancelled", "error"];
const FINAL = new Set(["done", "cancelled", "error"]);
const RECONNECT_MAX_MS = 8000;
const OFFLINE_AFTER_FAILURES = 3;

/** An HTTP answer that was not a success: status, the gateway's error code and message. */
export class ApiError extends Error {
  constructor(status, code, message, { field = null, retryAfter = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status; // 0: the gateway could not be reached
    this.code = code;
    this.field = field;
    this.retryAfter = retryAfter; // seconds, from Retry-After
  }
}

/** Redis stream ids, "<ms>-<seq>": true when a comes strictly after b. */
export function idAfter(a, b) {
  const [am, as] = a.split("-").map(BigInt);
  const [bm, bs] = b.split("-").map(BigInt);
  return am > bm || (am === bm && as > bs);
}

/** The gateway's API over fetch: JSON in and out, errors as ApiError. */
export async function request(base, method, path, { body, headers = {} } = {}) {
  let response;
  try {
    response = await fetch(`${base}${path}`, {
      method,
      credentials: "same-origin",
      headers: { ...(body === undefined ? {} : { "Content-Type": "application/json" }), ...headers },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    throw new ApiError(0, "network", "The gateway cannot be reached. Check your connection.");
  }
  if (response.status === 204) return null;
  const payload = await response.json().catch(() => null);
  if (!response.ok) {
    const error = payload?.error ?? {};
    const wait = Number.parseFloat(response.headers.get("Retry-After") ?? "");
    throw new ApiError(response.status, error.code ?? `http_${response.status}`,
      error.message ?? response.statusText,
      { field: error.field ?? null, retryAfter: Number.isFinite(wait) ? wait : null });
  }
  return payload;
}

/** One reply (a generation): its events as DOM events, its text so far, and stop(). */
export class Reply extends EventTarget {
  constructor(session, generationId, kind = "message") {
    super();
    this.session = session;
    this.generationId = generationId;
    this.kind = kind; // message, edit, regenerate, continue, or "followed" (not started here)
    this.after = session.lastEventId; // the event before its first: replay it from there
    this.text = "";
    this.count = 0;
    this.state = "queued";
    this.final = null;
    this.finished = new Promise((resolve) => (this.#resolve = resolve));
  }

  #resolve;

  /** Ask the gateway to stop it (any replica); the `cancelled` event ends it. */
  async stop() {
    const path = `/v1/sessions/${encodeURIComponent(this.session.id)}/generations/` +
      `${encodeURIComponent(this.generationId)}/cancel`;
    const answer = await this.session.call("POST", path, {});
    // The stream usually brings `cancelled` first; if it is down, the answer says how it ended.
    if (!this.final && answer?.final) this.apply(answer.final.type ?? "cancelled", answer.final);
    return answer;
  }

  /** An event of this generation, from the stream (or a cancel's answer). */
  apply(type, data) {
    if (this.final) return;
    if (type === "token") {
      if (data.count <= this.count) return; // a replay of a token shown already
      this.text += data.text;
      this.count = data.count;
    }
    if (type === "started" || type === "token") this.state = "streaming";
    if (FINAL.has(type)) {
      this.state = type;
      this.final = { type, ...data };
    }
    this.dispatchEvent(new CustomEvent(type, { detail: data }));
    if (this.final) this.#resolve(this.final);
  }
}

/** True when `base` is this page's own origin: there the owner cookie authorises. */
function sameOrigin(base) {
  return new URL(base || "/", location.href).origin === location.origin;
}

/** A session: its event stream (one EventSource, resumed by event id) and its turns. */
export class Session extends EventTarget {
  #sendToken;

  constructor(id, { base = "", token = null, after = null, apiKey = null } = {}) {
    super();
    this.id = id;
    this.base = base;
    this.token = token;
    // The token goes out (a header, ?token= on the stream) only where the owner cookie
    // cannot serve: another origin, or a session opened with its token.
    this.#sendToken = Boolean(token);
    this.apiKey = apiKey;
    this.lastEventId = after; // the last event applied: a reconnect resumes after it
    this.replies = new Map(); // generation id -> Reply
    this.state = "closed"; // connecting, connected, reconnecting, offline, closed
    this.source = null;
    this.failures = 0;
    this.timer = null;
  }

  /** POST /v1/sessions: a new session (with the gateway's owner cookie when served by it). */
  static async create({ base = "", apiKey = null, ...settings } = {}) {
    const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
    const made = await request(base, "POST", "/v1/sessions", { body: settings, headers });
    const session = new Session(made.session_id, { base, token: made.token, apiKey });
    session.#sendToken = !sameOrigin(base);
    session.model = made.model;
    return session;
  }

  /** An existing session; `after`: the last event id a page saw (resume right after it). */
  static open(id, options = {}) {
    return new Session(id, options);
  }

  /** The conversations of this browser's owner cookie, the latest first. */
  static async list({ base = "" } = {}) {
    return (await request(base, "GET", "/v1/sessions")).sessions;
  }

  call(method, path, body, headers = {}) {
    const auth = this.#sendToken ? { "X-Session-Token": this.token } : {};
    return request(this.base, method, path, { body, headers: { ...auth, ...headers } });
  }

  get path() {
    return `/v1/sessions/${encodeURIComponent(this.id)}`;
  }

  /** GET: its messages, title and settings. */
  read() {
    return this.call("GET", this.path);
  }

  /** PATCH: rename ({title}) or change its settings ({model, system, temperature, max_tokens}). */
  update(changes) {
    return this.call("PATCH", this.path, changes);
  }

  /** DELETE: its running reply is stopped, the conversation is gone. */
  async remove() {
    this.close();
    await this.call("DELETE", this.path);
  }

  /** A new message; `params`: sampling fields, `edit`: the index of a user message it replaces. */
  send(content, params = {}) {
    const kind = params.edit === undefined ? "message" : "edit";
    return this.#turn("messages", { content, ...params }, kind);
  }

  /** Answer the last user message again (its reply is replaced). */
  regenerate(params = {}) {
    return this.#turn("regenerate", params, "regenerate");
  }

  /** Extend the last reply (one that hit its token limit): its tokens join that message. */
  continue(params = {}) {
    return this.#turn("continue", params, "continue");
  }

  /** The Reply of a generation this page did not start (one running before a reload). */
  follow(generationId, kind = "followed") {
    return this.replies.get(generationId) ?? this.#bind(generationId, kind);
  }

  /**
   * Read the conversation (GET) and open its event stream from the server's record: where
   * the running reply began, so it comes whole (its `reply` event first), else right after
   * the last event then. Resolves to what GET answered: `messages`, how each reply ended
   * (`replies`), earlier versions, `running`.
   */
  async resume() {
    const view = await this.read();
    const running = view.running;
    if (running) this.follow(running.generation_id, running.turn === "continue" ? "continue" : "followed");
    this.connect(running ? running.after : view.last_event_id);
    return view;
  }

  async #turn(path, body, kind) {
    const accepted = await this.call("POST", `${this.path}/${path}`, body, {
      "Idempotency-Key": crypto.randomUUID(), // a retried POST never starts a second reply
    });
    const reply = this.follow(accepted.generation_id, kind);
    reply.kind = kind;
    return reply;
  }

  #bind(generationId, kind) {
    const reply = new Reply(this, generationId, kind);
    this.replies.set(generationId, reply);
    this.dispatchEvent(new CustomEvent("reply", { detail: reply }));
    return reply;
  }

  #url(after) {
    const url = new URL(`${this.base}${this.path}/events`, location.href);
    if (this.#sendToken) url.searchParams.set("token", this.token);
    if (after) url.searchParams.set("last_event_id", after);
    return url;
  }

  #setState(state) {
    if (this.state === state) return;
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: state }));
  }

  /** Open the event stream after `after` (default: the last event applied; "$": new only). */
  connect(after = this.lastEventId) {
    this.#closeSource();
    this.lastEventId = after;
    this.#setState(this.failures ? "reconnecting" : "connecting");
    const source = new EventSource(this.#url(after));
    this.source = source;
    source.onopen = () => {
      this.failures = 0;
      this.#setState("connected");
    };
    source.addEventListener("error", (event) => {
      if (source !== this.source) return;
      if (event instanceof MessageEvent && !event.lastEventId) {
        // The stream's own end (expired events, a lost session): no generation's error.
        this.#streamError(event);
        return;
      }
      if (event instanceof MessageEvent) return; // a generation's error: #onEvent has it
      this.failures += 1;
      if (source.readyState === EventSource.CONNECTING) {
        this.#setState(this.#offline() ? "offline" : "reconnecting"); // it sends Last-Event-ID
      } else {
        this.#retryLater();
      }
    });
    for (const type of EVENT_TYPES) source.addEventListener(type, (e) => this.#onEvent(e));
    source.addEventListener("events_lost", (e) => this.#onEventsLost(e));
  }

  // The resume point is ahead of the stream (Redis lost events): the gateway says so, then
  // streams the session from its beginning, whose ids are all older than ours.
  #onEventsLost(event) {
    let detail = {};
    try {
      detail = JSON.parse(event.data);
    } catch (err) {
      console.warn("tokenspout: an unreadable events_lost event", event.data, err);
    }
    this.lastEventId = null; // what follows is the session from its start
    this.dispatchEvent(new CustomEvent("reset", { detail }));
  }

  close() {
    this.#closeSource();
    this.#setState("closed");
  }

  #closeSource() {
    clearTimeout(this.timer);
    this.timer = null;
    if (this.source) this.source.close();
    this.source = null;
  }

  #offline() {
    return !navigator.onLine || this.failures > OFFLINE_AFTER_FAILURES;
  }

  #streamError(event) {
    let body = {};
    try {
      body = JSON.parse(event.data).error ?? {};
    } catch (err) {
      console.warn("tokenspout: an unreadable stream error", event.data, err);
    }
    this.close();
    this.dispatchEvent(new CustomEvent("lost", { detail: { status: 410, ...body } }));
  }

  // The browser gave up (an HTTP error, a refused reconnect): a plain fetch says why, then a
  // new stream starts after the last event applied, backing off up to 8 s.
  #retryLater() {
    this.#closeSource();
    this.#setState(this.#offline() ? "offline" : "reconnecting");
    const delay = Math.min(500 * 2 ** Math.min(this.failures, 5), RECONNECT_MAX_MS);
    this.timer = setTimeout(() => this.#probe(), delay);
  }

  async #probe() {
    const probe = new AbortController();
    let status = 0;
    try {
      status = (await fetch(this.#url(this.lastEventId), { signal: probe.signal })).status;
    } catch (err) {
      status = 0; // unreachable: try again later
    } finally {
      probe.abort();
    }
    if (status === 200) {
      this.connect();
    } else if ([401, 403, 404, 410].includes(status)) {
      // 410: the events after ours were trimmed; the others: the session is gone.
      this.close();
      this.dispatchEvent(new CustomEvent("lost", { detail: { status } }));
    } else {
      this.failures += 1;
      this.#retryLater();
    }
  }

  #onEvent(event) {
    const id = event.lastEventId;
    if (id && this.lastEventId && this.lastEventId !== "$" && !idAfter(id, this.lastEventId)) {
      return; // seen already
    }
    let data;
    try {
      data = JSON.parse(event.data);
    } catch (err) {
      this.dispatchEvent(new CustomEvent("unreadable", { detail: { type: event.type, err } }));
      return;
    }
    const reply = this.follow(data.generation_id); // before the id moves: its `after`
    if (id) this.lastEventId = id;
    reply.apply(event.type, data);
    this.dispatchEvent(new CustomEvent("event", { detail: { type: event.type, id, data } }));
  }
}
