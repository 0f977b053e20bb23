// The catalog: playbooks and their versions; one version's YAML with its findings at their lines, its
// net, and a form that runs it.
import { api } from "./api.js";
import { drawNet } from "./graph.js";
import { h, add, clear, fmtTime, num } from "./dom.js";

export async function catalogPage(main, query, ctx) {
  ctx.title("Catalog");
  const entries = await api("/api/catalog");
  const byPath = new Map();
  for (const e of entries) {
    if (!byPath.has(e.path)) byPath.set(e.path, []);
    byPath.get(e.path).push(e);
  }
  const filter = h("input", { id: "cat-filter", type: "search", placeholder: "filter by path or name", value: query.q || "", size: 30 });
  const tbody = h("tbody");
  const render = () => {
    const q = filter.value.trim().toLowerCase();
    clear(tbody);
    for (const [path, versions] of byPath) {
      if (q && !path.toLowerCase().includes(q) && !(versions[0].name || "").toLowerCase().includes(q)) continue;
      const latest = versions[0];
      add(tbody, h("tr", { "data-path": path },
        h("td", {}, h("a", { href: `#/catalog/${latest.id}`, class: "mono" }, path)),
        h("td", {}, latest.name || ""),
        h("td", {}, versions.map((v, i) => [i ? " " : "", h("a", { href: `#/catalog/${v.id}`, title: fmtTime(v.created_at) }, `v${v.version}`)])),
        h("td", {}, fmtTime(latest.created_at))));
    }
    if (!tbody.firstChild) add(tbody, h("tr", {}, h("td", { colspan: 4, class: "note" }, "No playbook matches.")));
  };
  filter.addEventListener("input", render);
  add(main, h("div", { class: "page-head" }, h("h1", {}, "Catalog"), h("span", { class: "note" }, `${num(byPath.size)} playbooks, ${num(entries.length)} versions`)),
    h("div", { class: "filters" }, h("label", { for: "cat-filter" }, "Filter"), filter),
    h("table", { class: "grid", id: "catalog" },
      h("caption", { class: "sr-only" }, "Playbooks in the catalog"),
      h("thead", {}, h("tr", {}, ["Path", "Name", "Versions (newest first)", "Latest registered"].map((t) => h("th", { scope: "col" }, t)))),
      tbody));
  render();
}

export async function catalogEntryPage(main, catalogId, query, ctx) {
  const [entry, report] = await Promise.all([api(`/api/catalog/${catalogId}`), api(`/api/catalog/${catalogId}/lint`)]);
  ctx.title(`${entry.path} v${entry.version}`);
  const byLine = new Map();
  for (const f of report.findings) {
    const line = f.line || 0;
    if (!byLine.has(line)) byLine.set(line, []);
    byLine.get(line).push(f);
  }
  const counts = { error: 0, warning: 0, info: 0 };
  for (const f of report.findings) counts[f.severity] = (counts[f.severity] || 0) + 1;

  // the YAML with line numbers; findings under their line
  const code = h("ol", { class: "yaml", id: "yaml" });
  entry.content.split("\n").forEach((text, i) => {
    const n = i + 1;
    const found = byLine.get(n) || [];
    add(code, h("li", { id: `line-${n}`, class: found.length ? `has-${worst(found)}` : "" },
      h("code", {}, text || " "),
      found.map((f) => h("div", { class: `finding sev-${f.severity}`, role: "note" }, `${f.code} ${f.severity}: ${f.message}`))));
  });
  const findings = h("ul", { class: "findings", id: "findings" },
    report.findings.length ? report.findings.map((f) => h("li", { class: `sev-${f.severity}` },
      h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); const li = document.getElementById(`line-${f.line}`); if (li) { li.scrollIntoView({ block: "center" }); li.classList.add("flash"); setTimeout(() => li.classList.remove("flash"), 1500); } } },
        `line ${f.line ?? "?"}`), ` ${f.code} ${f.severity}: `, h("span", { class: "mono" }, f.location || "<document>"), ` — ${f.message}`))
      : h("li", { class: "note" }, "No findings: it validates and lints clean."));

  const netBox = h("div", { class: "net-box", id: "preview-net" });
  const workload = h("textarea", { id: "run-workload", rows: 6, class: "mono", "aria-label": "workload (JSON, merged over the playbook's)" }, "{}");
  const note = h("p", { role: "status", class: "note", id: "run-status" });
  const canRun = ctx.can("execution.start");
  const form = h("form", { class: "card run-form", onsubmit: async (ev) => {
    ev.preventDefault();
    let body;
    try { body = workload.value.trim() ? JSON.parse(workload.value) : {}; } catch (e) { note.textContent = `the workload is not JSON: ${e.message}`; return; }
    if (body === null || typeof body !== "object" || Array.isArray(body)) { note.textContent = "the workload is a JSON object"; return; }
    note.textContent = "Starting…";
    try {
      const r = await api("/api/executions", { method: "POST", body: { catalog_id: catalogId, workload: body } });
      ctx.go(`/executions/${r.execution_id}`);
    } catch (e) { note.textContent = e.message; }
  } },
  h("h2", {}, "Run"),
  h("label", { for: "run-workload" }, "Workload (JSON, merged over the playbook's own)"), workload,
  h("button", { type: "submit", class: "primary", id: "run", disabled: !canRun || !report.valid }, `Run ${entry.path} v${entry.version}`),
  !canRun ? h("p", { class: "note" }, "Your roles may not start executions (execution.start).") : null, note);

  add(main, 
    h("div", { class: "page-head" }, h("h1", {}, h("span", { class: "mono" }, entry.path), ` v${entry.version}`),
      h("span", { class: report.valid ? "badge st-done" : "badge st-failed" }, report.valid ? "valid" : "invalid"),
      h("span", { class: "note" }, `${counts.error} errors, ${counts.warning} warnings, ${counts.info} notes`),
      h("a", { href: "#/catalog" }, "all playbooks")),
    h("section", { class: "two-col" },
      h("div", { class: "panel" }, h("h2", {}, "Net"), netBox),
      h("div", {}, form, h("div", { class: "panel" }, h("h2", {}, "Findings"), findings))),
    h("section", { class: "panel" }, h("h2", {}, "YAML"), h("p", { class: "note" }, `${entry.name || ""} · registered ${fmtTime(entry.created_at)} · id ${entry.id}`), code));
  if (report.net.nodes.length) drawNet(netBox, report.net, {}).update({ steps: {} });
  else add(netBox, h("p", { class: "note" }, "No net: the playbook does not validate."));
}

function worst(found) {
  return found.some((f) => f.severity === "error") ? "error" : found.some((f) => f.severity === "warning") ? "warning" : "info";
}
