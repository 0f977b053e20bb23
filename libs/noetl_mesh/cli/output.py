"""One output layer for the command line: what a command answers, as a table or YAML for people, or
JSON for programs. ``-o table|yaml|json`` chooses; without it, a terminal gets a table (a list) or YAML
(anything else) and a pipe gets JSON, so scripts that read a command's output keep reading JSON. And
what ``noetl run`` shows on the way (:class:`Progress`) and at the end (:func:`outcome_text`)."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["FORMATS", "emit", "table", "aligned", "chosen", "yamlish", "Progress", "outcome_text"]

FORMATS = ("table", "yaml", "json")
_CELL = 60  # characters a table cell shows at most


def chosen(fmt: str | None, out: TextIO | None = None) -> str:
    """The format to use: the one asked for, else table/YAML on a terminal and JSON on a pipe."""
    if fmt:
        return fmt
    stream = out or sys.stdout
    return "table" if stream.isatty() else "json"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False,
                                                           separators=(",", ":"))
    text = text.replace("\n", " ")
    return text if len(text) <= _CELL else text[:_CELL - 1] + "…"


def table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Rows as aligned columns: ``columns`` when given, else every key that holds a plain value in some
    row, in the order first seen (nested values shown as compact JSON, long ones cut)."""
    if not rows:
        return "(none)"
    if columns is None:
        seen: list[str] = []
        for row in rows:
            for key, value in row.items():
                if key not in seen and not isinstance(value, (dict, list)):
                    seen.append(key)
        columns = seen or list(rows[0])
    return aligned([[c.upper() for c in columns]] + [[_cell(row.get(c)) for c in columns] for row in rows])


