// tokenspout web chat: conversations kept on the server (the owner cookie), replies streamed
// through web/tokenspout.js, Markdown rendered by marked, sanitised by DOMPurify, code
// highlighted by highlight.js (all three vendored under vendor/, see vendor/README.md).
//
// The page's address names the conversation (#s_...), so a reload or another tab opens it
// again; sessionStorage keeps, per conversation, where its event stream was and the reply
// that was running, so a reload resumes that reply from its first event with no word lost
// or repeated (a replay is fast, and tokens already counted are skipped).

import { request, Session } from "./tokenspout.js";
import { marked } from "./vendor/marked/marked.esm.js";
import DOMPurify from "./vendor/dompurify/purify.es.mjs";
import hljs from "./vendor/highlight/highlight.min.js";

const API_KEY_STORE = "tokenspout.apiKey.v1";
const DEFAULTS_STORE = "tokenspout.defaults.v1"; // settings a new chat starts with
const RUN_STORE = "tokenspout.run.v1"; // per conversation: the stream's place, the running reply
const COLLAPSE_CHARS = 700;
const COLLAPSE_LINES = 12;

const $ = (id) => document.getElementById(id);
const ui = {
  app: $("app"), sidebar: $("sidebar"), scrim: $("scrim"), list: $("conversations"),
  listEmpty: $("list-empty"), newChat: $("new-chat"), openSidebar: $("open-sidebar"),
  closeSidebar: $("close-sidebar"), title: $("chat-title"), picker: $("model-picker"),
  conn: $("conn"), connLabel: $("conn-label"), openSettings: $("open-settings"),
  log: $("log"), empty: $("empty"), messages: $("messages"), banner: $("banner"),
  bannerText: $("banner-text"), bannerAction: $("banner-action"), bannerClose: $("banner-close"),
  keyForm: $("key-form"), keyInput: $("api-key"), keyError: $("key-error"), form: $("composer"),
  input: $("input"), send: $("send"), stop: $("stop"), announcer: $("announcer"),
  settings: $("settings"), settingsForm: $("settings-form"), system: $("set-system"),
  temperature: $("set-temperature"), temperatureShown: $("temperature-shown"),
  maxTokens: $("set-max-tokens"), settingsError: $("settings-error"),
  settingsCancel: $("settings-cancel"), confirmDelete: $("confirm-delete"),
  deleteWhat: $("delete-what"),
};

const chat = {
  session: null, // the open conversation's Session (null: a new chat, made at its first send)
  about: null, // its title and settings, as the server has them
  conversations: [],
  models: [],
  rows: [], // the rows shown, in order (Row)
  active: null, // the assistant Row whose reply runs
  sending: false,
  apiKey: null,
  storageWarned: false,
};

// ---- small helpers ------------------------------------------------------------------------

function announce(text) {
  ui.announcer.textContent = "";
  // A new node, so a screen reader reads it even when the words repeat.
  requestAnimationFrame(() => (ui.announcer.textContent = text));
}

function readStore(store, key, fallback) {
  try {
    return JSON.parse(store.getItem(key) ?? "null") ?? fallback;
  } catch (err) {
    console.warn("ignoring an unreadable saved value", key, err);
    return fallback;
  }
}

function writeStore(store, key, value) {
  try {
    store.setItem(key, JSON.stringify(value));
  } catch (err) {
    console.warn("browser storage refused a write", key, err);
    if (!chat.storageWarned) {
      chat.storageWarned = true;
      showBanner("This tab cannot save where a reply was (browser storage is full or " +
        "blocked): the conversation is kept on the server, but a reload will not resume a " +
        "running reply.");
    }
  }
}

function defaults() {
  return readStore(localStorage, DEFAULTS_STORE, {});
}

function apiKey() {
  return chat.apiKey ?? sessionStorage.getItem(API_KEY_STORE);
}

function keyHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function describeError(err) {
  switch (err.status) {
    case 0:
      return err.message;
    case 409:
      return err.code === "generation_running"
        ? "A reply is still running in this conversation. Stop it or wait for it to finish."
        : err.message;
    case 413:
      return "That message is larger than the gateway accepts. Shorten it and send it again.";
    case 429: {
      const wait = err.retryAfter ? ` Try again in ${Math.ceil(err.retryAfter)} s.` : "";
      return `The gateway is busy with other replies right now.${wait}`;
    }
    case 503:
      return `The service is unavailable for a moment (${err.message}).`;
    default:
      if (err.code === "message_too_long") {
        return `That message is too long to send (${err.message}). Shorten it and send it again.`;
      }
      return err.message || `The request failed (HTTP ${err.status}).`;
  }
}

