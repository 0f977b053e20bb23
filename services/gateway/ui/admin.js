// Users (user.admin), API tokens (token.own; another user's with token.any) and the audit log
// (audit.read). Each page is in the menu only for a user whose roles grant its permission; reached by
// its address without it, it says which permission it needs instead of asking the API.
import { api } from "./api.js";
import { h, add, clear, fmtTime, short } from "./dom.js";

const ROLES = ["admin", "developer", "operator", "viewer"];

export function needs(main, ctx, permission, what) {
  if (ctx.can(permission)) return false;
  ctx.title(what);
  add(main, h("h1", {}, what), h("p", { class: "error", role: "alert", id: "forbidden" },
    `This page needs the permission ${permission}, which your roles (${(ctx.me.roles || []).join(", ")}) do not grant.`));
  return true;
}

function rolePicker(prefix, chosen) {
  const boxes = ROLES.map((r) => h("input", { type: "checkbox", id: `${prefix}-${r}`, value: r, checked: chosen.includes(r) }));
  return {
    element: h("span", { class: "roles-pick", role: "group", "aria-label": "roles" },
      ROLES.map((r, i) => h("span", { class: "choice" }, boxes[i], h("label", { for: `${prefix}-${r}`, class: "inline" }, r)))),
    value: () => boxes.filter((b) => b.checked).map((b) => b.value),
  };
}

// ------------------------------------------------------------------------------------------ users
export async function usersPage(main, query, ctx) {
  if (needs(main, ctx, "user.admin", "Users")) return;
  ctx.title("Users");
  const tbody = h("tbody");
  const note = h("p", { role: "status", class: "note", id: "users-status" });
  const name = h("input", { id: "nu-name", required: true, autocomplete: "off", size: 16 });
  const display = h("input", { id: "nu-display", autocomplete: "off", size: 16 });
  const password = h("input", { id: "nu-password", type: "password", autocomplete: "new-password", size: 18 });
  const roles = rolePicker("nu-role", ["viewer"]);
  const form = h("form", { class: "filters card", id: "new-user", onsubmit: async (ev) => {
    ev.preventDefault();
    const body = { username: name.value.trim(), roles: roles.value() };
    if (display.value.trim()) body.display_name = display.value.trim();
    if (password.value) body.password = password.value;
    try {
      const u = await api("/api/users", { method: "POST", body });
      note.textContent = `User ${u.username} added.`;
      name.value = ""; display.value = ""; password.value = "";
      load();
    } catch (e) { note.textContent = e.message; }
  } },
  h("label", { for: "nu-name" }, "Username"), name, h("label", { for: "nu-display" }, "Name"), display,
  h("label", { for: "nu-password" }, "Password"), password, roles.element,
  h("button", { type: "submit", class: "primary" }, "Add user"));

  async function call(path, body, done) {
    try { await api(path, { method: "POST", body }); note.textContent = done; } catch (e) { note.textContent = e.message; }
    load();
  }

  async function load() {
    let rows;
    try { rows = await api("/api/users"); } catch (e) { note.textContent = e.message; return; }
    clear(tbody);
    for (const u of rows) {
      const pick = rolePicker(`roles-${u.user_id}`, u.roles || []);
      add(tbody, h("tr", { "data-user": u.username, "data-disabled": String(!!u.disabled) },
        h("td", {}, h("strong", {}, u.username), u.display_name ? h("div", { class: "note" }, u.display_name) : null),
        h("td", { class: "mono", title: u.user_id }, short(u.user_id)),
        h("td", {}, pick.element, h("button", { type: "button", class: "small", "data-action": "roles",
          onclick: () => call(`/api/users/${u.user_id}/roles`, { roles: pick.value() }, `Roles of ${u.username} set.`) }, "Set roles")),
        h("td", {}, u.disabled ? h("span", { class: "badge st-cancelled" }, "disabled") : h("span", { class: "badge st-done" }, "active"),
          u.has_password ? null : h("div", { class: "note" }, "no password")),
        h("td", {}, fmtTime(u.created_at)),
        h("td", {}, u.user_id === ctx.me.user_id ? h("span", { class: "note" }, "you")
          : u.disabled ? h("button", { type: "button", class: "small", "data-action": "enable", onclick: () => call(`/api/users/${u.user_id}/enable`, undefined, `${u.username} enabled.`) }, "Enable")
            : h("button", { type: "button", class: "small danger", "data-action": "disable", onclick: () => call(`/api/users/${u.user_id}/disable`, undefined, `${u.username} disabled: its sessions and tokens are revoked.`) }, "Disable"))));
    }
  }

  add(main, h("div", { class: "page-head" }, h("h1", {}, "Users")), form, note,
    h("table", { class: "grid", id: "users" },
      h("caption", { class: "sr-only" }, "Users"),
      h("thead", {}, h("tr", {}, ["User", "Id", "Roles", "State", "Created", ""].map((t) => h("th", { scope: "col" }, t)))),
      tbody));
  await load();
}