def aligned(grid: Sequence[Sequence[str]]) -> str:
    """Rows of cells (the header first) as left-aligned columns two spaces apart, no trailing blanks."""
    widths = [max(len(line[i]) for line in grid) for i in range(len(grid[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in grid)


def emit(value: Any, fmt: str | None = None, columns: Sequence[str] | None = None, out: TextIO | None = None) -> None:
    """Print a command's answer in the chosen format (see :func:`chosen`)."""
    stream = out or sys.stdout
    kind = chosen(fmt, stream)
    if kind == "json":
        text = json.dumps(value, indent=2, default=str)
    elif kind == "table" and isinstance(value, list) and all(isinstance(v, dict) for v in value):
        text = table(value, columns)
    else:  # yaml, or a table asked of something that is not a list of records
        text = yamlish(json.loads(json.dumps(value, default=str)))
    print(text, file=stream)


def outcome_text(final: dict, elapsed: float) -> str:
    """The end of a run for people: the status, each step's status and result, the error; values as
    YAML (flow style on one line when short), long ones cut (``--json`` has everything)."""
    lines = [f"execution {final.get('execution_id')}: {final.get('status')} in {elapsed:.1f}s"]
    steps = final.get("steps") or {}
    width = max((len(name) for name in steps), default=0)
    for name, step in steps.items():
        head = f"  {name:<{width}}  {step.get('status')}" + (f" ({step['runs']} runs)" if step.get("runs", 1) > 1 else "")
        result = step.get("result")
        if result is None:
            lines.append(head)
            continue
        flow = yamlish(result, flow=True)
        if "\n" not in flow and len(head) + len(flow) < 120:
            lines.append(f"{head}  {flow}")
        elif "\n" not in flow and len(flow) <= 400:  # a few lines once the terminal wraps it
            lines += [head, f"      {flow}"]
        else:
            lines.append(head)
            lines += indented(yamlish(result), "      ")
    if final.get("error"):
        lines.append("error:")
        lines += indented(yamlish(final["error"]), "  ")
    return "\n".join(lines)


def indented(text: str, prefix: str, max_lines: int = 30) -> list[str]:
    rows = text.rstrip("\n").split("\n")
    if len(rows) > max_lines:
        rows = rows[:max_lines] + [f"... ({len(rows) - max_lines} more lines: --json shows everything)"]
    return [prefix + row for row in rows]


def yamlish(value, flow: bool = False) -> str:
    """A JSON value as YAML: block style (multi-line strings as ``|`` blocks), or flow style on one line."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, data: str):
        style = "|" if "\n" in data and not flow else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, text)
    if isinstance(value, str) and flow:
        return value if "\n" not in value else yaml.dump(value, Dumper=Dumper, width=10**9).strip()
    out = yaml.dump(value, Dumper=Dumper, default_flow_style=flow, sort_keys=False, allow_unicode=True,
                    width=10**9)  # long lines are the terminal's to wrap
    return out[:-5] if out.endswith("\n...\n") else out.rstrip("\n")


class Progress:
    """``noetl run``'s progress: :func:`event_line`'s lines, and for each running loop how many
    iterations are done of how many, the rate and the time since it started: a bar redrawn in place
    when stdout is a terminal, else a plain line every ``every`` seconds and one when the loop ends."""

    SHOW_FAILED = 3  # failed iterations shown with their error, per loop

    def __init__(self, out=None, tty: bool | None = None, every: float = 2.0):
        self.out = out if out is not None else sys.stdout
        self.tty = bool(self.out.isatty()) if tty is None else tty
        self.every = every
        self.loops: dict[str, dict] = {}
        self.shown = False  # a bar is on screen
        self.drawn = ""  # what it shows

    def __call__(self, event: dict) -> None:
        name, data = event["name"], event.get("data") or {}
        key = str(event.get("step_run_id") or event.get("step"))
        now = time.monotonic()
        at = event.get("timestamp") if isinstance(event.get("timestamp"), (int, float)) else None
        if name == "loop.started":
            items = data.get("items")
            self.loops[key] = {"step": event.get("step") or "", "total": len(items) if isinstance(items, list) else None,
                               "done": set(), "failed": set(), "seen": now, "said": now, "t0": at, "t1": at}
        elif name in ("loop.iteration.done", "loop.iteration.failed") and key in self.loops:
            loop = self.loops[key]
            loop["failed" if name.endswith("failed") else "done"].add(event.get("iteration"))
            loop["t1"] = at if at is not None else loop["t1"]
            if name.endswith("failed") and len(loop["failed"]) <= self.SHOW_FAILED:
                error = data.get("error") if isinstance(data.get("error"), dict) else {}
                more = "; further failures only counted" if len(loop["failed"]) == self.SHOW_FAILED else ""
                self._line(f"  {'iteration.failed':<18} {loop['step']}[{event.get('iteration')}] "
                           f"({error.get('message', '')}){more}")
        ended = self.loops.pop(key, None) if name in ("loop.done", "step.failed") else None
        if ended is not None:
            if isinstance(data.get("total"), int):
                ended["total"] = data["total"]
            ended["t1"] = at if at is not None else ended["t1"]
            self._line(self._loop_text(ended, now, bar=False, ended=True))
        said = event_line(event)
        if said is not None:
            self._clear()
            self.out.write(said + "\n")
            self.out.flush()
        self._tick(now)

    @staticmethod
    def _loop_text(loop: dict, now: float, bar: bool, ended: bool = False) -> str:
        done, failed = len(loop["done"]), len(loop["failed"])
        total = loop["total"]
        # the events' own times when they are known (a poll may bring many at once), else this clock's
        timed = loop["t0"] is not None and loop["t1"] is not None
        elapsed = loop["t1"] - loop["t0"] if timed and ended else now - loop["seen"]
        span = loop["t1"] - loop["t0"] if timed and loop["t1"] > loop["t0"] else elapsed
        per_second = (done + failed) / span if span > 0 and done + failed else 0.0
        rate = f"{per_second:.1f}/s" if per_second else "-/s"
        count = f"{done + failed}/{total if total is not None else '?'}"
        extra = f", {failed} failed" if failed else ""
        left = total - done - failed if total else 0
        eta = f" ETA {left / per_second:.0f}s" if per_second and left > 0 and not ended else ""
        if bar and total:
            filled = int(20 * (done + failed) / total)
            return f"{loop['step']} [{'#' * filled}{'.' * (20 - filled)}] {count}{extra} {rate} {elapsed:.1f}s{eta}"
        return f"  {'loop':<18} {loop['step']} {count} iterations{extra}, {rate}, {elapsed:.1f}s{eta and ','}{eta}"

    def _tick(self, now: float) -> None:
        if not self.loops:
            return
        if self.tty:
            import shutil

            text = "  " + "  ".join(self._loop_text(loop, now, bar=True) for loop in self.loops.values())
            text = text[:shutil.get_terminal_size().columns - 1]
            if text != self.drawn or not self.shown:
                self.out.write("\r\x1b[K" + text)
                self.out.flush()
                self.shown, self.drawn = True, text
            return
        for loop in self.loops.values():
            if now - loop["said"] >= self.every:
                loop["said"] = now
                self._line(self._loop_text(loop, now, bar=False))

    def _line(self, text: str) -> None:
        self._clear()
        print(text, file=self.out, flush=True)

    def _clear(self) -> None:
        if self.shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self.shown = False

    def close(self) -> None:
        self._clear()


def event_line(event: dict) -> str | None:
    """The line ``noetl run`` shows for an event of its execution (None: not shown)."""
    name = event["name"]
    if name in ("step.started", "step.done", "step.failed", "step.skipped", "loop.done", "workflow.finished"):
        where = event.get("step") or ""
        extra = ""
        if name == "step.failed":
            extra = f" ({(event.get('data') or {}).get('error', {}).get('message', '')})"
        if name == "workflow.finished":
            extra = f" {(event.get('data') or {}).get('status')}"
        return f"  {name:<18} {where}{extra}"
    elif name in ("task.suspended", "playbook.child.finished", "wait.ended"):  # children and waits (D29, D30)
        data = event.get("data") or {}
        where = event.get("step") or ""
        if event.get("iteration") is not None:
            where += f"[{event['iteration']}]"
        if name == "task.suspended" and "wait" in data:
            label, extra = "waiting", f"{event.get('task')}: {wait_text(data['wait'])}"
        elif name == "task.suspended":
            child = data.get("child") or {}
            label, extra = "child.started", f"{event.get('task')} -> {child.get('path')} ({child.get('execution_id')})"
        elif name == "wait.ended":
            outcome = data.get("outcome") or {}
            how = "ok" if outcome.get("status") == "ok" else (outcome.get("error") or {}).get("kind") or "error"
            label, extra = "wait.ended", f"{event.get('task')}: {how}"
        else:
            label, extra = "child.finished", f"{data.get('child_execution_id')} {data.get('status')}"
        return f"  {label:<18} {where} {extra}"
    return None


def wait_text(wait: dict) -> str:
    """What a wait task waits for, in a few words: a signal (and its timeout) or a time."""
    if wait.get("signal"):
        timeout = f" (timeout {wait['timeout']})" if wait.get("timeout") is not None else ""
        return f"signal {wait['signal']!r}{timeout}"
    due, since = wait.get("due"), wait.get("suspended_at")
    if isinstance(due, (int, float)) and isinstance(since, (int, float)):
        return f"{max(0.0, due - since):g} s"
    return "a time"
