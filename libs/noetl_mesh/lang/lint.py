"""Static analysis of a valid playbook: findings that say whether it will *behave* (``noetl lint``).

Validation says a playbook is well formed; these rules read the valid document, its static graph
(:class:`.graph.WorkflowGraph`, D16) and its templates (Jinja2's own parser) and report what will
go wrong when it runs: joins that never join, cycles that never end, ``ctx`` writes that race, names
no template can read, arcs and steps that never fire, loops wider than their pool, waits without
end. Every rule, with an example and its fix, is in ``docs/lint.md``; each finding has a code
(``L101``), a severity (``error``: it fails or never ends whenever that part runs; ``warning``: it
probably does not do what it says; ``info``: worth knowing), the place in the document, and one
line saying why.

Pure functions, no I/O: :func:`lint` takes the (valid) raw document and the validator's graph;
:func:`lint_text` validates a text first and places every finding at its line and column;
:func:`sarif_log` and :meth:`Finding.as_dict` shape the output.
"""
from __future__ import annotations

import collections
import functools
import math
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import PurePath
from types import SimpleNamespace
from typing import Any, Iterator, Literal

import jinja2
from jinja2 import nodes

from ..core.decide import DEFAULT_POOL, chunk_size
from . import model as m
from .diagnostics import Diagnostic, Path, did_you_mean, locate
from .documents import Parsed, parse, position
from .graph import Place, WorkflowGraph
from .normalize import deep_merge, normalize_tasks, normalize_workbook
from .templates import is_template, referenced_names, truthy
from .validate import entry_step, validate

Severity = Literal["error", "warning", "info"]

# code -> (default severity, what it detects); docs/lint.md has a section per code.
RULES: dict[str, tuple[Severity, str]] = {
    "L000": ("error", "what noetl validate reports: the playbook's validation errors and warnings"),
    "L101": ("warning", "a join that never joins: no inclusive router can send tokens to two of its inputs"),
    "L102": ("warning", "a join can fire without an optional branch and then reads an arg only that branch passes"),
    "L201": ("error", "an endless cycle: on success every step of it sends the token on around it"),
    "L301": ("warning", "a ctx key written by steps that can run at the same time: the last writer wins"),
    "L401": ("error", "a template reads a name that is not there (misspelt, or a namespace of another context)"),
    "L402": ("error", "a template reads a ctx key that no set_ctx writes, or that only later steps write"),
    "L403": ("error", "a template reads an args key that an arc into the step does not pass"),
    "L404": ("error", "a template reads an iter key that is not the iterator, index, parent or a set_iter key"),
    "L405": ("info", "a template reads a workload key that the playbook's workload does not have"),
    "L406": ("error", "a template reads a keychain entry that the playbook does not declare"),
    "L407": ("warning", "a template reads the result of a step that cannot have run before"),
    "L408": ("warning", "a template reads the outcome of a task that runs later in the same pipeline"),
    "L409": ("warning", "a 'when' that is not a template: a constant condition"),
    "L410": ("error", "a template reads a field that an event, outcome or step result does not have"),
    "L411": ("warning", "a template reads a field of the error where there may be no error (it is null on success)"),
    "L501": ("warning", "a step after which the execution cannot complete: every way on leads into an endless cycle"),
    "L502": ("warning", "an arc that can never fire: an earlier arc of its exclusive router has no 'when'"),
    "L503": ("warning", "a step that can be reached only through arcs that never fire"),
    "L601": ("info", "a parallel loop runs more commands at once than one worker of its pool takes"),
    "L602": ("warning", "a wait on a signal without a timeout: the execution waits forever if it never comes"),
}
HELP_URI = "docs/lint.md#{anchor}"

# The worker's default concurrency (commands one worker runs at once: `noetl service worker
# --concurrency N`, services/worker/service.py); a test keeps the two equal.
WORKER_CONCURRENCY = 8

# D6: what each kind of template can read besides the step names (docs/dsl.md, "Rendering context").
_TASK_NAMES = frozenset({"workload", "ctx", "iter", "args", "execution_id", "keychain", "_prev", "_task", "_attempt"})
_SCOPE: dict[str, frozenset[str]] = {
    "task": _TASK_NAMES,
    "rule": _TASK_NAMES | {"outcome", "output"},
    "arc": frozenset({"workload", "ctx", "args", "execution_id", "event"}),
    "admit": frozenset({"workload", "ctx", "args", "execution_id"}),
    "loop": frozenset({"workload", "ctx", "args", "execution_id"}),
    "workbook": _TASK_NAMES,
}
_WHERE = {"task": "task fields", "rule": "task policy rules", "arc": "arc when/args", "admit": "admit rules",
          "loop": "loop.in", "workbook": "workbook tasks"}
# The fields of the values templates read by name (D8, D13; core/pipeline.py and core/decide.py build them).
_OUTCOME_FIELDS = frozenset({"status", "result", "error", "meta", "data", "http", "pg", "py"})
_STEP_FIELDS = frozenset({"status", "result", "error", "data"})
_EVENT_FIELDS = frozenset({"name", "step", "result", "error", "total", "done", "failed"})


@dataclass(frozen=True)
class Finding:
    code: str
    severity: Severity
    location: str  # e.g. workflow[3].step=report.next.arcs[0]
    message: str
    path: Path = ()
    line: int | None = None  # 1-based, when the playbook was read from text
    column: int | None = None

    def as_dict(self, file: str | None = None) -> dict[str, Any]:
        out = {"code": self.code, "severity": self.severity, "location": self.location,
               "line": self.line, "column": self.column, "message": self.message}
        return {"file": file, **out} if file is not None else out

    def text(self, file: str) -> str:
        """``file:line:col: severity code: location: message`` (``file:`` alone without a line)."""
        where = f"{file}:{self.line}:{self.column}" if self.line is not None else file
        return f"{where}: {self.severity} {self.code}: {self.location or '<document>'}: {self.message}"


@dataclass
class Report:
    """One playbook's findings; ``valid`` is False when it did not validate (its L000 errors say why)."""

    findings: list[Finding]
    valid: bool = True

    @property
    def failed(self) -> bool:
        """D26-like: an invalid playbook or an error finding."""
        return not self.valid or any(f.severity == "error" for f in self.findings)


def from_diagnostics(diagnostics: list[Diagnostic]) -> list[Finding]:
    """The validator's diagnostics as L000 findings (lint never re-derives what validation reports)."""
    return [Finding("L000", d.severity, d.location, d.message, d.path, d.line, d.column) for d in diagnostics]


def lint_text(text: str | bytes) -> Report:
    """Validate a playbook text and, when valid, lint it; every finding carries its line and column."""
    parsed = parse(text, positions=True)
    if not parsed.ok:
        return Report(from_diagnostics(parsed.diagnostics), valid=False)
    result = validate(parsed.value)
    checked = from_diagnostics(result.diagnostics)
    found = lint(parsed.value, result.graph) if result.ok and result.graph is not None else []
    placed = [_placed(f, parsed) for f in checked + found]
    placed.sort(key=lambda f: (f.code != "L000", f.line or 0, f.column or 0, f.code))
    return Report(placed, valid=result.ok)


