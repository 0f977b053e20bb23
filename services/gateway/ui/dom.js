// Small DOM helpers: elements from h(), formatting, values shown bounded.
const SVG = "http://www.w3.org/2000/svg";
const PROPS = new Set(["value", "checked", "selected", "disabled", "hidden", "open", "required"]); // the rest: attributes

function build(el, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "text") el.textContent = value;
    else if (key === "class") el.setAttribute("class", value);
    else if (key === "style" && typeof value === "object") Object.assign(el.style, value);
    else if (PROPS.has(key) && el.namespaceURI !== SVG) el[key] = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG, tag), attrs, children);
}

// Append children to an element: arrays flattened, null/undefined/false skipped.
export function add(el, ...children) {
  return build(el, {}, children);
}

export function clear(el) {
  while (el.firstChild) el.firstChild.remove();
  return el;
}

export function fmtTime(value) {
  if (value === null || value === undefined || value === "") return "—";
  const d = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  if (Number.isNaN(d.getTime())) return String(value);
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

export function fmtDuration(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "—";
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const sec = ms / 1000;
  if (sec < 60) return `${sec.toFixed(sec < 10 ? 2 : 1)} s`;
  const m = Math.floor(sec / 60), r = Math.round(sec % 60);
  if (m < 60) return `${m} min ${r} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function duration(start, end) {
  if (!start) return null;
  const a = new Date(start).getTime(), b = end ? new Date(end).getTime() : Date.now();
  return b - a;
}

export function short(id) {
  return id ? String(id).slice(0, 8) : "—";
}

export function num(n) {
  return n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US");
}

export function bytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

const SHOW = 20000; // characters of a value shown at most; the rest is a download

export function isPreview(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v) && "$preview" in v;
}

// A value as the API gives it: JSON, or a preview {$preview, $size, $items} of a big one.
export function value(v, { download } = {}) {
  if (isPreview(v)) {
    const note = `${bytes(v["$size"])}${v["$items"] !== undefined ? `, ${num(v["$items"])} items` : ""}: first bytes shown`;
    return h("div", { class: "value" },
      h("pre", { class: "json", tabindex: "0" }, v["$preview"] + " …"),
      h("div", { class: "note" }, note, download ? [" · ", download] : []));
  }
  const whole = v === undefined ? "" : JSON.stringify(v);
  if (whole === undefined) return h("div", { class: "value" }, h("pre", { class: "json", tabindex: "0" }, String(v)));
  const parts = [];
  const cut = v === undefined ? false : pretty(v, "", parts, { left: SHOW });
  return h("div", { class: "value" },
    h("pre", { class: typeof v === "string" && v.includes("\n") ? "json text" : "json", tabindex: "0" }, parts, cut ? " …" : ""),
    cut ? h("div", { class: "note" }, `${bytes(whole.length)}: first ${num(SHOW)} characters shown`, download ? [" · ", download] : []) : null);
}

// JSON laid out like JSON.stringify(v, null, 2), except that a string with line breaks (a traceback, a
// task's output) is shown as its lines, indented under its key, not as one line of "\n" escapes.
// Appends text nodes and spans to `out`, at most `budget.left` characters; true when it was cut.
function pretty(v, indent, out, budget) {
  const put = (text, cls) => {
    if (budget.left <= 0) return false;
    const piece = text.length > budget.left ? text.slice(0, budget.left) : text;
    budget.left -= piece.length;
    out.push(cls ? h("span", { class: cls }, piece) : piece);
    return piece.length === text.length;
  };
  if (typeof v === "string" && v.includes("\n")) {
    const lines = v.replace(/\n$/, "").split("\n");
    return !put(indent ? lines.map((l) => `${indent}  ${l}`).join("\n") : lines.join("\n"), "multiline");
  }
  if (v === null || typeof v !== "object") return !put(JSON.stringify(v) ?? "null");
  const entries = Array.isArray(v) ? v.map((x) => [null, x]) : Object.entries(v);
  if (!entries.length) return !put(Array.isArray(v) ? "[]" : "{}");
  if (!put(Array.isArray(v) ? "[\n" : "{\n")) return true;
  const inner = indent + "  ";
  for (let i = 0; i < entries.length; i++) {
    const [k, x] = entries[i];
    const multiline = typeof x === "string" && x.includes("\n");
    if (!put(k === null ? inner : `${inner}${JSON.stringify(k)}:${multiline ? "\n" : " "}`)) return true;
    if (pretty(x, inner, out, budget)) return true;
    if (!put(i < entries.length - 1 ? ",\n" : "\n")) return true;
  }
  return !put(`${indent}${Array.isArray(v) ? "]" : "}"}`);
}

export function statusBadge(status) {
  const st = String(status || "unknown").toLowerCase();
  return h("span", { class: `badge st-${st}`, "data-status": st }, String(status || "unknown"));
}

export function saveFile(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const a = h("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// One call at a time, the last request wins: for reads triggered by live events.
export function singleFlight(fn, minGap = 0) {
  let running = null, again = false, last = 0, timer = null;
  const run = async () => {
    if (running) { again = true; return running; }
    const wait = last + minGap - Date.now();
    if (wait > 0) {
      if (!timer) timer = setTimeout(() => { timer = null; run(); }, wait);
      return;
    }
    running = (async () => {
      try { await fn(); } catch (e) { console.error(e); }
      last = Date.now();
      running = null;
      if (again) { again = false; run(); }
    })();
    return running;
  };
  run.cancel = () => { if (timer) clearTimeout(timer); timer = null; again = false; };
  return run;
}
