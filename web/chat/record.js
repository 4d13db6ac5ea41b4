// A conversation as the server keeps it (GET /v1/sessions/{id}): its messages with how each
// reply ended, the earlier versions of what a regenerate or an edit replaced, and the reply
// running now, shown as rows; a message with earlier versions has a pager ("‹ 1 / 2 ›")
// that shows one of them, to read, in place of what follows it.

import { chat, ui } from "./state.js";
import { AssistantRow, UserRow } from "./rows.js";

/** Rows for `messages` (with their `replies`' endings), and one for a reply that left no
 * message (it failed, or was stopped while it waited); `earlier`: a version, to read. */
function rowsOf(messages, replies, { earlier = false, from = 0 } = {}) {
  const ending = new Map(replies.map((reply) => [reply.at, reply]));
  const rows = [];
  messages.forEach((message, i) => {
    if (message.role !== "user" && message.role !== "assistant") return;
    const row = message.role === "user"
      ? new UserRow(message.content, { earlier })
      : new AssistantRow(message.content, { earlier });
    row.committed = true;
    const record = ending.get(from + i);
    if (record && row instanceof AssistantRow) row.applyRecord(record);
    rows.push(row);
  });
  const left = ending.get(from + messages.length);
  if (left) {
    const row = new AssistantRow("", { earlier });
    row.applyRecord(left);
    rows.push(row);
  }
  return rows;
}

/**
 * Show the conversation `view` (clears what is shown): its rows, and the running reply's
 * row (returned; its Reply is bound by the caller). A running continue goes on in the last
 * message, whose text the record has as it was before it.
 */
export function showRecord(view) {
  for (const row of chat.rows) if (row instanceof AssistantRow) row.detach();
  ui.messages.replaceChildren();
  chat.browsing = null;
  const replies = view.running
    ? view.replies.filter((reply) => reply.generation_id !== view.running.generation_id)
    : view.replies;
  chat.rows = rowsOf(view.messages, replies);
  ui.empty.hidden = chat.rows.length > 0;
  let row = null;
  if (view.running?.turn === "continue" && chat.rows.at(-1) instanceof AssistantRow) {
    row = chat.rows.at(-1);
    row.base = row.text;
  } else if (view.running) {
    row = new AssistantRow();
    chat.rows.push(row);
  }
  if (row) {
    row.kind = view.running.turn === "continue" ? "continue" : "followed";
    row.replayed = true;
  }
  for (const each of chat.rows) if (each instanceof AssistantRow) each.renderActions();
  showVersions(view.versions);
  return row;
}

/** The earlier versions the server keeps (after a turn: a regenerate or an edit adds one). */
export function showVersions(versions) {
  chat.versions = versions ?? [];
  showCurrent();
  for (const row of chat.rows) row.setPager(1, 1);
  for (const at of new Set(chat.versions.map((version) => version.at))) {
    const count = chat.versions.filter((version) => version.at === at).length + 1;
    rowAt(at)?.setPager(count, count, (n) => pick(at, n));
  }
}

// The row of history message `at` (or of a reply there that left no message).
function rowAt(at) {
  return chat.rows.find((row) => row.index === at && (row.committed || row instanceof AssistantRow));
}

function pick(at, n) {
  const earlier = chat.versions.filter((version) => version.at === at);
  showCurrent();
  const current = rowAt(at);
  if (n > earlier.length || !current) {
    current?.pager.querySelector("button:not(:disabled)")?.focus();
    return;
  }
  for (const row of chat.rows.slice(chat.rows.indexOf(current))) row.el.hidden = true;
  const version = earlier[n - 1];
  const shown = rowsOf(version.messages, version.replies, { earlier: true, from: at });
  for (const row of shown) if (row instanceof AssistantRow) row.renderActions();
  shown[0]?.setPager(n, earlier.length + 1, (to) => pick(at, to));
  chat.browsing = { at, rows: shown };
  shown[0]?.pager.querySelector("button:not(:disabled)")?.focus();
}

/** Back to the conversation as it is (from an earlier version shown). */
export function showCurrent() {
  if (!chat.browsing) return;
  for (const row of chat.browsing.rows) row.el.remove();
  for (const row of chat.rows) row.el.hidden = false;
  chat.browsing = null;
}