def _placed(f: Finding, parsed: Parsed) -> Finding:
    where = position(parsed, f.path) if f.line is None else None
    return replace(f, line=where[0], column=where[1]) if where else f


def lint(doc: Mapping[str, Any], graph: WorkflowGraph) -> list[Finding]:
    """Every finding of a *valid* playbook: ``doc`` as written (its paths locate findings), ``graph``
    the validator's (``ValidationResult.graph``). Sorted by code, then in document order; a finding
    made twice (one template reading one key twice) is kept once."""
    v = _View.of(doc, graph)
    found: dict[Finding, None] = {}
    for rule in (_joins, _cycles, _ctx_races, _templates, _error_reads, _dead_arcs, _wide_loops, _endless_waits):
        found.update(dict.fromkeys(rule(v)))
    return sorted(found, key=lambda f: f.code)


# ----------------------------------------------------------------------------- the playbook, as read
@dataclass
class _Task:
    index: int
    name: str
    raw: Mapping[str, Any]
    path: Path


@dataclass
class _Step:
    index: int
    name: str
    raw: Mapping[str, Any]
    tasks: list[_Task]
    arcs: list[Mapping[str, Any]]
    inclusive: bool

    @property
    def path(self) -> Path:
        return ("workflow", self.index)

    def arc_path(self, k: int) -> Path:
        return ("workflow", self.index, "next", "arcs", k)

    @property
    def join_any(self) -> bool:
        return _get(self.raw, "spec", "join") == "any"

    @functools.cached_property
    def admits(self) -> bool:
        """Has admit rules: a token reaching it may be denied (D17)."""
        return bool(_get(self.raw, "spec", "policy", "admit", "rules"))

    @property
    def loop(self) -> Mapping[str, Any] | None:
        loop = self.raw.get("loop")
        return loop if isinstance(loop, Mapping) else None

    def live(self, k: int) -> bool:
        """D14: in an exclusive router an arc without ``when`` matches every success event, so a later
        arc without ``when`` (which matches only those) never fires."""
        arc = self.arcs[k]
        return self.inclusive or "when" in arc or all("when" in a for a in self.arcs[:k])

    @functools.cached_property
    def on_success(self) -> list[int] | None:
        """The arcs that may fire on success when every one of them is sure to send the token on
        (some arc fires whatever the conditions), else None. Exclusive: the arcs up to the first one
        without ``when``; inclusive: the arcs without ``when``."""
        plain = [k for k, a in enumerate(self.arcs) if "when" not in a]
        if not plain:
            return None
        return plain if self.inclusive else list(range(plain[0] + 1))


@dataclass
class _View:
    doc: Mapping[str, Any]
    graph: WorkflowGraph
    steps: list[_Step]
    by_name: dict[str, _Step]
    entry: str | None

    @classmethod
    def of(cls, doc: Mapping[str, Any], graph: WorkflowGraph) -> "_View":
        steps = []
        for i, raw in enumerate(doc["workflow"]):
            tool = raw.get("tool")
            tasks = normalize_tasks(raw["step"], tool)
            paths: list[Path] = ([("workflow", i, "tool")] if isinstance(tool, Mapping)
                                 else [("workflow", i, "tool", j) for j in range(len(tasks))])
            nxt = raw.get("next") if isinstance(raw.get("next"), Mapping) else {}
            named = [_Task(j, t["name"], t, p) for j, (t, p) in enumerate(zip(tasks, paths))]
            steps.append(_Step(i, raw["step"], raw, named, list(nxt.get("arcs") or []),
                               _get(nxt, "spec", "mode") == "inclusive"))
        return cls(doc, graph, steps, {s.name: s for s in steps}, entry_step(doc))

    def reach(self, step: str) -> frozenset[str]:
        return self.graph.reachable_from(step)

    @functools.cached_property
    def reachable(self) -> frozenset[str]:
        return self.reach(self.entry) if self.entry else frozenset()

    def finding(self, code: str, path: Path, message: str, severity: Severity | None = None) -> Finding:
        return Finding(code, severity or RULES[code][0], locate(self.doc, path), message, path)

    def arc_label(self, p: Place) -> str:
        return f"{p.source} -> {p.target} (arc {p.index})"

    def place_args(self, p: Place) -> Mapping[str, Any]:
        args = self.by_name[p.source].arcs[p.index].get("args")
        return args if isinstance(args, Mapping) else {}

    @functools.cached_property
    def joins(self) -> dict[str, "_Join"]:
        """The barrier joins (D16) reached from the entry step, by name."""
        return _joins_of(self)

    @functools.cached_property
    def refs(self) -> list["_Ref"]:
        """Every name every template of the workflow reads (L102 and L401-L410 check them)."""
        return _refs_of(self)

    @functools.cached_property
    def rules(self) -> list[tuple[_Step, _Task, Path, Mapping[str, Any]]]:
        """Every rule action (``then``) of every task policy in the workflow, with its path."""
        out = []
        for s in self.steps:
            for t in s.tasks:
                for r, rule in enumerate(_get(t.raw, "spec", "policy", "rules") or []):
                    path = t.path + ("spec", "policy", "rules", r)
                    if "else" in rule:
                        then, path = _get(rule, "else", "then"), path + ("else", "then")
                    else:
                        then, path = rule.get("then"), path + ("then",)
                    if isinstance(then, Mapping):
                        out.append((s, t, path, then))
        return out

    @functools.cached_property
    def ctx_writers(self) -> dict[str, list[tuple[_Step, Path]]]:
        """ctx key -> (step, path of the key in a set_ctx). Workbook tasks' own policies never apply
        (the caller's does), so their set_ctx writes nothing."""
        out: dict[str, list[tuple[_Step, Path]]] = {}
        for s, _, path, then in self.rules:
            for key in then.get("set_ctx") or {}:
                out.setdefault(key, []).append((s, path + ("set_ctx", key)))
        return out

    @functools.cached_property
    def iter_keys(self) -> dict[str, set[str]]:
        """Step -> what ``iter`` holds in its runs: its set_iter keys, and in a loop the iterator,
        ``index`` and ``parent`` (D6)."""
        out: dict[str, set[str]] = {s.name: set() for s in self.steps}
        for s, _, _, then in self.rules:
            out[s.name] |= set(then.get("set_iter") or {})
        for s in self.steps:
            if s.loop is not None:
                out[s.name] |= {s.loop.get("iterator"), "index", "parent"}
        return out


# ----------------------------------------------------------------------------------- joins (L101, L102)
@dataclass
class _Join:
    """A barrier join (D16) reached from the entry step: its forward inputs, the steps that can feed
    each without passing through it, and the routers where the ways to different inputs split."""

    step: _Step
    places: list[Place]
    feeders: dict[Place, frozenset[str]]
    splits: list[_Step]

    @property
    def joins(self) -> bool:
        """Can two inputs hold tokens at once? Only an inclusive router makes two tokens of one."""
        return any(r.inclusive for r in self.splits)