// What helps after a failure: only retrying what a retry can change; a message that is too
// long for the model or the gateway wants editing instead.
function remedyFor(err) {
  const tooLong = ["message_too_long", "prompt_too_long", "context_exceeded"].includes(err.code);
  if (tooLong || err.status === 413) return "edit";
  if (err.status === 0 || err.status === 429 || err.status >= 500) return "retry";
  if (["worker_lost", "queue_timeout", "engine_error", "events_lost"].includes(err.code)) {
    return "retry";
  }
  return null;
}

// ---- banner, connection state ----------------------------------------------------------------

function showBanner(text, action = null) {
  ui.bannerText.textContent = text;
  ui.bannerAction.hidden = !action;
  if (action) {
    ui.bannerAction.textContent = action.label;
    ui.bannerAction.onclick = () => {
      hideBanner();
      action.run();
    };
  }
  ui.banner.hidden = false;
}

function hideBanner() {
  ui.banner.hidden = true;
}

const CONN_LABELS = {
  connecting: "Connecting…", connected: "Connected", reconnecting: "Reconnecting…",
  offline: "Offline", locked: "API key needed", closed: "Connected",
};

function setConn(state) {
  ui.conn.dataset.state = state === "closed" ? "connected" : state;
  ui.connLabel.textContent = CONN_LABELS[state];
}

// ---- Markdown ----------------------------------------------------------------------------------

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

// Raw HTML in model text is shown as the text it is, never parsed (DOMPurify would keep
// harmless tags; a chat shows them literally). Images are links: the page loads nothing
// from elsewhere.
const escapeHtml = (text) =>
  text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
marked.use({
  renderer: {
    html: ({ text }) => escapeHtml(text),
    image: ({ href, text }) => `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`,
  },
});

// Model text as Markdown, sanitised: no script, handler or style survives DOMPurify; code
// blocks are highlighted once the reply ends (highlighting every frame costs too much).
function renderMarkdown(container, text, { highlight = false } = {}) {
  const html = marked.parse(text, { gfm: true, breaks: true, async: false });
  container.innerHTML = DOMPurify.sanitize(html, {
    USE_PROFILES: { html: true },
    FORBID_TAGS: ["img", "style", "form", "input", "button", "textarea", "select"],
  });
  for (const table of container.querySelectorAll("table")) {
    const wrap = document.createElement("div");
    wrap.className = "table-wrap";
    table.replaceWith(wrap);
    wrap.append(table);
  }
  if (!highlight) return;
  for (const code of container.querySelectorAll("pre code")) {
    hljs.highlightElement(code);
    const copy = actionButton("Copy code", "copy", () => copyText(code.textContent, copy));
    copy.classList.add("code-copy");
    code.parentElement.append(copy);
  }
}

hljs.configure({ ignoreUnescapedHTML: true });

// ---- rows ---------------------------------------------------------------------------------------

const ICONS = {
  copy: "M9 9h10v10H9zM5 15V5h10",
  edit: "M4 20h4L19 9l-4-4L4 16zM13 7l4 4",
  regenerate: "M20 12a8 8 0 1 1-3-6.2M20 4v5h-5",
  continue: "M5 12h12M13 6l6 6-6 6",
  info: "M12 8h.01M11 12h1v5h1M12 3a9 9 0 1 0 0 18 9 9 0 0 0 0-18z",
};

function actionButton(label, icon, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "action";
  button.setAttribute("aria-label", label);
  button.title = label;
  button.dataset.action = icon;
  button.innerHTML = `<svg viewBox="0 0 24 24" aria-hidden="true"><path d="${ICONS[icon]}"/></svg>`;
  button.addEventListener("click", onClick);
  return button;
}

// The way out of a failure, said in words (not an icon): Edit message, Retry, New chat.
function remedyButton(label, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "remedy";
  button.textContent = label;
  button.addEventListener("click", onClick);
  return button;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (err) {
    console.warn("the clipboard refused the text", err);
    showBanner("The browser did not let the page copy. Select the text and copy it instead.");
    return;
  }
  const label = button.getAttribute("aria-label");
  button.setAttribute("aria-label", "Copied");
  button.dataset.copied = "true";
  announce("Copied");
  setTimeout(() => {
    button.setAttribute("aria-label", label);
    delete button.dataset.copied;
  }, 1500);
}

class Row {
  constructor(role, text = "") {
    this.role = role;
    this.text = text;
    this.committed = false; // in the server's history (its index counts)
    this.el = document.createElement("li");
    this.el.className = `msg ${role}`;
    this.bubble = document.createElement("div");
    this.bubble.className = "bubble";
    this.content = document.createElement("div");
    this.content.className = "content";
    this.actions = document.createElement("div");
    this.actions.className = "actions";
    this.bubble.append(this.content);
    this.el.append(this.bubble, this.actions);
    ui.messages.append(this.el);
    ui.empty.hidden = true;
  }

