// Live streams: server-sent events read with fetch (so the bearer token goes in a header, never in the
// URL), reopened when the gateway ends one (its lifetime) or the connection drops. Nothing here asks
// the server on a timer: a stream is one long request and every update arrives on it.
import { token, url } from "./api.js";

export function openStream(path, handlers, { query } = {}) {
  let closed = false, controller = null, backoff = 1000;
  const status = handlers.status || (() => {});

  async function run() {
    while (!closed) {
      controller = new AbortController();
      let reason = "dropped";
      try {
        const resp = await fetch(url(path, query), {
          headers: { Authorization: `Bearer ${token()}`, Accept: "text/event-stream" },
          signal: controller.signal, credentials: "omit", cache: "no-store",
        });
        if (resp.status === 401) { status("unauthorized"); (handlers.unauthorized || (() => {}))(); return; }
        if (!resp.ok) throw new Error(`${resp.status}`);
        status("live");
        backoff = 1000;
        reason = await read(resp.body, handlers);
      } catch (e) {
        if (closed) return;
        status("reconnecting");
      }
      if (closed) return;
      if (reason === "unauthorized") { status("unauthorized"); return; }
      // the session or token was revoked (a logout elsewhere, a disabled user): back to the login
      if (reason === "revoked") { status("unauthorized"); (handlers.unauthorized || (() => {}))(); return; }
      // after the gateway's own end of a stream, at once; after a failure, a growing delay
      const wait = reason === "lifetime" ? 100 : backoff;
      if (reason !== "lifetime") backoff = Math.min(backoff * 2, 30000);
      await new Promise((r) => setTimeout(r, wait));
      if (!closed && handlers.resync) handlers.resync(); // what happened meanwhile is read again
    }
  }

  run();
  return () => { closed = true; if (controller) controller.abort(); };
}

async function read(body, handlers) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", reason = "dropped";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return reason;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (!data) continue;
      let parsed;
      try { parsed = JSON.parse(data); } catch { continue; }
      if (event === "bye") reason = parsed.reason || "lifetime";
      const fn = handlers[event];
      if (fn) fn(parsed);
    }
  }
}
