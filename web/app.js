// tokenspout web chat: conversations kept on the server (the owner cookie), replies streamed
// through web/tokenspout.js; this module holds the turns (send, regenerate, continue, edit,
// stop), the conversations, the API key and the page's wiring; chat/ holds the rest (the
// rows, the server's record, the settings).
//
// The page's address names the conversation (#s_...), so a reload, another tab or another
// browser opens it again, from the server's record (chat/record.js): its messages, how each
// reply ended, earlier versions, and a running reply replayed from its first event, so it
// is shown whole with no word lost or repeated (a replay is fast). Nothing about a
// conversation is kept in the browser.

import { request, Session } from "./tokenspout.js";
import { API_KEY_STORE, chat, ui } from "./chat/state.js";
import {
  actionButton,
  announce,
  apiKey,
  defaults,
  describeError,
  hideBanner,
  keyHeaders,
  remedyButton,
  remedyFor,
  scrollToEnd,
  setConn,
  showBanner,
} from "./chat/page.js";
import { AssistantRow, turns, UserRow } from "./chat/rows.js";
import { showCurrent, showRecord, showVersions } from "./chat/record.js";
import { showSystemPrompt } from "./chat/settings.js";

const SETTINGS = ["system", "temperature", "max_tokens"];

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

// Make the conversation at its first message: its settings are the new chat's (the saved
// defaults for new chats, changed in the dialog before the first message).
async function ensureSession() {
  if (chat.session) return chat.session;
  const settings = {};
  for (const key of SETTINGS) settings[key] = (chat.about ?? defaults())[key] ?? null;
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
  session.addEventListener("event", () => {
    // Events flow: the network is back, whatever the browser said while they did not.
    if (ui.conn.dataset.state === "offline" && session.state === "connected") setConn("connected");
  });
  session.addEventListener("reply", (e) => adoptReply(e.detail));
  session.addEventListener("lost", (e) => onLost(e.detail));
  session.addEventListener("reset", () => reopen(session));
  session.addEventListener("unreadable", (e) => {
    showBanner(`The gateway sent a ${e.detail.type} event this page could not read; the reply ` +
      "shown may be incomplete. Reloading the page shows the saved conversation.");
  });
}

// A reply the stream announced before this page bound it: the one it is sending (the stream
// can be faster than the POST's answer), the one running when the page opened, or one
// started elsewhere (another tab, another browser): then the conversation is read again,
// its new message with it.
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
  showAgain(chat.session, reply);
}

// The conversation read again, or null (why it could not be is in the console).
async function readAgain(session, what) {
  try {
    return await session.read();
  } catch (err) {
    console.warn(`could not read ${what} again`, err);
    return null;
  }
}

async function showAgain(session, reply) {
  const view = await readAgain(session, "the conversation");
  if (!view || chat.session !== session || chat.active?.reply !== reply) return;
  chat.about = { ...chat.about, ...view };
  if (view.running?.generation_id !== reply.generationId) view.running = null; // it ended: in the history
  const row = showRecord(view);
  chat.active = row;
  if (row) row.follow(reply, row.kind);
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
  showCurrent(); // a message goes on from the conversation as it is, not a version shown
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
  showCurrent();
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
  updateComposer();
  refreshList();
  refreshRecord(row);
}

// After a reply: the versions a regenerate or an edit left, and the server's figures.
async function refreshRecord(row) {
  const session = chat.session;
  if (!session) return;
  const view = await readAgain(session, "the conversation's record");
  if (!view || chat.session !== session || busy()) return;
  const record = view.replies.find((reply) => reply.generation_id === row.reply?.generationId);
  if (record) {
    row.seconds = record.seconds;
    row.renderDetails();
  }
  showVersions(view.versions);
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
  showSystemPrompt();
}

function clearRows() {
  ui.messages.replaceChildren();
  chat.rows = [];
  chat.active = null;
  chat.versions = [];
  chat.browsing = null;
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
  const session = Session.open(id);
  chat.session = null;
  clearRows();
  setConn("connecting"); // until its history is shown and its stream open
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
  // The running reply replays from its first event (its events after `running.after`);
  // else the stream goes on right after its last event when it was read.
  chat.active = showRecord(view);
  if (view.running) session.follow(view.running.generation_id, chat.active.kind);
  session.connect(view.running ? view.running.after : view.last_event_id);
  scrollToEnd(true);
  closeSidebar();
  refreshList();
  updateComposer();
}

// Redis lost the events after this tab's place (a restart without its data): the stream
// would start over from the beginning; the conversation is shown again from its history,
// and new events followed from now.
async function reopen(session) {
  if (chat.session !== session) return;
  session.close();
  chat.session = null;
  showBanner("The gateway lost part of this conversation's events; it is shown from its " +
    "saved history.");
  await openConversation(session.id);
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
window.addEventListener("online", () => {
  // Back online: what the stream says now (its state changes only when it dropped).
  if (ui.conn.dataset.state === "offline") setConn(chat.session?.state ?? "connected");
});
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

Object.assign(turns, {
  busy,
  edit: editTurn,
  regenerate,
  continue: continueReply,
  ended: replyEnded,
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