  get index() {
    // Its place in the server's history: the committed rows before it.
    return chat.rows.slice(0, chat.rows.indexOf(this)).filter((row) => row.committed).length;
  }

  remove() {
    this.el.remove();
    chat.rows.splice(chat.rows.indexOf(this), 1);
  }
}

class UserRow extends Row {
  constructor(text) {
    super("user", text);
    this.content.textContent = text; // the person's words stay text (white-space: pre-wrap)
    this.actions.append(
      actionButton("Copy message", "copy", (e) => copyText(this.text, e.currentTarget)),
      actionButton("Edit message", "edit", () => this.startEdit()),
    );
    const long = text.length > COLLAPSE_CHARS || text.split("\n").length > COLLAPSE_LINES;
    if (long) this.collapsible();
  }

  collapsible() {
    this.bubble.classList.add("collapsed");
    const toggle = document.createElement("button");
    toggle.type = "button";
    toggle.className = "link more";
    toggle.textContent = "Show more";
    toggle.setAttribute("aria-expanded", "false");
    toggle.addEventListener("click", () => {
      const open = this.bubble.classList.toggle("collapsed") === false;
      toggle.textContent = open ? "Show less" : "Show more";
      toggle.setAttribute("aria-expanded", String(open));
    });
    this.bubble.after(toggle);
  }

  startEdit() {
    if (busy() || this.editor) return;
    const editor = document.createElement("form");
    editor.className = "editor";
    const box = document.createElement("textarea");
    box.value = this.text;
    box.setAttribute("aria-label", "Edit your message");
    box.rows = Math.min(10, this.text.split("\n").length + 1);
    const cancel = document.createElement("button");
    cancel.type = "button";
    cancel.className = "ghost";
    cancel.textContent = "Cancel";
    const save = document.createElement("button");
    save.type = "submit";
    save.className = "primary";
    save.textContent = "Send";
    const buttons = document.createElement("div");
    buttons.className = "editor-actions";
    buttons.append(cancel, save);
    editor.append(box, buttons);
    const close = () => {
      editor.remove();
      this.editor = null;
      this.bubble.hidden = false;
      this.actions.hidden = false;
    };
    cancel.addEventListener("click", () => {
      close();
      this.actions.querySelector('[data-action="edit"]').focus();
    });
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") {
        event.stopPropagation();
        cancel.click();
      } else if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        editor.requestSubmit();
      }
    });
    editor.addEventListener("submit", (event) => {
      event.preventDefault();
      if (!box.value.trim()) return;
      close();
      editTurn(this, box.value);
    });
    this.editor = editor;
    this.bubble.hidden = true;
    this.actions.hidden = true;
    this.bubble.before(editor);
    box.focus();
  }
}

class AssistantRow extends Row {
  constructor(text = "") {
    super("assistant", text);
    this.reply = null;
    this.model = "";
    this.sentAt = null;
    this.firstAt = null;
    this.firstCount = 0;
    this.lastAt = null;
    this.count = 0;
    this.base = text; // a continued reply's text before the continuation
    this.finish = null;
    this.takeovers = 0;
    this.renderQueued = false;
    this.el.setAttribute("aria-busy", "false");
    this.status = document.createElement("p");
    this.status.className = "status";
    this.status.hidden = true;
    this.details = document.createElement("dl");
    this.details.className = "details";
    this.details.hidden = true;
    this.bubble.append(this.status, this.details);
    if (text) this.render(true);
  }

  get final() {
    return this.reply === null || this.reply.final !== null;
  }

  setStatus(text, kind = "") {
    this.status.textContent = text;
    this.status.dataset.kind = kind;
    this.status.hidden = !text;
  }

  follow(reply, kind) {
    this.reply = reply;
    this.el.dataset.generationId = reply.generationId;
    this.el.dataset.state = "queued";
    this.el.setAttribute("aria-busy", "true");
    this.kind = kind;
    this.setStatus("Waiting for an engine…");
    reply.addEventListener("started", (e) => this.onStarted(e.detail));
    reply.addEventListener("token", (e) => this.onToken(e.detail));
    reply.addEventListener("resumed", (e) => {
      this.takeovers = e.detail.takeover;
      this.renderDetails();
    });
    for (const type of ["done", "cancelled", "error"]) {
      reply.addEventListener(type, (e) => this.onFinal(type, e.detail));
    }
  }

  onStarted(data) {
    this.model = data.model;
    this.el.dataset.state = "streaming";
    this.setStatus("");
    this.started = true;
  }

  onToken(data) {
    const now = performance.now();
    if (this.firstAt === null) {
      this.firstAt = now;
      this.firstCount = this.count;
      if (this.count === 0 || this.kind === "continue") announce("The assistant is replying.");
    }
    this.lastAt = now;
    this.count = data.count;
    this.text = this.base + this.reply.text;
    this.el.dataset.state = "streaming";
    this.setStatus("");
    this.started = true;
    if (!this.renderQueued) {
      this.renderQueued = true;
      requestAnimationFrame(() => this.renderQueued && this.render(false));
    }
  }

