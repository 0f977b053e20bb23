// The playbook drawn as a net: steps as nodes, arcs (places) as edges, laid out by dagre. The layout is
// made once per playbook; a new state only changes classes and counts (no layout again).
import dagre from "./vendor/dagre.esm.js";
import { s, clear, num } from "./dom.js";

const KIND_LABEL = { python: "python", noop: "noop", http: "http", postgres: "postgres", duckdb: "duckdb",
  wait: "wait", playbook: "playbook", secrets: "secrets" };

function label(text, max) {
  const t = typeof text === "string" ? text : JSON.stringify(text);
  return t.length > max ? t.slice(0, max - 1) + "…" : t;
}

function nodeMarkers(n) {
  const out = [];
  if (n.loop) out.push(`⟳ ${n.loop.mode}${n.loop.mode === "parallel" ? ` ×${n.loop.max_in_flight}` : ""}`);
  if (n.join) out.push("⋈ join");
  if (n.join_any) out.push("join: any");
  const kinds = (n.kinds || []).map((k) => KIND_LABEL[k] || k);
  if (kinds.length) out.push(kinds.length > 2 ? `${kinds.slice(0, 2).join(", ")} +${kinds.length - 2}` : kinds.join(", "));
  else if (!n.loop) out.push("no tool");
  return out.join(" · ");
}

function edgeText(e) {
  if (typeof e.when === "string") return `if ${label(e.when.replace(/^\{\{\s*|\s*\}\}$/g, ""), 28)}`;
  if (e.when) return "if …";
  if (e.args && typeof e.args === "object" && !("$preview" in e.args)) return `args: ${label(Object.keys(e.args).join(", "), 24)}`;
  return e.args ? "args" : "";
}

