// The timeline as a Gantt chart: each step run a row (admitted -> ended, the wait for a worker lighter),
// under it its tasks' attempts, waits and loop iterations; a big loop as how many iterations ended in
// each slice of time (never a bar per iteration). Zoom: buttons, + and - keys, or drag over the chart;
// a big loop's slices are asked again for the window zoomed to. HTML rows (buttons, text) with bars
// placed in percent of the window: nothing grows with the size of the execution but the rows the API
// gives (at most 500 runs, 1,500 attempts, 100 iterations a loop).
import { h, s, add, clear, fmtTime, fmtDuration, num } from "./dom.js";

const MIN_SPAN = 0.001; // seconds: the narrowest window
const TICKS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800,
  3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];

export function relative(seconds) {
  if (seconds === 0) return "0";
  const ms = Math.abs(seconds) * 1000;
  const text = ms < 1000 ? `${+ms.toFixed(ms < 10 ? 1 : 0)} ms` : fmtDuration(ms);
  return `${seconds < 0 ? "−" : "+"}${text}`;
}

function span(a, b) {
  return a === null || a === undefined || b === null || b === undefined ? null : Math.max(0, (b - a) * 1000);
}

// A run's detail for the step panel: admitted, started, ended, how long it waited and ran.
export function runTimes(run, now) {
  if (!run) return null;
  const end = run.ended_at ?? null;
  return {
    admitted: run.admitted_at, started: run.started_at, ended: end,
    queued: span(run.admitted_at, run.started_at),
    duration: span(run.started_at ?? run.admitted_at, end ?? now),
    running: end === null,
  };
}