  onFinal(type, data) {
    this.el.dataset.state = type;
    this.el.setAttribute("aria-busy", "false");
    this.finish = type === "done" ? data.finish_reason : type;
    if (type === "error") {
      this.text = this.base; // what the server keeps: the reply before a failed continue
      this.committed = this.base !== "";
    } else {
      this.committed = this.started || this.base !== "";
    }
    if (type === "error") this.showError(data);
    this.render(true);
    if (type === "cancelled") this.setStatus(STOPPED[data.reason] ?? "Stopped");
    if (type === "done" && data.finish_reason === "length") {
      this.setStatus("The reply reached its token limit.");
    }
    announce(type === "done" ? `Reply finished. ${this.text}` : this.status.textContent);
    replyEnded(this);
    if (this.kind === "followed" && type !== "error") this.settleFromHistory();
  }

  // A reply another tab started was seen from the moment this tab opened the conversation:
  // once it ends, the history has all of it.
  async settleFromHistory() {
    const session = chat.session;
    try {
      const view = await session.read();
      const last = view.messages[view.messages.length - 1];
      if (chat.session === session && last?.role === "assistant") {
        this.text = last.content;
        this.render(true);
      }
    } catch (err) {
      console.warn("could not read the finished reply back", err);
    }
  }

  showError(data) {
    this.setStatus(`The engine could not finish this reply: ${data.message} (${data.code}).`, "error");
    this.remedy = remedyFor({ status: -1, code: data.code });
  }

  render(final) {
    this.renderQueued = false;
    renderMarkdown(this.content, this.text, { highlight: final });
    if (final) this.renderActions();
    scrollToEnd();
  }

  renderActions() {
    const last = chat.rows[chat.rows.length - 1] === this;
    const buttons = [actionButton("Copy reply", "copy", (e) => copyText(this.text, e.currentTarget))];
    if (last && this.committed) {
      buttons.push(actionButton("Regenerate reply", "regenerate", () => regenerate()));
    }
    if (last && this.committed && this.finish === "length") {
      buttons.push(actionButton("Continue the reply", "continue", () => continueReply()));
    }
    if (last && !this.committed && this.remedy === "retry") {
      buttons.push(remedyButton("Retry", () => regenerate()));
    }
    const user = chat.rows[chat.rows.indexOf(this) - 1];
    if (last && !this.committed && this.remedy === "edit" && user instanceof UserRow) {
      buttons.push(remedyButton("Edit message", () => user.startEdit()));
    }
    if (this.model || this.count) {
      const info = actionButton("Reply details", "info", () => {
        this.details.hidden = !this.details.hidden;
        info.setAttribute("aria-expanded", String(!this.details.hidden));
      });
      info.setAttribute("aria-expanded", "false");
      buttons.push(info);
      this.renderDetails();
    }
    this.actions.replaceChildren(...buttons);
  }

  // The figures, one click away (the info button): model, time to first token, tokens/s.
  renderDetails() {
    const facts = [];
    if (this.model) facts.push(["Model", this.model]);
    if (this.sentAt !== null && this.firstAt !== null) {
      facts.push(["Time to first token", `${((this.firstAt - this.sentAt) / 1000).toFixed(2)} s`]);
      this.details.dataset.ttftMs = (this.firstAt - this.sentAt).toFixed(0);
    }
    const tokens = this.count - this.firstCount;
    if (tokens > 0 && this.lastAt > this.firstAt) {
      const rate = tokens / ((this.lastAt - this.firstAt) / 1000);
      facts.push(["Speed", `${rate.toFixed(1)} tokens/s`]);
      this.details.dataset.tokensPerS = rate.toFixed(1);
    }
    if (this.count) facts.push(["Tokens", String(this.count)]);
    if (this.takeovers) facts.push(["Engine", "continued on another engine"]);
    this.details.replaceChildren(...facts.flatMap(([term, value]) => {
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = term;
      dd.textContent = value;
      return [dt, dd];
    }));
  }
}

const STOPPED = {
  user: "Stopped", abandoned: "Stopped: nobody was reading",
  disconnected: "Stopped: the client left", shutdown: "Stopped: the engine shut down",
};

function scrollToEnd(force = false) {
  const log = ui.log;
  if (force || log.scrollHeight - log.scrollTop - log.clientHeight < 160) {
    log.scrollTop = log.scrollHeight;
  }
}

// ---- turns --------------------------------------------------------------------------------------

function busy() {
  return chat.sending || chat.active !== null;
}

