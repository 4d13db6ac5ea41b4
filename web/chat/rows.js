// The messages as rows of the page: a person's (plain text, collapsed when long, copy and
// edit) and the assistant's (Markdown, its reply's events, its actions and figures). What a
// row's buttons do to the conversation is the page's (web/app.js fills `turns`).

import { chat, ui } from "./state.js";
import { actionButton, announce, copyText, remedyButton, remedyFor, scrollToEnd } from "./page.js";
import { renderMarkdown } from "./markdown.js";

const COLLAPSE_CHARS = 700;
const COLLAPSE_LINES = 12;

/** What the rows' buttons start: set by web/app.js (busy, edit, regenerate, continue, ended). */
export const turns = {};

export class Row {
  constructor(role, text = "", { earlier = false } = {}) {
    this.role = role;
    this.text = text;
    this.earlier = earlier; // a message of an earlier version, shown to read (not in chat.rows)
    this.committed = false; // in the server's history (its index counts)
    this.el = document.createElement("li");
    this.el.className = `msg ${role}`;
    if (earlier) this.el.classList.add("earlier");
    this.bubble = document.createElement("div");
    this.bubble.className = "bubble";
    this.content = document.createElement("div");
    this.content.className = "content";
    this.pager = document.createElement("nav");
    this.pager.className = "pager";
    this.pager.hidden = true;
    this.actions = document.createElement("div");
    this.actions.className = "actions";
    this.bubble.append(this.content);
    this.el.append(this.bubble, this.pager, this.actions);
    ui.messages.append(this.el);
    ui.empty.hidden = true;
  }

  /** "‹ n / count ›": this message's versions (the last is the current one); `pick(n)`. */
  setPager(n, count, pick) {
    this.pager.hidden = count < 2;
    if (count < 2) return;
    const what = this.role === "user" ? "message" : "reply";
    this.pager.setAttribute("aria-label", `Versions of this ${what}`);
    const step = (label, glyph, to) => {
      const button = document.createElement("button");
      button.type = "button";
      button.className = "page";
      button.textContent = glyph;
      button.setAttribute("aria-label", label);
      button.disabled = to < 1 || to > count;
      button.addEventListener("click", () => pick(to));
      return button;
    };
    const where = document.createElement("span");
    where.className = "page-of";
    where.textContent = `${n} / ${count}`;
    this.pager.replaceChildren(step("Previous version", "‹", n - 1), where, step("Next version", "›", n + 1));
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

export class UserRow extends Row {
  constructor(text, options = {}) {
    super("user", text, options);
    this.content.textContent = text; // the person's words stay text (white-space: pre-wrap)
    this.actions.append(actionButton("Copy message", "copy", (e) => copyText(this.text, e.currentTarget)));
    if (!this.earlier) this.actions.append(actionButton("Edit message", "edit", () => this.startEdit()));
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
    if (turns.busy() || this.editor) return;
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
      turns.edit(this, box.value);
    });
    this.editor = editor;
    this.bubble.hidden = true;
    this.actions.hidden = true;
    this.bubble.before(editor);
    box.focus();
  }
}

export class AssistantRow extends Row {
  constructor(text = "", options = {}) {
    super("assistant", text, options);
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
    this.seconds = null; // queued to final event, as the server recorded it
    this.replayed = false; // rebuilt from the server's record: no figures timed here
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
    this.listening = new AbortController();
    const listen = (type, handle) =>
      reply.addEventListener(type, (e) => handle(e.detail), { signal: this.listening.signal });
    listen("started", (data) => this.onStarted(data));
    listen("token", (data) => this.onToken(data));
    listen("resumed", (data) => {
      this.takeovers = data.takeover;
      this.renderDetails();
    });
    for (const type of ["done", "cancelled", "error"]) listen(type, (data) => this.onFinal(type, data));
    if (reply.state !== "queued") this.catchUp(reply);
  }