def _joins_of(v: _View) -> dict[str, _Join]:
    out = {}
    for j in v.steps:
        if j.join_any or not v.graph.is_join(j.name) or j.name not in v.reachable:
            continue
        places = v.graph.forward_places[j.name]
        feeders = {p: v.graph.feeders[(j.name, p)] for p in places}
        region = set().union(*feeders.values())
        splits = []
        for r in (s for s in v.steps if s.name in region):
            leads = [x for k in range(len(r.arcs)) if r.live(k) and (x := _leads(v, r, k, j.name, feeders))]
            if len(leads) >= 2 and len(set().union(*leads)) >= 2:
                splits.append(r)
        out[j.name] = _Join(j, places, feeders, splits)
    return out


def _leads(v: _View, r: _Step, k: int, join: str, feeders: dict[Place, frozenset[str]]) -> frozenset[Place]:
    """The inputs of ``join`` that a token on arc ``k`` of ``r`` can reach (without passing the join)."""
    target, own = r.arcs[k]["step"], v.graph.by_arc.get((r.name, k))
    return frozenset(p for p, f in feeders.items() if p == own or (target != join and target in f))


def _joins(v: _View) -> Iterator[Finding]:
    for join in v.joins.values():
        if not join.joins:
            yield v.finding("L101", join.step.path, _never_joins(join))
        else:
            yield from _optional_reads(v, join)


def _never_joins(join: _Join) -> str:
    splits = join.splits
    where = (f"the ways to its inputs split at exclusive router{'s' if len(splits) > 1 else ''} "
             + ", ".join(f"'{s.name}'" for s in splits) + " (the first matching arc wins)") if splits else \
        "no router forks tokens towards its inputs"
    return (f"join '{join.step.name}' can never receive two inputs at once: {where}, so one token at a time "
            "arrives; D16 then fires it at once with that token alone (no other input can still receive one), "
            "once per token, as 'spec.join: any' would: the barrier waits for nothing, and its args are those of "
            "one branch. Set 'spec.join: any' to say so, or make the router inclusive if the branches should run "
            "together")


def _optional_reads(v: _View, join: _Join) -> Iterator[Finding]:
    """L102: what the join reads unguarded (an args key, a step's result) that only branches which may
    not be taken provide: D16 fires it without them."""
    j = join.step
    optional = {p: _optional(v, join, p) for p in join.places}
    reported = set()
    for ref in v.refs:
        if ref.step is not j or ref.guarded or (ref.name, ref.keys[:1]) in reported:
            continue
        if ref.name == "args" and ref.keys:
            key = ref.keys[0]
            passing = [p for p in join.places if key in v.place_args(p)]
            if not passing or len(passing) == len(join.places) or not all(optional[p] for p in passing):
                continue
            what = f"args.{key} is passed only on branches"
        elif ref.name in v.by_name and ref.name != j.name and ref.context != "arc" \
                and all(t.name != ref.name for t in j.tasks):  # a task of its own shadows the step (D6)
            fed = [p for p in join.places if ref.name in join.feeders[p]]
            if not fed or not all(optional[p] and ref.name in v.reach(optional[p][1]) for p in fed):
                continue
            passing, what = fed, f"step '{ref.name}' runs only on branches"
        else:
            continue
        reported.add((ref.name, ref.keys[:1]))
        why = "; ".join(f"{v.arc_label(p)}: {optional[p][0]}" for p in passing)
        yield v.finding("L102", ref.path, (
            f"join '{j.name}' fires once every branch that was taken has arrived (D16), and {what} that may not "
            f"be taken ({why}): without them '{{{{ {'.'.join((ref.name, *ref.keys[:1]))} }}}}' is undefined and "
            "the render fails. Guard it ('| default(...)') or provide it on every branch"))


def _optional(v: _View, join: _Join, p: Place) -> tuple[str, str] | None:
    """Why input ``p`` may get no token while another input does, and the step after that choice:
    an arc on the way to ``p`` that may not fire (a ``when``, an exclusive choice, an admission) and
    after which no other input can be reached. None when no such arc is seen."""
    feeders = join.feeders
    others = set().union(*(f for q, f in feeders.items() if q != p))
    for s in v.steps:
        if s.name not in feeders[p]:
            continue
        for k, arc in enumerate(s.arcs):
            target = arc["step"]
            own = v.graph.by_arc.get((s.name, k)) == p
            if not s.live(k) or target in others or not (own or (target != join.step.name and target in feeders[p])):
                continue
            if "when" in arc:
                return f"arc {s.name} -> {target} has a 'when'", target
            if not s.inclusive and sum(s.live(i) for i in range(len(s.arcs))) >= 2:
                return f"'{s.name}' takes one of its arcs", target
            if not own and v.by_name[target].admits:
                return f"'{target}' has admit rules", target
    return None


# ---------------------------------------------------------------------------------- cycles (L201, L501)
def _cycles(v: _View) -> Iterator[Finding]:
    """L201: steps that, on success, always send the token on to steps that do the same (the largest
    such set; a failure is the only way out). Its cycles never end. L501: the steps before them."""
    trapped = {s.name for s in v.steps}
    work = collections.deque(v.steps)
    while work:  # a step leaves the set when it can end its token; then its predecessors are looked at again
        s = work.popleft()
        if s.name in trapped and not _traps(s, trapped):
            trapped.discard(s.name)
            work.extend(v.by_name[p] for p in v.graph.predecessors[s.name] if p in trapped)
    trapped &= v.reachable
    covered: set[str] = set()
    cycles: list[list[str]] = []
    for s in v.steps:
        if s.name not in trapped or s.name in covered:
            continue
        walk = [s.name]
        while (nxt := _forced(v.by_name[walk[-1]], trapped)) not in walk:
            walk.append(nxt)
        cycle = walk[walk.index(nxt):]
        if cycle[0] in covered:  # this walk only led into a cycle already reported
            continue
        covered |= {n for n in trapped if n in v.reach(cycle[0]) and cycle[0] in v.reach(n)}
        cycles.append(cycle)
        yield _endless(v, cycle)
    for s in v.steps:
        if s.name in trapped and s.name not in covered and not any(p in trapped for p in v.graph.predecessors[s.name]):
            into = next(c for c in cycles if c[0] in v.reach(s.name))
            yield v.finding("L501", s.path, (
                f"after step '{s.name}' the execution cannot complete: on success every way on (arcs without "
                f"'when', no admit rules) leads into the endless cycle {' -> '.join(into + into[:1])} (L201)"))


def _traps(s: _Step, trapped: set[str]) -> bool:
    arcs = s.on_success
    if s.admits or arcs is None:
        return False
    targets = [s.arcs[k]["step"] in trapped for k in arcs]
    return any(targets) if s.inclusive else all(targets)


def _forced(s: _Step, trapped: set[str]) -> str:
    """The step a trapped step's token surely goes to: its first arc without ``when`` into the trap."""
    return next(s.arcs[k]["step"] for k in s.on_success or ()
                if "when" not in s.arcs[k] and s.arcs[k]["step"] in trapped)


