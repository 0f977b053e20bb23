// The executions list: filters, a page of rows, kept current by the list's live stream.
import { api } from "./api.js";
import { openStream } from "./live.js";
import { h, add, clear, fmtTime, fmtDuration, duration, short, statusBadge, singleFlight } from "./dom.js";

const PAGE = 50;
const ID = /^[A-Za-z0-9_-]{1,128}$/;
const STATUSES = ["", "PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"];

function localInput(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return "";
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

export async function executionsPage(main, query, ctx) {
  ctx.title("Executions");
  const q = { id: query.id || "", status: query.status || "", path: query.path || "", user: query.user || "", since: query.since || "",
    until: query.until || "", offset: Number(query.offset) || 0 };
  const liveNote = h("span", { class: "live-dot", role: "status", "aria-live": "polite" }, "connecting…");
  const ident = h("input", { id: "f-id", name: "id", value: q.id, placeholder: "an id, or its start", size: 14, class: "mono",
    autocomplete: "off", spellcheck: "false" });
  const status = h("select", { id: "f-status", name: "status" }, STATUSES.map((st) => h("option", { value: st, selected: st === q.status }, st || "any")));
  const path = h("input", { id: "f-path", name: "path", value: q.path, placeholder: "e.g. examples/fork_join", size: 24 });
  const user = h("select", { id: "f-user", name: "user" }, h("option", { value: "" }, "anyone"),
    h("option", { value: "me", selected: q.user === "me" }, "me"));
  const since = h("input", { id: "f-since", name: "since", type: "datetime-local", value: localInput(q.since) });
  const until = h("input", { id: "f-until", name: "until", type: "datetime-local", value: localInput(q.until) });
  const message = h("p", { role: "alert", class: "error", id: "executions-message", hidden: true });
  const tbody = h("tbody");
  const pager = h("div", { class: "pager" });

  const form = h("form", { class: "filters", onsubmit: (ev) => { ev.preventDefault(); apply(0); } },
    h("label", { for: "f-id" }, "Execution"), ident,
    h("label", { for: "f-status" }, "Status"), status,
    h("label", { for: "f-path" }, "Playbook"), path,
    h("label", { for: "f-user" }, "Started by"), user,
    h("label", { for: "f-since" }, "From"), since,
    h("label", { for: "f-until" }, "To"), until,
    h("button", { type: "submit" }, "Filter"),
    h("button", { type: "button", onclick: () => { ident.value = ""; status.value = ""; path.value = ""; user.value = ""; since.value = ""; until.value = ""; apply(0); } }, "Clear"));

  add(main, 
    h("div", { class: "page-head" }, h("h1", {}, "Executions"), liveNote),
    form, message,
    h("table", { class: "grid", id: "executions" },
      h("caption", { class: "sr-only" }, "Executions, newest first"),
      h("thead", {}, h("tr", {}, ["Execution", "Playbook", "Status", "Started by", "Created", "Duration"].map((t) => h("th", { scope: "col" }, t)))),
      tbody),
    pager);

  function apply(offset) {
    q.id = ident.value.trim();
    q.status = status.value; q.path = path.value.trim(); q.user = user.value;
    q.since = since.value ? new Date(since.value).toISOString() : "";
    q.until = until.value ? new Date(until.value).toISOString() : "";
    q.offset = offset;
    ctx.setQuery("/executions", q);
    load();
  }

  const load = singleFlight(async () => {
    let rows;
    if (q.id && !ID.test(q.id)) {  // the API's own rule, said before asking
      message.textContent = "An execution id has letters, digits, - and _ only (at most 128).";
      message.hidden = false;
      clear(tbody);
      return;
    }
    try {
      rows = await api("/api/executions", { query: { id: q.id, status: q.status, path: q.path, user: q.user, since: q.since, until: q.until, limit: PAGE, offset: q.offset } });
      message.hidden = true;
    } catch (e) {
      message.textContent = e.message;
      message.hidden = false;
      return;
    }
    clear(tbody);
    if (!rows.length) add(tbody, h("tr", {}, h("td", { colspan: 6, class: "note" }, "No executions match.")));
    for (const x of rows) {
      add(tbody, h("tr", { "data-execution": x.execution_id, "data-status": x.status },
        h("td", {}, h("a", { href: `#/executions/${x.execution_id}`, class: "mono" }, short(x.execution_id)),
          x.parent_execution_id ? h("span", { class: "note" }, " child of ", h("a", { href: `#/executions/${x.parent_execution_id}`, class: "mono" }, short(x.parent_execution_id))) : null),
        h("td", {}, x.path ? `${x.path}${x.version ? ` v${x.version}` : ""}` : h("span", { class: "note" }, "inline")),
        h("td", {}, statusBadge(x.status)),
        h("td", {}, x.requested_by_name || (x.requested_by ? short(x.requested_by) : "—")),
        h("td", {}, fmtTime(x.created_at)),
        h("td", {}, x.started_at ? fmtDuration(duration(x.started_at, x.finished_at)) + (x.finished_at ? "" : " so far") : "—")));
    }
    clear(pager);
    add(pager, 
      h("button", { type: "button", disabled: q.offset === 0, onclick: () => apply(Math.max(0, q.offset - PAGE)) }, "← Newer"),
      h("span", { class: "note" }, `rows ${q.offset + 1}–${q.offset + rows.length}`),
      h("button", { type: "button", disabled: rows.length < PAGE, onclick: () => apply(q.offset + PAGE) }, "Older →"));
  }, 500);

  await load();
  const close = openStream("/api/live/executions", {
    executions: () => load(), resync: () => load(),
    status: (st) => {  // live: read again what changed before the stream could say so
      liveNote.textContent = st === "live" ? "live" : st; liveNote.dataset.state = st;
      if (st === "live") load();
    },
  });
  return () => { close(); load.cancel(); };
}
