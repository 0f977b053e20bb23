// One execution: the net (live, or at any past event), a step's runs, the timeline (a Gantt chart and the
// events), waits, cancel, run again.
import { api, ApiError } from "./api.js";
import { openStream } from "./live.js";
import { drawNet } from "./graph.js";
import { createGantt, runTimes } from "./gantt.js";
import { signalForm } from "./forms.js";
import { h, add, clear, fmtTime, fmtDuration, duration, short, num, statusBadge, value, isPreview, saveFile, singleFlight } from "./dom.js";

const PAGE = 100;
const TASK_EVENTS = ["task.started", "task.processed", "task.suspended"];
const COMMON_NAMES = ["playbook.execution.requested", "playbook.request.evaluated", "workflow.started", "token.enqueued",
  "step.admitted", "step.skipped", "step.started", "step.done", "step.failed", "task.started", "task.processed",
  "next.evaluated", "loop.started", "loop.iteration.started", "loop.iteration.done", "loop.iteration.failed", "loop.done",
  "wait.started", "wait.ended", "signal.received", "timer.scheduled", "timer.fired", "execution.cancelled",
  "workflow.finished", "playbook.processed"];

export async function executionPage(main, id, query, ctx) {
  ctx.title(`Execution ${short(id)}`);
  const page = { latest: null, shown: null, net: null, graph: null, live: true, step: query.step || null,
    timeline: { offset: 0, filters: { name: query.name || "", step: query.fstep || "", task: query.task || "", iteration: query.iteration || "" }, total: 0, last: null } };

  // the chart's timeline (gantt.js) and its runs by id; the event filters' fields
  let timeline = null, gantt = null, zoomWindow = null, filterFields = null;
  const timelineRuns = new Map();

  // ---------------------------------------------------------------- the frame
  const liveNote = h("span", { class: "live-dot", role: "status", "aria-live": "polite" }, "connecting…");
  const headInfo = h("dl", { class: "facts" });
  const statusHolder = h("span", { id: "exec-status" });
  const actions = h("div", { class: "actions" });
  const banner = h("p", { class: "note", role: "status", id: "exec-banner" });
  const netBox = h("div", { id: "net", class: "net-box" }, h("p", { class: "note" }, "Loading the playbook…"));
  const aside = h("aside", { id: "step-detail", class: "detail", "aria-live": "polite" });
  const slider = h("input", { id: "tt", type: "range", min: 0, max: 0, value: 0, step: 1, "aria-label": "time travel: the state after event number" });
  const ttLabel = h("span", { id: "tt-label", class: "tt-label" });
  const liveBtn = h("button", { type: "button", id: "tt-live", class: "small", onclick: () => goLive() }, "Live");
  const tbody = h("tbody");
  const pager = h("div", { class: "pager", id: "timeline-pager" });
  const tlMessage = h("p", { class: "error", role: "alert", hidden: true });
  const rerunBox = h("div", { id: "rerun-box" });
  const ganttBox = h("div", { id: "gantt", class: "gantt" }, h("p", { class: "note" }, "Loading the timeline…"));
  const ganttMessage = h("p", { class: "error", role: "alert", hidden: true });
  let streamState = "connecting…";

  add(main, 
    h("div", { class: "page-head" },
      h("h1", {}, "Execution ", h("span", { class: "mono", title: id }, short(id))), statusHolder, liveNote, actions),
    headInfo, banner, rerunBox,
    h("section", { class: "two-col exec" },
      h("div", { class: "panel", id: "net-panel" },
        h("div", { class: "panel-head" }, h("h2", {}, "Net"),
          h("span", { class: "legend", "aria-hidden": "true" },
            ["idle", "waiting", "running", "done", "partial", "failed", "cancelled", "skipped"].map((st) => h("span", { class: `chip st-${st}` }, st)),
            h("span", { class: "chip back" }, "back-edge"), h("span", { class: "chip join" }, "⋈ join"),
            h("span", { class: "chip" }, "↺ carried over"))),
        netBox,
        h("div", { class: "timetravel" },
          h("label", { for: "tt" }, "Time travel"), slider, ttLabel,
          h("button", { type: "button", class: "small", "aria-label": "one event back", onclick: () => nudge(-1) }, "◀"),
          h("button", { type: "button", class: "small", "aria-label": "one event on", onclick: () => nudge(1) }, "▶"),
          liveBtn)),
      aside),
    h("section", { class: "panel", id: "gantt-panel" },
      h("div", { class: "panel-head" }, h("h2", {}, "Timeline"),
        h("span", { class: "note" }, "each step run from its admission to its end; ▸ for its tasks, attempts, waits and iterations; drag over the chart to zoom")),
      ganttMessage, ganttBox),
    h("section", { class: "panel", id: "timeline-panel" },
      h("div", { class: "panel-head" }, h("h2", {}, "Events")),
      timelineFilters(), tlMessage,
      h("table", { class: "grid compact", id: "timeline" },
        h("caption", { class: "sr-only" }, "The execution's events in log order"),
        h("thead", {}, h("tr", {}, ["#", "time", "event", "step", "task", "iteration", "attempt", "status", ""].map((t) => h("th", { scope: "col" }, t)))),
        tbody),
      pager));

  // ---------------------------------------------------------------- state
  async function fetchState(q) {
    try {
      return await api(`/api/executions/${id}/state`, { query: q });
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) return null;
      throw e;
    }
  }

  // An execution just started may not be recorded yet: wait for it, but not forever (a wrong id).
  const UNKNOWN_AFTER_MS = 10000;
  let firstMiss = null, unknown = false;
  async function loadLatest() {
    if (unknown) return;
    const view = await fetchState(page.net ? {} : { net: true });
    if (!view) {
      firstMiss = firstMiss ?? Date.now();
      if (Date.now() - firstMiss < UNKNOWN_AFTER_MS) {
        banner.textContent = "Waiting for the execution's first events to be recorded…";
        setTimeout(() => { if (!page.latest) loadLatest(); }, UNKNOWN_AFTER_MS - (Date.now() - firstMiss) + 50);
        return;
      }
      unknown = true;
      banner.textContent = `No execution ${id} is known to this stack: check the id, or the stack it ran on.`;
      banner.dataset.state = "unknown";
      if (close) close();
      liveNote.textContent = "not found"; liveNote.dataset.state = "unknown";
      return;
    }
    banner.textContent = "";
    if (view.net && !page.net) setNet(view.net);
    receive(view);
  }

  function setNet(net) {
    if (!net.nodes.length) { add(clear(netBox), h("p", { class: "note" }, "No playbook yet (not evaluated).")); return; }
    page.net = net;
    page.graph = drawNet(netBox, net, { onSelect: (step) => selectStep(step) });
    const stepSelect = document.getElementById("tl-step");
    if (stepSelect) for (const n of net.nodes) stepSelect.append(h("option", { value: n.id, selected: n.id === page.timeline.filters.step }, n.id));
  }

  function receive(view) {
    // a view fetched before one already shown (an answer that came late, or a stream push that
    // overtook it) must not take the page back: the log only grows
    if (page.latest && view.total < page.latest.total) return;
    page.latest = view;
    if (page.live) show(view);
    else {
      slider.max = view.total;
      liveBtn.textContent = view.total > page.shown.position ? `Live (+${num(view.total - page.shown.position)})` : "Live";
      renderHead(page.shown);
    }
  }

  // The live dot says what the page shows: the stream's state, or a point of the past (time travel).
  function showLiveNote() {
    if (unknown) return;
    if (!page.live && page.shown) {
      liveNote.textContent = `time travel: after event ${num(page.shown.position)} of ${num(slider.max)}`;
      liveNote.dataset.state = "past";
    } else {
      liveNote.textContent = streamState;
      liveNote.dataset.state = streamState;
    }
  }

  function show(view) {
    page.shown = view;
    if (!page.net && view.net) setNet(view.net);
    if (page.graph) page.graph.update(view);
    slider.max = view.total;
    slider.value = view.position;
    const at = view.at;
    ttLabel.textContent = page.live && view.position === view.total
      ? `live: after all ${num(view.total)} events`
      : `after event ${num(view.position)} of ${num(view.total)}${at ? `: ${at.name}${at.step ? ` (${at.step}${at.iteration !== null && at.iteration !== undefined ? `[${at.iteration}]` : ""})` : ""}` : ""}`;
    liveBtn.disabled = page.live;
    liveBtn.textContent = "Live";
    netBox.classList.toggle("past", !page.live);
    if (gantt) gantt.setMarker(!page.live && at ? at.timestamp : null);
    renderHead(view);
    renderAside();
  }

  // The head shows the execution as the page shows it: at a past event while travelling in time (its
  // status then, marked as past), else as it is now.
  function renderHead(view) {
    const past = !page.live;
    add(clear(statusHolder), statusBadge(view.status),
      past ? h("span", { class: "badge past", id: "exec-past", title: "the status at the event the page shows" }, "past") : null);
    showLiveNote();
    clear(headInfo);
    const fact = (k, v) => [h("dt", {}, k), h("dd", {}, v)];
    const who = view.requested_by ? (view.requested_by.username || short(view.requested_by.user_id)) : null;
    add(headInfo, 
      fact("playbook", view.path ? `${view.path}${view.version ? ` v${view.version}` : ""}` : "inline"),
      who ? fact("started by", who) : null,
      fact("created", fmtTime(view.created_at)),
      fact("duration", view.started_at ? fmtDuration(duration(view.started_at, view.finished_at)) + (view.finished_at ? "" : " so far") : "—"),
      fact("events", num(view.total)),
      view.parent_execution_id ? fact("parent", h("a", { href: `#/executions/${view.parent_execution_id}`, class: "mono", id: "parent-link" }, short(view.parent_execution_id))) : null,
      view.restarted_from ? fact("restarted from", h("span", { id: "restarted-from" },
        h("a", { href: `#/executions/${view.restarted_from.execution}`, class: "mono" }, short(view.restarted_from.execution)),
        ` at step ${view.restarted_from.step}`)) : null,
      view.restarts && view.restarts.length ? fact(`restarts (${num(view.restarts.length)})`,
        h("span", { id: "restarts" }, view.restarts.map((r) => [h("a", { href: `#/executions/${r}`, class: "mono" }, short(r)), " "]))) : null,
      view.children && view.children.length ? fact(`children (${num(view.children_total)})`,
        h("span", { id: "children" }, view.children.map((c) => [h("a", { href: `#/executions/${c}`, class: "mono" }, short(c)), " "]))) : null);
    renderActions(page.latest || view);
  }

  // ---------------------------------------------------------------- cancel
  let confirming = false;
  function renderActions(view) {
    clear(actions);
    if (ctx.can("execution.start") && (view.path || view.finished !== undefined)) {
      add(actions, h("button", { type: "button", id: "rerun", "aria-expanded": String(!!rerunBox.firstChild),
        onclick: () => toggleRerun() }, "Run again…"));
    }
    if (view.finished) return;
    if (!(ctx.can("execution.cancel.any") || ctx.can("execution.cancel.own"))) return;
    if (!confirming) {
      add(actions, h("button", { type: "button", id: "cancel", class: "danger", onclick: () => { confirming = true; renderActions(page.latest); document.getElementById("cancel-confirm").focus(); } },
        view.cancel_requested ? "Cancelling…" : "Cancel execution"));
    } else {
      add(actions, h("span", { class: "note" }, "Cancel it?"),
        h("button", { type: "button", id: "cancel-confirm", class: "danger", onclick: cancel }, "Yes, cancel"),
        h("button", { type: "button", onclick: () => { confirming = false; renderActions(page.latest); } }, "Keep running"));
    }
  }

  async function cancel() {
    confirming = false;
    try {
      await api(`/api/executions/${id}/cancel`, { method: "POST", body: { reason: "cancelled from the console" } });
      banner.textContent = "Cancellation requested.";
    } catch (e) {
      banner.textContent = e.message;
    }
    renderActions(page.latest);
  }

  // ---------------------------------------------------------------- run again
  // The same playbook (the same catalog version, or the same inline document) with this execution's
  // workload, editable; POST /api/executions as "Run" does (execution.start).
  async function toggleRerun() {
    if (rerunBox.firstChild) { clear(rerunBox); renderActions(page.latest); return; }
    const note = h("p", { role: "status", class: "note", id: "rerun-status" }, "Reading the execution's workload…");
    add(rerunBox, h("div", { class: "card rerun-form" }, note));
    renderActions(page.latest);
    let full, playbook = null, catalog = false;
    try {
      full = await api(`/api/executions/${id}`);
      catalog = !!(full.path && full.version);  // an inline playbook has its metadata's path, no version
      if (!catalog) {
        const first = await api(`/api/executions/${id}/events`, { query: { name: ["playbook.execution.requested"], limit: 1 } });
        playbook = first.events.length ? first.events[0].data.playbook : null;
      }
    } catch (e) { note.textContent = e.message; return; }
    const workload = h("textarea", { id: "rerun-workload", rows: 8, class: "mono", oninput: () => { status.textContent = ""; } },
      JSON.stringify(full.workload || {}, null, 2));
    const which = catalog ? h("select", { id: "rerun-version" },
      h("option", { value: "same" }, `this version (v${full.version})`), h("option", { value: "latest" }, "the latest version")) : null;
    const form = h("form", { class: "card rerun-form", onsubmit: async (ev) => {
      ev.preventDefault();
      let body;
      try { body = workload.value.trim() ? JSON.parse(workload.value) : {}; } catch (e) { status.textContent = `the workload is not JSON: ${e.message}`; return; }
      if (body === null || typeof body !== "object" || Array.isArray(body)) { status.textContent = "the workload is a JSON object"; return; }
      const request = { workload: body };
      if (catalog) { request.path = full.path; if (which.value === "same") request.version = full.version; }
      else if (playbook) request.playbook = playbook;
      else { status.textContent = "this execution's playbook is not in its log"; return; }
      status.textContent = "Starting…";
      try {
        const r = await api("/api/executions", { method: "POST", body: request });
        ctx.go(`/executions/${r.execution_id}`);
      } catch (e) { status.textContent = e.message; }
    } },
    h("h2", {}, "Run again"),
    h("p", { class: "note" }, catalog ? `A new execution of ${full.path}, with this execution's workload (merged over the playbook's own, as when it was started): change it below.`
      : "A new execution of the same inline playbook, with this execution's workload: change it below."),
    which ? [h("label", { for: "rerun-version" }, "Playbook"), which] : null,
    h("label", { for: "rerun-workload" }, "Workload (JSON)"), workload,
    h("div", { class: "row" },
      h("button", { type: "submit", class: "primary", id: "rerun-start" }, "Start"),
      h("button", { type: "button", onclick: () => toggleRerun() }, "Close")));
    const status = h("p", { role: "status", class: "note", id: "rerun-status" });
    add(form, status);
    add(clear(rerunBox), form);
    workload.focus();
  }

  // ---------------------------------------------------------------- time travel
  const travel = singleFlight(async () => {
    const upto = Number(slider.value);
    const view = await fetchState({ upto });
    if (view && Number(slider.value) === upto && !page.live) show(view);
  }, 120);

  slider.addEventListener("input", () => { page.live = false; travel(); });
  function nudge(by) {
    slider.value = String(Math.max(0, Math.min(Number(slider.max), Number(slider.value) + by)));
    page.live = false;
    travel();
  }
  async function travelTo(q) {
    page.live = false;
    const view = await fetchState(q);
    if (view) show(view);
  }
  function goLive() {
    page.live = true;
    if (page.latest) show(page.latest);
    showLiveNote();
    loadLatest();
  }

  // ---------------------------------------------------------------- the detail panel
  function selectStep(step, { open = false, run = null } = {}) {
    page.step = step === page.step && !open ? null : step;
    if (page.graph) page.graph.select(page.step);
    renderAside(true);
    if (page.step) aside.focus?.();
    if (run) {
      const article = aside.querySelector(`article.run[data-run="${run}"]`);
      if (article) { article.scrollIntoView({ block: "nearest" }); article.classList.add("flash"); setTimeout(() => article.classList.remove("flash"), 1500); }
    }
  }

  // The panel is drawn again only when what it shows changed, and keeps what the user is doing in it
  // (an open list of tasks, a signal's payload being typed) across live updates.
  let asideKey = null;
  const taskBlocks = new Map();
  function renderAside(force = false) {
    const view = page.shown;
    if (!view) return;
    const key = JSON.stringify(page.step
      ? [page.step, (view.steps || {})[page.step], (view.runs || {})[page.step], view.position,
        (((view.runs || {})[page.step] || {}).shown || []).map((r) => timelineRuns.get(r.run_id) || null)]
      : [view.failure, view.errors, view.runs, view.ctx, view.workload, view.waits, waits.map((w) => w.wait_id)]);
    if (!force && key === asideKey) return;
    asideKey = key;
    clear(aside);
    if (page.step) return renderStep(view, page.step);
    renderOverview(view);
  }

  function renderOverview(view) {
    add(aside, h("h2", {}, "Execution"),
      view.failure ? h("div", {}, h("h3", {}, "Failure"), value(view.failure)) : null,
      view.errors && view.errors.length ? h("div", {}, h("h3", {}, "Errors"), value(view.errors)) : null);
    const loops = Object.entries(view.runs || {}).flatMap(([step, r]) => r.shown.filter((x) => x.loop).slice(-1).map((x) => [step, x]));
    for (const [step, run] of loops) add(aside, h("h3", {}, `Loop ${step}`), loopBlock(run.loop));
    add(aside, waitsBlock(view),
      h("h3", {}, "ctx"), value(view.ctx),
      h("h3", {}, "workload"), value(view.workload),
      h("p", { class: "note" }, "Select a step in the net (click, or Tab and Enter) for its runs, tasks and results."));
  }

  function loopBlock(loop) {
    const total = loop.total || 0, done = loop.done || 0, failed = loop.failed || 0;
    return h("div", { class: "loop-progress", id: "loop-progress", "data-done": done, "data-total": total },
      h("div", { class: "bar", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": total, "aria-valuenow": done + failed,
        "aria-label": "iterations ended" },
      h("span", { class: "done", style: { width: total ? `${(100 * done) / total}%` : "0" } }),
      h("span", { class: "failed", style: { width: total ? `${(100 * failed) / total}%` : "0" } })),
      h("dl", { class: "facts small" },
        h("dt", {}, "done"), h("dd", { class: "loop-done" }, num(done)),
        h("dt", {}, "failed"), h("dd", {}, num(failed)),
        h("dt", {}, "total"), h("dd", {}, total === null || total === undefined ? "?" : num(total)),
        h("dt", {}, "in flight"), h("dd", {}, num(loop.in_flight)),
        h("dt", {}, "rate"), h("dd", {}, loop.rate ? `${num(loop.rate)} /s` : "—"),
        h("dt", {}, "mode"), h("dd", {}, `${loop.mode || "?"}${loop.mode === "parallel" ? `, ${loop.max_in_flight} at once` : ""}`)));
  }

  function renderStep(view, step) {
    const st = (view.steps || {})[step] || { status: "idle", runs: 0 };
    const runs = (view.runs || {})[step];
    const node = page.net && page.net.nodes.find((n) => n.id === step);
    add(aside, 
      h("div", { class: "panel-head" }, h("h2", {}, "Step ", h("span", { class: "mono" }, step)),
        h("button", { type: "button", class: "small", onclick: () => selectStep(step) }, "Close")),
      h("p", {}, statusBadge(st.status), ` ${num(st.runs)} run${st.runs === 1 ? "" : "s"}`,
        st.active ? `, ${num(st.active)} active` : "", st.skipped ? `, skipped ${num(st.skipped)}×` : "",
        st.tokens ? `, ${num(st.tokens)} token${st.tokens === 1 ? "" : "s"} waiting` : ""),
      node ? h("p", { class: "note" }, [node.join ? "a join (fires once per set of tokens, D16). " : "",
        node.loop ? `a ${node.loop.mode} loop over ${node.loop.iterator}. ` : "", node.kinds.length ? `tasks: ${node.tasks.join(", ")}` : "no tool"]) : null);
    add(aside, restartForm(view, step, st));
    if (!runs) { add(aside, h("p", { class: "note" }, "No run at this point.")); return; }
    if (runs.total > runs.shown.length) add(aside, h("p", { class: "note" }, `the last ${runs.shown.length} of ${num(runs.total)} runs`));
    for (const run of [...runs.shown].reverse()) {
      // a run carried over by a restart (D32) is the restarted execution's: its result and tasks are there
      const from = run.restored && view.restarted_from ? view.restarted_from.execution : id;
      const dl = () => h("button", { type: "button", class: "link", onclick: () => downloadResult(run.run_id, from) }, "download the whole result");
      add(aside, h("article", { class: "run", "data-run": run.run_id },
        h("h3", {}, "run ", h("span", { class: "mono", title: run.run_id }, short(run.run_id)), " ", statusBadge(run.status)),
        run.restored ? h("p", { class: "note restored" }, "carried over from execution ",
          h("a", { href: `#/executions/${from}`, class: "mono" }, short(from)), ": it did not run again") : null,
        run.restored ? null : timesBlock(run),
        run.loop ? loopBlock(run.loop) : null,
        h("h4", {}, "args"), value(run.args),
        run.ended ? [h("h4", {}, "result"), value(run.result, { download: dl() }), !isPreview(run.result) ? h("p", {}, dl()) : null] : null,
        run.error ? [h("h4", {}, "error"), value(run.error)] : null,
        run.restored ? null : taskBlocks.get(run.run_id) || taskBlocks.set(run.run_id, tasksBlock(run)).get(run.run_id)));
    }
  }

  // When a run was admitted, started by a worker and ended, and how long it took (the timeline's; at a
  // past point of the log, what had happened by then).
  function timesBlock(run) {
    const t = runTimes(timelineRuns.get(run.run_id), timeline ? timeline.now : null);
    if (!t) return null;
    const ended = run.ended && t.ended !== null;
    return h("dl", { class: "facts small run-times" },
      h("dt", {}, "admitted"), h("dd", { class: "mono" }, fmtTime(t.admitted).slice(11)),
      h("dt", {}, "started"), h("dd", { class: "mono" }, t.started ? fmtTime(t.started).slice(11) : "—"),
      h("dt", {}, "ended"), h("dd", { class: "mono" }, ended ? fmtTime(t.ended).slice(11) : "—"),
      t.queued !== null ? [h("dt", {}, "waited for a worker"), h("dd", {}, fmtDuration(t.queued))] : null,
      h("dt", {}, "duration"), h("dd", { class: "run-duration" }, ended ? fmtDuration(t.duration) : run.ended ? "—" : `${fmtDuration(t.duration)} so far`));
  }

  // ---------------------------------------------------------------- restart from a step (D32)
  function restartForm(view, step, st) {
    if (!view.finished || !["failed", "cancelled", "partial"].includes(st.status) || st.restored) return null;
    if (!ctx.can("execution.start")) return null;
    const workload = h("textarea", { id: "restart-workload", rows: 3, class: "mono", "aria-label": "workload changes (JSON, merged over this execution's)" }, "{}");
    const note = h("p", { role: "status", class: "note", id: "restart-status" });
    return h("form", { class: "card restart-form", "data-step": step, onsubmit: async (ev) => {
      ev.preventDefault();
      let changes;
      try { changes = workload.value.trim() ? JSON.parse(workload.value) : {}; } catch (e) { note.textContent = `the workload is not JSON: ${e.message}`; return; }
      if (changes === null || typeof changes !== "object" || Array.isArray(changes)) { note.textContent = "the workload is a JSON object"; return; }
      note.textContent = "Restarting…";
      try {
        const body = { from_step: step };
        if (Object.keys(changes).length) body.workload = changes;
        const r = await api(`/api/executions/${id}/restart`, { method: "POST", body });
        ctx.go(`/executions/${r.execution_id}`);
      } catch (e) { note.textContent = e.message; }
    } },
    h("h3", {}, "Restart from here"),
    h("p", { class: "note" }, `A new execution goes on from ${step} with this one's state as it stood when ${step} first started: the steps that had finished are not run again.`),
    h("label", { for: "restart-workload" }, "Workload changes (JSON, merged over this execution's)"), workload,
    h("button", { type: "submit", class: "primary", id: "restart-from" }, `Restart from ${step}`), note);
  }

  async function downloadResult(runId, from = id) {
    try {
      const resp = await api(`/api/executions/${from}/runs/${runId}/result`, { raw: true });
      saveFile(`${runId}.json`, await resp.text());
    } catch (e) { banner.textContent = e.message; }
  }

  function tasksBlock(run) {
    const holder = h("div", { class: "tasks" });
    const iteration = h("input", { type: "number", min: 0, value: run.loop ? 0 : "", class: "narrow", "aria-label": "iteration" });
    const load = async () => {
      const q = { step_run_id: run.run_id, name: TASK_EVENTS, limit: 100 };
      if (iteration.value !== "") q.iteration = iteration.value;
      let page;
      try { page = await api(`/api/executions/${id}/events`, { query: q }); } catch (e) { add(clear(holder), h("p", { class: "error" }, e.message)); return; }
      clear(holder);
      if (!page.events.length) { add(holder, h("p", { class: "note" }, "No task events.")); return; }
      // one row per attempt: its task.started, then its task.suspended (a wait) and task.processed
      const attempts = [], byKey = new Map();
      for (const e of page.events) {
        const key = `${e.task_run_id || e.task}/${e.iteration}/${e.attempt}`;
        let a = byKey.get(key);
        if (!a) { a = { task: e.task, attempt: e.attempt, iteration: e.iteration }; byKey.set(key, a); attempts.push(a); }
        if (e.name === "task.started") a.started = e.timestamp;
        else if (e.name === "task.suspended") { a.suspended = e.timestamp; a.outcome = a.outcome || { status: "waiting" }; }
        else { a.ended = e.timestamp; a.outcome = (e.data && e.data.outcome) || { status: e.status }; }
      }
      add(holder, h("table", { class: "grid compact attempts" },
        h("thead", {}, h("tr", {}, ["task", "attempt", "iteration", "started", "ended", "duration", "outcome"].map((t) => h("th", { scope: "col" }, t)))),
        h("tbody", {}, attempts.map((a) => {
          const out = a.outcome;
          return h("tr", { "data-task": a.task || "", "data-attempt": a.attempt ?? "" },
            h("td", {}, a.task || "—"), h("td", {}, a.attempt ?? "—"), h("td", {}, a.iteration ?? "—"),
            h("td", { class: "mono" }, a.started ? fmtTime(a.started).slice(11) : "—"),
            h("td", { class: "mono" }, a.ended ? fmtTime(a.ended).slice(11) : a.suspended ? `waiting since ${fmtTime(a.suspended).slice(11)}` : "—"),
            h("td", { class: "attempt-duration" }, a.started && a.ended ? fmtDuration((a.ended - a.started) * 1000) : "—"),
            h("td", {}, out ? [statusBadge(out.status), out.error || out.result !== undefined ? value(out.error || out.result) : null] : "—"));
        }))), page.total > page.events.length ? h("p", { class: "note" }, `the first ${num(page.events.length)} of ${num(page.total)} task events`) : null);
    };
    return h("details", { class: "tasks-box", ontoggle: (ev) => { if (ev.target.open) load(); } },
      h("summary", {}, "Tasks and attempts"),
      run.loop ? h("label", {}, "iteration ", iteration, h("button", { type: "button", class: "small", onclick: load }, "Show")) : null,
      holder);
  }

  // ---------------------------------------------------------------- waits and signals
  let waits = [];
  const loadWaits = singleFlight(async () => {
    try { waits = await api("/api/waits", { query: { execution_id: id } }); } catch { waits = []; }
    if (!page.step) renderAside();
  }, 1000);

  const signalForms = new Map();
  function waitsBlock(view) {
    const open = waits.filter((w) => w.kind === "signal");
    const box = h("div", { id: "waits" }, h("h3", {}, "Waits"));
    for (const wid of [...signalForms.keys()]) if (!open.some((w) => w.wait_id === wid)) signalForms.delete(wid);
    if (!open.length && !(view.waits || []).length) { add(box, h("p", { class: "note" }, "No wait in progress.")); return box; }
    for (const w of (view.waits || []).filter((x) => x.status !== "waiting")) {
      add(box, h("p", { class: "note" }, `${w.step}.${w.task}: ${w.kind} ${w.signal || ""} ${w.status}`));
    }
    for (const w of open) {
      if (!signalForms.has(w.wait_id)) signalForms.set(w.wait_id, signalForm({ ...w, execution_id: id }));
      add(box, signalForms.get(w.wait_id));
    }
    return box;
  }

  // ---------------------------------------------------------------- the timeline
  function filterEvents({ step = "", task = "", iteration = "" }) {
    const f = filterFields;
    if (step && !Array.from(f.step.options).some((o) => o.value === step)) f.step.append(h("option", { value: step }, step));
    f.name.value = ""; f.step.value = step; f.task.value = task || ""; f.iteration.value = iteration ?? "";
    Object.assign(page.timeline.filters, { name: "", step, task: task || "", iteration: iteration === null || iteration === undefined ? "" : String(iteration) });
    loadTimeline(0);
    document.getElementById("timeline-panel").scrollIntoView({ block: "start" });
  }

  function timelineFilters() {
    const f = page.timeline.filters;
    const name = h("input", { id: "tl-name", list: "tl-names", value: f.name, placeholder: "any event", size: 22 });
    const step = h("select", { id: "tl-step" }, h("option", { value: "" }, "any step"));
    const task = h("input", { id: "tl-task", value: f.task, placeholder: "any task", size: 10 });
    const iteration = h("input", { id: "tl-iteration", type: "number", min: 0, value: f.iteration, class: "narrow" });
    filterFields = { name, step, task, iteration };
    return h("form", { class: "filters", onsubmit: (ev) => {
      ev.preventDefault();
      Object.assign(page.timeline.filters, { name: name.value.trim(), step: step.value, task: task.value.trim(), iteration: iteration.value });
      loadTimeline(0);
    } },
    h("datalist", { id: "tl-names" }, COMMON_NAMES.map((n) => h("option", { value: n }))),
    h("label", { for: "tl-name" }, "Event"), name, h("label", { for: "tl-step" }, "Step"), step,
    h("label", { for: "tl-task" }, "Task"), task, h("label", { for: "tl-iteration" }, "Iteration"), iteration,
    h("button", { type: "submit" }, "Filter"),
    h("button", { type: "button", onclick: () => { name.value = ""; step.value = ""; task.value = ""; iteration.value = ""; Object.assign(page.timeline.filters, { name: "", step: "", task: "", iteration: "" }); loadTimeline(0); } }, "Clear"));
  }

  function filtered() {
    const f = page.timeline.filters;
    return !!(f.name || f.step || f.task || f.iteration !== "");
  }

  async function loadTimeline(offset) {
    const f = page.timeline.filters;
    const q = { offset, limit: PAGE, name: f.name ? [f.name] : undefined, step: f.step, task: f.task, iteration: f.iteration };
    let pg;
    try { pg = await api(`/api/executions/${id}/events`, { query: q }); tlMessage.hidden = true; } catch (e) {
      if (e instanceof ApiError && e.status === 404) return;
      tlMessage.textContent = e.message; tlMessage.hidden = false; return;
    }
    page.timeline.offset = offset;
    page.timeline.total = pg.total;
    page.timeline.last = pg;
    clear(tbody);
    pg.events.forEach((e, i) => add(tbody, ...eventRow(e, offset + i + 1)));
    clear(pager);
    const last = Math.max(0, Math.floor((pg.total - 1) / PAGE) * PAGE);
    add(pager, 
      h("button", { type: "button", disabled: offset === 0, onclick: () => loadTimeline(0) }, "⇤ First"),
      h("button", { type: "button", disabled: offset === 0, onclick: () => loadTimeline(Math.max(0, offset - PAGE)) }, "← Earlier"),
      h("span", { class: "note", id: "timeline-range" }, `${num(pg.events.length ? offset + 1 : 0)}–${num(offset + pg.events.length)} of ${num(pg.total)}${filtered() ? ` matching (log: ${num(pg.log_total)})` : ""}`),
      h("button", { type: "button", disabled: pg.next_offset === null, onclick: () => loadTimeline(pg.next_offset) }, "Later →"),
      h("button", { type: "button", disabled: pg.next_offset === null, onclick: () => loadTimeline(last) }, "Last ⇥"));
  }

  function eventRow(e, n) {
    const where = filtered() ? `${num(n)}` : `${num(n)}`;
    const detail = h("tr", { class: "event-data", hidden: true }, h("td", { colspan: 9 }));
    const toggle = () => {
      const open = detail.hidden;
      detail.hidden = !open;
      row.setAttribute("aria-expanded", String(open));
      if (open && !detail.firstChild.firstChild) {
        add(detail.firstChild, value(e.data, { download: h("button", { type: "button", class: "link", onclick: () => saveFile(`${e.event_id}.json`, JSON.stringify(e, null, 1)) }, "download the event") }),
          h("p", { class: "note" }, `event ${e.event_id} · source ${e.source} · seq ${e.seq}`));
      }
    };
    const row = h("tr", { class: "event", tabindex: "0", "data-name": e.name, "data-seq": e.seq, "data-step": e.step || "", "aria-expanded": "false",
      onclick: (ev) => { if (!ev.target.closest("button")) toggle(); },
      onkeydown: (ev) => { if (ev.key === "Enter" && ev.target === row) toggle(); } },
    h("td", { class: "num" }, where), h("td", { class: "mono" }, fmtTime(e.timestamp).slice(11)),
    h("td", {}, h("span", { class: `ev ev-${e.name.split(".")[0]}` }, e.name)), h("td", {}, e.step || ""), h("td", {}, e.task || ""),
    h("td", {}, e.iteration ?? ""), h("td", {}, e.attempt ?? ""), h("td", {}, e.status || ""),
    h("td", {}, h("button", { type: "button", class: "small", title: "show the state after this event", "aria-label": `state after event ${n}`,
      onclick: () => travelTo({ seq: e.seq }) }, "⟲ state")));
    return [row, detail];
  }

  const tail = singleFlight(async () => {
    const tl = page.timeline;
    if (!tl.last && !filtered()) return loadTimeline(0);  // its first read came before the execution was recorded
    if (filtered() || !tl.last || tl.last.next_offset !== null) return; // only the last page follows the log
    const end = tl.offset + tl.last.events.length;
    if (tl.last.events.length >= PAGE) return loadTimeline(end);
    return loadTimeline(tl.offset);
  }, 1000);

  // ---------------------------------------------------------------- the chart
  const loadChart = singleFlight(async () => {
    const q = {};
    if (zoomWindow) { q.from = String(zoomWindow[0]); q.to = String(zoomWindow[1]); }
    let tl;
    try { tl = await api(`/api/executions/${id}/timeline`, { query: q }); ganttMessage.hidden = true; } catch (e) {
      if (e instanceof ApiError && e.status === 404) return;
      ganttMessage.textContent = e.message; ganttMessage.hidden = false; return;
    }
    timeline = tl;
    timelineRuns.clear();
    for (const r of tl.runs) timelineRuns.set(r.run_id, r);
    if (!gantt) {
      gantt = createGantt(ganttBox, {
        onSelect: (step, run) => selectStep(step, { open: true, run }),
        onFilter: (f) => filterEvents(f),
        onWindow: (w) => { zoomWindow = w; loadChart(); },
      });
    }
    gantt.update(tl);
    ganttBox.dataset.end = tl.end ?? "";  // read after the execution finished: the chart changes no more
    if (!page.live && page.shown && page.shown.at) gantt.setMarker(page.shown.at.timestamp);
    renderAside();
  }, 1500);
  // a finished execution's timeline changes no more: read once it is over (and when zoomed)
  let chartFinal = false;
  const chartAgain = () => { if (!chartFinal) { if (page.latest && page.latest.finished) chartFinal = true; loadChart(); } };

  // ---------------------------------------------------------------- wiring
  // A notice can arrive before the first page is shown (tail() then has nothing to follow), and what is
  // recorded before the stream is live has no notice: once both are there, read the tail again.
  let loaded = false, close = null;
  const catchUp = () => { loadLatest(); tail(); loadWaits(); chartAgain(); };
  close = openStream(`/api/live/executions/${id}`, {
    events: () => { if (!page.latest) loadLatest(); tail(); chartAgain(); },
    state: (view) => { if (!page.net) loadLatest(); else receive(view); loadWaits(); chartAgain(); },
    resync: () => { loadLatest(); loadTimeline(page.timeline.offset); loadWaits(); chartFinal = false; chartAgain(); },
    status: (st) => {
      if (unknown) return;
      streamState = st;
      showLiveNote();
      if (st === "live" && loaded) catchUp();
    },
  });
  await Promise.all([loadLatest(), loadTimeline(0), loadWaits(), loadChart()]);
  loaded = true;
  catchUp();
  if (page.step && page.graph) { page.graph.select(page.step); renderAside(); }
  return () => { close(); travel.cancel(); tail.cancel(); loadWaits.cancel(); loadChart.cancel(); };
}