def _endless(v: _View, cycle: list[str]) -> Finding:
    hops = list(zip(cycle, cycle[1:] + cycle[:1]))
    arcs = [(v.by_name[a], next(k for k in v.by_name[a].on_success or () if v.by_name[a].arcs[k]["step"] == b))
            for a, b in hops]
    back = next(((s, k) for s, k in arcs if v.by_name[s.arcs[k]["step"]].index <= s.index), arcs[0])
    return v.finding("L201", back[0].arc_path(back[1]), (
        f"endless cycle {' -> '.join(cycle + cycle[:1])}: on success each of its steps sends the token on around "
        "it (its arcs there have no 'when', or come before any that has one; no admit rules), so once a token "
        "reaches it the execution never completes — only a failure ends it (D14, D18). Nothing bounds step "
        "runs: max_steps counts task visits inside one pipeline run (D9). Give an arc of the cycle a 'when' "
        "(the token ends when no arc matches), or an arc that leaves it first"))


# ------------------------------------------------------------------------------------- ctx races (L301)
def _ctx_races(v: _View) -> Iterator[Finding]:
    """L301: a ctx key written by steps that can run at the same time, i.e. on different branches of
    an inclusive fork before a join merges them (a step reached on two such branches runs twice).
    One finding per key, at the later writer of its first racing pair."""
    forks = [(f, _branches(v, f)) for f in v.steps if f.inclusive and f.name in v.reachable and len(f.arcs) >= 2]
    if not forks:
        return
    for key, writers in v.ctx_writers.items():
        steps = list({s.name: s for s, _ in writers}.values())
        pairs = [(a, b, f) for i, a in enumerate(steps) for b in steps[i:]
                 if (f := _concurrent(a.name, b.name, forks)) is not None]
        if not pairs:
            continue
        a, b, fork = pairs[0]
        who = (f"step '{a.name}' can run twice at the same time (two branches of step '{fork.name}''s inclusive "
               "router reach it with no join between)") if a is b else (
            f"steps '{a.name}' and '{b.name}' can run at the same time (branches of step '{fork.name}''s "
            "inclusive router, before any join)")
        more = f" (and {len(pairs) - 1} more such pair{'s' if len(pairs) > 2 else ''})" if len(pairs) > 1 else ""
        path = next(p for s, p in writers if s is b)
        yield v.finding("L301", path, (
            f"ctx.{key} is written by both: {who}{more}; set_ctx patches apply in the order the runs end, the "
            "last writer wins (D12), so its value depends on timing. Write different keys and combine them "
            "after the join, or pass the values along arcs"))


def _branches(v: _View, fork: _Step) -> dict[str, tuple[int, ...]]:
    """For an inclusive ``fork``: step -> the arcs of the fork on whose branch it lies, a branch being
    the steps a token on that arc can reach before a join that another arc also reaches (where the
    branches merge into one token again)."""
    reach = [v.reach(a["step"]) for a in fork.arcs]
    merges = {n for n in set().union(*reach) if sum(n in r for r in reach) >= 2
              and v.graph.is_join(n) and not v.by_name[n].join_any}
    cut = WorkflowGraph.build((s.name, [] if s.name in merges else [a["step"] for a in s.arcs]) for s in v.steps)
    on: dict[str, tuple[int, ...]] = {}
    for i, arc in enumerate(fork.arcs):
        for step in cut.reachable_from(arc["step"]) - merges:
            on[step] = on.get(step, ()) + (i,)
    return on


def _concurrent(a: str, b: str, forks: list[tuple[_Step, dict[str, tuple[int, ...]]]]) -> _Step | None:
    """The inclusive fork whose different branches reach ``a`` and ``b`` (or ``a`` twice), if any.
    Steps one after the other on one branch share their branches; a step reached on two branches
    without a join between runs once per token, so it races with the other branch."""
    for fork, on in forks:
        on_a, on_b = on.get(a, ()), on.get(b, ())
        if on_a and on_b and (len(on_a) > 1 or len(on_b) > 1 or on_a != on_b):
            return fork
    return None


# ------------------------------------------------------------------------------- templates (L401-L410)
@dataclass(frozen=True)
class _Ref:
    """One name a template reads: ``name.keys[0].keys[1]...`` (the static part of the chain)."""

    name: str
    keys: tuple[str, ...]
    guarded: bool  # under '| default' or 'is defined', or tested with "'k' in name": undefined is fine
    path: Path
    context: str  # a key of _SCOPE
    step: _Step | None
    task: _Task | None


def _templates(v: _View) -> Iterator[Finding]:
    for ref in v.refs:
        yield from _check_ref(v, ref)
    for path, when in _conditions(v):
        if not is_template(when):
            value = "true" if truthy(when, {}) else "false"
            yield v.finding("L409", path, (
                f"when {_short(when)!r} is not a template: the text itself is the condition, so it is always "
                f"{value} (D7); write it as '{{{{ ... }}}}'"))


def _refs_of(v: _View) -> list[_Ref]:
    out = []
    for path, source, context, step, task in _sites(v):
        names = referenced_names(source)  # Jinja's own scoping: set/for/macro locals are not reads
        for name, keys, guarded in _template_refs(source):
            if name in names:
                out.append(_Ref(name, keys, guarded, path, context, step, task))
    return out


def _sites(v: _View) -> Iterator[tuple[Path, str, str, _Step | None, _Task | None]]:
    """Every template of the workflow with the kind of context it renders in (D6). Steps that no
    token reaches are left out: the validator warns about them, and their templates never render."""
    for s in v.steps:
        if s.name not in v.reachable:
            continue
        for t in s.tasks:
            for key, value in _rendered(t.raw):
                for path, text in _strings(value, t.path + (key,)):
                    yield path, text, "task", s, t
            for r, rule in enumerate(_get(t.raw, "spec", "policy", "rules") or []):
                for path, text in _strings(rule, t.path + ("spec", "policy", "rules", r)):
                    yield path, text, "rule", s, t
        for r, rule in enumerate(_get(s.raw, "spec", "policy", "admit", "rules") or []):
            for path, text in _strings(rule, s.path + ("spec", "policy", "admit", "rules", r)):
                yield path, text, "admit", s, None
        if s.loop is not None:
            for path, text in _strings(s.loop.get("in"), s.path + ("loop", "in")):
                yield path, text, "loop", s, None
        for k, arc in enumerate(s.arcs):
            for key in ("when", "args"):
                for path, text in _strings(arc.get(key), s.arc_path(k) + (key,)):
                    yield path, text, "arc", s, None
    workbook = v.doc.get("workbook")
    keys = list(workbook) if isinstance(workbook, Mapping) else range(len(workbook or []))
    for key, task in zip(keys, normalize_workbook(workbook)):
        for field_, value in _rendered(task):
            for path, text in _strings(value, ("workbook", key, field_)):
                yield path, text, "workbook", None, None