function updateComposer() {
  const running = busy();
  ui.stop.hidden = !running;
  ui.send.hidden = running;
  ui.stop.disabled = chat.active === null || chat.active.reply === null;
  ui.send.disabled = running || !ui.input.value.trim() || ui.conn.dataset.state === "locked";
  ui.form.dataset.busy = String(running);
  for (const button of ui.messages.querySelectorAll('[data-action="edit"], [data-action="regenerate"], [data-action="continue"]')) {
    button.disabled = running;
  }
  if (!running && document.activeElement === ui.stop) ui.input.focus();
}

// Make the conversation at its first message: its settings are the new chat's.
async function ensureSession() {
  if (chat.session) return chat.session;
  const settings = { ...defaults() };
  for (const key of Object.keys(settings)) if (settings[key] === null) delete settings[key];
  if (ui.picker.value) settings.model = ui.picker.value;
  const session = await Session.create({ apiKey: apiKey(), ...settings });
  attach(session);
  session.connect(null); // a new session's stream starts at its first event
  history.replaceState(null, "", `#${session.id}`);
  chat.about = { session_id: session.id, title: "", ...settings };
  return session;
}

function attach(session) {
  chat.session = session;
  session.addEventListener("state", (e) => setConn(e.detail));
  session.addEventListener("event", () => saveRun());
  session.addEventListener("reply", (e) => adoptReply(e.detail));
  session.addEventListener("lost", (e) => onLost(e.detail));
  session.addEventListener("unreadable", (e) => {
    showBanner(`The gateway sent a ${e.detail.type} event this page could not read; the reply ` +
      "shown may be incomplete. Reloading the page shows the saved conversation.");
  });
}

// A reply the stream announced before this page bound it: the one it is sending (the stream
// can be faster than the POST's answer), or one started elsewhere (another tab).
function adoptReply(reply) {
  if (chat.active && chat.active.reply === null) {
    chat.active.follow(reply, chat.active.kind);
    return;
  }
  if (chat.active) return; // one reply at a time in a session: this cannot be shown apart
  const row = new AssistantRow();
  chat.rows.push(row);
  row.follow(reply, "followed");
  chat.active = row;
  updateComposer();
}

async function startTurn(kind, run, row) {
  hideBanner();
  chat.sending = true;
  chat.active = row;
  row.kind = kind;
  row.sentAt = performance.now();
  row.el.dataset.state = "sending";
  row.el.setAttribute("aria-busy", "true");
  row.setStatus("Sending…");
  updateComposer();
  scrollToEnd(true);
  try {
    const session = await ensureSession();
    const reply = await run(session);
    if (row.reply === null) row.follow(reply, kind);
    saveRun();
    return true;
  } catch (err) {
    if (chat.active === row) chat.active = null;
    turnRefused(row, err);
    return false;
  } finally {
    chat.sending = false;
    updateComposer();
  }
}

function turnRefused(row, err) {
  if (err.status === 401 && !chat.session) {
    forgetApiKey();
    askForKey("That API key was not accepted. Check it and try again.");
  }
  row.el.dataset.state = "refused";
  row.el.setAttribute("aria-busy", "false");
  row.setStatus(describeError(err), "error");
  const remedy = remedyFor(err);
  const buttons = [];
  const user = chat.rows[chat.rows.indexOf(row) - 1];
  if (remedy === "edit" && user instanceof UserRow) {
    buttons.push(remedyButton("Edit message", () => user.startEdit()));
  } else if (remedy === "retry") {
    buttons.push(remedyButton("Retry", () => retry(row)));
  } else if (err.status === 404 && err.code === "unknown_session") {
    buttons.push(remedyButton("Start a new chat", () => newChat()));
  }
  row.actions.replaceChildren(...buttons);
  scrollToEnd(true);
}

async function sendMessage(text) {
  if (busy() || !text.trim()) return;
  const user = new UserRow(text);
  const row = new AssistantRow();
  chat.rows.push(user, row);
  row.retry = () => sendAgain(user, row);
  const sent = await startTurn("message", (session) => session.send(text), row);
  user.committed = sent;
  if (sent) refreshList();
}

function sendAgain(user, row) {
  // The refused message is not in the history: send it as new.
  user.remove();
  row.remove();
  return sendMessage(user.text);
}

function retry(row) {
  if (row.retry) return row.retry();
  return regenerate();
}

async function regenerate() {
  if (busy()) return;
  const last = chat.rows[chat.rows.length - 1];
  if (last instanceof AssistantRow) last.remove();
  const row = new AssistantRow();
  chat.rows.push(row);
  await startTurn("regenerate", (session) => session.regenerate(), row);
}

async function continueReply() {
  const row = chat.rows[chat.rows.length - 1];
  if (busy() || !(row instanceof AssistantRow)) return;
  row.base = row.text;
  row.reply = null;
  row.started = false;
  row.count = 0;
  row.firstAt = null;
  row.actions.replaceChildren();
  const ok = await startTurn("continue", (session) => session.continue(), row);
  if (!ok) row.renderActions();
}

