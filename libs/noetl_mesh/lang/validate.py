"""Loading and validating playbooks: every error of a document, each with its location (D1).

The document is checked piece by piece (root, each step, each task) against the models in
:mod:`model`, so one bad step does not hide the errors of the next; the dialect rules of D1 that
the models cannot say (legacy constructs, references between names, D12, D17) run on the raw
document alongside. A valid document is normalised (D4) and returned as a typed :class:`Playbook`.

Text is read by :mod:`.documents` (the one safe loader), and an already-parsed value passes the same
document checks first, so the rules here only ever see JSON data of bounded size and depth. They
never raise, whatever the types, and run in time about linear in the document's size.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import re
import threading
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path as FsPath
from typing import Any

import orjson
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, create_model

from .. import limits
from ..contracts import refs
from . import model as m
from .diagnostics import Diagnostic, Path, did_you_mean, locate
from .documents import Parsed, check_value, load_document, parse, position, read_document
from .graph import WorkflowGraph
from .normalize import normalize_document, normalize_tasks
from .templates import check_syntax, is_template

ROOT_KEYS = ("apiVersion", "kind", "metadata", "executor", "workload", "keychain", "workbook", "workflow")
LEGACY_STEP_KEYS = {
    "when": "step-level 'when' is not part of the language: admit the step with spec.policy.admit.rules (D1)",
    "case": "'case' is not part of the language: route with next.arcs[].when (D1)",
    "eval": "legacy 'eval' is rejected: use a task's spec.policy.rules (D1)",
    "expr": "legacy 'expr' is rejected: use 'when' (D1)",
}
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SUGGESTION_BUDGET = 10_000  # names compared for "did you mean" per document

_RootShape = create_model(
    "Playbook",
    __base__=m.Playbook,
    workflow=(list[Any], Field(min_length=1)),
    workbook=(Any, None),
)
_StepShape = create_model("Step", __base__=m.Step, tool=(Any, None))
_TASK = TypeAdapter(m.Task)


@dataclass
class ValidationResult:
    diagnostics: list[Diagnostic]
    playbook: m.Playbook | None = None  # set when there is no error
    document: dict[str, Any] | None = None  # the normalised document, when valid
    graph: WorkflowGraph | None = None

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors


class PlaybookError(ValueError):
    """A playbook that does not validate; ``diagnostics`` lists every finding."""

    def __init__(self, diagnostics: list[Diagnostic], source: str = ""):
        self.diagnostics = diagnostics
        lines = [f"{source}: {d}" if source else str(d) for d in diagnostics if d.severity == "error"]
        super().__init__("invalid playbook:\n  " + "\n  ".join(lines))


def parse_yaml(text: str | bytes) -> tuple[Any, list[Diagnostic]]:
    """The value of a playbook text, read by the safe loader (:func:`.documents.load_document`):
    ``(value, [])``, or ``(None, diagnostics)`` when it cannot be read."""
    return load_document(text)


def validate_text(text: str | bytes) -> ValidationResult:
    """Validate a playbook text (YAML or JSON; bytes are decoded as :mod:`.documents` says). Every
    diagnostic carries the line and column where its location starts."""
    parsed = parse(text, positions=True)
    if not parsed.ok:
        return ValidationResult(parsed.diagnostics)
    result = _validate(parsed.value)
    result.diagnostics = [_placed(d, parsed) for d in result.diagnostics]
    return result


def validate_file(path: str | FsPath) -> ValidationResult:
    text, problems = read_document(path)
    if text is None:
        return ValidationResult(problems)
    return validate_text(text)


def load_playbook(source: str | bytes | Mapping[str, Any]) -> ValidationResult:
    """Validate YAML text or an already-parsed mapping; raise :class:`PlaybookError` if invalid."""
    result = validate_text(source) if isinstance(source, (str, bytes)) else validate(source)
    if not result.ok:
        raise PlaybookError(result.diagnostics)
    return result


_CACHE: "collections.OrderedDict[str, ValidationResult]" = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()


def parse_and_validate(playbook: str | Any) -> tuple[Any, list[Diagnostic]]:
    """A submitted playbook (YAML text, or a value already parsed) read and checked, as it is published:
    ``(value, diagnostics)``, the value not normalised (the gateway's and ``noetl run``'s requests)."""
    doc, diags = parse_yaml(playbook) if isinstance(playbook, str) else (playbook, [])
    return doc, (diags or validate_cached(doc).diagnostics)


def validate_cached(doc: Any) -> ValidationResult:
    """:func:`validate` with a small LRU keyed by the document's digest: the same playbook submitted
    again is not validated again (gateway and admission see the same playbooks over and over). The
    result is shared: do not mutate it (its ``document`` is deep-copied by callers that keep it).
    The value is checked (:func:`.documents.check_value`) before its digest is taken, so the digest
    is of a JSON value and only valid values are cached."""
    problems = check_value(doc)
    if problems:
        return ValidationResult(problems)
    key = hashlib.blake2b(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS), digest_size=16).hexdigest()
    with _CACHE_LOCK:  # callers may validate in worker threads (off an event loop)
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    hit = _validate(doc)
    with _CACHE_LOCK:
        _CACHE[key] = hit
        if len(_CACHE) > 256:
            _CACHE.popitem(last=False)
    return hit


def validate(doc: Any) -> ValidationResult:
    """Validate an already-parsed value (a mapping from JSON or YAML): first the rules of a document
    (nesting, size, JSON types: :func:`.documents.check_value`), then the language's."""
    problems = check_value(doc)
    if problems:
        return ValidationResult(problems)
    return _validate(doc)


