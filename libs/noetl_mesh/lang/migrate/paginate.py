"""Pagination by retry for ``noetl migrate`` (docs/migrate.md, M6): the legacy ``retry.on_success``
(call the tool again while a condition on the response holds, with new parameters, collecting a part
of each response) becomes the canonical pipeline that pages with ``jump`` (D9), its pages gathered in
``iter`` (D6), as ``examples/pagination.yaml`` does.

The legacy runtime ran, for a task with ``retry: {on_success: {while, max_attempts, next_call,
collect}, on_error}``: call; take the part of the response body at ``collect.path`` (the whole body
without one) and add it to the pages (``append``: a list's items, else the value; ``replace``: the
value); stop after ``max_attempts`` calls (default 100) or when ``while`` (reading the body as
``response`` or ``page``, the call's number as ``iteration``) is false; else call again with
``next_call.params`` rendered over the params. ``on_error`` retried each call (``when``, reading
``error.status``; ``max_attempts`` 3, ``initial_delay`` 1 s, ``backoff_multiplier`` 2, jitter).
The step's result was ``{status, data: <the pages>, meta: {iterations, ...}}``.

Only an http or postgres task alone in its step is translated (the response is the http body there,
and the postgres statements' results ``{command_N: {rows, ...}}``); the task's own templates read the
pages so far by ``collect.into`` and the call's number by ``_retry.index``, which a cursor loop over a
table uses (``WHERE id > {{ pages[-1].id if pages else 0 }}``). Anything the translation is unsure of
is left to a person with the reason. :func:`translate` is pure: the round-trip YAML nodes given are
rewritten in place, what was changed or could not be is returned; :func:`paging_retry`, the hook the
migrator calls (``_Migrator.RETRY_LOOPS``), reports it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateSyntaxError

from ..diagnostics import Path
from .structure import _cmap, _cseq, _flow
from .templates import NeedsPerson, Ref, build, parse_expression, rewrite, unparse

IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEFAULT_CALLS = 100  # the legacy on_success.max_attempts when none is given
ON_SUCCESS_KEYS = {"while", "max_attempts", "next_call", "collect"}
ON_ERROR_KEYS = {"when", "retry_when", "max_attempts", "initial_delay", "backoff_multiplier", "max_delay", "jitter"}
CALLS = "calls"  # the iter key counting the calls made
# on_success's 'response' in the task's policy: an http response's body is canonically outcome.result,
# written so (the template pass leaves those reads alone, M7 would read them as the legacy result's);
# the postgres statements' results are the legacy policy's 'response', which M7 reads by the statements
RESPONSE = {"http": ("outcome", [("attr", "result")]), "postgres": ("response", [])}
NOT_PAGED = {"duckdb": "the legacy duckdb result's keys (command_N_*) have no canonical reading"}


@dataclass
class Paging:
    """A task whose ``retry`` pages: the retry block, taken off the task, and where it was written."""

    task: Any
    path: Path  # the task's
    retry: Any
    at: Path  # the retry block's


@dataclass
class Result:
    changes: list[tuple[Path, str]] = field(default_factory=list)
    problem: tuple[Path, str] | None = None
    canonical: bool = False  # the task's policy reads its outcome canonically (the template pass leaves it)


class _Unsure(Exception):
    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path, self.message = path, message


def paging_retry(migrator: Any, task: Any, path: Path, retry: Any) -> bool:
    """The registered translation of a paging ``retry`` (``_Migrator.RETRY_LOOPS``): a block with
    ``on_success`` on the only task of its step (its own, or the step's given to it) is translated, or
    left on the task with the reason it needs a person; True either way. Anything else is not this
    rule's (False)."""
    step = migrator._step
    tool = step.get("tool") if isinstance(step, dict) else None
    tasks = [tool] if isinstance(tool, dict) else [t for t in tool if isinstance(t, dict)] if isinstance(tool, list) else []
    alone = len(tasks) == 1 and tasks[0] is task
    if not (isinstance(retry, dict) and isinstance(retry.get("on_success"), dict)) or not alone:
        return False
    done = translate(step, Paging(task, path, retry, path + ("retry",)), migrator.workload_keys)
    for at, message in done.changes:
        migrator.change("M6", at, message)
    if done.problem:
        migrator.problem("M6", *done.problem)
    if done.canonical:
        migrator._canonical_outcome.add(id(task))
    return True


# ------------------------------------------------------------------------------------- templates


def _expr(value: Any, where: Path) -> str:
    """The expression of a template that is exactly ``{{ expr }}`` (a condition)."""
    s = value.strip() if isinstance(value, str) else ""
    if not (s.startswith("{{") and s.endswith("}}") and s.count("{{") == 1):
        raise _Unsure(where, "a condition that is not one '{{ expression }}': rewrite it as one")
    try:
        parse_expression(s[2:-2].strip())
    except TemplateSyntaxError as e:
        raise _Unsure(where, f"the expression does not parse ({e.message})") from None
    return s[2:-2].strip()


def _call_number(ref: Ref) -> Any:
    """``_retry.index`` (and ``.count``): the number of this call, from 1."""
    if ref.path in ([("attr", "index")], [("attr", "count")]):
        return nodes.Add(build(f"iter.{CALLS}", []), nodes.Const(1))
    raise NeedsPerson(f"'_retry' read other than as _retry.index: it has no translation (the calls made are "
                      f"iter.{CALLS})")


def _response_reader(kind: str, into: str):
    """on_success's own names (``while``, ``next_call``), as the task's policy reads them in the legacy
    dialect: the response (``response``, ``page``) by RESPONSE; the call's number (``iteration``,
    ``_retry.index``) is ``iter.calls + 1``. The pages so far are not read there (the legacy value
    differs by strategy and call)."""
    def resolve(ref: Ref) -> Any:
        if ref.root in ("response", "page"):
            root, prefix = RESPONSE[kind]
            return Ref(root, prefix + ref.path)
        if ref.root == "iteration" and not ref.path:
            return nodes.Add(build(f"iter.{CALLS}", []), nodes.Const(1))
        if ref.root == "_retry":
            return _call_number(ref)
        if ref.root in ("iteration", into):
            raise NeedsPerson(f"'{ref.root}' read here has no translation (the pages are iter.{into}, the calls "
                              f"made iter.{CALLS})")
        return None

    return resolve


def _task_reader(into: str, workload: set[str]):
    """The task's own templates: the legacy runtime rendered them with the pages so far under
    ``collect.into`` (from the second call; before it the name was unset, false in a condition) and
    the call's number as ``_retry.index``."""
    def resolve(ref: Ref) -> Any:
        if ref.root == "_retry":
            return _call_number(ref)
        if ref.root == into:
            if into in workload:
                raise NeedsPerson(f"'{into}' is both a workload key and where the pages are collected: the first "
                                  "call read the workload's; rename one")
            return Ref(f"iter.{into}", ref.path)
        return None

    return resolve


def _rewritten(value: Any, resolve: Any, where: Path, changed: list | None = None) -> Any:
    if not isinstance(value, str):
        return value
    out = rewrite(value, resolve)
    if out.problems:
        raise _Unsure(where, "; ".join(out.problems))
    if changed is not None:
        changed.extend((where, old, new) for old, new in out.changed)
    return out.text


def _error_reader(ref: Ref) -> Any:
    """on_error's ``when`` read ``error`` ({status, message} of the failed call), ``status_code``."""
    if ref.root == "status_code" and not ref.path:
        return build("outcome.http.status", [])
    if ref.root == "error":
        if ref.path == [("attr", "status")]:
            return build("outcome.http.status", [])
        if ref.path == [("attr", "message")]:
            return build("outcome.error.message", [])
        raise NeedsPerson(f"'error{'.' if ref.path else ''}{'.'.join(str(p[1]) for p in ref.path)}' in "
                          "on_error: only error.status and error.message have a translation")
    if ref.root in ("result", "attempt", "success", "data"):
        raise NeedsPerson(f"'{ref.root}' in on_error has no translation: write the condition on outcome")
    return None


# ------------------------------------------------------------------------------------------- rules


def _on_error(block: Any, kind: str, at: Path) -> Any:
    """The legacy error retry of each call (``retry.on_error``, next to ``on_success`` or alone) -> the
    first rule of the task's policy."""
    if not isinstance(block, dict):
        raise _Unsure(at, "'on_error' must be a mapping")
    for key in block:
        if key not in ON_ERROR_KEYS:
            raise _Unsure(at + (key,), f"'on_error.{key}' has no translation" + (
                " (the legacy runtime read initial_delay, not delay)" if key == "delay" else ""))
    when = block.get("retry_when") or block.get("when")  # the legacy runtime's order
    cond = "outcome.status == 'error'"
    if when is not None:
        w = at + ("retry_when" if block.get("retry_when") else "when",)
        if kind != "http":
            raise _Unsure(w, f"a condition on the error of a {kind} task: write it on outcome.error by hand")
        # the legacy runtime asked it only of a call that failed
        cond = unparse(nodes.And(parse_expression(cond), parse_expression(_expr(_rewritten(when, _error_reader, w), w))))
    multiplier = block.get("backoff_multiplier", 2.0)
    if multiplier not in (1, 2):
        raise _Unsure(at + ("backoff_multiplier",), f"backoff_multiplier {multiplier!r}: the engine's backoffs "
                      "multiply the delay by 1 (none) or 2 (exponential)")
    then = [("do", "retry"), ("attempts", block.get("max_attempts", 3)),
            ("backoff", "none" if multiplier == 1 else "exponential"),
            ("delay", block.get("initial_delay", 1.0))]
    if "max_delay" in block:
        then.append(("max_delay", block["max_delay"]))
    if block.get("jitter", True):
        then.append(("jitter", True))
    return _cmap([("when", "{{ %s }}" % cond), ("then", _flow(_cmap(then)))])


def _collected(collect: Any, kind: str, at: Path) -> tuple[str, str, Any]:
    """(into, the expression of the pages after this call, their value before the first)."""
    collect = {} if collect is None else collect
    if not isinstance(collect, dict):
        raise _Unsure(at, "'collect' must be a mapping")
    for key in collect:
        if key not in ("strategy", "path", "into"):
            raise _Unsure(at + (key,), f"'collect.{key}' has no translation")
    into = collect.get("into", "pages")
    if not isinstance(into, str) or not IDENT.match(into) or into == CALLS:
        raise _Unsure(at + ("into",), f"'collect.into' {into!r}: a name (not '{CALLS}') is needed")
    path = collect.get("path")
    parts = [] if path is None else str(path).split(".")
    if not all(IDENT.match(p) for p in parts):
        raise _Unsure(at + ("path",), f"'collect.path' {path!r}: only names joined by dots are translated")
    root, prefix = RESPONSE[kind]
    part = ".".join([root] + [a for _, a in prefix] + parts)
    strategy = collect.get("strategy", "append")
    if strategy == "append":
        return (into, f"iter.{into} + ({part} if {part} is sequence and {part} is not string and {part} is "
                      f"not mapping else [{part}])", _cseq())
    if strategy == "replace":
        return into, part, None
    raise _Unsure(at + ("strategy",), f"'collect.strategy: {strategy}' has no translation (append and replace do)")


def translate(step: Any, paging: Paging, workload: set[str] = frozenset()) -> Result:
    """Rewrite ``step`` (whose only task pages by ``paging``) into the paging pipeline. ``workload``:
    the workload's keys (a bare name of the legacy templates may be one)."""
    out = Result()
    try:
        _translate(step, paging, set(workload), out)
    except _Unsure as e:
        paging.task["retry"] = paging.retry  # left as it was written
        out.problem = (e.path, f"{e.message} ('retry.on_success', pagination by retry, is translated into a "
                               "pipeline that pages with jump: docs/migrate.md, M6)")
    return out


def _checked(step: Any, paging: Paging) -> tuple[str, Any, int]:
    """(the task's kind, on_success, the most calls) once the shape is one that is translated."""
    t, at, retry = paging.task, paging.at, paging.retry
    for key in retry:
        if key not in ("on_success", "on_error"):
            raise _Unsure(at + (key,), f"'retry.{key}' next to on_success has no translation")
    ok, sat = retry["on_success"], at + ("on_success",)
    for key in ok:
        if key not in ON_SUCCESS_KEYS:
            raise _Unsure(sat + (key,), f"'on_success.{key}' has no translation")
    kind = t.get("kind")
    if kind not in RESPONSE:
        raise _Unsure(sat, f"paging a {kind} task: " + NOT_PAGED.get(kind, "only an http or postgres task's "
                                                                       "response has a known shape"))
    if "case" in step:
        raise _Unsure(sat, "a step with 'case' and a paging retry: write the pipeline by hand")
    spec = t.get("spec")
    if (isinstance(spec, dict) and "policy" in spec) or any(k in t for k in ("set", "set_ctx", "set_iter")):
        raise _Unsure(sat, "the task has a policy of its own (or a 'set'): merge it with the paging by hand")
    if "while" not in ok:
        raise _Unsure(sat, "'on_success' without 'while'")
    calls = ok.get("max_attempts", DEFAULT_CALLS)
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
        raise _Unsure(sat + ("max_attempts",), f"max_attempts {calls!r}: a number of calls is needed")
    nxt = ok.get("next_call") or {}
    if kind == "http" and (not isinstance(nxt, dict) or any(k != "params" for k in nxt)
                           or not isinstance(nxt.get("params", {}), dict)):
        raise _Unsure(sat + ("next_call",), "only 'next_call.params' (a mapping) is translated; headers, url "
                                            "and body of the next call need a person")
    if kind != "http" and nxt:
        raise _Unsure(sat + ("next_call",), f"'next_call' of a {kind} task: let the next query read the pages "
                                            "so far (collect.into) or the call's number (_retry.index)")
    if kind == "http" and "params" in t and not isinstance(t["params"], dict):
        raise _Unsure(paging.path + ("params",), "params that are not a mapping, with a paging retry")
    return kind, ok, calls


def _translate(step: Any, paging: Paging, workload: set[str], out: Result) -> None:
    t, at, retry = paging.task, paging.at, paging.retry
    kind, ok, calls = _checked(step, paging)
    sat = at + ("on_success",)
    into, pages, first = _collected(ok.get("collect"), kind, sat + ("collect",))
    resolve = _response_reader(kind, into)
    cond = _expr(_rewritten(ok["while"], resolve, sat + ("while",)), sat + ("while",))
    loop = step.get("loop") if isinstance(step.get("loop"), dict) else {}
    iterators = {str(loop[k]) for k in ("iterator", "element", "item") if k in loop}
    if iterators & {into, CALLS}:
        raise _Unsure(sat + ("collect",), f"the loop's iterator is named '{(iterators & {into, CALLS}).pop()}', "
                                          f"where the pages (iter.{into}) or the calls (iter.{CALLS}) are kept")
    taken = {into, CALLS, "index"} | iterators
    moving = []
    for key, value in ((ok.get("next_call") or {}).get("params") or {}).items():
        key = str(key)
        if not IDENT.match(key) or key in taken:
            raise _Unsure(sat + ("next_call", "params", key), f"param {key!r}: kept in iter.{key}, which is "
                                                               "not a free name there")
        moving.append((key, _rewritten(value, resolve, sat + ("next_call", "params", key))))
    edits: list = []  # the task's own templates, reading the pages so far and the call's number
    changed: list = []
    _edits(t, _task_reader(into, workload), paging.path, edits, changed, skip=("name", "kind", "desc", "spec"))
    for where, _, _ in changed:
        if where[:len(paging.path) + 2] in [paging.path + ("params", k) for k, _ in moving]:
            raise _Unsure(where, f"the first value of param '{where[len(paging.path) + 1]}' reads the call's number "
                                 "or the pages, and the next call's value replaces it: write the pipeline by hand")
    on_error = _on_error(retry["on_error"], kind, at + ("on_error",)) if "on_error" in retry else None
    # ---- sure of everything: rewrite
    for container, key, new in edits:
        container[key] = new
    base = str(t.get("name") or f"{step.get('step')}_page")
    if "name" not in t:
        t.insert(0, "name", base)
    params = t.get("params")
    if moving and params is None:
        params = t["params"] = _cmap()
    start = [(k, params.get(k)) for k, _ in moving]
    for key, _ in moving:
        params[key] = "{{ iter.%s }}" % key
    calls_now = f"iter.{CALLS} + 1"
    rules = _cseq([on_error] if on_error is not None else [])
    rules.append(_cmap([("when", "{{ outcome.status == 'error' }}"), ("then", _flow(_cmap([("do", "fail")])))]))
    rules.append(_cmap([
        ("when", "{{ %s }}" % unparse(nodes.And(parse_expression(f"{calls_now} < {calls}"), parse_expression(cond)))),
        ("then", _cmap([("do", "jump"), ("to", base), ("set_iter", _cmap(
            [(into, "{{ %s }}" % pages), (CALLS, "{{ %s }}" % calls_now)] + moving))]))]))
    rules.append(_cmap([("else", _cmap([("then", _cmap([("do", "continue"), ("set_iter", _cmap(
        [(into, "{{ %s }}" % pages), (CALLS, "{{ %s }}" % calls_now)]))]))]))]))
    spec = t.get("spec")
    if not isinstance(spec, dict):
        spec = t["spec"] = _cmap()
    spec["policy"] = _cmap([("rules", rules)])
    init = _cmap([("name", f"{base}_init"), ("kind", "noop"), ("spec", _cmap([("policy", _cmap([
        ("rules", _cseq([_cmap([("else", _cmap([("then", _cmap([
            ("do", "continue"), ("set_iter", _flow(_cmap([(into, first), (CALLS, 0)] + start)))]))]))])]))]))]))])
    result = _cmap([("name", f"{base}_collect"), ("kind", "noop"), ("result", _cmap([
        ("status", "success"), ("data", "{{ iter.%s }}" % into), ("meta", _flow(_cmap([("iterations", "{{ iter.%s }}" % CALLS)])))]))])
    step["tool"] = _cseq([init, t, result])
    for where, old, new in changed:
        out.changes.append((where, f"{{{{ {old} }}}} -> {{{{ {new} }}}} (the pages so far, the call's number)"))
    out.changes.append((at, f"'retry.on_success' (pagination by retry) -> a pipeline: '{base}_init' starts the pages, "
                            f"'{base}' jumps back to itself while the condition holds (at most {calls} calls), "
                            f"'{base}_collect' gives {{status, data: iter.{into}, meta: {{iterations}}}} (D9); "
                            + ("on_success's 'response' (the body) is outcome.result" if kind == "http" else
                               "on_success's 'response' is the legacy policy's, which M7 translates below")))
    out.canonical = kind == "http"


def _edits(value: Any, resolve: Any, where: Path, out: list, changed: list, skip: tuple = ()) -> None:
    """(container, key, new text) for each template in ``value`` the resolver rewrites; ``changed``
    gets (path, old expression, new expression)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if k in skip:
            continue
        if isinstance(v, str):
            new = _rewritten(v, resolve, where + (k,), changed)
            if new != v:
                out.append((value, k, type(v)(new) if type(v) is not str else new))  # its quoting kept
        else:
            _edits(v, resolve, where + (k,), out, changed)