async function editTurn(user, text) {
  if (busy()) return;
  if (!user.committed) {
    // A message the gateway refused is not in the history: it goes as a new one.
    for (const row of chat.rows.slice(chat.rows.indexOf(user))) row.remove();
    await sendMessage(text);
    return;
  }
  const index = user.index;
  for (const row of chat.rows.slice(chat.rows.indexOf(user))) row.remove();
  const edited = new UserRow(text);
  const row = new AssistantRow();
  chat.rows.push(edited, row);
  const sent = await startTurn("edit", (session) => session.send(text, { edit: index }), row);
  edited.committed = sent;
}

async function stopReply() {
  const row = chat.active;
  if (!row || !row.reply || row.final) return;
  if (document.activeElement === ui.stop) ui.input.focus();
  ui.stop.disabled = true;
  row.setStatus("Stopping…");
  try {
    await row.reply.stop();
  } catch (err) {
    showBanner(`Could not stop the reply: ${describeError(err)}`, { label: "Retry", run: stopReply });
    ui.stop.disabled = false;
  }
}

function replyEnded(row) {
  if (chat.active === row) chat.active = null;
  for (const other of chat.rows) {
    if (other instanceof AssistantRow && other !== row && other.final) other.renderActions();
  }
  saveRun();
  updateComposer();
  refreshList();
}

// ---- where the stream was (reload resume) ---------------------------------------------------------

function saveRun() {
  const session = chat.session;
  if (!session) return;
  const runs = readStore(sessionStorage, RUN_STORE, {});
  const row = chat.active;
  const reply = row?.reply;
  runs[session.id] = {
    lastEventId: session.lastEventId,
    // The running reply replays from its first event after a reload (`from`: the event
    // before it), onto the text it continues when it is a continue.
    running: reply && !reply.final
      ? { gid: reply.generationId, kind: row.kind, base: row.base, from: reply.after }
      : null,
  };
  writeStore(sessionStorage, RUN_STORE, runs);
}

// ---- conversations ----------------------------------------------------------------------------

async function refreshList() {
  try {
    chat.conversations = await Session.list();
  } catch (err) {
    console.warn("could not list the conversations", err);
    return;
  }
  const current = chat.session?.id;
  ui.list.replaceChildren(...chat.conversations.map((c) => listItem(c, c.session_id === current)));
  ui.listEmpty.hidden = chat.conversations.length > 0;
  const about = chat.conversations.find((c) => c.session_id === current);
  if (about) {
    chat.about = about;
    showTitle();
  }
}

function listItem(conversation, current) {
  const li = document.createElement("li");
  li.className = "conversation";
  li.dataset.sessionId = conversation.session_id;
  const link = document.createElement("a");
  link.href = `#${conversation.session_id}`;
  link.className = "conversation-link";
  link.textContent = conversation.title || "New chat";
  if (current) link.setAttribute("aria-current", "page");
  const rename = actionButton(`Rename “${link.textContent}”`, "edit", () => startRename(li, conversation));
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "action";
  remove.dataset.action = "delete";
  remove.setAttribute("aria-label", `Delete “${link.textContent}”`);
  remove.title = "Delete";
  remove.innerHTML = '<svg viewBox="0 0 24 24" aria-hidden="true"><path d="M5 7h14M10 7V4h4v3M7 7l1 13h8l1-13"/></svg>';
  remove.addEventListener("click", () => confirmDelete(conversation));
  li.append(link, rename, remove);
  return li;
}

function startRename(li, conversation) {
  const input = document.createElement("input");
  input.type = "text";
  input.value = conversation.title;
  input.maxLength = 120;
  input.className = "rename";
  input.setAttribute("aria-label", "New title");
  li.replaceChildren(input);
  input.focus();
  input.select();
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (save && title && title !== conversation.title) {
      try {
        await Session.open(conversation.session_id).update({ title });
        announce(`Renamed to ${title}`);
      } catch (err) {
        showBanner(`Could not rename it: ${describeError(err)}`);
      }
    }
    await refreshList();
    ui.list.querySelector(`[data-session-id="${conversation.session_id}"] a`)?.focus();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") {
      event.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true));
}

function confirmDelete(conversation) {
  ui.deleteWhat.textContent = `“${conversation.title || "New chat"}” and its messages will be gone.`;
  ui.confirmDelete.returnValue = "";
  ui.confirmDelete.showModal();
  ui.confirmDelete.onclose = async () => {
    if (ui.confirmDelete.returnValue !== "delete") return;
    try {
      await Session.open(conversation.session_id).remove();
      announce("Conversation deleted");
    } catch (err) {
      if (err.status !== 404) showBanner(`Could not delete it: ${describeError(err)}`);
    }
    if (chat.session?.id === conversation.session_id) newChat();
    await refreshList();
    ui.newChat.focus();
  };
}