export function createGantt(container, { onSelect, onFilter, onWindow } = {}) {
  let data = null, win = null, full = null, dragging = null, marker = null, justDragged = false;
  const expanded = new Set();
  const axisTrack = h("div", { class: "g-axis-track" });
  const axisLabel = h("span", { class: "g-axis-label" });
  const axis = h("div", { class: "g-axis", "aria-hidden": "true" }, axisLabel, axisTrack);
  const rows = h("div", { class: "g-rows", role: "list", "aria-label": "step runs on a time axis" });
  const selection = h("div", { class: "g-brush", hidden: true });
  const cursor = h("div", { class: "g-marker", hidden: true, title: "the event the net shows" });
  const chart = h("div", { class: "g-chart", tabindex: "0", id: "gantt-chart",
    "aria-label": "timeline chart: + and - zoom, left and right arrows move, 0 fits the execution" },
  axis, rows, selection, cursor);
  const range = h("span", { class: "note", id: "gantt-range", role: "status" });
  const more = h("p", { class: "note", id: "gantt-more", hidden: true });
  const button = (text, label, fn, id) => h("button", { type: "button", class: "small", "aria-label": label, id, onclick: fn }, text);
  const controls = h("div", { class: "g-controls" },
    button("−", "zoom out", () => zoom(2), "gantt-out"), button("+", "zoom in", () => zoom(0.5), "gantt-in"),
    button("Fit", "fit the whole execution", () => fit(), "gantt-fit"),
    button("Expand all", "show every run's tasks, waits and iterations", () => expandAll(), "gantt-expand"),
    range,
    h("span", { class: "g-legend", "aria-hidden": "true" },
      h("span", { class: "g-key queued" }, "waiting for a worker"), h("span", { class: "g-key st-running" }, "running"),
      h("span", { class: "g-key st-waiting" }, "waiting (signal, time)"), h("span", { class: "g-key st-done" }, "done"),
      h("span", { class: "g-key st-partial" }, "partial"), h("span", { class: "g-key st-failed" }, "failed"),
      h("span", { class: "g-key slices" }, "iterations ended per slice")));
  add(clear(container), controls, chart, more);

  // ------------------------------------------------------------------ geometry
  const pct = (t) => ((t - win[0]) / (win[1] - win[0])) * 100;
  function place(el, a, b) {
    const left = pct(a), right = pct(b);
    const l = Math.max(-1, left), r = Math.min(101, right);
    el.hidden = r < 0 || l > 100;
    el.style.left = `${l}%`;
    el.style.width = `max(2px, ${Math.max(0, r - l)}%)`;
    return el;
  }
  function endOf(run) {
    return run.ended_at ?? data.end ?? data.now;
  }

  // ------------------------------------------------------------------ rows
  function bar(cls, a, b, title, extra = {}) {
    return place(h("span", { class: `g-bar ${cls}`, title, ...extra }), a, b);
  }

  function runTitle(run) {
    const t = runTimes(run, data.now);
    return [`step ${run.step}, run ${run.run_id.slice(0, 8)}: ${run.status}`,
      `admitted ${fmtTime(run.admitted_at)}`, run.started_at ? `started ${fmtTime(run.started_at)} (after ${fmtDuration(t.queued)})` : null,
      run.ended_at ? `ended ${fmtTime(run.ended_at)}` : "not ended", `ran ${fmtDuration(t.duration)}${t.running ? " so far" : ""}`,
      run.error_kind ? `error: ${run.error_kind}` : null].filter(Boolean).join("\n");
  }

  function histogram(run, tall) {
    const sl = run.loop && run.loop.slices;
    const w = data.window;
    if (!sl || !w) return null;
    const n = w.buckets, done = sl.done.slice(1, n + 1), failed = sl.failed.slice(1, n + 1);
    const top = Math.max(1, ...done.map((d, i) => d + failed[i]));
    const svg = s("svg", { class: "g-hist", viewBox: `0 0 ${n} 100`, preserveAspectRatio: "none", "aria-hidden": "true" });
    done.forEach((d, i) => {
      const hd = (100 * d) / top, hf = (100 * failed[i]) / top;
      if (d) svg.append(s("rect", { x: i + 0.08, width: 0.84, y: 100 - hd, height: hd, class: "done" }));
      if (failed[i]) svg.append(s("rect", { x: i + 0.08, width: 0.84, y: 100 - hd - hf, height: hf, class: "failed" }));
    });
    const holder = h("span", { class: `g-slices${tall ? " tall" : ""}`,
      title: `iterations ended per slice of ${fmtDuration(w.width * 1000)}: at most ${num(top)} in one` +
        `${sl.done[0] + sl.failed[0] ? `; ${num(sl.done[0] + sl.failed[0])} before this window` : ""}` +
        `${sl.done[n + 1] + sl.failed[n + 1] ? `; ${num(sl.done[n + 1] + sl.failed[n + 1])} after it` : ""}` }, svg);
    return place(holder, w.from, w.to);
  }

  function row({ key, label, level, status, bars, title, dur, expandable, onclick, filter, data: attrs }) {
    const open = expandable && expanded.has(key);
    const toggle = expandable ? h("button", { type: "button", class: "g-toggle", "aria-expanded": String(open),
      "aria-label": `${open ? "hide" : "show"} the tasks, waits and iterations of ${label}`,
      onclick: () => { if (open) expanded.delete(key); else expanded.add(key); render(); } }, open ? "▾" : "▸") : h("span", { class: "g-toggle-space" });
    const name = h("button", { type: "button", class: "g-name link", title, onclick }, label);
    return h("div", { class: `g-row level-${level}`, role: "listitem", "data-status": status, ...attrs },
      h("div", { class: "g-label" }, toggle, name, h("span", { class: "g-dur" }, dur || "")),
      h("div", { class: "g-track", onclick: filter ? (ev) => { if (!ev.target.closest("button")) filter(); } : null }, bars));
  }

  function runRows(run, index) {
    const key = run.run_id;
    const loop = run.loop;
    const end = endOf(run);
    const t = runTimes(run, data.now);
    const bars = [];
    if (run.started_at && run.started_at > run.admitted_at) bars.push(bar("queued", run.admitted_at, run.started_at, "waiting for a worker"));
    bars.push(bar(`st-${run.status}${loop && loop.slices ? " faint" : ""}`, run.started_at ?? run.admitted_at, end, runTitle(run),
      { "data-run": run.run_id }));
    if (loop && loop.slices) bars.push(histogram(run, false));
    const sub = (run.tasks || []).length + (run.waits || []).length + ((loop && loop.iterations) || []).length;
    const label = `${run.step}${index.count > 1 ? ` #${index.n}` : ""}${loop ? ` ⟳ ${num(loop.total ?? 0)}` : ""}`;
    const out = [row({ key, label, level: 0, status: run.status, bars, title: runTitle(run),
      dur: `${fmtDuration(t.duration)}${t.running ? "…" : ""}`, expandable: sub > 0 || !!(loop && loop.slices),
      onclick: () => onSelect && onSelect(run.step, run.run_id),
      filter: () => onFilter && onFilter({ step: run.step }),
      data: { "data-run": run.run_id, "data-step": run.step } })];
    if (!expanded.has(key)) return out;
    if (loop && loop.slices) {
      const w = data.window;
      out.push(row({ key: `${key}/slices`, label: `iterations ended (${num(loop.done)} done, ${num(loop.failed)} failed)`, level: 1,
        status: run.status, bars: [histogram(run, true)], dur: `per ${fmtDuration(w.width * 1000)}`,
        title: "counts per slice of the window: zoom in for finer slices", onclick: () => zoomTo(loop.started_at ?? run.admitted_at, end),
        data: { "data-slices": run.run_id } }));
    }
    const waitsOf = (iteration, task) => (run.waits || []).filter((w) => (w.iteration ?? null) === (iteration ?? null) && (!task || w.task === task));
    const taskRows = (tasks, level) => tasks.map((a) => {
      const aEnd = a.ended_at ?? (a.status === "waiting" || a.status === "running" ? data.end ?? data.now : a.started_at);
      const bars2 = [bar(`st-${a.status}`, a.started_at, a.suspended_at ?? aEnd,
        `task ${a.task}, attempt ${a.attempt ?? "?"}${a.iteration !== null && a.iteration !== undefined ? `, iteration ${a.iteration}` : ""}: ${a.status}\nstarted ${fmtTime(a.started_at)}${a.ended_at ? `\nended ${fmtTime(a.ended_at)}` : ""}`)];
      for (const w of waitsOf(a.iteration, a.task)) {
        bars2.push(bar("st-waiting wait", w.started_at, w.ended_at ?? data.end ?? data.now,
          `waiting for ${w.kind === "signal" ? `signal ${w.signal}` : "a time"} since ${fmtTime(w.started_at)}${w.ended_at ? `, until ${fmtTime(w.ended_at)}` : ""}`));
      }
      return row({ key: `${key}/${a.task}/${a.iteration}/${a.attempt}`, label: `${a.task} · attempt ${a.attempt ?? "?"}`, level, status: a.status,
        bars: bars2, dur: fmtDuration(span(a.started_at, a.ended_at ?? (a.status === "done" || a.status === "failed" ? a.started_at : data.end ?? data.now))),
        title: `task ${a.task}, attempt ${a.attempt}`, onclick: () => onFilter && onFilter({ step: run.step, task: a.task, iteration: a.iteration ?? "" }),
        data: { "data-task": a.task, "data-attempt": a.attempt ?? "" } });
    });
    if (loop && loop.iterations) {
      const byIteration = new Map();
      for (const a of run.tasks || []) {
        if (!byIteration.has(a.iteration)) byIteration.set(a.iteration, []);
        byIteration.get(a.iteration).push(a);
      }
      for (const it of loop.iterations) {
        const itEnd = it.ended_at ?? data.end ?? data.now;
        const ikey = `${key}/i${it.iteration}`;
        const tasks = byIteration.get(it.iteration) || [];
        const bars3 = [bar(`st-${it.status}`, it.started_at ?? run.admitted_at, itEnd,
          `iteration ${it.iteration}: ${it.status}\nstarted ${fmtTime(it.started_at)}${it.ended_at ? `\nended ${fmtTime(it.ended_at)}` : ""}`)];
        for (const w of waitsOf(it.iteration)) bars3.push(bar("st-waiting wait", w.started_at, w.ended_at ?? data.end ?? data.now, `waiting for ${w.signal ? `signal ${w.signal}` : "a time"}`));
        out.push(row({ key: ikey, label: `iteration ${it.iteration}`, level: 1, status: it.status, bars: bars3,
          dur: fmtDuration(span(it.started_at, it.ended_at ?? data.end ?? data.now)), expandable: tasks.length > 0,
          title: `iteration ${it.iteration}: its events`, onclick: () => onFilter && onFilter({ step: run.step, iteration: it.iteration }),
          data: { "data-iteration": it.iteration } }));
        if (expanded.has(ikey)) out.push(...taskRows(tasks, 2));
      }
    } else {
      out.push(...taskRows(run.tasks || [], 1));
      const listed = new Set((run.tasks || []).map((a) => `${a.iteration}/${a.task}`));
      for (const w of run.waits || []) {
        if (listed.has(`${w.iteration}/${w.task}`)) continue;
        out.push(row({ key: `${key}/w${w.task}`, label: `wait ${w.signal || w.kind}`, level: 1, status: w.ended_at ? "done" : "waiting",
          bars: [bar("st-waiting wait", w.started_at, w.ended_at ?? data.end ?? data.now, `waiting since ${fmtTime(w.started_at)}`)],
          dur: fmtDuration(span(w.started_at, w.ended_at ?? data.end ?? data.now)), title: "a wait" }));
      }
    }
    return out;
  }

  function ticks() {
    clear(axisTrack);
    const spanS = win[1] - win[0];
    const step = TICKS.find((t) => spanS / t <= 8) || TICKS[TICKS.length - 1];
    const origin = data.start;
    const first = Math.ceil((win[0] - origin) / step - 1e-9) * step + origin;
    axisLabel.textContent = `time from the start, ${fmtTime(origin).slice(11)}`;
    for (let k = 0, t = first; t <= win[1] + 1e-9 && k < 50; k++, t = first + k * step) {
      const tick = h("span", { class: "g-tick" }, relative(Math.round((t - origin) / step) * step));
      tick.style.left = `${pct(t)}%`;
      add(axisTrack, tick);
    }
  }

  function render() {
    if (!data) return;
    const counts = {};
    for (const r of data.runs) counts[r.step] = (counts[r.step] || 0) + 1;
    const seen = {};
    const list = [];
    for (const r of data.runs) {
      seen[r.step] = (seen[r.step] || 0) + 1;
      list.push(...runRows(r, { n: seen[r.step], count: counts[r.step] }));
    }
    ticks();
    add(clear(rows), list.length ? list : h("p", { class: "note" }, "No step has run yet."));
    range.textContent = `${relative(win[0] - data.start)} to ${relative(win[1] - data.start)} (${fmtDuration((win[1] - win[0]) * 1000)})`;
    chart.dataset.zoomed = String(zoomed());
    const notes = [];
    if (data.runs_total > data.runs.length) notes.push(`the last ${num(data.runs.length)} of ${num(data.runs_total)} runs are drawn`);
    if (data.tasks_more || data.tasks_total > (data.limits || {}).tasks) notes.push(`the first ${num((data.limits || {}).tasks)} task attempts are drawn`);
    more.hidden = !notes.length;
    more.textContent = notes.length ? `${notes.join("; ")}: the events below list them all.` : "";
    showMarker();
  }

  function showMarker() {
    if (marker === null || !win) { cursor.hidden = true; return; }
    const p = pct(marker);
    cursor.hidden = p < 0 || p > 100;
    cursor.style.left = `calc(var(--g-label) + (100% - var(--g-label)) * ${p / 100})`;
  }

  // ------------------------------------------------------------------ zoom
  function setWindow(a, b, ask = true) {
    const spanS = Math.max(MIN_SPAN, b - a);
    const mid = (a + b) / 2;
    win = [mid - spanS / 2, mid + spanS / 2];
    if (full) {  // never wider than the whole execution, never past its ends
      const fw = full[1] - full[0];
      if (win[1] - win[0] >= fw) win = [...full];
      else if (win[0] < full[0]) win = [full[0], full[0] + (win[1] - win[0])];
      else if (win[1] > full[1]) win = [full[1] - (win[1] - win[0]), full[1]];
    }
    render();
    if (ask && onWindow && data && data.runs.some((r) => r.loop && r.loop.slices)) onWindow(zoomed() ? win : null);
  }
  const zoomed = () => !!(full && (win[0] > full[0] + 1e-6 || win[1] < full[1] - 1e-6));
  function zoom(factor) {
    if (!win) return;
    const mid = (win[0] + win[1]) / 2, half = ((win[1] - win[0]) * factor) / 2;
    setWindow(mid - half, mid + half);
  }
  function zoomTo(a, b) { setWindow(a, b); }
  function fit() {  // exactly the whole execution (setWindow's arithmetic could miss its ends by a rounding)
    if (!full) return;
    win = [...full];
    render();
    if (onWindow && data && data.runs.some((r) => r.loop && r.loop.slices)) onWindow(null);
  }
  function pan(by) {
    if (!win) return;
    const d = (win[1] - win[0]) * by;
    setWindow(win[0] + d, win[1] + d);
  }
  function expandAll() {
    if (!data) return;
    const all = data.runs.every((r) => expanded.has(r.run_id));
    for (const r of data.runs) { if (all) expanded.delete(r.run_id); else expanded.add(r.run_id); }
    render();
  }

  chart.addEventListener("keydown", (ev) => {
    if (ev.target !== chart) return;
    const keys = { "+": () => zoom(0.5), "=": () => zoom(0.5), "-": () => zoom(2), "0": () => fit(),
      ArrowLeft: () => pan(-0.2), ArrowRight: () => pan(0.2) };
    if (keys[ev.key]) { ev.preventDefault(); keys[ev.key](); }
  });
  // drag over the tracks to zoom to that stretch
  const trackX = (ev) => {
    const first = rows.querySelector(".g-track") || axisTrack;
    const box = first.getBoundingClientRect();
    return { x: Math.min(Math.max(ev.clientX, box.left), box.right), box };
  };
  chart.addEventListener("pointerdown", (ev) => {
    if (ev.button !== 0 || !ev.target.closest(".g-track, .g-axis") || !win) return;
    const { x, box } = trackX(ev);
    dragging = { x0: x, box, moved: false };
    chart.setPointerCapture(ev.pointerId);
  });
  chart.addEventListener("pointermove", (ev) => {
    if (!dragging) return;
    const { x } = trackX(ev);
    if (Math.abs(x - dragging.x0) < 4) return;
    dragging.moved = true;
    const cb = chart.getBoundingClientRect();
    selection.hidden = false;
    selection.style.left = `${Math.min(x, dragging.x0) - cb.left}px`;
    selection.style.width = `${Math.abs(x - dragging.x0)}px`;
  });
  chart.addEventListener("pointerup", (ev) => {
    if (!dragging) return;
    const { x } = trackX(ev);
    const d = dragging;
    dragging = null;
    selection.hidden = true;
    if (!d.moved) return;
    const at = (px) => win[0] + ((px - d.box.left) / d.box.width) * (win[1] - win[0]);
    setWindow(at(Math.min(x, d.x0)), at(Math.max(x, d.x0)));
    justDragged = true;
    setTimeout(() => { justDragged = false; }, 0);
  });
  chart.addEventListener("click", (ev) => { if (justDragged) { ev.stopPropagation(); ev.preventDefault(); } }, true);

  return {
    // a new timeline: the window follows the execution's end unless the user zoomed
    update(tl) {
      const wasZoomed = win && zoomed();
      data = tl;
      // the recorder reads its clock before the events: one recorded meanwhile may be later than `now`
      let latest = tl.now ?? tl.start;
      for (const r of tl.runs) {
        for (const t of [r.admitted_at, r.started_at, r.ended_at]) if (t > latest) latest = t;
        for (const a of r.tasks || []) for (const t of [a.started_at, a.suspended_at, a.ended_at]) if (t > latest) latest = t;
        for (const w of r.waits || []) for (const t of [w.started_at, w.ended_at]) if (t > latest) latest = t;
      }
      data = { ...tl, now: latest };
      const end = tl.end ?? data.now;
      full = [tl.start, Math.max(tl.start + MIN_SPAN, end + (end - tl.start) * 0.02)];
      if (!win || !wasZoomed) win = [...full];
      render();
    },
    setMarker(t) { marker = t ?? null; showMarker(); },
    window: () => win && [...win],
    zoomed,
    expand(runId) { expanded.add(runId); render(); },
    chart,
  };
}
