// The noetl-mesh console: a hash router over a few pages, all reading the gateway's API.
import { api, setToken, token, whenUnauthorized, ApiError } from "./api.js";
import { h, add, clear } from "./dom.js";
import { executionsPage } from "./executions.js";
import { executionPage } from "./execution.js";
import { catalogPage, catalogEntryPage } from "./catalog.js";
import { credentialsPage, sessionsPage } from "./account.js";
import { overviewPage } from "./overview.js";
import { waitsPage } from "./waits.js";
import { schedulesPage } from "./schedules.js";
import { usersPage, tokensPage, auditPage } from "./admin.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
let me = null;
let cleanup = null;

const ROUTES = [
  [/^\/executions\/([A-Za-z0-9_-]+)$/, (m, q) => executionPage(main, m[1], q, ctx)],
  [/^\/executions\/?$/, (m, q) => executionsPage(main, q, ctx)],
  [/^\/catalog\/(\d+)$/, (m, q) => catalogEntryPage(main, Number(m[1]), q, ctx)],
  [/^\/catalog\/?$/, (m, q) => catalogPage(main, q, ctx)],
  [/^\/credentials\/?$/, (m, q) => credentialsPage(main, q, ctx)],
  [/^\/sessions\/?$/, (m, q) => sessionsPage(main, q, ctx)],
  [/^\/overview\/?$/, (m, q) => overviewPage(main, q, ctx)],
  [/^\/waits\/?$/, (m, q) => waitsPage(main, q, ctx)],
  [/^\/schedules\/?$/, (m, q) => schedulesPage(main, q, ctx)],
  [/^\/users\/?$/, (m, q) => usersPage(main, q, ctx)],
  [/^\/tokens\/?$/, (m, q) => tokensPage(main, q, ctx)],
  [/^\/audit\/?$/, (m, q) => auditPage(main, q, ctx)],
];

const ctx = {
  get me() { return me; },
  can(permission) { return !!me && (me.permissions || []).includes(permission); },
  go(path) { window.location.hash = "#" + path; },
  setQuery(path, query) {
    const qs = new URLSearchParams(Object.entries(query).filter(([, v]) => v !== "" && v !== null && v !== undefined)).toString();
    history.replaceState(null, "", `#${path}${qs ? "?" + qs : ""}`);
  },
  title(text) { document.title = text ? `${text} · noetl console` : "noetl console"; },
};

function parseHash() {
  const raw = window.location.hash.replace(/^#/, "") || "/executions";
  const [path, qs] = raw.split("?");
  return { path, query: Object.fromEntries(new URLSearchParams(qs || "")) };
}

async function route() {
  if (window.location.hash && !window.location.hash.startsWith("#/")) return; // an in-page anchor (skip link)
  if (cleanup) { try { cleanup(); } catch (e) { console.error(e); } cleanup = null; }
  if (!token() || !me) return showLogin();
  const { path, query } = parseHash();
  for (const a of nav.querySelectorAll("a[data-section]")) {
    a.toggleAttribute("aria-current", path.startsWith("/" + a.dataset.section));
    if (path.startsWith("/" + a.dataset.section)) a.setAttribute("aria-current", "page");
  }
  clear(main);
  for (const [re, page] of ROUTES) {
    const m = path.match(re);
    if (m) {
      try {
        cleanup = (await page(m, query)) || null;
      } catch (e) {
        add(main, h("p", { class: "error", role: "alert" }, e instanceof ApiError ? `${e.status}: ${e.message}` : String(e)));
      }
      main.focus({ preventScroll: true });
      return;
    }
  }
  add(main, h("p", { class: "error" }, `no page at ${path}`));
}

function renderNav() {
  clear(nav);
  if (!me) return;
  const link = (section, text) => h("a", { href: `#/${section}`, "data-section": section }, text);
  // a page is in the menu only when the user's roles grant what it needs
  const may = (permission, section, text) => (ctx.can(permission) ? link(section, text) : null);
  add(nav,
    may("execution.read", "overview", "Overview"), may("execution.read", "executions", "Executions"),
    may("execution.read", "waits", "Waits"), may("execution.read", "schedules", "Schedules"),
    may("catalog.read", "catalog", "Catalog"), may("credential.list", "credentials", "Credentials"),
    may("user.admin", "users", "Users"), may("audit.read", "audit", "Audit"),
    may("token.own", "tokens", "Tokens"), link("sessions", "Sessions"),
    h("span", { class: "who", title: (me.roles || []).join(", ") }, `${me.username} (${(me.roles || []).join(", ")})`),
    h("button", { type: "button", class: "link", onclick: logout }, "Log out"));
}

async function logout() {
  try { await api("/api/auth/logout", { method: "POST" }); } catch { /* gone already */ }
  setToken(null);
  me = null;
  renderNav();
  showLogin("Logged out.");
}

function showLogin(message) {
  if (cleanup) { try { cleanup(); } catch { /* */ } cleanup = null; }
  clear(main);
  renderNav();
  ctx.title("Log in");
  const status = h("p", { class: message ? "note" : "", role: "status", id: "login-status" }, message || "");
  const user = h("input", { id: "username", name: "username", autocomplete: "username", required: true });
  const pass = h("input", { id: "password", name: "password", type: "password", autocomplete: "current-password", required: true });
  const apiToken = h("input", { id: "api-token", name: "token", type: "password", autocomplete: "off" });
  // novalidate: the browser would refuse an empty username and password even when a token is given
  const form = h("form", { class: "login card", novalidate: true, onsubmit: async (ev) => {
    ev.preventDefault();
    if (!apiToken.value.trim() && (!user.value || !pass.value)) {
      status.textContent = "Give a username and a password, or an API token.";
      status.className = "error";
      (user.value ? pass : user).focus();
      return;
    }
    status.className = "";
    status.textContent = "Logging in…";
    try {
      if (apiToken.value.trim()) setToken(apiToken.value.trim());
      else {
        const reply = await api("/api/auth/login", { method: "POST", body: { username: user.value, password: pass.value } });
        setToken(reply.token);
      }
      me = await api("/api/auth/whoami");
      renderNav();
      if (!window.location.hash || window.location.hash === "#/login") window.location.hash = "#/executions";
      else route();
    } catch (e) {
      setToken(null);
      status.textContent = e instanceof ApiError ? e.message : String(e);
      status.className = "error";
    }
  } },
  h("h1", {}, "noetl console"),
  h("label", { for: "username" }, "Username"), user,
  h("label", { for: "password" }, "Password"), pass,
  h("details", {}, h("summary", {}, "Or an API token"),
    h("label", { for: "api-token" }, "API token (noetl_t_…)"), apiToken,
    h("p", { class: "note" }, "Fill this in instead of a password: e.g. the token `noetl up` printed for the first admin.")),
  h("button", { type: "submit", class: "primary" }, "Log in"), status);
  add(main, form);
  (token() ? apiToken : user).focus();
  if (!user.value) user.focus();
}

whenUnauthorized((message) => {
  setToken(null);
  me = null;
  showLogin(`Please log in again: ${message}`);
});

window.addEventListener("hashchange", route);

(async function start() {
  if (token()) {
    try { me = await api("/api/auth/whoami"); } catch { me = null; setToken(null); }
  }
  renderNav();
  route();
})();

export { ctx };