for (const dialog of [ui.confirmDelete, ui.settings]) {
  // The page's CSP allows no form action: close dialogs here, with the button's value.
  dialog.addEventListener("submit", (event) => {
    event.preventDefault();
    dialog.close(event.submitter?.value ?? "");
  });
}

function showTitle() {
  const title = chat.about?.title || "New chat";
  ui.title.textContent = title;
  document.title = `${title} · tokenspout`;
  if (chat.about?.model && [...ui.picker.options].some((o) => o.value === chat.about.model)) {
    ui.picker.value = chat.about.model;
  }
}

function clearRows() {
  ui.messages.replaceChildren();
  chat.rows = [];
  chat.active = null;
  ui.empty.hidden = false;
}

function newChat() {
  if (chat.session) chat.session.close();
  chat.session = null;
  chat.about = null;
  clearRows();
  if (location.hash) history.pushState(null, "", location.pathname + location.search);
  showTitle();
  setConn(ui.conn.dataset.state === "locked" ? "locked" : "connected");
  ui.list.querySelectorAll("[aria-current]").forEach((a) => a.removeAttribute("aria-current"));
  closeSidebar();
  updateComposer();
  ui.input.focus();
}

async function openConversation(id) {
  if (chat.session?.id === id) return;
  if (chat.session) chat.session.close();
  const saved = readStore(sessionStorage, RUN_STORE, {})[id] ?? {};
  const session = Session.open(id);
  chat.session = null;
  clearRows();
  let view;
  try {
    view = await session.read();
  } catch (err) {
    if ([403, 404].includes(err.status)) {
      newChat();
      showBanner("That conversation is not there any more (deleted, or expired).");
    } else {
      showBanner(`Could not open the conversation. ${describeError(err)}`,
        { label: "Retry", run: () => openConversation(id) });
    }
    return;
  }
  attach(session);
  chat.about = { ...view, session_id: id };
  showTitle();
  showHistory(view.messages, saved.running);
  // Resume where this tab was: a running reply from its first event; else new events only.
  const running = saved.running;
  session.connect(running ? running.from ?? null : saved.lastEventId ?? "$");
  closeSidebar();
  refreshList();
  updateComposer();
}

function showHistory(messages, running) {
  let shown = messages;
  if (running && running.kind === "continue" && shown.length) {
    // The reply it extends, as it was: the stream brings the continuation again.
    shown = [...shown.slice(0, -1), { ...shown[shown.length - 1], content: running.base ?? "" }];
  } else if (running) {
    // A reply that ended while the page was away is in the history: the stream brings it again.
    const lastUser = shown.map((m) => m.role).lastIndexOf("user");
    shown = shown.slice(0, lastUser + 1);
  }
  for (const message of shown) {
    if (message.role !== "user" && message.role !== "assistant") continue;
    const row = message.role === "user" ? new UserRow(message.content) : new AssistantRow(message.content);
    row.committed = true;
    chat.rows.push(row);
  }
  const last = chat.rows[chat.rows.length - 1];
  if (running && running.kind === "continue" && last instanceof AssistantRow) {
    chat.active = last;
    last.base = last.text;
    last.kind = "continue";
  } else if (running) {
    chat.active = new AssistantRow();
    chat.active.kind = running.kind;
    chat.rows.push(chat.active);
  }
  for (const row of chat.rows) if (row instanceof AssistantRow) row.renderActions();
  scrollToEnd(true);
}

function onLost(detail) {
  if (detail.status === 410) {
    showBanner("Part of this conversation's events expired while the page was away; the saved " +
      "conversation is shown.", { label: "Reload", run: () => location.reload() });
  } else {
    showBanner("This conversation is not there any more (deleted, or expired).",
      { label: "New chat", run: newChat });
  }
}

// ---- settings ---------------------------------------------------------------------------------

function openSettings() {
  const about = chat.about ?? defaults();
  ui.system.value = about.system ?? "";
  ui.temperature.value = String(about.temperature ?? 0.7);
  ui.temperatureShown.textContent = ui.temperature.value;
  ui.maxTokens.value = about.max_tokens ? String(about.max_tokens) : "";
  ui.settingsError.hidden = true;
  ui.settings.returnValue = "";
  ui.settings.showModal();
  ui.system.focus();
}

async function saveSettings() {
  const maxTokens = ui.maxTokens.value ? Number.parseInt(ui.maxTokens.value, 10) : null;
  const wanted = {
    system: ui.system.value.trim() || null,
    temperature: Number.parseFloat(ui.temperature.value),
    max_tokens: Number.isFinite(maxTokens) ? maxTokens : null,
  };
  writeStore(localStorage, DEFAULTS_STORE, wanted); // the next new chat starts with them
  if (!chat.session) {
    chat.about = { ...(chat.about ?? {}), ...wanted };
    return true;
  }
  try {
    chat.about = await chat.session.update(wanted);
    return true;
  } catch (err) {
    ui.settingsError.textContent = describeError(err);
    ui.settingsError.hidden = false;
    ui.settings.showModal();
    return false;
  }
}