def _validate(doc: Any) -> ValidationResult:
    """The language's rules, for a value that passed :func:`.documents.check_value`."""
    v = _Validator(doc)
    v.run()
    result = ValidationResult(v.found)
    if result.ok:
        normalised = normalize_document(doc)
        try:
            result.playbook = m.Playbook.model_validate(normalised)
        except ValidationError as exc:  # the piecewise checks missed something: still an answer
            for err in exc.errors():
                v.error(tuple(err["loc"]), f"{err['msg']} (after normalisation)")
            result = ValidationResult(v.found)
        else:
            result.document = normalised
            result.graph = v.graph
    result.diagnostics = sorted(result.diagnostics, key=lambda d: d.severity != "error")  # stable: document order
    return result


def _placed(d: Diagnostic, parsed: Parsed) -> Diagnostic:
    where = position(parsed, d.path)
    return replace(d, line=where[0], column=where[1]) if where and d.line is None else d


@dataclass
class _Validator:
    doc: Any
    found: list[Diagnostic] = field(default_factory=list)
    graph: WorkflowGraph | None = None
    suggestions: int = SUGGESTION_BUDGET

    # ------------------------------------------------------------------ reporting
    def error(self, path: Path, message: str) -> None:
        self.found.append(Diagnostic("error", locate(self.doc, path), message, path))

    def warn(self, path: Path, message: str) -> None:
        self.found.append(Diagnostic("warning", locate(self.doc, path), message, path))

    def check_model(self, adapter: Any, value: Any, path: Path) -> Any:
        """Validate ``value`` against a model; report each pydantic error at its own location."""
        try:
            if isinstance(adapter, type) and issubclass(adapter, BaseModel):
                obj = adapter.model_validate(value)
            else:
                obj = adapter.validate_python(value)
        except ValidationError as exc:
            root = adapter if isinstance(adapter, type) else None
            for err in exc.errors():
                self._pydantic_error(root, value, path, err)
            return None
        self._warn_extras(obj, value, path)
        return obj

    def _pydantic_error(self, root: type | None, value: Any, path: Path, err: Mapping[str, Any]) -> None:
        loc, node = _strip_tags(value, tuple(err["loc"]))
        kind, got = err["type"], err.get("input")
        where = path + loc
        if kind == "extra_forbidden":
            known = _known_keys(root, tuple(err["loc"])[:-1])
            self.error(where, f"unknown key '{_short(loc[-1])}'{self.suggest(str(loc[-1]), known)}")
        elif kind == "missing":
            self.error(where, f"missing required key '{loc[-1]}'")
        elif kind == "union_tag_invalid":
            self.error(
                where + ("kind",),
                f"unknown tool kind {_describe(got.get('kind'))}{self.suggest(str(got.get('kind')), m.TOOL_KINDS)};"
                f" known kinds: {', '.join(m.TOOL_KINDS)}"
                if isinstance(got, Mapping)
                else err["msg"],
            )
        elif kind == "union_tag_not_found":
            self.error(where, "a task needs a 'kind'")
        elif kind in ("model_type", "dict_type", "model_attributes_type"):
            self.error(where, f"expected a mapping, got {_describe(got)}")
        elif kind == "list_type":
            self.error(where, f"expected a list, got {_describe(got)}")
        elif kind == "value_error":  # a check of the model's own (durations, wait fields): its message says it all
            self.error(where, str((err.get("ctx") or {}).get("error") or err["msg"]))
        else:
            self.error(where, f"{err['msg']} (got {_describe(got)})")

    def _warn_extras(self, obj: Any, raw: Any, path: Path) -> None:
        """Unknown keys inside ``spec`` mappings are kept but reported as warnings (placeholders are
        allowed there)."""
        if isinstance(obj, list):
            for i, item in enumerate(obj):
                self._warn_extras(item, raw[i] if isinstance(raw, list) and i < len(raw) else None, path + (i,))
            return
        if not isinstance(obj, BaseModel):
            return
        extras = obj.unknown_keys if hasattr(obj, "unknown_keys") else list(obj.model_extra or {})
        for key in extras:
            known = [f.alias or n for n, f in type(obj).model_fields.items()]
            self.warn(path + (key,), f"unknown spec key '{_short(key)}' is ignored{self.suggest(key, known)}")
        if not isinstance(raw, Mapping):
            return
        for name, key in _nested_fields(type(obj)):
            sub = getattr(obj, name)
            if isinstance(sub, (BaseModel, list)) and key in raw:
                self._warn_extras(sub, raw[key], path + (key,))

    # ------------------------------------------------------------------ the rules
    def run(self) -> None:
        doc = self.doc
        if not isinstance(doc, Mapping):
            self.error((), f"a playbook is a YAML mapping, got {_describe(doc)}")
            return
        at = refs.forged(doc)
        if at is not None:  # literal values (workload, results, loop items, args) travel as the user wrote them
            self.error(at, refs.refusal("this value"))
        shape = dict(doc)
        if "vars" in shape:
            self.error(("vars",), "root 'vars' is not part of the language: use workload, ctx or iter (D1)")
            shape.pop("vars")
        for key in list(shape):
            if key not in ROOT_KEYS and key != "vars":
                self.error((key,), f"unknown root key '{_short(key)}'{self.suggest(key, ROOT_KEYS)}")
                shape.pop(key)
        workflow = doc.get("workflow")
        if isinstance(workflow, list) and len(workflow) > limits.current().max_steps:
            self.error(("workflow",), str(limits.LimitExceeded("max_steps", len(workflow))))
            return  # the limit bounds the cost of checking: nothing more is read
        self.check_model(_RootShape, shape, ())
        workflow = workflow if isinstance(workflow, list) else []
        self.keychain(doc.get("keychain"))
        workbook = self.workbook(doc.get("workbook"))
        names = self.step_names(workflow)
        for i, step in enumerate(workflow):
            if isinstance(step, Mapping):
                self.step(i, step, names, workbook)
            else:
                self.error(("workflow", i), f"a step is a mapping, got {_describe(step)}")
        self.templates()
        self.entry_and_reach(doc, workflow, names)

    def keychain(self, keychain: Any) -> None:
        seen: set[str] = set()
        for i, entry in enumerate(keychain if isinstance(keychain, list) else []):
            name = entry.get("name") if isinstance(entry, Mapping) else None
            if isinstance(name, str):
                if name in seen:
                    self.error(("keychain", i, "name"), f"duplicate keychain entry '{_short(name)}'")
                seen.add(name)

    def workbook(self, workbook: Any) -> set[str]:
        if workbook is None:
            return set()
        if not isinstance(workbook, (list, Mapping)):
            self.error(("workbook",), f"'workbook' is a list of named tasks, got {_describe(workbook)}")
            return set()
        names: set[str] = set()
        items = workbook.items() if isinstance(workbook, Mapping) else enumerate(workbook)
        for key, task in items:
            path = ("workbook", key)
            if not isinstance(task, Mapping):
                self.error(path, f"a workbook task is a mapping, got {_describe(task)}")
                continue
            name = key if isinstance(workbook, Mapping) else task.get("name")
            if not isinstance(name, str) or not name:
                self.error(path, "a workbook task needs a 'name'")
            elif name in names:
                self.error(path + ("name",), f"duplicate workbook task '{_short(name)}'")
            else:
                names.add(name)
            self.task(path, task, pipeline=set(), parallel=False, workbook=None)
        return names

    def step_names(self, workflow: list[Any]) -> set[str]:
        names: set[str] = set()
        for i, step in enumerate(workflow):
            name = step.get("step") if isinstance(step, Mapping) else None
            if not isinstance(name, str):
                continue  # a missing or non-string name is the model's to report
            if name in names:
                self.error(("workflow", i, "step"), f"duplicate step name '{_short(name)}' (D1)")
            elif name in m.RESERVED_NAMES:
                self.error(("workflow", i, "step"), f"'{name}' is a reserved name and cannot name a step (D6)")
            names.add(name)
        return names

    def step(self, i: int, step: Mapping[str, Any], names: set[str], workbook: set[str]) -> None:
        path: Path = ("workflow", i)
        shape = dict(step)
        for key, why in LEGACY_STEP_KEYS.items():
            if key in shape:
                self.error(path + (key,), why)
                shape.pop(key)
        nxt = shape.get("next")
        if nxt is not None and not isinstance(nxt, Mapping):
            self.error(
                path + ("next",),
                "'next' must be a router object {spec?, arcs: [...]} (D1); a list of steps is the legacy form",
            )
            shape.pop("next")
        spec = shape.get("spec")
        policy = spec.get("policy") if isinstance(spec, Mapping) else None
        if isinstance(policy, Mapping) and "rules" in policy:
            self.error(
                path + ("spec", "policy", "rules"),
                "control rules (retry/jump/break/continue/fail) belong in a task's spec.policy, not the step's;"
                " admission rules go in spec.policy.admit.rules",
            )
            shape["spec"] = {**spec, "policy": {k: v for k, v in policy.items() if k != "rules"}}
        if "tool" not in step and "next" not in step:
            self.error(path, "a step needs a 'tool', a 'next', or both (D4)")
        self.check_model(_StepShape, shape, path)
        self.admission(path, spec)
        loop = step.get("loop")
        parallel = False
        if isinstance(loop, Mapping):
            iterator = loop.get("iterator")
            if "in" not in loop or "iterator" not in loop:
                pass  # reported by the model as a missing key
            elif not isinstance(iterator, str) or not IDENT.match(iterator):
                self.error(path + ("loop", "iterator"),
                           f"the iterator must be an identifier, got {_describe(iterator)}")
            elif iterator in ("index", "parent"):
                self.error(path + ("loop", "iterator"), f"'{iterator}' is reserved inside iter (iter.{iterator}, D6)")
            lspec = _mapping(loop.get("spec"))
            parallel = (lspec.get("mode") or _mapping(lspec.get("policy")).get("mode")) == "parallel"
        if isinstance(nxt, Mapping):
            for j, arc in enumerate(_list(nxt.get("arcs"))):
                target = arc.get("step") if isinstance(arc, Mapping) else None
                if isinstance(target, str) and target not in names:
                    self.error(
                        path + ("next", "arcs", j, "step"),
                        f"arc to unknown step '{_short(target)}'{self.suggest(target, names)} (D1)",
                    )
        self.pipeline(path, step, parallel, workbook)

    def admission(self, path: Path, spec: Any) -> None:
        """D17: warn when a step has admit rules, all of them allow, and there is no else."""
        rules = _mapping(_mapping(_mapping(spec).get("policy")).get("admit")).get("rules")
        if not isinstance(rules, list) or not rules:
            return
        if any(isinstance(r, Mapping) and "else" in r for r in rules):
            return
        if all(isinstance(r, Mapping) and _mapping(r.get("then")).get("allow", True) is True for r in rules):
            self.warn(
                path + ("spec", "policy", "admit", "rules"),
                "every admit rule allows and there is no 'else': the step is admitted whatever the conditions (D17)",
            )

    def pipeline(self, path: Path, step: Mapping[str, Any], parallel: bool, workbook: set[str]) -> None:
        tool = step.get("tool")
        if tool is None:
            return
        if isinstance(tool, Mapping) and _label_shape(tool):
            self.error(path + ("tool",), _label_shape_message(next(iter(tool))))
            return
        if isinstance(tool, Mapping):
            tasks: list[tuple[Path, Any]] = [(path + ("tool",), tool)]
        elif isinstance(tool, list):
            if not tool:
                self.error(path + ("tool",), "'tool' is an empty list: give at least one task, or remove it")
            tasks = [(path + ("tool", j), t) for j, t in enumerate(tool)]
        else:
            self.error(path + ("tool",), f"'tool' is a list of tasks or one task, got {_describe(tool)}")
            return
        labels: set[str] = set()
        step_name = step.get("step") if isinstance(step.get("step"), str) else "step"
        if isinstance(tool, list) and all(isinstance(t, Mapping) for t in tool):
            for (tpath, _), task in zip(tasks, normalize_tasks(step_name, tool)):
                name = task.get("name")
                if not isinstance(name, str):
                    continue  # the model reports a name that is not a string
                if name in labels:
                    self.error(tpath + ("name",), f"duplicate task name '{_short(name)}' in step '{_short(step_name)}' (D1)")
                labels.add(name)
        elif isinstance(tool, Mapping):
            labels.add(f"{step_name}_task")
        for tpath, task in tasks:
            if not isinstance(task, Mapping):
                self.error(tpath, f"a task is a mapping, got {_describe(task)}")
            elif _label_shape(task):
                self.error(tpath, _label_shape_message(next(iter(task))))
            else:
                self.task(tpath, task, labels, parallel, workbook)

    def task(self, path: Path, task: Mapping[str, Any], pipeline: set[str], parallel: bool, workbook: set[str] | None) -> None:
        shape = dict(task)
        name = task.get("name")
        if isinstance(name, str) and name in m.RESERVED_NAMES:
            self.error(path + ("name",), f"'{name}' is a reserved name and cannot name a task (D6)")
        spec = shape.get("spec")
        policy = spec.get("policy") if isinstance(spec, Mapping) else None
        if policy is not None and not (isinstance(policy, Mapping) and isinstance(policy.get("rules"), list)):
            self.error(
                path + ("spec", "policy"),
                "a task policy must be an object with a 'rules' list (D1); "
                f"got {_describe(policy)}",
            )
            shape["spec"] = {k: v for k, v in spec.items() if k != "policy"}
        self.check_model(_TASK, shape, path)
        if shape.get("kind") == "workbook" and workbook is not None:
            ref = task.get("task") or name
            if isinstance(ref, str) and ref not in workbook:
                self.error(
                    path + ("task" if "task" in task else "name",),
                    f"no workbook task named '{_short(ref)}'{self.suggest(ref, workbook)}",
                )
        if not isinstance(policy, Mapping):
            return
        for j, rule in enumerate(_list(policy.get("rules"))):
            then = rule.get("then") if isinstance(rule, Mapping) else None
            rpath = path + ("spec", "policy", "rules", j)
            if isinstance(rule, Mapping) and "else" in rule:
                then = _mapping(rule["else"]).get("then")
                rpath += ("else",)
            if not isinstance(then, Mapping):
                continue
            if then.get("do") == "jump" and pipeline:
                target = then.get("to")
                if target is None:
                    self.error(rpath + ("then",), "'jump' needs 'to': the task to jump to")
                elif isinstance(target, str) and target not in pipeline:  # not a string: the model says so
                    self.error(
                        rpath + ("then", "to"),
                        f"jump to unknown task '{_short(target)}'{self.suggest(target, pipeline)} (D1)",
                    )
            if then.get("do") == "retry" and then.get("attempts") is None:
                self.warn(rpath + ("then",), "'retry' without 'attempts' tries once more only (attempts: 2)")
            if parallel and "set_ctx" in then:
                self.error(
                    rpath + ("then", "set_ctx"),
                    "set_ctx is not allowed in a parallel loop (D12): use set_iter or the loop's result",
                )

    def templates(self) -> None:
        """Template syntax errors anywhere but in python ``code`` (which is not rendered). An explicit
        stack: the nesting is bounded by max_document_depth, not by Python's recursion limit."""
        stack: list[tuple[Any, Path]] = [(self.doc, ())]
        found: list[tuple[str, Path]] = []
        while stack:
            node, path = stack.pop()
            if isinstance(node, Mapping):
                python = node.get("kind") == "python"
                items: Any = node.items()
            elif isinstance(node, list):
                python, items = False, enumerate(node)
            else:
                continue
            for key, value in items:
                kind = type(value)
                if kind is str:
                    if "{" in value and not (python and key == "code") and is_template(value):
                        found.append((value, path + (key,)))
                elif kind is dict or kind is list or (kind not in _SCALARS and isinstance(value, Mapping)):
                    stack.append((value, path + (key,)))
        # Parsing costs CPU in proportion to the text: bounded for the whole playbook, counted first.
        total = sum(len(source) for source, _ in found)
        if total > limits.current().max_template_chars:
            self.error((), str(limits.LimitExceeded("max_template_chars", total)) + "; no template was checked")
            return
        for source, where in found:
            for _, message in check_syntax(source):
                self.error(where, message)

    def entry_and_reach(self, doc: Mapping[str, Any], workflow: list[Any], names: set[str]) -> None:
        arcs_of = []
        for s in workflow:
            if isinstance(s, Mapping) and isinstance(s.get("step"), str):
                arcs = _list(_mapping(s.get("next")).get("arcs"))
                arcs_of.append((s["step"], [a.get("step") for a in arcs if isinstance(a, Mapping)]))
        self.graph = WorkflowGraph.build(arcs_of)
        spec = _mapping(_mapping(doc.get("executor")).get("spec"))
        entry = spec.get("entry_step")
        if entry is not None and not (isinstance(entry, str) and entry in names):
            if isinstance(entry, str):  # not a string: the model says so
                self.error(
                    ("executor", "spec", "entry_step"),
                    f"entry step '{_short(entry)}' is not a step of the workflow{self.suggest(entry, names)} (D3)",
                )
            return
        start = entry_step(doc)
        if start is None:
            return
        reachable = self.graph.reachable_from(start)
        for i, s in enumerate(workflow):
            if isinstance(s, Mapping) and isinstance(s.get("step"), str) and s["step"] not in reachable:
                self.warn(("workflow", i), f"step '{_short(s['step'])}' is unreachable from the entry step '{_short(start)}'")

    def suggest(self, word: str, candidates: Any) -> str:
        """:func:`did_you_mean` within a budget of comparisons per document, so that a document with
        thousands of misspelt references stays linear: past the budget, no suggestion."""
        self.suggestions -= len(candidates)
        return did_you_mean(word, candidates) if self.suggestions >= 0 else ""