// ------------------------------------------------------------------------------------------ tokens
export async function tokensPage(main, query, ctx) {
  if (needs(main, ctx, "token.own", "API tokens")) return;
  ctx.title("API tokens");
  const tbody = h("tbody");
  const note = h("p", { role: "status", class: "note", id: "tokens-status" });
  const shown = h("div", { id: "new-token", "aria-live": "polite" });
  const whose = h("input", { id: "tk-user", size: 20, value: query.user || "", placeholder: "you", autocomplete: "off" });
  const name = h("input", { id: "tk-name", required: true, size: 16, autocomplete: "off" });
  const days = h("input", { id: "tk-days", type: "number", min: 1, max: 365, class: "narrow", placeholder: "max" });
  const roles = rolePicker("tk-role", []);

  const create = h("form", { class: "filters card", id: "token-form", onsubmit: async (ev) => {
    ev.preventDefault();
    const body = { name: name.value.trim() };
    const r = roles.value();
    if (r.length) body.roles = r;
    if (days.value) body.expires_in = Math.round(Number(days.value) * 86400);
    try {
      const t = await api("/api/tokens", { method: "POST", body });
      const text = h("input", { id: "token-value", class: "mono", readonly: "", size: 60, value: t.token });
      add(clear(shown), h("div", { class: "card" },
        h("p", {}, h("strong", {}, `Token ${t.name}`), ": copy it now, it is not shown again."),
        text, h("p", { class: "note" }, `roles ${t.roles.join(", ")} · expires ${t.expires_at ? fmtTime(t.expires_at) : "never"}`)));
      text.select();
      name.value = "";
      load();
    } catch (e) { note.textContent = e.message; }
  } },
  h("label", { for: "tk-name" }, "New token, name"), name,
  h("label", { for: "tk-days" }, "Days"), days, h("span", { class: "note" }, "roles (default: yours)"), roles.element,
  h("button", { type: "submit", class: "primary" }, "Create"));

  async function load() {
    let rows;
    const user = whose.value.trim();
    try { rows = await api("/api/tokens", { query: { user_id: user || undefined } }); } catch (e) { note.textContent = e.message; clear(tbody); return; }
    clear(tbody);
    for (const t of rows) {
      add(tbody, h("tr", { "data-token": t.token_id, "data-name": t.name },
        h("td", {}, t.name), h("td", { class: "mono", title: t.token_id }, short(t.token_id)), h("td", {}, (t.roles || []).join(", ")),
        h("td", {}, fmtTime(t.created_at)), h("td", {}, t.expires_at ? fmtTime(t.expires_at) : "never"),
        h("td", {}, h("button", { type: "button", class: "small danger", "data-action": "revoke", onclick: async () => {
          try { await api(`/api/tokens/${t.token_id}`, { method: "DELETE" }); note.textContent = `Token ${t.name} revoked.`; } catch (e) { note.textContent = e.message; }
          load();
        } }, "Revoke"))));
    }
    if (!rows.length) add(tbody, h("tr", {}, h("td", { colspan: 6, class: "note" }, "No live API token.")));
  }

  add(main, h("div", { class: "page-head" }, h("h1", {}, "API tokens"),
    h("span", { class: "note" }, "bearer tokens for scripts and the CLI: the token itself is shown once, when it is made")),
  create, shown,
  ctx.can("token.any") ? h("form", { class: "filters", onsubmit: (ev) => { ev.preventDefault(); ctx.setQuery("/tokens", { user: whose.value.trim() }); load(); } },
    h("label", { for: "tk-user" }, "Tokens of (a username or user id)"), whose, h("button", { type: "submit" }, "Show")) : null,
  note,
  h("table", { class: "grid", id: "tokens" },
    h("caption", { class: "sr-only" }, "Live API tokens"),
    h("thead", {}, h("tr", {}, ["Name", "Id", "Roles", "Created", "Expires", ""].map((t) => h("th", { scope: "col" }, t)))),
    tbody));
  await load();
}

