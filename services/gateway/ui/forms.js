// Forms made from a JSON Schema (a wait's `schema`, D30): an object's properties as fields — a boolean a
// checkbox, a string a text field (an enum a list to choose from, a date a date field), a number a number
// field, an array of choices checkboxes — with their titles, descriptions, defaults and required marks.
// What a form cannot say (oneOf, a list of objects, ...) is a JSON box for that field, and the whole
// payload can always be written as JSON instead ("As JSON"). The gateway checks the payload against the
// schema in full; the form only helps to write it.
import { api } from "./api.js";
import { h, add, clear } from "./dom.js";

let serial = 0;
const MAX_DEPTH = 4;  // objects nested deeper than this are a JSON box: a hostile schema draws no endless form
const HINT_TYPES = { checkbox: "boolean", boolean: "boolean", number: "number", integer: "integer", text: "string",
  string: "string", textarea: "string", date: "string", datetime: "string", email: "string" };
const FORMATS = { "date-time": "datetime-local", date: "date", time: "time", email: "email", uri: "url" };

function typeOf(schema) {
  const t = schema && schema.type;
  if (Array.isArray(t)) return t.filter((x) => x !== "null").length === 1 ? t.find((x) => x !== "null") : null;
  return t || (schema && schema.enum ? "enum" : schema && schema.properties ? "object" : null);
}

// A schema from a wait's `form` hints ({field: checkbox | number | text | textarea | ...}), when it has no schema.
export function schemaOfHints(hints) {
  if (!hints || typeof hints !== "object" || Array.isArray(hints)) return null;
  const properties = {};
  for (const [k, v] of Object.entries(hints)) {
    const type = HINT_TYPES[String(v).toLowerCase()];
    if (!type) return null;
    properties[k] = { type, ...(v === "date" ? { format: "date" } : v === "datetime" ? { format: "date-time" } : {}) };
  }
  return { type: "object", properties };
}

// Whether the form can say everything the schema allows: an object whose properties it can draw.
export function formable(schema) {
  return !!schema && typeOf(schema) === "object" && schema.properties && typeof schema.properties === "object";
}

