// Model text as Markdown: marked, then DOMPurify, then highlight.js on finished replies
// (all three vendored and pinned under vendor/, see vendor/README.md).

import { marked } from "../vendor/marked/marked.esm.js";
import DOMPurify from "../vendor/dompurify/purify.es.mjs";
import hljs from "../vendor/highlight/highlight.min.js";
import { actionButton, copyText } from "./page.js";

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
export function renderMarkdown(container, text, { highlight = false } = {}) {
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
