// What the chat page says and shows around its messages: announcements, the banner, the
// connection state, browser storage, errors in words and what helps, the messages' buttons.

import { API_KEY_STORE, chat, DEFAULTS_STORE, ui } from "./state.js";

export function announce(text) {
  ui.announcer.textContent = "";
  // A new node, so a screen reader reads it even when the words repeat.
  requestAnimationFrame(() => (ui.announcer.textContent = text));
}

export function readStore(store, key, fallback) {
  try {
    return JSON.parse(store.getItem(key) ?? "null") ?? fallback;
  } catch (err) {
    console.warn("ignoring an unreadable saved value", key, err);
    return fallback;
  }
}

export function writeStore(store, key, value) {
  try {
    store.setItem(key, JSON.stringify(value));
  } catch (err) {
    console.warn("browser storage refused a write", key, err);
    if (!chat.storageWarned) {
      chat.storageWarned = true;
      showBanner("The browser refused to save that here (its storage is full or blocked): " +
        "conversations are kept on the server, so only this tab's API key or the settings " +
        "for new chats are not kept.");
    }
  }
}

export function defaults() {
  return readStore(localStorage, DEFAULTS_STORE, {});
}

export function apiKey() {
  return chat.apiKey ?? sessionStorage.getItem(API_KEY_STORE);
}

export function keyHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

export function describeError(err) {
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
export function remedyFor(err) {
  const tooLong = ["message_too_long", "prompt_too_long", "context_exceeded"].includes(err.code);
  if (tooLong || err.status === 413) return "edit";
  if (err.status === 0 || err.status === 429 || err.status >= 500) return "retry";
  if (["worker_lost", "queue_timeout", "engine_error", "events_lost"].includes(err.code)) {
    return "retry";
  }
  return null;
}

// ---- banner, connection state ----------------------------------------------------------------

export function showBanner(text, action = null) {
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

export function hideBanner() {
  ui.banner.hidden = true;
}

const CONN_LABELS = {
  connecting: "Connecting…", connected: "Connected", reconnecting: "Reconnecting…",
  offline: "Offline", locked: "API key needed", closed: "Connected",
};

export function setConn(state) {
  ui.conn.dataset.state = state === "closed" ? "connected" : state;
  ui.connLabel.textContent = CONN_LABELS[state];
}

// ---- buttons ------------------------------------------------------------------------------------

const ICONS = {
  copy: "M9 9h10v10H9zM5 15V5h10",
  edit: "M4 20h4L19 9l-4-4L4 16zM13 7l4 4",
  regenerate: "M20 12a8 8 0 1 1-3-6.2M20 4v5h-5",
  continue: "M5 12h12M13 6l6 6-6 6",
  info: "M12 8h.01M11 12h1v5h1M12 3a9 9 0 1 0 0 18 9 9 0 0 0 0-18z",
};

export function actionButton(label, icon, onClick) {
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
export function remedyButton(label, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "remedy";
  button.textContent = label;
  button.addEventListener("click", onClick);
  return button;
}

export async function copyText(text, button) {
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

export function scrollToEnd(force = false) {
  const log = ui.log;
  if (force || log.scrollHeight - log.scrollTop - log.clientHeight < 160) {
    log.scrollTop = log.scrollHeight;
  }
}