function localDateTime(value) {
  const d = new Date(value);
  if (Number.isNaN(d.getTime())) return "";
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

// One field: {element, get() -> {value} | {missing} | {error}, set(value)}.
function field(name, schema, { required, hint, prefix, path }) {
  const id = `${prefix}-${path.join("-").replace(/[^A-Za-z0-9_-]/g, "_")}`;
  const type = typeOf(schema);
  const title = schema.title || name;
  const label = h("label", { for: id }, title, required ? h("span", { class: "req", title: "required" }, " *") : null);
  const help = schema.description ? h("span", { class: "note field-help" }, schema.description) : null;
  const wrap = (control, cls = "") => h("div", { class: `field ${cls}`, "data-field": path.join(".") }, label, control, help);

  if (type === "boolean") {
    const box = h("input", { type: "checkbox", id, name, checked: schema.default === true });
    return { element: h("div", { class: "field check", "data-field": path.join(".") }, box, label, help),
      get: () => ({ value: box.checked }), set: (v) => { box.checked = v === true; } };
  }
  if (Array.isArray(schema.enum) && schema.enum.every((x) => ["string", "number", "boolean"].includes(typeof x) || x === null)) {
    const select = h("select", { id, name, required: !!required },
      required ? null : h("option", { value: "" }, "—"),
      schema.enum.map((x, i) => h("option", { value: String(i), selected: schema.default === x }, x === null ? "null" : String(x))));
    if (required && schema.default === undefined) select.prepend(h("option", { value: "", selected: true, disabled: true }, "choose…"));
    return { element: wrap(select),
      get: () => (select.value === "" ? { missing: true } : { value: schema.enum[Number(select.value)] }),
      set: (v) => { const i = schema.enum.findIndex((x) => x === v); select.value = i < 0 ? "" : String(i); } };
  }
  if (type === "string") {
    const long = hint === "textarea" || (schema.maxLength || 0) > 200;
    const kind = FORMATS[schema.format] || (hint === "date" ? "date" : hint === "datetime" ? "datetime-local" : "text");
    const input = long ? h("textarea", { id, name, rows: 3, required: !!required })
      : h("input", { id, name, type: kind, required: !!required,
        minlength: schema.minLength ?? null, maxlength: schema.maxLength ?? null });
    if (schema.default !== undefined) input.value = kind === "datetime-local" ? localDateTime(schema.default) : String(schema.default);
    return { element: wrap(input),
      get: () => {
        if (input.value === "") return { missing: true };
        if (!input.checkValidity()) return { error: `${title}: ${input.validationMessage}` };
        return { value: kind === "datetime-local" ? new Date(input.value).toISOString() : input.value };
      },
      set: (v) => { input.value = v === undefined || v === null ? "" : kind === "datetime-local" ? localDateTime(v) : String(v); } };
  }
  if (type === "number" || type === "integer") {
    const input = h("input", { id, name, type: "number", required: !!required, step: type === "integer" ? (schema.multipleOf || 1) : (schema.multipleOf || "any"),
      min: schema.minimum ?? null, max: schema.maximum ?? null, class: "narrow" });
    if (schema.default !== undefined) input.value = String(schema.default);
    return { element: wrap(input),
      get: () => {
        if (input.value === "") return input.validity.badInput ? { error: `${title}: not a number` } : { missing: true };
        if (!input.checkValidity()) return { error: `${title}: ${input.validationMessage}` };
        const n = Number(input.value);
        if (type === "integer" && !Number.isInteger(n)) return { error: `${title}: a whole number` };
        return { value: n };
      },
      set: (v) => { input.value = typeof v === "number" ? String(v) : ""; } };
  }
  const items = schema.items || {};
  if (type === "array" && Array.isArray(items.enum)) {
    const boxes = items.enum.map((x, i) => {
      const bid = `${id}-${i}`;
      return [h("input", { type: "checkbox", id: bid, value: String(i), checked: Array.isArray(schema.default) && schema.default.includes(x) }),
        h("label", { for: bid, class: "inline" }, String(x))];
    });
    const group = h("fieldset", { class: "field choices", "data-field": path.join(".") }, h("legend", {}, title, required ? " *" : ""), boxes.map(([b, l]) => h("span", { class: "choice" }, b, l)), help);
    return { element: group,
      get: () => ({ value: boxes.filter(([b]) => b.checked).map(([b]) => items.enum[Number(b.value)]) }),
      set: (v) => boxes.forEach(([b], i) => { b.checked = Array.isArray(v) && v.includes(items.enum[i]); }) };
  }
  if (type === "object" && formable(schema) && path.length < MAX_DEPTH) {
    const inner = fields(schema, { prefix, path });
    const set = h("fieldset", { class: "field group", "data-field": path.join(".") }, h("legend", {}, title, required ? " *" : ""), help, inner.element);
    return { element: set, get: () => inner.get(), set: (v) => inner.set(v) };
  }
  // what the form cannot say: this field as JSON
  const box = h("textarea", { id, name, rows: 2, class: "mono", required: !!required, placeholder: "JSON" });
  if (schema.default !== undefined) box.value = JSON.stringify(schema.default);
  return { element: wrap(box, "json-field"),
    get: () => {
      if (!box.value.trim()) return { missing: true };
      try { return { value: JSON.parse(box.value) }; } catch (e) { return { error: `${title}: not JSON (${e.message})` }; }
    },
    set: (v) => { box.value = v === undefined ? "" : JSON.stringify(v); } };
}

function fields(schema, { hints = {}, prefix, path = [] }) {
  const required = new Set(Array.isArray(schema.required) ? schema.required : []);
  // the required fields first, in the order `required` lists them (an array keeps its order; the keys of
  // an object stored in Postgres' jsonb come back shortest first), then the others
  const names = Object.keys(schema.properties);
  const order = [...[...required].filter((n) => names.includes(n)), ...names.filter((n) => !required.has(n))];
  const list = order.map((name) => [name, schema.properties[name]]).map(([name, sub]) => [name,
    field(name, sub && typeof sub === "object" ? sub : {}, { required: required.has(name), hint: hints[name], prefix, path: [...path, name] })]);
  return {
    element: h("div", { class: "fields" }, list.map(([, f]) => f.element)),
    get() {
      const out = {}, errors = [];
      for (const [name, f] of list) {
        const got = f.get();
        if (got.error) errors.push(got.error);
        else if (got.missing) { if (required.has(name)) errors.push(`${name} is required`); }
        else out[name] = got.value;
      }
      return errors.length ? { error: errors.join("; ") } : { value: out };
    },
    set(v) { for (const [name, f] of list) f.set(v && typeof v === "object" ? v[name] : undefined); },
  };
}

// A payload editor: the schema's form, or JSON, switchable; {element, read() -> {value} | {error}}.
export function payloadEditor({ schema, hints, label = "payload" }) {
  const prefix = `pf${++serial}`;
  const shape = formable(schema) ? schema : (!schema ? schemaOfHints(hints) : null);
  const json = h("textarea", { rows: 4, class: "mono", id: `${prefix}-json`, "aria-label": `${label} (JSON)` });
  const jsonBox = h("div", { class: "json-box" }, h("label", { for: `${prefix}-json` }, `${label} (JSON)`), json);
  if (!shape) {  // nothing a form can draw: JSON only
    json.value = schema && typeOf(schema) === "object" ? "{}" : "";
    return { element: h("div", { class: "payload" }, jsonBox), read: () => readJson(json), mode: () => "json" };
  }
  const form = fields(shape, { hints: hints || {}, prefix });
  let mode = "form";
  const formBox = h("div", { class: "form-box" }, form.element);
  const tabs = h("div", { class: "mode", role: "group", "aria-label": "write the payload as" });
  const show = (next) => {
    if (next === "json" && mode === "form") {
      const got = form.get();
      json.value = JSON.stringify(got.value ?? partial(form), null, 1);
    } else if (next === "form" && mode === "json" && json.value.trim()) {
      try { form.set(JSON.parse(json.value)); } catch { /* keep the form as it was */ }
    }
    mode = next;
    formBox.hidden = mode !== "form";
    jsonBox.hidden = mode !== "json";
    clear(tabs);
    add(tabs, ["form", "json"].map((m) => h("button", { type: "button", class: "small", "aria-pressed": String(m === mode),
      "data-mode": m, onclick: () => show(m) }, m === "form" ? "Form" : "As JSON")));
  };
  show("form");
  return {
    element: h("div", { class: "payload" }, tabs, formBox, jsonBox),
    read: () => (mode === "json" ? readJson(json) : form.get()),
    mode: () => mode,
  };
}

function partial(form) {
  try { return JSON.parse(JSON.stringify(form.get().value || {})); } catch { return {}; }
}

function readJson(box) {
  if (!box.value.trim()) return { value: null };
  try { return { value: JSON.parse(box.value) }; } catch (e) { return { error: `not JSON: ${e.message}` }; }
}

// A wait's answer: its form (from its schema, else its form hints, else JSON) and "Send signal".
export function signalForm(w, { onSent } = {}) {
  const spec = w.spec || {};
  const editor = payloadEditor({ schema: spec.schema || null, hints: spec.form || null, label: `payload of signal ${w.signal}` });
  const note = h("span", { role: "status", class: "note signal-status" });
  const send = h("button", { type: "submit", class: "primary small" }, "Send signal");
  return h("form", { class: "signal card", "data-signal": w.signal, "data-execution": w.execution_id || "", novalidate: true,
    onsubmit: async (ev) => {
      ev.preventDefault();
      const got = editor.read();
      if (got.error) { note.textContent = got.error; note.dataset.state = "error"; return; }
      send.disabled = true;
      note.textContent = "Sending…";
      try {
        const r = await api(`/api/executions/${w.execution_id}/signals/${encodeURIComponent(w.signal)}`, { method: "POST", body: got.value });
        note.textContent = `sent: ${r.status}`;
        note.dataset.state = "sent";
        if (onSent) onSent(r);
      } catch (e) {
        note.textContent = e.message;
        note.dataset.state = "error";
        send.disabled = false;
      }
    } },
  h("p", {}, h("strong", {}, w.signal), ` — step ${w.step}${w.iteration !== null && w.iteration !== undefined ? `[${w.iteration}]` : ""}, task ${w.task}`,
    spec.assignee ? `, for ${spec.assignee}` : "", Array.isArray(spec.roles) ? `, roles ${spec.roles.join(", ")}` : ""),
  editor.element, h("div", { class: "row" }, send, note));
}