// ------------------------------------------------------------------------------------------ audit
export async function auditPage(main, query, ctx) {
  if (needs(main, ctx, "audit.read", "Audit log")) return;
  ctx.title("Audit log");
  const tbody = h("tbody");
  const message = h("p", { class: "error", role: "alert", hidden: true });
  const action = h("input", { id: "au-action", size: 18, value: query.action || "", placeholder: "e.g. user or user.created", autocomplete: "off" });
  const user = h("input", { id: "au-user", size: 34, value: query.user || "", placeholder: "a user id", class: "mono", autocomplete: "off" });
  const form = h("form", { class: "filters", onsubmit: (ev) => { ev.preventDefault(); load(); } },
    h("label", { for: "au-action" }, "Action"), action, h("label", { for: "au-user" }, "User"), user,
    h("button", { type: "submit" }, "Filter"),
    h("button", { type: "button", onclick: () => { action.value = ""; user.value = ""; load(); } }, "Clear"));

  const text = (v) => (v && typeof v === "object" ? Object.entries(v).map(([k, x]) => `${k}: ${typeof x === "object" ? JSON.stringify(x) : x}`).join(", ") : "");

  async function load() {
    const q = { action: action.value.trim(), user: user.value.trim(), limit: 200 };
    ctx.setQuery("/audit", { action: q.action, user: q.user });
    let rows;
    try { rows = await api("/api/audit", { query: q }); message.hidden = true; } catch (e) { message.textContent = e.message; message.hidden = false; clear(tbody); return; }
    clear(tbody);
    for (const r of rows) {
      const who = r.actor || {};
      add(tbody, h("tr", { "data-action": r.action, "data-outcome": r.outcome },
        h("td", { class: "mono" }, fmtTime(r.at)), h("td", { class: "mono" }, r.action),
        h("td", {}, h("span", { class: `badge st-${r.outcome === "ok" ? "done" : "failed"}` }, r.outcome)),
        h("td", { title: who.user_id || "" }, who.username || (who.user_id ? short(who.user_id) : "—"), who.kind ? h("span", { class: "note" }, ` (${who.kind})`) : null),
        h("td", {}, text(r.target)), h("td", { class: "note" }, text(r.details)), h("td", { class: "mono" }, r.client_ip || "—")));
    }
    if (!rows.length) add(tbody, h("tr", {}, h("td", { colspan: 7, class: "note" }, "No record matches.")));
  }

  add(main, h("div", { class: "page-head" }, h("h1", {}, "Audit log"), h("span", { class: "note" }, "newest first, the last 200 that match")),
    form, message,
    h("table", { class: "grid", id: "audit" },
      h("caption", { class: "sr-only" }, "Audit records, newest first"),
      h("thead", {}, h("tr", {}, ["When", "Action", "Outcome", "Who", "Target", "Details", "From"].map((t) => h("th", { scope: "col" }, t)))),
      tbody));
  await load();
}