def _rendered(task: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """A task's fields that render (D6): all but ``name``, ``kind``, ``spec``, ``desc`` and python ``code``."""
    for key, value in task.items():
        if key not in ("name", "kind", "spec", "desc") and not (key == "code" and task.get("kind") == "python"):
            yield key, value


def _strings(value: Any, path: Path) -> Iterator[tuple[Path, str]]:
    if isinstance(value, str):
        if is_template(value):
            yield path, value
    elif isinstance(value, Mapping):
        for k, item in value.items():
            yield from _strings(item, path + (k,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, path + (i,))


def _conditions(v: _View) -> Iterator[tuple[Path, str]]:
    """Every ``when`` of arcs, task policy rules and admit rules, with its path."""
    for s in v.steps:
        for k, arc in enumerate(s.arcs):
            if isinstance(arc.get("when"), str):
                yield s.arc_path(k) + ("when",), arc["when"]
        rules = [(s.path + ("spec", "policy", "admit", "rules", r), rule)
                 for r, rule in enumerate(_get(s.raw, "spec", "policy", "admit", "rules") or [])]
        rules += [(t.path + ("spec", "policy", "rules", r), rule)
                  for t in s.tasks for r, rule in enumerate(_get(t.raw, "spec", "policy", "rules") or [])]
        for path, rule in rules:
            if isinstance(rule.get("when"), str):
                yield path + ("when",), rule["when"]


def _check_ref(v: _View, ref: _Ref) -> Iterator[Finding]:
    s, scope = ref.step, _SCOPE[ref.context]
    tasks = {t.name: t for t in s.tasks} if s is not None and ref.context in ("task", "rule") else {}
    sev: Severity = "warning" if ref.guarded else "error"
    fails = "it is undefined here" + (" (guarded, so the default is always used)" if ref.guarded else
                                      ": the render fails")
    if ref.name in tasks:  # D6: finished tasks of this run shadow the step names
        yield from _task_ref(v, ref, tasks[ref.name])
        if ref.keys and ref.keys[0] not in _OUTCOME_FIELDS:
            yield _field(v, ref, _OUTCOME_FIELDS, f"the outcome of task '{ref.name}'", sev)
    elif ref.name in scope:
        yield from _namespace_ref(v, ref, sev)
    elif ref.name in v.by_name:
        if ref.context != "workbook":
            yield from _step_ref(v, ref)
        if ref.keys and ref.keys[0] not in _STEP_FIELDS:
            yield _field(v, ref, _STEP_FIELDS, f"the result of step '{ref.name}'", sev)
    elif ref.context == "workbook" and any(ref.name in {t.name for t in x.tasks} for x in v.steps):
        return  # a workbook task renders in its caller's run, which may have such a task
    else:
        yield v.finding("L401", ref.path, _unknown(v, ref, scope, tasks) + f"; {fails}", sev)


def _unknown(v: _View, ref: _Ref, scope: frozenset[str], tasks: Mapping[str, _Task]) -> str:
    where = _WHERE[ref.context]
    if ref.name in m.RESERVED_NAMES:
        there = [_WHERE[c] for c, names in _SCOPE.items() if ref.name in names and c != "workbook"]
        return (f"'{ref.name}' is not available in {where} (D6): only in {', '.join(there)}; "
                f"{where} read {', '.join(sorted(scope))} and the finished steps")
    owner = next((x.name for x in v.steps for t in x.tasks if t.name == ref.name), None)
    if owner is not None:
        return (f"'{ref.name}' is a task of step '{owner}': a task's outcome is readable only in its own "
                f"pipeline (read the step's result, '{owner}.result', once it has finished)")
    known = set(scope) | set(v.by_name) | set(tasks)
    return f"'{ref.name}' names nothing {where} can read: not a namespace, step or task{did_you_mean(ref.name, known)}"


def _namespace_ref(v: _View, ref: _Ref, sev: Severity) -> Iterator[Finding]:
    if not ref.keys:
        return
    key, s = ref.keys[0], ref.step
    fails = " (guarded: the default is always used)" if ref.guarded else ": the render fails"
    if ref.name == "ctx":
        writers = v.ctx_writers.get(key)
        if not writers:
            yield v.finding("L402", ref.path, f"ctx.{key} is written by no set_ctx of the playbook, so it is "
                            f"never there{fails}{did_you_mean(key, v.ctx_writers)}", sev)
        elif s is not None and not ref.guarded and not any(w is s or s.name in v.reach(w.name) for w, _ in writers):
            names = ", ".join(sorted({f"'{w.name}'" for w, _ in writers}))
            yield v.finding("L402", ref.path, f"ctx.{key} is written only by {names}, which cannot run before "
                            f"step '{s.name}' (no path leads from them to it): it is there only if a concurrent "
                            "branch wrote it first", "warning")
    elif ref.name == "args" and s is not None and ref.context != "workbook" and s.name != v.entry:
        yield from _args_ref(v, ref, key, sev)
    elif ref.name == "iter" and s is not None:
        keys = v.iter_keys[s.name]
        if key not in keys:
            what = (f"the loop's iterator '{s.loop.get('iterator')}', index, parent or a set_iter key of this step"
                    if s.loop is not None else
                    "a set_iter key of this step: outside a loop, iter holds only what set_iter wrote in this run (D6)")
            yield v.finding("L404", ref.path, f"iter.{key} is not {what}{fails}"
                            f"{did_you_mean(key, {k for k in keys if isinstance(k, str)})}", sev)
    elif ref.name == "workload" and not ref.guarded:
        workload = v.doc.get("workload") or {}
        if key not in workload:
            yield v.finding("L405", ref.path, f"workload.{key} is not in the playbook's workload: it must come "
                            "from 'noetl run --workload' or a parent playbook's workload, or the render fails"
                            f"{did_you_mean(key, workload)}")
    elif ref.name == "keychain":
        names = {e.get("name") for e in v.doc.get("keychain") or [] if isinstance(e, Mapping)}
        if key not in names:
            yield v.finding("L406", ref.path, f"keychain.{key} is not a keychain entry of the playbook (D24)"
                            f"{fails}{did_you_mean(key, {n for n in names if isinstance(n, str)})}", sev)
    elif ref.name in ("outcome", "output") and key not in _OUTCOME_FIELDS:
        yield _field(v, ref, _OUTCOME_FIELDS, "a task outcome", sev)
    elif ref.name == "event" and key not in _EVENT_FIELDS:
        yield _field(v, ref, _EVENT_FIELDS, "the event arcs see", sev)


def _field(v: _View, ref: _Ref, fields: frozenset[str], what: str, sev: Severity) -> Finding:
    key = ref.keys[0]
    return v.finding("L410", ref.path, f"'{ref.name}.{key}': {what} has no field '{key}' (D8, D13); its fields "
                     f"are {', '.join(sorted(fields))}{did_you_mean(key, fields)}", sev)


def _args_ref(v: _View, ref: _Ref, key: str, sev: Severity) -> Iterator[Finding]:
    """L403: the arcs into the step that fire it with args lacking ``key`` (D14, D16)."""
    s = ref.step
    assert s is not None
    forward, back = v.graph.forward_places[s.name], v.graph.back_places[s.name]
    passing = [p for p in forward + back if key in v.place_args(p)]
    if not passing:
        passed = {k for p in forward + back for k in v.place_args(p)}
        yield v.finding("L403", ref.path, f"args.{key}: no arc into step '{s.name}' passes '{key}' in its args"
                        f"{' (guarded: the default is always used)' if ref.guarded else ': the render fails'}"
                        f"{did_you_mean(key, passed)}", sev)
        return
    if ref.guarded:
        return
    # A join that joins merges its forward inputs (L102 covers those); any other token fires the step alone.
    join = v.joins.get(s.name)
    alone = back if join is not None and join.joins else forward + back
    lacking = [p for p in alone if key not in v.place_args(p)]
    if lacking:
        yield v.finding("L403", ref.path, (
            f"args.{key}: step '{s.name}' can fire from {', '.join(v.arc_label(p) for p in lacking)}, which does not "
            f"pass '{key}' (a token's args are its arc's, D14): then the render fails. Pass it on every arc into "
            "the step, or guard it ('| default(...)')"), "warning")


def _step_ref(v: _View, ref: _Ref) -> Iterator[Finding]:
    """L407: a step's result read where that step cannot have finished before (no path from it)."""
    s = ref.step
    if s is None or ref.guarded:
        return
    before = s.name in v.reach(ref.name) and (ref.name != s.name or bool(v.graph.back_places[s.name]))
    if before or (ref.context == "arc" and ref.name == s.name):  # arcs see the run that just ended
        return
    why = ("it is this step: its own result exists only once this run has finished" if ref.name == s.name
           else f"no path leads from '{ref.name}' to '{s.name}'")
    yield v.finding("L407", ref.path, f"'{ref.name}' cannot have finished before step '{s.name}' runs ({why}): "
                    f"'{{{{ {ref.name}... }}}}' is undefined unless a concurrent branch finished it first (D6)")


def _task_ref(v: _View, ref: _Ref, target: _Task) -> Iterator[Finding]:
    """L408: a task's outcome read by an earlier task of the same pipeline (or by its own inputs) when
    no jump or retry can have run it before."""
    s, t = ref.step, ref.task
    if s is None or t is None or ref.guarded:
        return
    later = target.index > t.index or (target.index == t.index and ref.context == "task")
    if not later or _ran_before(v, s, target.index, t.index):
        return
    shadow = f" (until then the name reads step '{ref.name}''s result)" if ref.name in v.by_name else ""
    yield v.finding("L408", ref.path, (
        f"task '{ref.name}' has not run yet when {'its own inputs' if target is t else f'task {t.name!r}'} "
        f"render{'' if target is t else 's'}: a task's outcome is readable once it has finished (D6), and no jump "
        f"or retry of step '{s.name}''s pipeline runs it before{shadow}; the render fails"))


def _ran_before(v: _View, s: _Step, done: int, at: int) -> bool:
    """Can task ``done`` have finished when task ``at`` renders: a jump from ``done`` or later back to
    ``at`` or earlier, or (``done == at``) a retry of it."""
    index = {t.name: t.index for t in s.tasks}
    for step, t, _, then in v.rules:
        if step is not s:
            continue
        if then.get("do") == "retry" and t.index == done == at:
            return True
        if then.get("do") == "jump" and t.index >= done and index.get(then.get("to"), at + 1) <= at:
            return True
    return False


@functools.lru_cache(maxsize=4096)
def _template_refs(source: str) -> tuple[tuple[str, tuple[str, ...], bool], ...]:
    """``(name, keys, guarded)`` for every name a template reads (syntax errors: none; they are the
    validator's). Keys are the static part of the chain: ``args.rows[0]`` gives ``('rows', ...)``."""
    try:
        ast = _PARSER.parse(source)
    except Exception:  # noqa: BLE001 - an unparseable template is a validation error, not ours
        return ()
    found: list[tuple[str, tuple[str, ...], bool]] = []
    guards: set[tuple[str, str | None]] = set()
    _walk(ast, False, found, guards)
    return tuple((n, k, g or (n, None) in guards or (n, k[0] if k else None) in guards) for n, k, g in found)


_PARSER = jinja2.Environment()  # the language's syntax is Jinja's own; parsing needs no sandbox


def _walk(node: nodes.Node, guarded: bool, found: list, guards: set) -> None:
    if isinstance(node, (nodes.Getattr, nodes.Getitem, nodes.Name)):
        chain = _chain(node)
        if chain is not None:
            name, keys, dynamic = chain
            found.append((name, keys, guarded))
            if guarded:
                guards.add((name, keys[0] if keys else None))
            for sub in dynamic:
                _walk(sub, False, found, guards)
            return
    if isinstance(node, nodes.Filter) and node.name in ("default", "d") and node.node is not None:
        _walk(node.node, True, found, guards)
        children = [*node.args, *(kw.value for kw in node.kwargs)]
    elif isinstance(node, nodes.Test) and node.name in ("defined", "undefined"):
        _walk(node.node, True, found, guards)
        children = [*node.args]
    elif isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr):
        _walk(node.node.node, guarded, found, guards)  # a method call: its attribute is not a key
        children = [*node.args, *(kw.value for kw in node.kwargs)]
        children += [c for c in (node.dyn_args, node.dyn_kwargs) if c is not None]
    else:
        if isinstance(node, nodes.Compare):  # 'k' in name: the key is tested for
            for op in node.ops:
                if op.op in ("in", "notin") and isinstance(node.expr, nodes.Const) and isinstance(op.expr, nodes.Name):
                    guards.add((op.expr.name, str(node.expr.value)))
        children = list(node.iter_child_nodes())
    for child in children:
        _walk(child, False, found, guards)


def _chain(node: nodes.Node) -> tuple[str, tuple[str, ...], list[nodes.Node]] | None:
    """``a.b['c'][x].d`` -> ``('a', ('b', 'c'), [x])``: the name, the static keys up to the first
    dynamic one, and the dynamic parts (read too). None when the chain does not start at a name."""
    accessors: list[Any] = []
    while isinstance(node, (nodes.Getattr, nodes.Getitem)):
        if isinstance(node, nodes.Getattr):
            accessors.append(node.attr)
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            accessors.append(node.arg.value)
        else:
            accessors.append(node.arg)
        node = node.node
    if not isinstance(node, nodes.Name) or node.ctx != "load":
        return None
    accessors.reverse()
    keys: list[str] = []
    for a in accessors:
        if not isinstance(a, str):
            break
        keys.append(a)
    return node.name, tuple(keys), [a for a in accessors if not isinstance(a, str)]


# ------------------------------------------------------------- an error's field without an error (L411)
_ERROR_ROOTS = {"rule": ("outcome", "output"), "arc": ("event",)}  # the error a policy rule, an arc reads


def _error_reads(v: _View) -> Iterator[Finding]:
    """L411: ``outcome.error.<f>`` (``output``) in a policy rule, ``event.error.<f>`` in an arc, read
    unguarded where the rule or arc can run without an error: an ok outcome's error and a done step's
    event's error are null (D8, D13), and reading into null fails the render (D7)."""
    for s in v.steps:
        if s.name not in v.reachable:
            continue
        for t in s.tasks:
            rules = _get(t.raw, "spec", "policy", "rules") or []
            for r, rule in enumerate(rules):
                whens = [x.get("when") for x in rules[:r + 1] if isinstance(x, Mapping)]
                if isinstance(rule, Mapping):
                    yield from _error_reads_in(v, rule, t.path + ("spec", "policy", "rules", r), "rule", whens, None)
        for k, arc in enumerate(s.arcs):
            whens = [a.get("when") for a in (s.arcs[:k + 1] if not s.inclusive else s.arcs[k:k + 1])]
            yield from _error_reads_in(v, {key: arc.get(key) for key in ("when", "args")}, s.arc_path(k), "arc",
                                       whens, "when" not in arc)


def _error_reads_in(v: _View, node: Mapping[str, Any], base: Path, context: str, whens: list[Any],
                    never: bool | None) -> Iterator[Finding]:
    """``whens``: the conditions tried up to this rule or arc (error_certain). Its values are read
    where its own condition holds; its condition where the earlier ones did not."""
    certain = error_certain(whens, _ERROR_ROOTS[context])
    certain_before = error_certain(whens[:-1] + [None], _ERROR_ROOTS[context]) if len(whens) > 1 else False
    roots = _ERROR_ROOTS[context]
    for path, text in _strings(node, base):
        condition = path == base + ("when",)
        if (certain_before if condition else certain):
            continue  # the rule or arc runs only on an error: its values read one
        for name, keys in _unguarded_error_reads(text, roots):
            chain = ".".join((name,) + keys)
            guard = f"{name}.error and {chain}" if condition else f"{chain} if {name}.error else none"
            if context == "rule":
                which = ("this 'else' rule runs on any outcome no earlier rule took" if "when" not in node else
                         "this rule's 'when' does not hold only on an error")
                why = (f"an ok outcome's error is null and {which} (nor does an earlier rule take every ok outcome): "
                       f"on success {'the condition' if condition else 'the render'} fails the pipeline")
            elif never:
                why = ("an arc without 'when' fires only on step.done/loop.done, whose event's error is null: the "
                       "render fails whenever it fires; read it on an arc that fires on a failure "
                       "(when: '{{ event.error }}')")
            else:
                why = ("a done step's event has a null error and this arc's 'when' does not hold only on a failure: "
                       "after a done step the render fails and ends the step's routing")
            yield v.finding("L411", path, f"'{chain}' reads a field of the error where there may be none ({why}, D7); "
                            f"guard it with its error: '{{{{ {guard} }}}}'", "error" if never else None)


def error_certain(whens: list[Any], roots: tuple[str, ...]) -> bool:
    """Is there certainly an error where the last of ``whens`` holds, the conditions of a task's policy
    rules (or of an exclusive router's arcs) up to one of them, in order (None: no ``when``)? Yes when
    its own condition says so (``R.error``, ``R.status == 'error'``, ``event.name == 'step.failed'``,
    alone or in an ``and``; R one of ``roots``), or when an earlier one takes every outcome without an
    error (``R.status == 'ok'``, ``R.status != 'error'``, ``not R.error``, ``R.error is none``; an arc
    without ``when``, which matches only step.done/loop.done). The shapes are read, never evaluated."""
    *earlier, own = whens
    expr = _condition(own)
    if expr is not None and _has_error(expr, roots):
        return True
    for when in earlier:
        if when is None:  # an arc without 'when' (an 'else' rule is the last)
            return True
        expr = _condition(when)
        if expr is not None and _no_error(expr, roots):
            return True
    return False


def _condition(when: Any) -> nodes.Expr | None:
    """The expression of a ``when`` that is exactly ``{{ expr }}``."""
    if not isinstance(when, str):
        return None
    try:
        body = _PARSER.parse(when).body
    except Exception:  # noqa: BLE001 - an unparseable template is a validation error, not ours
        return None
    if len(body) != 1 or not isinstance(body[0], nodes.Output):
        return None
    exprs = [n for n in body[0].nodes if not (isinstance(n, nodes.TemplateData) and not n.data.strip())]
    return exprs[0] if len(exprs) == 1 and not isinstance(exprs[0], nodes.TemplateData) else None


def _is_chain(node: nodes.Node, roots: tuple[str, ...], keys: tuple[str, ...]) -> bool:
    chain = _chain(node)
    return chain is not None and chain[0] in roots and chain[1] == keys and not chain[2]


def _compares(node: nodes.Node, roots: tuple[str, ...], keys: tuple[str, ...], op: str, value: str) -> bool:
    return (isinstance(node, nodes.Compare) and len(node.ops) == 1 and node.ops[0].op == op
            and _is_chain(node.expr, roots, keys) and isinstance(node.ops[0].expr, nodes.Const)
            and node.ops[0].expr.value == value)


def _has_error(node: nodes.Node, roots: tuple[str, ...]) -> bool:
    """Does ``node`` being true mean the error is there?"""
    if isinstance(node, nodes.And):
        return _has_error(node.left, roots) or _has_error(node.right, roots)
    return (_is_chain(node, roots, ("error",)) or _compares(node, roots, ("status",), "eq", "error")
            or ("event" in roots and _compares(node, roots, ("name",), "eq", "step.failed")))


def _no_error(node: nodes.Node, roots: tuple[str, ...]) -> bool:
    """Does ``node`` hold for every outcome (event) without an error?"""
    if isinstance(node, nodes.Or):
        return _no_error(node.left, roots) or _no_error(node.right, roots)
    return ((isinstance(node, nodes.Not) and _is_chain(node.node, roots, ("error",)))
            or (isinstance(node, nodes.Test) and node.name == "none" and _is_chain(node.node, roots, ("error",)))
            or _compares(node, roots, ("status",), "eq", "ok") or _compares(node, roots, ("status",), "ne", "error"))


def _unguarded_error_reads(source: str, roots: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """``(name, keys)`` of each ``R.error.<f>...`` a template reads (R one of ``roots``) that nothing
    guards: not under ``| default`` or ``is defined``, not after a test that the error is there
    (``R.error and ...``, ``... if R.error``, ``{% if R.error %}``, ``not R.error or ...``)."""
    try:
        ast = _PARSER.parse(source)
    except Exception:  # noqa: BLE001 - an unparseable template is a validation error, not ours
        return []
    found: list[tuple[str, tuple[str, ...]]] = []

    def walk(node: nodes.Node, known: bool) -> None:
        if known:
            return  # the error is there wherever this part is evaluated
        if isinstance(node, nodes.Filter) and node.name in ("default", "d") or \
                isinstance(node, nodes.Test) and node.name in ("defined", "undefined"):
            children = [*node.args, *(kw.value for kw in getattr(node, "kwargs", []))]
        elif isinstance(node, nodes.And):
            walk(node.left, False)
            walk(node.right, _has_error(node.left, roots))
            return
        elif isinstance(node, nodes.Or):
            walk(node.left, False)
            walk(node.right, _no_error(node.left, roots))
            return
        elif isinstance(node, (nodes.CondExpr, nodes.If)):
            walk(node.test, False)
            for child in (node.expr1,) if isinstance(node, nodes.CondExpr) else node.body:
                walk(child, _has_error(node.test, roots))
            children = ([node.expr2] if node.expr2 is not None else []) if isinstance(node, nodes.CondExpr) \
                else [*node.elif_, *node.else_]
        elif isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr):
            children = [node.node.node, *node.args, *(kw.value for kw in node.kwargs)]  # a method: not a key
            children += [c for c in (node.dyn_args, node.dyn_kwargs) if c is not None]
        elif isinstance(node, (nodes.Getattr, nodes.Getitem)) and (chain := _chain(node)) is not None:
            name, keys, dynamic = chain
            if name in roots and len(keys) >= 2 and keys[0] == "error":
                found.append((name, keys))
            children = dynamic
        else:
            children = list(node.iter_child_nodes())
        for child in children:
            walk(child, False)

    walk(ast, False)
    return list(dict.fromkeys(found))


# ------------------------------------------------------------------------ arcs that never fire (L502, L503)
def _dead_arcs(v: _View) -> Iterator[Finding]:
    for s in v.steps:
        for k, arc in enumerate(s.arcs):
            if not s.live(k):
                first = next(i for i, a in enumerate(s.arcs) if "when" not in a)
                yield v.finding("L502", s.arc_path(k), (
                    f"arc to '{arc['step']}' can never fire: the router of '{s.name}' is exclusive (the first "
                    f"matching arc wins) and arc {first} has no 'when', so it matches every success event first, "
                    "and an arc without 'when' matches nothing else (D14). Give it a 'when', or make the router "
                    "inclusive"))
    live = WorkflowGraph.build((s.name, [a["step"] for k, a in enumerate(s.arcs) if s.live(k)]) for s in v.steps)
    reached = live.reachable_from(v.entry) if v.entry else frozenset()
    for s in v.steps:
        if s.name in v.reachable and s.name not in reached:
            yield v.finding("L503", s.path, (
                f"step '{s.name}' never runs: every way to it from the entry step '{v.entry}' passes an arc that "
                "can never fire (L502)"))


# ------------------------------------------------------------------------------- loops and waits (L601, L602)
def _wide_loops(v: _View) -> Iterator[Finding]:
    """L601: the commands a parallel loop keeps in flight (iterations travel in chunks, D19) against
    what one worker runs at once. The playbook cannot know how many workers serve the pool."""
    executor = _get(v.doc, "executor", "spec")
    for s in v.steps:
        loop = s.loop
        spec = loop.get("spec") if loop is not None and isinstance(loop.get("spec"), Mapping) else {}
        if loop is None or (spec.get("mode") or _get(spec, "policy", "mode")) != "parallel":
            continue
        width = spec.get("max_in_flight", m.LoopSpec.model_fields["max_in_flight"].default)
        items = _known_length(v, loop.get("in"))
        running = min(width, items) if items is not None else width
        chunk = chunk_size(SimpleNamespace(mode="parallel", max_in_flight=width))
        commands = math.ceil(running / chunk)
        if commands <= WORKER_CONCURRENCY:
            continue
        pool = deep_merge(executor, s.raw.get("spec"), spec).get("pool") or DEFAULT_POOL
        where = s.path + (("loop", "spec", "max_in_flight") if "max_in_flight" in spec else ("loop",))
        yield v.finding("L601", where, (
            f"loop '{s.name}' keeps up to {running} iterations in flight (max_in_flight {width}"
            f"{f', {items} items' if items is not None else ''}) in commands of {chunk}: {commands} commands at once, "
            f"but a worker of pool '{pool}' runs {WORKER_CONCURRENCY} at a time by default ('noetl service worker "
            f"--concurrency'); the playbook cannot know how many workers serve the pool. With one default worker at "
            f"most {WORKER_CONCURRENCY * chunk} iterations run at once, and the loop takes every slot of the pool "
            "while it runs"))


def _known_length(v: _View, collection: Any) -> int | None:
    """The number of items of ``loop.in`` when it is a list, or exactly ``{{ workload.<key> }}`` with a
    list in the playbook's workload (``--workload`` can still replace it)."""
    if isinstance(collection, list):
        return len(collection)
    if not isinstance(collection, str):
        return None
    refs = _template_refs(collection)
    text = collection.strip()
    if (len(refs) == 1 and refs[0][0] == "workload" and len(refs[0][1]) == 1 and text.startswith("{{")
            and text.endswith("}}") and text[2:-2].strip() == f"workload.{refs[0][1][0]}"):
        value = (v.doc.get("workload") or {}).get(refs[0][1][0])
        return len(value) if isinstance(value, list) else None
    return None


def _endless_waits(v: _View) -> Iterator[Finding]:
    """L602 (D30): a ``kind: wait`` task on a ``signal`` with no ``timeout``, in a step whose run no
    ``spec.policy.lifecycle.timeout_s`` bounds (D29). Read on the raw task mapping."""
    executor = _get(v.doc, "executor", "spec")
    for s in v.steps:
        lifecycle = _get(deep_merge(executor, s.raw.get("spec"), _get(s.loop or {}, "spec")), "policy", "lifecycle")
        bounded = isinstance(lifecycle, Mapping) and lifecycle.get("timeout_s") is not None
        for t in s.tasks:
            if t.raw.get("kind") == "wait" and t.raw.get("signal") is not None and t.raw.get("timeout") is None \
                    and not bounded:
                yield v.finding("L602", t.path, (
                    f"task '{t.name}' waits for signal {_short(t.raw['signal'])!r} with no 'timeout' and step "
                    f"'{s.name}' has no spec.policy.lifecycle.timeout_s: if the signal never comes the execution "
                    "never ends (D30). Give it a 'timeout' (the task then ends with error kind timeout, which a "
                    "policy or an arc can route)"))


# ------------------------------------------------------------------------------------------------ output
def sarif_log(reports: list[tuple[str, Report]]) -> dict[str, Any]:
    """A SARIF 2.1.0 log of the findings of each file: one run, the rules as ``tool.driver.rules``."""
    codes = list(RULES)
    rules = [{"id": code, "name": code, "shortDescription": {"text": RULES[code][1]},
              "helpUri": HELP_URI.format(anchor=code.lower()),
              "defaultConfiguration": {"level": _LEVEL[RULES[code][0]]}} for code in codes]
    results = []
    for file, report in reports:
        for f in report.findings:
            physical: dict[str, Any] = {"artifactLocation": {"uri": _uri(file)}}
            if f.line is not None:
                physical["region"] = {"startLine": f.line, "startColumn": f.column or 1}
            location: dict[str, Any] = {"physicalLocation": physical}
            if f.location:
                location["logicalLocations"] = [{"fullyQualifiedName": f.location}]
            results.append({"ruleId": f.code, "ruleIndex": codes.index(f.code), "level": _LEVEL[f.severity],
                            "message": {"text": f.message}, "locations": [location]})
    return {
        "$schema": "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json",
        "version": "2.1.0",
        "runs": [{"tool": {"driver": {"name": "noetl lint", "rules": rules}}, "results": results}],
    }


_LEVEL = {"error": "error", "warning": "warning", "info": "note"}


def _uri(file: str) -> str:
    path = PurePath(file)
    return path.as_uri() if path.is_absolute() else urllib.parse.quote(path.as_posix())


# ----------------------------------------------------------------------------------------------- helpers
def _get(value: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _short(text: Any, size: int = 60) -> str:
    text = str(text)
    return text if len(text) <= size else text[: size - 3] + "..."