def entry_step(doc: Mapping[str, Any]) -> str | None:
    """D3: executor.spec.entry_step, else the step named ``start``, else the first step."""
    spec = _mapping(_mapping(doc.get("executor")).get("spec"))
    entry = spec.get("entry_step")
    if entry:
        return entry if isinstance(entry, str) else None
    steps = [s.get("step") for s in _list(doc.get("workflow")) if isinstance(s, Mapping)]
    if "start" in steps:
        return "start"
    return steps[0] if steps and isinstance(steps[0], str) else None


_SCALARS = frozenset({int, float, bool, type(None)})


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _label_shape(task: Mapping[str, Any]) -> bool:
    """The rejected ``{label: {kind: ...}}`` task shape."""
    return "kind" not in task and len(task) == 1 and isinstance(next(iter(task.values())), Mapping)


def _label_shape_message(label: str) -> str:
    label = _short(label)
    return (
        f"the '{{{label}: {{kind: ...}}}}' task shape is not supported (D1, D4):"
        f" write '- name: {label}' followed by 'kind: ...'"
    )


def _short(text: Any, size: int = 60) -> str:
    """A name from the document, shortened for messages."""
    text = str(text)
    return text if len(text) <= size else text[: size - 3] + "..."


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (Mapping, list)):
        return "a mapping" if isinstance(value, Mapping) else "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _strip_tags(value: Any, loc: tuple) -> tuple[Path, Any]:
    """Drop the union tags pydantic puts in error locations, keeping only real document keys."""
    out: list[str | int] = []
    node = value
    for i, key in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, Mapping):
            nxt = None if last else loc[i + 1]
            is_tag = key in _TAGS and (key not in node if last else (
                key not in node or (nxt in node and not (isinstance(node[key], Mapping) and nxt in node[key]))
            ))
            if not is_tag and (key in node or last):
                out.append(key)
                node = node.get(key)
            continue  # a union tag such as 'http' or 'when'
        if isinstance(node, list) and isinstance(key, int):
            out.append(key)
            node = node[key] if key < len(node) else None
            continue
        if last or not isinstance(key, str) or key not in _TAGS:
            out.append(key)
            node = None
    return tuple(out), node


