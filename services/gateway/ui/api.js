// The gateway's API, with the session token as a bearer token (kept in this tab's sessionStorage: no
// cookie is ever sent, so no other site can make the browser call the API as the user).
const KEY = "noetl.token";

export class ApiError extends Error {
  constructor(status, message, detail) {
    super(message);
    this.status = status;
    this.detail = detail;
  }
}

export function token() {
  return sessionStorage.getItem(KEY);
}

export function setToken(value) {
  if (value) sessionStorage.setItem(KEY, value);
  else sessionStorage.removeItem(KEY);
}

let onUnauthorized = () => {};
export function whenUnauthorized(fn) {
  onUnauthorized = fn;
}

export function url(path, query) {
  const u = new URL(path, window.location.origin);
  for (const [k, v] of Object.entries(query || {})) {
    if (v === undefined || v === null || v === "") continue;
    if (Array.isArray(v)) v.forEach((x) => u.searchParams.append(k, x));
    else u.searchParams.set(k, v);
  }
  return u.pathname + u.search;
}

export async function api(path, { method = "GET", query, body, raw = false, signal } = {}) {
  const headers = { Accept: "application/json" };
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(url(path, query), {
    method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body), credentials: "omit",
  });
  if (raw && resp.ok) return resp;
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!resp.ok) {
    const detail = data && data.detail;
    const message = (detail && detail.message) || (typeof data === "string" ? data : resp.statusText);
    if (resp.status === 401 && !path.startsWith("/api/auth/login")) onUnauthorized(message);
    throw new ApiError(resp.status, message, detail);
  }
  return data;
}
