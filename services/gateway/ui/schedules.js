// Schedules (D31): every schedule with its status and next fire time; its next fire times on demand;
// pause and resume where the user may (GET /api/schedules, /{id}?next=, POST /{id}/pause, /resume).
import { api } from "./api.js";
import { h, add, clear, fmtTime, short } from "./dom.js";

const PAGE = 100;

// 21600 -> "6 h", 90 -> "1 min 30 s"
function seconds(n) {
  const parts = [];
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["min", 60], ["s", 1]]) {
    if (n >= size) { parts.push(`${Math.floor(n / size)} ${unit}`); n %= size; }
  }
  return parts.join(" ") || `${n} s`;
}

function when(spec) {
  if (!spec) return "—";
  if (spec.cron) return `cron ${spec.cron}${spec.timezone ? ` (${spec.timezone})` : " (UTC)"}`;
  if (spec.every !== undefined) return `every ${typeof spec.every === "number" ? seconds(spec.every) : spec.every}`;
  if (spec.at) return `once at ${fmtTime(spec.at)}`;
  return JSON.stringify(spec);
}

export async function schedulesPage(main, query, ctx) {
  ctx.title("Schedules");
  const tbody = h("tbody");
  const note = h("p", { role: "status", class: "note", id: "schedules-status" });
  const pager = h("div", { class: "pager" });
  let offset = Number(query.offset) || 0;
  add(main,
    h("div", { class: "page-head" }, h("h1", {}, "Schedules"),
      h("span", { class: "note" }, "a catalog playbook started at set times; `noetl schedule add` makes one")),
    note,
    h("table", { class: "grid", id: "schedules" },
      h("caption", { class: "sr-only" }, "Schedules, newest first"),
      h("thead", {}, h("tr", {}, ["Schedule", "Playbook", "When", "Status", "Next fire", "Created by", ""].map((t) => h("th", { scope: "col" }, t)))),
      tbody),
    pager);

  const mine = (x) => ctx.me && x.created_by && x.created_by.user_id === ctx.me.user_id;
  const canPause = (x) => ctx.can("execution.cancel.any") || (mine(x) && ctx.can("execution.cancel.own"));
  const canResume = (x) => ctx.can("execution.start") && (mine(x) || ctx.can("execution.cancel.any"));

  async function act(x, verb) {
    note.textContent = `${verb === "pause" ? "Pausing" : "Resuming"} ${x.id}…`;
    try {
      await api(`/api/schedules/${encodeURIComponent(x.id)}/${verb}`, { method: "POST" });
      note.textContent = `${x.id} ${verb === "pause" ? "paused" : "resumed"}.`;
    } catch (e) { note.textContent = e.message; }
    load();
  }

  function nextFires(x) {
    const holder = h("div", { class: "next-fires" });
    const load = async () => {
      add(clear(holder), h("p", { class: "note" }, "Loading…"));
      try {
        const full = await api(`/api/schedules/${encodeURIComponent(x.id)}`, { query: { next: 10 } });
        clear(holder);
        add(holder, (full.next_fire_times || []).length
          ? h("ol", { class: "fires" }, full.next_fire_times.map((t) => h("li", { class: "mono" }, fmtTime(t))))
          : h("p", { class: "note" }, x.status === "paused" ? "Paused: no firing." : "No firing to come."),
        h("p", { class: "note" }, "workload: ", h("code", {}, JSON.stringify(full.workload || {}))));
      } catch (e) { add(clear(holder), h("p", { class: "error" }, e.message)); }
    };
    return h("details", { class: "fires-box", ontoggle: (ev) => { if (ev.target.open) load(); } },
      h("summary", {}, "next 10 fires"), holder);
  }

  async function load() {
    let page;
    try { page = await api("/api/schedules", { query: { offset, limit: PAGE } }); } catch (e) { note.textContent = e.message; return; }
    clear(tbody);
    for (const x of page.schedules) {
      const by = x.created_by || {};
      add(tbody, h("tr", { "data-schedule": x.id, "data-status": x.status },
        h("td", { class: "mono" }, x.id),
        h("td", {}, x.path, x.version ? ` v${x.version}` : h("span", { class: "note" }, " (latest)")),
        h("td", {}, when(x.spec)),
        h("td", {}, h("span", { class: `badge st-${x.status === "active" ? "running" : x.status === "paused" ? "waiting" : "done"}`, "data-status": x.status }, x.status),
          x.paused_reason ? h("div", { class: "note" }, x.paused_reason) : null),
        h("td", {}, x.next_fire_time ? fmtTime(x.next_fire_time) : "—", nextFires(x)),
        h("td", {}, by.username || short(by.user_id)),
        h("td", {},
          x.status === "active" && canPause(x) ? h("button", { type: "button", class: "small", "data-action": "pause", onclick: () => act(x, "pause") }, "Pause") : null,
          x.status === "paused" && canResume(x) ? h("button", { type: "button", class: "small", "data-action": "resume", onclick: () => act(x, "resume") }, "Resume") : null)));
    }
    if (!page.schedules.length) add(tbody, h("tr", {}, h("td", { colspan: 7, class: "note" }, "No schedule.")));
    clear(pager);
    if (page.total > PAGE || offset > 0) {
      add(pager,
        h("button", { type: "button", disabled: offset === 0, onclick: () => { offset = Math.max(0, offset - PAGE); load(); } }, "← Newer"),
        h("span", { class: "note" }, `${offset + 1}–${offset + page.schedules.length} of ${page.total}`),
        h("button", { type: "button", disabled: page.next_offset === null, onclick: () => { offset = page.next_offset; load(); } }, "Older →"));
    }
  }
  await load();
}
