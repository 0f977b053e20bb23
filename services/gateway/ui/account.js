// Credentials by name and kind (the API never gives their values here), and the user's sessions.
import { api } from "./api.js";
import { h, add, clear, fmtTime, short } from "./dom.js";

export async function credentialsPage(main, query, ctx) {
  ctx.title("Credentials");
  const rows = await api("/api/credentials");
  add(main, h("div", { class: "page-head" }, h("h1", {}, "Credentials"),
    h("span", { class: "note" }, "names, kinds and descriptions only: values never leave the gateway here")),
  h("table", { class: "grid", id: "credentials" },
    h("caption", { class: "sr-only" }, "Credentials"),
    h("thead", {}, h("tr", {}, ["Name", "Kind", "Description", "Used by", "Created", "Updated"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, rows.length ? rows.map((c) => h("tr", { "data-name": c.name },
      h("td", { class: "mono" }, c.name), h("td", {}, c.kind), h("td", {}, c.description || ""),
      h("td", { title: "whoever starts a playbook that uses it, and whoever wrote it, must hold one of these roles or be one of these users" },
        [...(c.roles || []), ...(c.users || []).map((u) => `user ${u.username}`)].join(", ")),
      h("td", {}, fmtTime(c.created_at)), h("td", {}, fmtTime(c.updated_at))))
      : h("tr", {}, h("td", { colspan: 6, class: "note" }, "No credential.")))));
}

export async function sessionsPage(main, query, ctx) {
  ctx.title("Sessions");
  const tbody = h("tbody");
  const note = h("p", { role: "status", class: "note" });
  const load = async () => {
    const rows = await api("/api/sessions");
    clear(tbody);
    for (const x of rows) {
      add(tbody, h("tr", { "data-session": x.session_id, class: x.current ? "current" : "" },
        h("td", { class: "mono", title: x.session_id }, short(x.session_id), x.current ? h("strong", {}, " (this one)") : ""),
        h("td", {}, fmtTime(x.created_at)), h("td", {}, fmtTime(x.last_activity_at)), h("td", {}, fmtTime(x.expires_at)),
        h("td", {}, x.client_ip || "—"),
        h("td", {}, x.current ? "" : h("button", { type: "button", class: "small danger", onclick: async () => {
          try { await api(`/api/sessions/${x.session_id}`, { method: "DELETE" }); note.textContent = "Session ended."; load(); } catch (e) { note.textContent = e.message; }
        } }, "End"))));
    }
    if (!rows.length) add(tbody, h("tr", {}, h("td", { colspan: 6, class: "note" }, "No session: you are signed in with an API token.")));
  };
  add(main, h("div", { class: "page-head" }, h("h1", {}, "Sessions"), h("span", { class: "note" }, `of ${ctx.me.username}`)),
    note,
    h("table", { class: "grid", id: "sessions" },
      h("caption", { class: "sr-only" }, "Your sessions"),
      h("thead", {}, h("tr", {}, ["Session", "Logged in", "Last active", "Expires", "From", ""].map((t) => h("th", { scope: "col" }, t)))),
      tbody));
  await load();
}
