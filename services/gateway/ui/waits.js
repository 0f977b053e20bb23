// The waits inbox: every wait for a signal, across running executions, that the user may answer
// (GET /api/waits?kind=signal&mine=true), each with its form (forms.js) that sends the signal.
import { api } from "./api.js";
import { openStream } from "./live.js";
import { signalForm } from "./forms.js";
import { h, add, clear, fmtTime, short, singleFlight } from "./dom.js";

export async function waitsPage(main, query, ctx) {
  ctx.title("Waits");
  const list = h("div", { id: "waits", class: "waits-list" });
  const message = h("p", { class: "error", role: "alert", hidden: true });
  const count = h("span", { class: "note", id: "waits-count", role: "status" });
  const forms = new Map();  // wait id -> its form, kept while the wait is open (what the user typed stays)
  const answered = new Map();  // wait id -> a wait answered here: shown, with what its signal got, until Refresh
  add(main,
    h("div", { class: "page-head" }, h("h1", {}, "Waits"), count,
      h("button", { type: "button", class: "small", id: "waits-refresh", onclick: () => { answered.clear(); load(); } }, "Refresh")),
    h("p", { class: "note" }, "Every wait for a signal, in running executions, that you may answer: its roles, or, without roles, who may cancel its execution."),
    message, list);

  const load = singleFlight(async () => {
    let rows;
    try {
      rows = await api("/api/waits", { query: { kind: "signal", mine: "true", limit: 500 } });
      message.hidden = true;
    } catch (e) { message.textContent = e.message; message.hidden = false; return; }
    const open = new Set(rows.map((w) => w.wait_id));
    for (const id of [...forms.keys()]) if (!open.has(id) && !answered.has(id)) forms.delete(id);
    clear(list);
    count.textContent = rows.length === 1 ? "1 wait" : `${rows.length} waits`;
    // a wait answered here stays (the signal's status in its form) when it ends, until Refresh
    const shown = [...rows, ...[...answered.values()].filter((w) => !open.has(w.wait_id))];
    if (!shown.length) { add(list, h("p", { class: "note", id: "waits-empty" }, "Nothing waits for you.")); return; }
    for (const w of shown) {
      if (!forms.has(w.wait_id)) forms.set(w.wait_id, signalForm(w, { onSent: () => { answered.set(w.wait_id, w); setTimeout(() => load(), 300); } }));
      add(list, h("article", { class: "card wait-item", "data-wait": w.wait_id, "data-execution": w.execution_id },
        h("p", { class: "note" }, "execution ", h("a", { href: `#/executions/${w.execution_id}`, class: "mono" }, short(w.execution_id)),
          w.path ? ` · ${w.path}` : " · inline", ` · waiting since ${fmtTime(w.started_at)}`),
        forms.get(w.wait_id)));
    }
  }, 500);

  await load();
  // read again when executions start or end (a wait that begins in a running execution: Refresh)
  const close = openStream("/api/live/executions", { executions: () => load(), resync: () => load() });
  return () => { close(); load.cancel(); };
}
