// The overview: executions created in a time range, per status over time; the playbooks whose
// executions took longest; the failures by error kind (GET /api/stats/executions, execution.read).
import { api } from "./api.js";
import { h, s, add, clear, fmtTime, fmtDuration, num, short, statusBadge } from "./dom.js";

const RANGES = [
  ["1h", "the last hour", 3600, 12],
  ["24h", "the last 24 hours", 86400, 48],
  ["7d", "the last 7 days", 7 * 86400, 56],
  ["30d", "the last 30 days", 30 * 86400, 60],
];
const STATUSES = ["COMPLETED", "FAILED", "CANCELLED", "RUNNING", "PENDING"];

export async function overviewPage(main, query, ctx) {
  ctx.title("Overview");
  const chosen = RANGES.find((r) => r[0] === query.range) || RANGES[1];
  const range = h("select", { id: "ov-range", "aria-label": "time range" },
    RANGES.map(([key, text]) => h("option", { value: key, selected: key === chosen[0] }, text)));
  const message = h("p", { class: "error", role: "alert", hidden: true });
  const totals = h("div", { class: "ov-totals", id: "ov-totals", role: "list" });
  const chart = h("div", { class: "ov-chart", id: "ov-chart" });
  const slowest = h("tbody");
  const failures = h("tbody");
  add(main,
    h("div", { class: "page-head" }, h("h1", {}, "Overview"), h("label", { for: "ov-range", class: "sr-only" }, "time range"), range,
      h("span", { class: "note" }, "executions created in that time")),
    message, totals,
    h("section", { class: "panel" }, h("h2", {}, "Executions per status over time"), chart),
    h("section", { class: "panel" }, h("h2", {}, "Slowest playbooks"),
      h("table", { class: "grid", id: "ov-slowest" },
        h("caption", { class: "sr-only" }, "Playbooks whose finished executions took longest"),
        h("thead", {}, h("tr", {}, ["Playbook", "Finished", "Failed", "Average", "Median", "95th percentile", "Longest", "Slowest execution"]
          .map((t) => h("th", { scope: "col" }, t)))), slowest)),
    h("section", { class: "panel" }, h("h2", {}, "Failures by error kind"),
      h("table", { class: "grid", id: "ov-failures" },
        h("caption", { class: "sr-only" }, "Failed executions by error kind"),
        h("thead", {}, h("tr", {}, ["Error kind", "Executions", "Latest", "Its message"].map((t) => h("th", { scope: "col" }, t)))), failures)));

  async function load() {
    const [key, , seconds, buckets] = RANGES.find((r) => r[0] === range.value) || RANGES[1];
    ctx.setQuery("/overview", { range: key });
    const until = Date.now() / 1000;
    let st;
    try {
      st = await api("/api/stats/executions", { query: { since: String(until - seconds), until: String(until), buckets } });
      message.hidden = true;
    } catch (e) { message.textContent = e.message; message.hidden = false; return; }
    clear(totals);
    const all = Object.values(st.totals || {}).reduce((a, b) => a + b, 0);
    add(totals, h("span", { class: "ov-total", role: "listitem", "data-status": "ALL" }, h("strong", {}, num(all)), " executions"),
      STATUSES.filter((x) => st.totals[x]).map((x) => h("span", { class: "ov-total", role: "listitem", "data-status": x },
        statusBadge(x), " ", h("strong", {}, num(st.totals[x])))));
    drawChart(chart, st);
    clear(slowest);
    for (const p of st.slowest || []) {
      add(slowest, h("tr", { "data-path": p.path },
        h("td", {}, h("a", { href: `#/executions?path=${encodeURIComponent(p.path)}` }, p.path)),
        h("td", { class: "num" }, num(p.count)), h("td", { class: "num" }, num(p.failed)),
        ["avg_seconds", "p50_seconds", "p95_seconds", "max_seconds"].map((k) => h("td", { class: "num" }, fmtDuration(p[k] * 1000))),
        h("td", {}, p.slowest_execution ? h("a", { href: `#/executions/${p.slowest_execution}`, class: "mono" }, short(p.slowest_execution)) : "—")));
    }
    if (!(st.slowest || []).length) add(slowest, h("tr", {}, h("td", { colspan: 8, class: "note" }, "No execution finished in this time.")));
    clear(failures);
    for (const f of st.failures || []) {
      add(failures, h("tr", { "data-kind": f.kind || "" },
        h("td", { class: "mono" }, f.kind || "(no kind)"), h("td", { class: "num" }, num(f.count)),
        h("td", {}, f.latest_execution ? [h("a", { href: `#/executions/${f.latest_execution}`, class: "mono" }, short(f.latest_execution)), " ", fmtTime(f.last_at)] : "—"),
        h("td", { class: "ov-message" }, f.latest_message || "")));
    }
    if (!(st.failures || []).length) add(failures, h("tr", {}, h("td", { colspan: 4, class: "note" }, "No execution failed in this time.")));
  }

  range.addEventListener("change", load);
  await load();
}

