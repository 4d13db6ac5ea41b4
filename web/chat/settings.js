// A conversation's settings: the dialog (system prompt, temperature, max tokens), saved with
// the conversation (PATCH), kept for new chats only when asked; and the system prompt in
// force, said above the messages (it shapes every reply, so it is never silent).

import { chat, DEFAULTS_STORE, ui } from "./state.js";
import { announce, defaults, describeError, writeStore } from "./page.js";

/** The system prompt in force (the conversation's, or a new chat's), above the messages. */
export function showSystemPrompt() {
  const system = (chat.about ?? defaults()).system ?? "";
  ui.systemNote.hidden = !system;
  ui.systemText.textContent = system;
}

function openSettings() {
  const about = chat.about ?? defaults();
  ui.system.value = about.system ?? "";
  const modelTemperature = about.temperature === null || about.temperature === undefined;
  ui.temperatureDefault.checked = modelTemperature;
  ui.temperature.disabled = modelTemperature;
  ui.temperature.value = String(about.temperature ?? 0.7);
  ui.temperatureShown.textContent = modelTemperature ? "the model's" : ui.temperature.value;
  ui.maxTokens.value = about.max_tokens ? String(about.max_tokens) : "";
  ui.forNewChats.checked = false;
  ui.settingsError.hidden = true;
  ui.settings.returnValue = "";
  ui.settings.showModal();
  ui.system.focus();
}

async function saveSettings() {
  const maxTokens = ui.maxTokens.value ? Number.parseInt(ui.maxTokens.value, 10) : null;
  const wanted = {
    system: ui.system.value.trim() || null,
    temperature: ui.temperatureDefault.checked ? null : Number.parseFloat(ui.temperature.value),
    max_tokens: Number.isFinite(maxTokens) ? maxTokens : null,
  };
  // Only when asked: otherwise a new chat starts from the documented defaults, not from
  // whatever the last conversation was set to.
  if (ui.forNewChats.checked) writeStore(localStorage, DEFAULTS_STORE, wanted);
  if (!chat.session) {
    chat.about = { ...(chat.about ?? {}), ...wanted };
    showSystemPrompt();
    return true;
  }
  try {
    chat.about = await chat.session.update(wanted);
    showSystemPrompt();
    return true;
  } catch (err) {
    ui.settingsError.textContent = describeError(err);
    ui.settingsError.hidden = false;
    ui.settings.showModal();
    return false;
  }
}

ui.openSettings.addEventListener("click", openSettings);
ui.settingsCancel.addEventListener("click", () => ui.settings.close("cancel"));
ui.temperature.addEventListener("input", () => (ui.temperatureShown.textContent = ui.temperature.value));
ui.temperatureDefault.addEventListener("change", () => {
  ui.temperature.disabled = ui.temperatureDefault.checked;
  ui.temperatureShown.textContent = ui.temperatureDefault.checked ? "the model's" : ui.temperature.value;
});
ui.editSystem.addEventListener("click", openSettings);
ui.settings.addEventListener("close", async () => {
  if (ui.settings.returnValue === "save" && (await saveSettings())) announce("Settings saved");
  if (!ui.settings.open) ui.openSettings.focus();
});