_TAGS = set(m.TOOL_KINDS) | {"when", "else"}


def _known_keys(root: type | None, loc: tuple) -> set[str]:
    """The keys allowed at ``loc`` inside ``root`` (the models a location can reach)."""
    models: set[type] = {root} if isinstance(root, type) and issubclass(root, BaseModel) else set(_models_in(m.Task))
    for key in loc:
        if isinstance(key, int):
            continue
        if key in m.TASK_MODELS and any(issubclass(c, m.TaskBase) for c in models):
            models = {m.TASK_MODELS[key]}
            continue
        nxt: set[type] = set()
        for model in models:
            for name, f in model.model_fields.items():
                if key in _field_names(name, f):
                    nxt |= set(_models_in(f.annotation))
        models = nxt or models
    return {n for model in models for name, f in model.model_fields.items() for n in _field_names(name, f)}


def _field_names(name: str, f: Any) -> set[str]:
    names = {f.alias or name}
    choices = getattr(f.validation_alias, "choices", None)
    if choices:
        names |= {c for c in choices if isinstance(c, str)}
    return names


@functools.cache
def _nested_fields(model: type[BaseModel]) -> tuple[tuple[str, str], ...]:
    """(attribute, key) of the fields of ``model`` that can hold models (those :meth:`_warn_extras`
    descends into)."""
    return tuple((name, f.alias or name) for name, f in model.model_fields.items() if _models_in(f.annotation))


def _models_in(annotation: Any) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m_ for arg in typing.get_args(annotation) for m_ in _models_in(arg)]
