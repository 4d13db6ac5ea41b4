// The chat page's state and its elements, shared by its modules (web/app.js).

export const API_KEY_STORE = "tokenspout.apiKey.v1";
export const DEFAULTS_STORE = "tokenspout.defaults.v1"; // settings a new chat starts with

export const $ = (id) => document.getElementById(id);
export const ui = {
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
  temperatureDefault: $("set-temperature-default"), forNewChats: $("set-for-new-chats"),
  systemNote: $("system-note"), systemText: $("system-text"), editSystem: $("edit-system"),
  settingsCancel: $("settings-cancel"), confirmDelete: $("confirm-delete"),
  deleteWhat: $("delete-what"),
};

export const chat = {
  session: null, // the open conversation's Session (null: a new chat, made at its first send)
  about: null, // its title and settings, as the server has them
  conversations: [],
  models: [],
  rows: [], // the rows shown, in order (Row)
  active: null, // the assistant Row whose reply runs
  versions: [], // earlier versions of its messages, as the server keeps them
  browsing: null, // an earlier version shown in place of what follows it ({at, rows})
  sending: false,
  apiKey: null,
  storageWarned: false,
};