export function drawNet(container, net, { onSelect } = {}) {
  clear(container);
  const g = new dagre.graphlib.Graph({ multigraph: true });
  g.setGraph({ rankdir: "LR", nodesep: 28, ranksep: 70, edgesep: 14, marginx: 16, marginy: 16 });
  g.setDefaultEdgeLabel(() => ({}));
  for (const n of net.nodes) {
    const sub = nodeMarkers(n);
    const width = Math.max(150, 8.2 * Math.max(n.id.length, sub.length * 0.82) + 36);
    g.setNode(n.id, { width, height: n.loop ? 76 : 56 });
  }
  const texts = {};
  for (const e of net.edges) {
    texts[e.id] = edgeText(e);
    const w = texts[e.id] ? Math.min(190, 6.3 * texts[e.id].length + 8) : 0;
    // the label beside its edge (dagre keeps room for it there), never on it: no line strikes it through
    g.setEdge(e.source, e.target, { minlen: 1, weight: e.back ? 0 : 1, width: w, height: w ? 16 : 0,
      labelpos: w ? "r" : "c", labeloffset: 4 }, e.id);
  }
  dagre.layout(g);
  const graph = g.graph();
  const svg = s("svg", {
    class: "net", viewBox: `0 0 ${Math.ceil(graph.width)} ${Math.ceil(graph.height)}`,
    width: Math.ceil(graph.width), height: Math.ceil(graph.height), role: "group",
    "aria-label": `the playbook as a net: ${net.nodes.length} steps, ${net.edges.length} arcs`,
  });
  svg.append(s("defs", {},
    s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" },
      s("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrowhead" })),
    s("marker", { id: "arrow-back", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" },
      s("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrowhead back" }))));

  const edgeLayer = s("g", { class: "edges" });
  const labelLayer = s("g", { class: "edge-labels" });  // above every edge: no other edge crosses a label
  const nodeLayer = s("g", { class: "nodes" });
  svg.append(edgeLayer, labelLayer, nodeLayer);
  const tokens = {};
  for (const e of net.edges) {
    const laid = g.edge({ v: e.source, w: e.target, name: e.id });
    const pts = laid.points;
    const d = pts.map((p, i) => `${i ? "L" : "M"} ${p.x.toFixed(1)} ${p.y.toFixed(1)}`).join(" ");
    const title = [`arc ${e.id}${e.back ? " (back-edge)" : ""}`, e.when ? `when: ${label(e.when, 300)}` : "when: (on success)",
      e.args ? `args: ${label(e.args, 300)}` : null, e.delay ? `delay: ${e.delay}` : null].filter(Boolean).join("\n");
    const grp = s("g", { class: `edge${e.back ? " back" : ""}`, "data-place": e.id },
      s("title", {}, title),
      s("path", { d, class: "edge-line", "marker-end": `url(#${e.back ? "arrow-back" : "arrow"})` }));
    if (texts[e.id]) {
      const at = laid.x !== undefined ? laid : pts[Math.floor(pts.length / 2)];
      const w = Math.min(190, 6.3 * texts[e.id].length + 8);
      labelLayer.append(s("g", { class: `edge-label-box${e.back ? " back" : ""}`, "data-place": e.id },
        s("title", {}, title),
        s("rect", { x: (at.x - w / 2).toFixed(1), y: (at.y - 8).toFixed(1), width: w.toFixed(1), height: 16, rx: 3 }),
        s("text", { x: at.x, y: at.y + 4, class: "edge-label", "text-anchor": "middle" }, texts[e.id])));
    }
    const end = pts[pts.length - 1], before = pts[pts.length - 2] || end;
    const tx = end.x - (end.x - before.x) * 0.25, ty = end.y - (end.y - before.y) * 0.25;
    const tok = s("g", { class: "token", transform: `translate(${tx.toFixed(1)} ${ty.toFixed(1)})`, visibility: "hidden" },
      s("circle", { r: 9 }), s("text", { "text-anchor": "middle", dy: "4" }, ""));
    grp.append(tok);
    tokens[e.id] = tok;
    edgeLayer.append(grp);
  }

  const nodes = {};
  for (const n of net.nodes) {
    const box = g.node(n.id);
    const x = box.x - box.width / 2, y = box.y - box.height / 2;
    const grp = s("g", {
      class: `node st-idle${n.join ? " join" : ""}${n.loop ? " loop" : ""}${n.entry ? " entry" : ""}`,
      transform: `translate(${x.toFixed(1)} ${y.toFixed(1)})`, tabindex: "0", role: "button",
      "data-step": n.id, "data-status": "idle", "aria-label": `step ${n.id}`,
    });
    grp.append(s("rect", { class: "node-box", width: box.width, height: box.height, rx: n.join ? 4 : 12 }));
    if (n.join) grp.append(s("rect", { class: "join-ring", x: 3, y: 3, width: box.width - 6, height: box.height - 6, rx: 2 }));
    if (n.entry) grp.append(s("path", { class: "entry-mark", d: `M 0 ${box.height / 2 - 8} L 8 ${box.height / 2} L 0 ${box.height / 2 + 8} z` }));
    grp.append(s("text", { x: 14, y: 22, class: "node-name" }, label(n.id, 28)));
    grp.append(s("text", { x: 14, y: 40, class: "node-sub" }, nodeMarkers(n)));
    const runs = s("text", { x: box.width - 10, y: 20, class: "node-runs", "text-anchor": "end" }, "");
    grp.append(runs);
    let bar = null, barDone = null, barFailed = null, barText = null;
    if (n.loop) {
      const w = box.width - 28;
      bar = s("rect", { x: 14, y: 48, width: w, height: 8, rx: 3, class: "loop-bar" });
      barDone = s("rect", { x: 14, y: 48, width: 0, height: 8, rx: 3, class: "loop-done" });
      barFailed = s("rect", { x: 14, y: 48, width: 0, height: 8, class: "loop-failed" });
      barText = s("text", { x: 14, y: 69, class: "node-loop" }, "");
      grp.append(bar, barDone, barFailed, barText);
    }
    grp.append(s("title", {}, `step ${n.id}${n.desc ? `: ${n.desc}` : ""}`));
    const select = () => onSelect && onSelect(n.id);
    grp.addEventListener("click", select);
    grp.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); select(); } });
    nodeLayer.append(grp);
    nodes[n.id] = { grp, runs, bar, barDone, barFailed, barText, width: box.width - 28, net: n };
  }
  container.append(svg);

  function update(view) {
    const steps = (view && view.steps) || {};
    for (const [id, node] of Object.entries(nodes)) {
      const st = steps[id] || { status: "idle", runs: 0 };
      const status = st.status || "idle";
      node.grp.setAttribute("class", node.grp.getAttribute("class").replace(/\bst-[a-z]+/, `st-${status}`));
      node.grp.setAttribute("data-status", status);
      node.grp.setAttribute("data-runs", String(st.runs || 0));
      node.grp.setAttribute("data-restored", st.restored ? "true" : "false"); // D32: carried over by a restart
      node.runs.textContent = st.runs ? `×${num(st.runs)}` : (st.restored ? "↺" : st.skipped ? "skipped" : "");
      node.grp.setAttribute("aria-label", `step ${id}: ${status}, ${st.runs || 0} run${st.runs === 1 ? "" : "s"}${st.restored ? ", its result carried over from the restarted execution" : ""}`);
      if (node.bar) {
        const shown = ((view.runs || {})[id] || {}).shown || [];
        const loop = shown.length ? shown[shown.length - 1].loop : null;
        if (loop && loop.total) {
          const fd = Math.min(1, (loop.done || 0) / loop.total), ff = Math.min(1 - fd, (loop.failed || 0) / loop.total);
          node.barDone.setAttribute("width", (node.width * fd).toFixed(1));
          node.barFailed.setAttribute("x", (14 + node.width * fd).toFixed(1));
          node.barFailed.setAttribute("width", (node.width * ff).toFixed(1));
          node.barText.textContent = `${num((loop.done || 0) + (loop.failed || 0))}/${num(loop.total)}${loop.failed ? ` (${num(loop.failed)} failed)` : ""}`;
        } else {
          node.barDone.setAttribute("width", "0");
          node.barFailed.setAttribute("width", "0");
          node.barText.textContent = loop && loop.total === 0 ? "0/0" : "";
        }
      }
    }
    const onPlace = {};
    for (const t of (view && view.tokens) || []) onPlace[t.place] = t.count;
    for (const [place, tok] of Object.entries(tokens)) {
      const n = onPlace[place] || 0;
      tok.setAttribute("visibility", n ? "visible" : "hidden");
      tok.lastChild.textContent = n > 99 ? "99+" : String(n);
    }
  }

  function select(step) {
    for (const [id, node] of Object.entries(nodes)) node.grp.classList.toggle("selected", id === step);
  }

  return { update, select, svg };
}