// Stacked bars, one for each slice of the range, a colour for each status; the numbers as a table for
// screen readers and on hover.
function drawChart(box, st) {
  clear(box);
  const slices = st.by_status || [];
  const W = 900, H = 190, left = 40, bottom = 22, pad = 10;  // pad: room for the top label
  const top = Math.max(1, ...slices.map((x) => STATUSES.reduce((a, k) => a + (x[k] || 0), 0)));
  const bw = (W - left) / Math.max(1, slices.length);
  const svg = s("svg", { class: "ov-bars", viewBox: `0 0 ${W} ${H}`, role: "img",
    "aria-label": `executions per status in ${slices.length} slices of ${fmtDuration((st.bucket_seconds || 0) * 1000)}` });
  for (const frac of [0, 0.5, 1]) {
    const y = pad + (H - bottom - pad) * (1 - frac);
    svg.append(s("line", { x1: left, x2: W, y1: y, y2: y, class: "ov-grid" }),
      s("text", { x: left - 6, y: y + 4, "text-anchor": "end", class: "ov-axis" }, num(Math.round(top * frac))));
  }
  slices.forEach((x, i) => {
    let y = H - bottom;
    const g = s("g", { class: "ov-slice", "data-from": x.from });
    const parts = [];
    for (const k of STATUSES) {
      const n = x[k] || 0;
      if (!n) continue;
      const hgt = ((H - bottom - pad) * n) / top;
      y -= hgt;
      g.append(s("rect", { x: left + i * bw + 1, width: Math.max(1, bw - 2), y, height: hgt, class: `ov-${k.toLowerCase()}` }));
      parts.push(`${k.toLowerCase()} ${n}`);
    }
    g.prepend(s("title", {}, `${fmtTime(x.from)}: ${parts.join(", ") || "none"}`));
    svg.append(g);
  });
  const labels = Math.min(6, slices.length);
  for (let j = 0; j < labels; j++) {
    const i = Math.round((j * (slices.length - 1)) / Math.max(1, labels - 1));
    svg.append(s("text", { x: left + i * bw + bw / 2, y: H - 6, "text-anchor": "middle", class: "ov-axis" }, fmtTime(slices[i].from).slice(5, 16)));
  }
  add(box, svg,
    h("div", { class: "ov-legend", "aria-hidden": "true" }, STATUSES.map((k) => h("span", { class: `chip st-${k.toLowerCase()}` }, k.toLowerCase()))),
    h("table", { class: "sr-only" }, h("caption", {}, "Executions per status in each slice"),
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "from"), STATUSES.map((k) => h("th", { scope: "col" }, k)))),
      h("tbody", {}, slices.map((x) => h("tr", {}, h("td", {}, fmtTime(x.from)), STATUSES.map((k) => h("td", {}, String(x[k] || 0))))))));
}