  /** No longer shown (the conversation is shown again): its reply's events are not its. */
  detach() {
    this.listening?.abort();
  }

  // A reply whose first events came before this row took it (a conversation shown again
  // while it ran): what it has so far, then its events as they come.
  catchUp(reply) {
    this.started = true;
    this.count = reply.count;
    this.text = this.base + reply.text;
    this.el.dataset.state = "streaming";
    this.setStatus("");
    this.render(false);
    if (reply.final) this.onFinal(reply.final.type, reply.final);
  }

  /** How it ended, from the conversation's record (GET /v1/sessions/{id} `replies`): the
   * note, the actions and the figures the tab that watched it showed. */
  applyRecord(record) {
    const final = record.final;
    this.el.dataset.generationId = record.generation_id;
    this.model = record.model;
    this.count = final.usage?.completion_tokens ?? 0;
    this.takeovers = record.takeovers;
    this.seconds = record.seconds;
    this.replayed = true;
    this.showEnding(final.type, final);
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
    if (type === "error") {
      this.text = this.base; // what the server keeps: the reply before a failed continue
      this.committed = this.base !== "";
    } else {
      this.committed = this.started || this.base !== "";
    }
    this.showEnding(type, data);
    this.render(true);
    announce(type === "done" ? `Reply finished. ${this.text}` : this.status.textContent);
    turns.ended(this);
  }

  // Its ending as the row shows it: state, the note under it (stopped, failed, its token
  // limit reached) and what its actions offer.
  showEnding(type, data) {
    this.el.dataset.state = type;
    this.el.setAttribute("aria-busy", "false");
    this.finish = type === "done" ? data.finish_reason : type;
    this.setStatus("");
    if (type === "error") this.showError(data);
    if (type === "cancelled") this.setStatus(STOPPED[data.reason] ?? "Stopped");
    if (type === "done" && data.finish_reason === "length") {
      this.setStatus("The reply reached its token limit.");
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
    const last = !this.earlier && chat.rows[chat.rows.length - 1] === this;
    const buttons = [actionButton("Copy reply", "copy", (e) => copyText(this.text, e.currentTarget))];
    if (last && this.committed) {
      buttons.push(actionButton("Regenerate reply", "regenerate", () => turns.regenerate()));
    }
    if (last && this.committed && this.finish === "length") {
      buttons.push(actionButton("Continue the reply", "continue", () => turns.continue()));
    }
    if (last && !this.committed && this.remedy === "retry") {
      buttons.push(remedyButton("Retry", () => turns.regenerate()));
    }
    const user = chat.rows[chat.rows.indexOf(this) - 1];
    if (last && !this.committed && this.remedy === "edit" && user instanceof UserRow) {
      buttons.push(remedyButton("Edit message", () => user.startEdit()));
    }
    if (this.model || this.count || this.seconds) {
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
    if (this.sentAt !== null && this.firstAt !== null && !this.replayed) {
      facts.push(["Time to first token", `${((this.firstAt - this.sentAt) / 1000).toFixed(2)} s`]);
      this.details.dataset.ttftMs = (this.firstAt - this.sentAt).toFixed(0);
    }
    const tokens = this.count - this.firstCount;
    if (tokens > 0 && this.lastAt > this.firstAt && !this.replayed) {
      const rate = tokens / ((this.lastAt - this.firstAt) / 1000);
      facts.push(["Speed", `${rate.toFixed(1)} tokens/s`]);
      this.details.dataset.tokensPerS = rate.toFixed(1);
    }
    if (this.count) facts.push(["Tokens", String(this.count)]);
    if (this.seconds) {
      // The server's figure: from the message's arrival to the reply's last event.
      facts.push(["Time", `${this.seconds.toFixed(2)} s`]);
      if (this.replayed && this.count) {
        facts.push(["Average speed", `${(this.count / this.seconds).toFixed(1)} tokens/s`]);
      }
    }
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