async function loadModels() {
  try {
    const list = await request("", "GET", "/v1/models", { headers: keyHeaders() });
    const roots = (list?.data ?? []).map((card) => card.root || card.id).filter(Boolean);
    chat.models = [...new Set(roots)].sort();
  } catch (err) {
    if (err.status === 401) {
      askForKey(apiKey() ? "That API key was not accepted. Check it and try again." : "");
      return false;
    }
    console.warn("could not list the served models", err);
    chat.models = [];
  }
  ui.picker.replaceChildren(...chat.models.map((model) => new Option(model, model)));
  ui.picker.disabled = chat.models.length < 2;
  showTitle();
  return true;
}

// ---- API key ----------------------------------------------------------------------------------

function forgetApiKey() {
  chat.apiKey = null;
  sessionStorage.removeItem(API_KEY_STORE);
}

function askForKey(problem) {
  if (problem) forgetApiKey();
  setConn("locked");
  ui.keyError.textContent = problem;
  ui.keyError.hidden = !problem;
  ui.keyForm.hidden = false;
  ui.keyInput.focus();
  updateComposer();
}

ui.keyForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const key = ui.keyInput.value.trim();
  if (!key) return;
  chat.apiKey = key;
  ui.keyInput.value = "";
  if (await loadModels()) {
    try {
      sessionStorage.setItem(API_KEY_STORE, key); // this tab only, gone when it closes
    } catch (err) {
      console.warn("sessionStorage refused the key: it is kept in memory only", err);
    }
    ui.keyForm.hidden = true;
    ui.keyError.hidden = true;
    setConn("connected");
    updateComposer();
    ui.input.focus();
    if (location.hash.length > 1) openConversation(location.hash.slice(1));
  }
});

// ---- wiring -----------------------------------------------------------------------------------

function autosize() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${Math.min(ui.input.scrollHeight, 200)}px`;
}

function openSidebar() {
  ui.app.dataset.sidebar = "open";
  ui.scrim.hidden = false;
  ui.openSidebar.setAttribute("aria-expanded", "true");
  ui.newChat.focus();
}

function closeSidebar() {
  if (ui.app.dataset.sidebar !== "open") return;
  delete ui.app.dataset.sidebar;
  ui.scrim.hidden = true;
  ui.openSidebar.setAttribute("aria-expanded", "false");
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.input.value;
  if (busy() || !text.trim() || ui.conn.dataset.state === "locked") return;
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
ui.newChat.addEventListener("click", () => {
  hideBanner();
  newChat();
});
ui.bannerClose.addEventListener("click", hideBanner);
ui.openSidebar.addEventListener("click", openSidebar);
ui.closeSidebar.addEventListener("click", () => {
  closeSidebar();
  ui.openSidebar.focus();
});
ui.scrim.addEventListener("click", closeSidebar);
ui.openSettings.addEventListener("click", openSettings);
ui.settingsCancel.addEventListener("click", () => ui.settings.close("cancel"));
ui.temperature.addEventListener("input", () => (ui.temperatureShown.textContent = ui.temperature.value));
ui.settings.addEventListener("close", async () => {
  if (ui.settings.returnValue === "save" && (await saveSettings())) announce("Settings saved");
  if (!ui.settings.open) ui.openSettings.focus();
});
ui.picker.addEventListener("change", async () => {
  const model = ui.picker.value;
  if (!chat.session) return;
  try {
    chat.about = await chat.session.update({ model });
    announce(`Replies now come from ${model}`);
  } catch (err) {
    showBanner(`Could not switch the model: ${describeError(err)}`);
  }
});
window.addEventListener("hashchange", () => {
  const id = location.hash.slice(1);
  if (id) openConversation(id);
  else if (chat.session) newChat();
});
window.addEventListener("offline", () => setConn("offline"));
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && chat.active && !document.querySelector("dialog[open]")) {
    stopReply();
  } else if (event.key === "Escape") {
    closeSidebar();
  }
  if (event.ctrlKey && event.shiftKey && event.key.toLowerCase() === "o") {
    event.preventDefault();
    newChat();
  }
});

async function start() {
  setConn("connecting");
  ui.input.focus();
  const unlocked = await loadModels();
  const id = location.hash.slice(1);
  // Connected: the conversation is shown and its stream open (its session says so), or,
  // for a new chat, the gateway answered.
  if (unlocked && id) await openConversation(id);
  else if (unlocked) setConn("connected");
  if (!id) refreshList();
  updateComposer();
}

start();
