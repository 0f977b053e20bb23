"""``noetl migrate``: a legacy NoETL playbook rewritten into the canonical language (docs/migrate.md).

Two dialects come in: the one NoETL runs in production (bare names in templates, a step's name for
its result, ``set:`` with scoped keys, label-shaped tasks, ``retry:`` blocks, ...), and the older
``case``/``then`` dialect. :func:`migrate_text` takes a playbook's text and gives the canonical text,
the list of changes it made and the list of what it could not translate (each with its location),
in three passes over a round-trip YAML tree (ruamel.yaml: comments, key order and quoting kept):

1. structure: the document header, tool and task shapes, legacy fields, ``set``, ``retry``, ``case``,
   ``next`` spellings, loop spellings, credentials (rules M0, M3, M4, M6, M7, M8);
2. templates: every template string is rewritten by :mod:`.migrate_jinja` (Jinja2's own AST) with a
   resolver that knows where the template stands (a task field, a policy rule, an arc, admission),
   the steps and tasks and their kinds, the loop variable and the workload (rules M1, M2, M7);
3. Python task code, by :mod:`.migrate_python` (Python's ``ast``) (rule M5).

The result is then validated (D1): a validation error becomes a finding that needs a person. A
playbook that is already canonical comes out byte for byte as it went in. No I/O, but one read: the
file a python task's ``script`` names, when the playbook's own path is given and the file lies in its
folder (:func:`read_script`).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from jinja2 import nodes

from . import migrate_paginate as paginate
from . import migrate_python as mpy
from .diagnostics import Path, locate
from .documents import load_document, parse, position
from .migrate_jinja import NeedsPerson, Ref, rewrite
from .model import RESERVED_NAMES, TASK_MODELS
from .templates import _ENV

API_VERSION = "noetl.io/v2"
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
COMMAND_N = re.compile(r"^command_(\d+)$")
TEMPLATE_GLOBALS = frozenset(_ENV.globals) | {"true", "false", "none", "True", "False", "None"}
RESULT_WORDS = frozenset({"result", "response", "this"})  # the legacy names of "what the tool returned"
STEP_VIEW = frozenset({"result", "error"})  # read on a step by name, the same in both dialects
TASK_VIEW = frozenset({"result", "error", "meta", "http", "pg", "py"})
HTTP_META = {"status_code": ("http", "status"), "headers": ("http", "headers")}

# Fields of each task kind in the canonical model (names and aliases).
_FIELDS: dict[str, set[str]] = {}
for _kind, _model in TASK_MODELS.items():
    _names: set[str] = set()
    for _name, _f in _model.model_fields.items():
        _names.add(_f.alias or _name)
        choices = getattr(_f.validation_alias, "choices", None)
        if choices:
            _names.update(c for c in choices if isinstance(c, str))
    _FIELDS[_kind] = _names
# Step-level keys of the legacy ``tool: <kind>`` shorthand that belong to the tool.
_TOOL_FIELDS_AT_STEP = {"code", "code_b64", "code_base64", "args", "input", "with", "data", "url", "endpoint",
                        "method", "headers", "params", "payload", "json", "body", "command", "commands", "query",
                        "auth", "credential", "credentials", "db_path", "database", "path", "version", "workload",
                        "script", "libs", "timeout", "return_step", "verify_ssl", "verify", "follow_redirects", "pool", "secret", "key",
                        "provider", "result", "task"}
_STEP_KEYS = {"step", "desc", "spec", "loop", "tool", "next"}


# ------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class Finding:
    rule: str  # M0..M8 (docs/migrate.md), or V for what the validator still finds
    location: str  # e.g. workflow[2].step=fetch.tool[0].url
    message: str
    line: int | None = None
    column: int | None = None  # with line: where the location starts in the text the finding is about

    def __str__(self) -> str:
        where = self.location or "<document>"
        at = f" (line {self.line}" + (f", column {self.column}" if self.column else "") + ")" if self.line else ""
        return f"{self.rule}: {where}{at}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "location": self.location, "line": self.line, "column": self.column,
                "message": self.message}


@dataclass
class Migration:
    original: str
    text: str
    changes: list[Finding] = field(default_factory=list)
    problems: list[Finding] = field(default_factory=list)  # need a person
    invalid: list[str] = field(default_factory=list)  # the input is not a playbook at all

    @property
    def changed(self) -> bool:
        return self.text != self.original

    @property
    def complete(self) -> bool:
        return not self.invalid and not self.problems


# -------------------------------------------------------------------------------------------- model


@dataclass
class _Task:
    name: str
    kind: str
    node: Any  # the task's mapping in the tree
    index: int
    statements: int = 1  # SQL: statements in its command
    return_step: str | None = None


@dataclass
class _Step:
    name: str
    node: Any
    index: int
    tasks: list[_Task] = field(default_factory=list)
    iterator: str | None = None
    loop: bool = False
    set_names: dict[str, str] = field(default_factory=dict)  # a bare name set here -> "ctx" / "iter"

    @property
    def result_task(self) -> _Task | None:
        return _producer(self.tasks, len(self.tasks) - 1)


def _producer(tasks: list[_Task], index: int) -> _Task | None:
    """The task whose result the task at ``index`` gives: itself, or for a noop without ``result``
    (which passes ``_prev`` through, D10) the task before it."""
    while index > 0 and tasks[index].kind == "noop" and "result" not in tasks[index].node:
        index -= 1
    return tasks[index] if tasks else None


@dataclass
class _Site:
    """Where a template stands: what its names can mean there."""

    kind: str  # task | policy | arc | admit | workbook
    step: _Step | None = None
    task: _Task | None = None
    path: Path = ()


# ------------------------------------------------------------------------------------------ helpers


def _is_map(v: Any) -> bool:
    from ruamel.yaml.comments import CommentedMap

    return isinstance(v, (dict, CommentedMap))


def _is_seq(v: Any) -> bool:
    return isinstance(v, list)


def _cmap(pairs: list[tuple[str, Any]] | None = None) -> Any:
    from ruamel.yaml.comments import CommentedMap

    m = CommentedMap()
    for k, v in pairs or ():
        m[k] = v
    return m


def _cseq(items: list[Any] | None = None) -> Any:
    from ruamel.yaml.comments import CommentedSeq

    return CommentedSeq(items or [])


def _flow(m: Any) -> Any:
    m.fa.set_flow_style()
    return m


def _rename(m: Any, old: str, new: str) -> None:
    """Key ``old`` renamed ``new`` in place (same position, its comments kept)."""
    keys = list(m.keys())
    pos = keys.index(old)
    comments = m.ca.items.pop(old, None) if hasattr(m, "ca") else None
    value = m.pop(old)
    m.insert(pos, new, value)
    if comments is not None:
        m.ca.items[new] = comments


def _insert_after(m: Any, after: str | None, key: str, value: Any) -> None:
    keys = list(m.keys())
    pos = keys.index(after) + 1 if after in keys else len(keys)
    m.insert(pos, key, value)


def _styled(old: Any, text: str) -> Any:
    """``text`` with the YAML style of the string ``old`` (quotes, block)."""
    if type(old) is str:
        return text
    try:
        return type(old)(text)
    except Exception:  # noqa: BLE001 - a style class we do not know: plain text
        return text


# ------------------------------------------------------------------- comments of moved keys
# ruamel.yaml keeps a comment (and blank lines) after a value on the deepest last item of that value:
# ``ca.items[key][2]`` of a mapping, ``ca.items[index][0]`` of a sequence. When a key is popped, or its
# value replaced, the comment goes with it; these helpers find it again and put it back where the text
# that followed it now starts.


def _last_slot(m: Any, key: Any) -> tuple[Any, Any, int]:
    """(container, key, position in its comment entry) of the deepest last item of ``m[key]``: where a
    comment that follows that value is kept."""
    container, k = m, key
    value = m[key]
    while (_is_map(value) or _is_seq(value)) and len(value) and hasattr(value, "fa") and not value.fa.flow_style():
        container, k = value, (list(value.keys())[-1] if _is_map(value) else len(value) - 1)
        value = container[k]
    return container, k, (2 if _is_map(container) else 0)


def _block_scalar(value: Any) -> bool:
    from ruamel.yaml.scalarstring import FoldedScalarString, LiteralScalarString

    return isinstance(value, (LiteralScalarString, FoldedScalarString))


def _slot_token(slot: tuple[Any, Any, int]) -> Any:
    container, k, pos = slot
    entry = container.ca.items.get(k) if hasattr(container, "ca") else None
    return entry[pos] if entry and len(entry) > pos and not isinstance(entry[pos], list) else None


def _tokens_in(node: Any, out: set[int]) -> set[int]:
    if hasattr(node, "ca"):  # an entry of a key no longer there stays in ca.items, and is not written
        live = set(node.keys()) if _is_map(node) else set(range(len(node))) if _is_seq(node) else set()
        for key, entry in node.ca.items.items():
            if key not in live:
                continue
            for tok in entry or ():
                for t in (tok if isinstance(tok, list) else [tok]):
                    if t is not None:
                        out.add(id(t))
    if _is_map(node):
        for v in node.values():
            _tokens_in(v, out)
    elif _is_seq(node):
        for v in node:
            _tokens_in(v, out)
    return out


def _place_token(m: Any, key: Any, token: Any, src_block: bool) -> None:
    """Put ``token`` (taken after a value that was a block scalar or not) after the value of ``m[key]``."""
    container, k, pos = _last_slot(m, key)
    if not hasattr(container, "ca"):
        return
    dst_block = _block_scalar(container[k])
    text = token.value
    if src_block and not dst_block:
        text = "\n" + text  # after a block scalar the line is ended already; after a plain one it is not
    elif dst_block and not src_block and text.startswith("\n"):
        text = text[1:]
    entry = container.ca.items.setdefault(k, [None] * (4 if pos == 2 else 2))
    while len(entry) <= pos:
        entry.append(None)
    if entry[pos] is not None and not isinstance(entry[pos], list):
        existing = entry[pos]
        existing.value = existing.value + (text[1:] if not dst_block and text.startswith("\n") else text)
    else:
        token.value = text
        entry[pos] = token


class _LeftOnTheArc(Exception):
    """An arc's ctx write that no policy can hold: it stays on the arc, for the person to translate."""


class _KeepTrailers:
    """Around the rewriting of a mapping (a step, a task): a comment that followed one of its values
    and is no longer in it afterwards (its key popped, its value replaced) is put back after the same
    key's new value, or, the key gone, after the value that now precedes the key that followed it."""

    def __init__(self, m: Any, handled: set[int]) -> None:
        self.m = m
        self.handled = handled  # ids of the comments put back already (by this or a nested rewrite)
        keys = list(m.keys()) if _is_map(m) and hasattr(m, "ca") else []
        self.kept = []
        self.before: list[tuple[Any, Any, list]] = []  # comments kept before a key (after a flow value)
        for i, k in enumerate(keys):
            slot = _last_slot(m, k)
            tok = _slot_token(slot)
            if tok is not None:
                self.kept.append((k, keys[i + 1] if i + 1 < len(keys) else None, tok,
                                  _block_scalar(slot[0][slot[1]])))
            entry = m.ca.items.get(k)
            if entry and len(entry) > 1 and isinstance(entry[1], list) and entry[1] and i > 0:
                self.before.append((k, keys[i - 1], list(entry[1])))

    def __enter__(self) -> "_KeepTrailers":
        return self

    def __exit__(self, *exc: Any) -> None:
        m = self.m
        if exc[0] is not None or not (self.kept or self.before) or not _is_map(m) or not len(m):
            return
        present = _tokens_in(m, set())
        for key, previous, toks in self.before:
            if all(id(t) in present for t in toks):
                continue
            if key in m:
                entry = m.ca.items.setdefault(key, [None, None, None, None])
                entry[1] = toks
            elif previous in m:
                from ruamel.yaml.error import CommentMark
                from ruamel.yaml.tokens import CommentToken

                text = "".join(" " * (t.column or 0) + t.value for t in toks)
                _place_token(m, previous, CommentToken(text, CommentMark(0)), True)
            present.update(id(t) for t in toks)
        for key, following, tok, src_block in self.kept:
            if id(tok) in present or id(tok) in self.handled:
                continue
            keys = list(m.keys())
            if key in m:
                at = key
            elif following in m and keys.index(following) > 0:
                at = keys[keys.index(following) - 1]
            else:
                at = keys[-1]
            _place_token(m, at, tok, src_block)
            present.add(id(tok))
            self.handled.add(id(tok))


def _writes_of(then: Any) -> set[tuple[str, str]]:
    """(scope, key) of what a rule's ``then`` writes (set_ctx, set_iter)."""
    return {(scope, str(k)) for scope in ("set_ctx", "set_iter") if _is_map(then.get(scope))
            for k in then[scope]}


def _keep_comments(src: Any, key: Any, dst: Any) -> None:
    """``dst[key]``, the same value as ``src[key]`` in a new mapping, keeps its comments."""
    entry = src.ca.items.get(key) if hasattr(src, "ca") else None
    if entry is not None and hasattr(dst, "ca"):
        dst.ca.items[key] = entry


def _carry_comment(src: Any, key: Any, dst: Any, new_key: Any, last_too: bool = False) -> None:
    """The comment on the line of ``src[key]`` (``# why``), kept on ``dst[new_key]`` where the value
    moved. What follows the line of the last key (``last_too`` aside) is what follows the whole
    mapping: it stays, for :class:`_KeepTrailers` to put back where that text starts."""
    if not (hasattr(src, "ca") and hasattr(dst, "ca") and _is_map(src)):
        return
    entry = src.ca.items.get(key)
    if not entry or len(entry) < 3 or entry[2] is None or _block_scalar(src.get(key)):
        return
    text = entry[2].value
    if not text.lstrip(" ").startswith("#"):
        return  # no comment on the key's own line
    keys = list(src.keys())
    cut = text.find("\n")
    if keys and key == keys[-1] and not last_too:
        if not 0 <= cut < len(text) - 1:
            return  # nothing follows the mapping but the comment: it stays with it
        from ruamel.yaml.error import CommentMark
        from ruamel.yaml.tokens import CommentToken

        dst.ca.items[new_key] = [None, None, CommentToken(text[:cut + 1], CommentMark(0)), None]
        entry[2].value = text[cut:]  # the end of the key's line, then the lines after the mapping
        return
    dst.ca.items[new_key] = [None, None, entry[2], None]
    entry[2] = None


def _append_key(m: Any, key: str, value: Any) -> None:
    """``m[key] = value`` at the end of ``m``, the comment that followed ``m``'s last value kept after
    the new one (it is what follows the mapping, such as the blank line before the next step); its
    lines indented under the last value are about that value, and stay there."""
    keys = list(m.keys())
    tok = src_block = None
    if keys:
        slot = _last_slot(m, keys[-1])
        tok = _slot_token(slot)
        if tok is not None:
            src_block = _block_scalar(slot[0][slot[1]])
            try:
                indent = m.lc.key(keys[0])[1]
            except (AttributeError, KeyError, TypeError):  # a mapping the migration made: no columns
                indent = None
            lines = tok.value.split("\n")
            inner = [n for n, line in enumerate(lines) if (n > 0 or src_block) and line.strip()
                     and indent is not None and len(line) - len(line.lstrip(" ")) > indent]
            if inner:
                head, tail = "\n".join(lines[:inner[-1] + 1]) + "\n", "\n".join(lines[inner[-1] + 1:])
                tok.value = head
                if not tail:
                    tok = None
                else:
                    from ruamel.yaml.error import CommentMark
                    from ruamel.yaml.tokens import CommentToken

                    tok, src_block = CommentToken(tail, CommentMark(0)), True
            else:
                slot[0].ca.items[slot[1]][slot[2]] = None
    m[key] = value
    if tok is not None:
        _place_token(m, key, tok, bool(src_block))


def _template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value or "{#" in value)


def _bare_expr(value: Any) -> str | None:
    """The expression of a string that is exactly ``{{ expr }}``."""
    if not isinstance(value, str):
        return None
    s = value.strip()
    if s.startswith("{{") and s.endswith("}}") and s.count("{{") == 1:
        return s[2:-2].strip()
    return None


def _plain(value: Any) -> Any:
    """A ruamel value as plain Python data."""
    if _is_map(value):
        return {str(k): _plain(v) for k, v in value.items()}
    if _is_seq(value):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


# ------------------------------------------------------------------------------------------ migrate


def migrate_text(text: str | bytes, source: str | os.PathLike | None = None) -> Migration:
    """The canonical form of a playbook's text (see the module's doc). ``source``: the file the text was
    read from; given, a python task's ``script`` naming a file in that file's folder is read and
    inlined (M5), and nothing else is read."""
    if isinstance(text, (bytes, bytearray)):
        from .documents import _decode

        try:
            text = _decode(bytes(text))
        except Exception as e:  # noqa: BLE001 - the loader's own refusal, with its reason
            return Migration("", "", invalid=[str(e)])
    original = text
    parsed = parse(text)
    if not parsed.ok:
        return Migration(original, original, invalid=[str(d) for d in parsed.diagnostics])
    value = parsed.value
    if not isinstance(value, dict):
        return Migration(original, original, invalid=["the document is not a mapping: not a playbook"])
    if not isinstance(value.get("workflow"), list) or not value.get("workflow"):
        return Migration(original, original, invalid=["the document has no 'workflow' list of steps: not a playbook"])
    return _Migrator(original, source).run()


class _Migrator:
    def __init__(self, text: str, source: str | os.PathLike | None = None) -> None:
        from ruamel.yaml import YAML

        self.source = source  # the playbook's file: a 'script' is read next to it (M5)
        self.original = text
        self.yaml = YAML(typ="rt")
        self.yaml.preserve_quotes = True
        self.yaml.width = 4096
        mapping, sequence, offset = _guess_indent(text)
        self.yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
        self.doc = self.yaml.load(text)
        self.positions = parse(text, positions=True)
        self.changes: list[Finding] = []
        self.problems: list[Finding] = []
        self.steps: dict[str, _Step] = {}
        self.workload_keys: set[str] = set()
        self.credentials: dict[str, Path] = {}  # stored credentials named by tools (M3)
        self.legacy = False
        self.structural = 0
        self._set_names: dict[int, dict[str, str]] = {}
        # task nodes whose policy received what the legacy runtime ran after the step's tool (a step's
        # 'set', a case's rules): there the step's own name read the result that task's outcome holds
        self._after_step: set[int] = set()
        self._arc_sets: list[tuple[Any, Path, int, Any]] = []  # (step, its path, arc index, {ctx key: value})
        self._step: Any = None  # the step whose structure is being rewritten
        self._handled: set[int] = set()  # comments put back after their key moved (_KeepTrailers)
        self._reads: dict[int, set[str]] = {}  # id(step node) -> the names its templates and code read

    # -------------------------------------------------------------- findings
    def _where(self, path: Path) -> tuple[int | None, int | None]:
        """(line, column) in the text read where ``path`` starts (or the nearest place it had there)."""
        where = position(self.positions, path) if self.positions.ok else None
        return (where[0], where[1]) if where else (None, None)

    def _line(self, path: Path) -> int | None:
        return self._where(path)[0]

    def change(self, rule: str, path: Path, message: str) -> None:
        f = Finding(rule, locate(self.doc, path), message, *self._where(path))
        if f not in self.changes:
            self.changes.append(f)

    def problem(self, rule: str, path: Path, message: str) -> None:
        f = Finding(rule, locate(self.doc, path), message, *self._where(path))
        if f not in self.problems:
            self.problems.append(f)

    def reported(self, path: Path | str) -> bool:
        """Is something needing a person reported at ``path`` (or that location) or inside it already?"""
        where = path if isinstance(path, str) else locate(self.doc, path)
        return any(p.location == where or p.location.startswith(where + ".") for p in self.problems)

    # -------------------------------------------------------------- driver
    def run(self) -> Migration:
        doc = self.doc
        self.header()
        wl = doc.get("workload")
        self.workload_keys = {str(k) for k in wl} if _is_map(wl) else set()
        workflow = doc["workflow"]
        def script(spec: Any) -> str | None:  # the code a 'script' names, when it will be inlined (M5)
            return read_script(spec, self.source)[0]

        self._reads = {id(st): _names_read(st, script) for st in workflow if _is_map(st)}
        wb = doc.get("workbook")
        self._reads[id(wb)] = _names_read(wb, script) if wb is not None else set()
        for i, st in enumerate(workflow):
            if not _is_map(st):
                self.problem("M6", ("workflow", i), "a step that is not a mapping")
                continue
            self._step = st
            self.step_structure(st, ("workflow", i))
        self._step = None
        self.workbook()
        self.structural = len(self.changes)
        self.legacy = self.structural > 0 or self.bare_names_used()
        self.build_model()
        if self.legacy or self.end_unrouted():
            self.implicit_end()
            self.build_model()
        self.keychain()
        self.templates()
        if self.legacy:
            self.guard_conditions()
        self.python()
        self.drop_return_steps()
        text = self.original
        if self.changes:
            out = io.StringIO()
            self.yaml.dump(self.doc, out)
            text = out.getvalue()
        self.validate(text)
        if self.changes and not self.problems:
            self.lint(text)
        return Migration(self.original, text, self.changes, self.problems)

    def validate(self, text: str) -> None:
        from .validate import validate_text

        result = validate_text(text)
        for d in result.errors:
            if d.location.endswith(".code") and self.reported(d.location[:-len("code")] + "script"):
                continue  # the code is in the file 'script' names, which was not read: said already
            if any(p.location == d.location or p.location.startswith(d.location + ".")
                   or d.location.startswith(p.location + ".") for p in self.problems):
                continue  # said already, in the words of the rule that could not translate it
            f = Finding("V", d.location, f"still invalid after the migration: {d.message}", d.line, d.column)
            if f not in self.problems:
                self.problems.append(f)

    def lint(self, text: str) -> None:
        """What the migration wrote must not fail when it runs: an error of ``noetl lint`` (a name that is
        not there, a ctx key nothing writes, ...; docs/lint.md) in the migrated text needs a person. A
        playbook the migration leaves as it is gets none (that is ``noetl lint``'s to say)."""
        from .lint import lint_text

        for f in lint_text(text).findings:
            if f.severity != "error" or f.code == "L000":
                continue
            at = f", line {f.line}, column {f.column} of the migrated text" if f.line is not None else ""
            finding = Finding("V", f.location, f"the migrated playbook fails when this runs: {f.message} "
                              f"(noetl lint {f.code}{at})", *(self._where(f.path) if self._line(f.path)
                                                               else (f.line, f.column)))
            if finding not in self.problems:
                self.problems.append(finding)

    # ======================================================================= M0: header
    def header(self) -> None:
        doc = self.doc
        if doc.get("apiVersion") != API_VERSION:
            old = doc.get("apiVersion")
            if "apiVersion" in doc:
                doc["apiVersion"] = API_VERSION
            else:
                doc.insert(0, "apiVersion", API_VERSION)
            self.change("M0", ("apiVersion",), f"apiVersion {old!r} -> {API_VERSION!r}" if old else
                        f"apiVersion: {API_VERSION} added")
        if doc.get("kind") != "Playbook":
            if "kind" in doc:
                doc["kind"] = "Playbook"
            else:
                _insert_after(doc, "apiVersion", "kind", "Playbook")
            self.change("M0", ("kind",), "kind: Playbook")
        meta = doc.get("metadata")
        if not _is_map(meta):
            meta = _cmap()
            _insert_after(doc, "kind", "metadata", meta)
            self.change("M0", ("metadata",), "metadata added")
        for key in ("name", "path", "version", "description"):
            if key in doc and key not in meta:
                meta[key] = doc.pop(key)
                self.change("M0", (key,), f"root '{key}' moved into metadata")
        if "name" not in meta:
            meta["name"] = "migrated"
            self.problem("M0", ("metadata",), "metadata has no name: 'migrated' was put there; give the playbook its name")
        if "path" not in meta:
            meta["path"] = str(meta.get("name"))
            self.change("M0", ("metadata",), "metadata.path set to the playbook's name (the catalog path)")
        if "vars" in doc:
            self.problem("M4", ("vars",), "root 'vars' has no canonical equivalent: move constants into workload, "
                                          "state into ctx (set_ctx)")

    # ======================================================================= structure
    def step_structure(self, st: Any, path: Path) -> None:
        with _KeepTrailers(st, self._handled):
            self._step_structure(st, path)

    def _step_structure(self, st: Any, path: Path) -> None:
        name = st.get("step")
        if "type" in st:
            kind = st.get("type")
            if kind in ("start", "end", "router") :
                st.pop("type")
                self.change("M6", path + ("type",), f"'type: {kind}' dropped (a step needs no type)")
            elif isinstance(kind, str) and "tool" not in st:
                st.pop("type")
                st.insert(1, "tool", kind)
                self.change("M6", path + ("type",), f"'type: {kind}' -> 'tool: {{kind: {kind}}}'")
        tool = st.get("tool")
        if isinstance(tool, str):
            self.tool_shorthand(st, path)
        elif _is_map(tool) and "kind" not in tool and len(tool) == 1 and _is_map(next(iter(tool.values()))):
            label = next(iter(tool))
            st["tool"] = _cseq([self.label_task(label, tool[label])])
            self.change("M6", path + ("tool",), f"the task '{label}: {{...}}' -> '- name: {label}'")
        tool = st.get("tool")
        if _is_seq(tool):
            for j, item in enumerate(list(tool)):
                if _is_map(item) and "kind" not in item and "tool" not in item and len(item) == 1 \
                        and _is_map(next(iter(item.values()))):
                    label = next(iter(item))
                    tool[j] = self.label_task(label, item[label])
                    self.change("M6", path + ("tool", j), f"the task '{label}: {{...}}' -> '- name: {label}'")
                elif _is_map(item) and _is_map(item.get("tool")):
                    tool[j] = self.flatten_tool(item)
                    self.change("M6", path + ("tool", j), "a task's nested 'tool: {kind...}' flattened")
        elif _is_map(tool) and _is_map(tool.get("tool")):
            st["tool"] = self.flatten_tool(tool)
            self.change("M6", path + ("tool",), "a task's nested 'tool: {kind...}' flattened")
        tool = st.get("tool")
        tasks: list[tuple[Any, Path]] = []
        if _is_map(tool):
            tasks = [(tool, path + ("tool",))]
        elif _is_seq(tool):
            tasks = [(t, path + ("tool", j)) for j, t in enumerate(tool) if _is_map(t)]
        for key in ("input", "args", "with"):
            if key in st:
                self.step_input(st, path, key, tasks)
        selections = [(st, path, k) for k in ("output", "output_select") if k in st]
        selections += [(t, p, "output_select") for t, p in tasks if "output_select" in t]
        step_retry = st.pop("retry", None)
        paging, step_retry = paginate.take(tasks, step_retry, path)  # translated below, the task's fields first
        for task, tpath in tasks:
            if step_retry is not None and "retry" not in task:
                task["retry"] = _copy(step_retry)
            self.task_structure(task, tpath, in_loop="loop" in st)
        if paging is not None:
            done = paginate.translate(st, paging, self.workload_keys)
            for at, message in done.changes:
                self.change("M6", at, message)
            if done.problem:
                self.problem("M6", *done.problem)
        if step_retry is not None:
            if not tasks:
                self.problem("M6", path + ("retry",), "'retry' on a step without a tool: dropped")
            else:
                self.change("M6", path + ("retry",), "the step's 'retry' moved to its task(s) (as a policy rule)")
        if "when" in st:
            self.step_when(st, path)
        if "loop" in st:
            self.loop(st, path)
        if "case" in st:
            self.case(st, path)
        for key in ("eval_mode", "case_mode", "next_policy", "branch_order"):
            self.legacy_spec_key(st, path, key)
        self.next(st, path)
        # step-level set (M4): after the pipeline
        for key in ("set", "set_ctx", "set_iter", "vars"):
            if key in st:
                self.step_set(st, path, key)
        for arc_set in [a for a in self._arc_sets if a[0] is st]:
            self.arc_set_ctx(*arc_set)
        if selections:
            self.step_output(st, path, tasks, selections)
        if "pool" in st:
            pool = st.pop("pool")
            spec = st.setdefault("spec", _cmap())
            if _is_map(spec):
                spec["pool"] = pool
            self.change("M6", path + ("pool",), "the step's 'pool' -> spec.pool (the worker pool)")
        if name == "end" and "tool" not in st and "next" not in st:
            st["tool"] = _flow(_cmap([("kind", "noop")]))
            self.change("M6", path, "the 'end' step gets a noop tool (a step needs a tool or a next, D4)")
        for key in list(st.keys()):
            if key not in _STEP_KEYS and not self.reported(path + (key,)):
                self.problem("M6", path + (key,), f"step key '{key}' has no canonical equivalent: "
                             + ("save results with a task of the pipeline" if key in ("save", "sink") else
                                "remove it or move it into a task"))

    def step_input(self, st: Any, path: Path, key: str, tasks: list[tuple[Any, Path]]) -> None:
        """A step's ``input:`` (or ``args:``, ``with:``) was what its tool received: canonically a task
        receives its ``args`` (D25, D4: python binds each as a variable, a playbook task passes them to the
        child's entry step, a workbook task to the workbook task); a step has none."""
        values = st[key]
        ipath = path + (key,)
        if not _is_map(values):
            self.problem("M6", ipath, f"the step's '{key}' is not a mapping: give the task its args by hand")
            return
        takers = [(t, p) for t, p in tasks if "args" in _FIELDS.get(str(t.get("kind")), ())]
        if len(tasks) != 1 or len(takers) != 1:
            kinds = ", ".join(str(t.get("kind")) for t, _ in tasks) or "none"
            self.problem("M6", ipath, f"the step's '{key}' (what its tool received): a step has no args; only a "
                         f"python, playbook or workbook task takes args, and this step's tool is {len(tasks)} task(s) "
                         f"({kinds}): give each task that reads these values its own args, or write them into its "
                         "fields")
            return
        task, tpath = takers[0]
        own_key = next((k for k in ("args", "input", "with") if k in task), None)
        own = task.get(own_key) if own_key else None
        if own is not None and not _is_map(own):
            self.problem("M6", ipath, f"the step's '{key}' and the task's own '{own_key}', which is not a mapping: "
                         "merge them by hand")
            return
        clash = sorted(str(k) for k in values if own is not None and k in own)
        if clash:
            self.problem("M6", ipath, f"the step's '{key}' and the task's '{own_key}' both give {', '.join(clash)}: "
                         "keep one value of each in the task's args")
            return
        st.pop(key)
        if own is None:
            keys = list(task.keys())
            at = next((k for k in ("code", "script", "code_b64", "code_base64") if k in keys), None)
            task.insert(keys.index(at) if at else len(keys), "args", values)
        else:
            for k, v in values.items():
                own[k] = v
                _keep_comments(values, k, own)
        self.change("M6", ipath, f"the step's '{key}' -> the task's args (a task receives args; a step has none)")

    def step_output(self, st: Any, path: Path, tasks: list[tuple[Any, Path]],
                    selections: list[tuple[Any, Path, str]]) -> None:
        """A step's ``output: {select: PATH}`` (or ``output_select: PATH`` on the step or its last task)
        chose the part of the tool's result the step stored. Canonically a step's result is its last
        task's result (D11), and a ``noop`` task's ``result:`` is what it renders (D10): a noop that
        renders ``{{ _prev.PATH }}`` is appended (PATH then read as the task's kind gives its result,
        M7). Anything else that shapes the result needs a person."""
        why = None
        (holder, hpath, key), = selections if len(selections) == 1 else ((None, path, "output"),)
        kpath = hpath + (key,) if holder is not None else path
        value = holder.get(key) if holder is not None else None
        if len(selections) > 1:
            why = "several of 'output' and 'output_select' are given"
        elif "loop" in st:
            why = "on a loop step the selection applied to the list of iteration results; a task of the loop runs " \
                  "per iteration: select in the next step from the loop's result"
        elif holder is not st and (not tasks or holder is not tasks[-1][0]):
            why = "on a task that is not the step's last, the selection changed what later tasks read as its " \
                  "result: read the part itself where it is used (<task>.result.PATH)"
        elif not tasks:
            why = "a step without a tool stores nothing to select from"
        selector = None
        if why is None:
            selector = value.get("select", value.get("path")) if key == "output" and _is_map(value) and \
                set(value) <= {"select", "path"} else value if key == "output_select" else None
            if not isinstance(selector, str) or not selector.strip():
                why = ("it shapes the result ('output' other than {select: PATH})" if key == "output"
                       else "it is not a path into the result")
        expr = None
        if why is None:
            text = selector.strip()
            text = text[2:] if text.startswith("$.") else text
            from .migrate_jinja import _chain, parse_expression

            try:
                base, chain = _chain(parse_expression("_prev." + text))
                ok = type(base) is nodes.Name and base.name == "_prev" and all(k in ("attr", "key") for k, _ in chain)
            except Exception:  # noqa: BLE001 - not a path
                ok = False
            if not ok or _template(text):
                why = f"{selector!r} is not a path of names and indexes into the result"
            else:
                expr = "{{ _prev.%s }}" % text
        name = f"{st.get('step')}_output"
        if why is None and any(_is_map(t) and t.get("name") == name for t, _ in tasks):
            why = f"a task named '{name}' is there already"
        if why is not None:
            self.problem("M6", kpath, f"'{key}' chose what the step stores, and {why}. A step's result is its last "
                         "task's result (D11): append a noop task whose result: renders what the step should store "
                         "from _prev (D10), e.g. {name: " + name + ", kind: noop, result: \"{{ _prev.items }}\"}")
            return
        holder.pop(key)
        tool = st["tool"]
        if _is_map(tool):
            if "name" not in tool:
                tool.insert(0, "name", f"{st.get('step')}_task")  # its name as a single task (D4), kept
            st["tool"] = tool = _cseq([tool])
        tool.append(_flow(_cmap([("name", name), ("kind", "noop"), ("result", expr)])))
        self.change("M6", kpath, f"'{key}: {selector}' -> a noop task '{name}' whose result is {expr} (a step's result "
                    "is its last task's, D10, D11)")

    def tool_shorthand(self, st: Any, path: Path) -> None:
        kind = st.pop("tool")
        if kind in ("router", "start", "end", "noop"):
            if kind == "noop":
                st.insert(1, "tool", _flow(_cmap([("kind", "noop")])))
            self.change("M6", path + ("tool",), f"'tool: {kind}' shorthand" + (" -> {kind: noop}" if kind == "noop"
                                                                               else " dropped"))
            return
        task = _cmap([("kind", kind)])
        for key in list(st.keys()):
            if key in _TOOL_FIELDS_AT_STEP or (kind == "workbook" and key == "name"):
                task[key] = st.pop(key)
        if kind == "workbook" and "name" in task and "task" not in task:
            _rename(task, "name", "task")
        keys = list(st.keys())
        pos = keys.index("desc") + 1 if "desc" in keys else 1
        st.insert(pos, "tool", task)
        self.change("M6", path + ("tool",), f"'tool: {kind}' with the tool's fields on the step -> "
                                            f"'tool: {{kind: {kind}, ...}}'")

    def label_task(self, label: str, inner: Any) -> Any:
        task = _cmap([("name", label)])
        if _is_map(inner.get("tool")):
            inner = self.flatten_tool(inner)
        for k, v in inner.items():
            if k != "name":
                task[k] = v
                _keep_comments(inner, k, task)
        return task

    def flatten_tool(self, item: Any) -> Any:
        """``{name?, tool: {kind, ...}, retry?, ...}`` (a task wrapping its tool) -> one task mapping."""
        out = _cmap()
        for k, v in item.items():
            if k == "tool" and _is_map(v):
                for k2, v2 in v.items():
                    out[k2] = v2
                    _keep_comments(v, k2, out)
            elif k == "tool" and isinstance(v, str):
                out["kind"] = v
            else:
                out[k] = v
                _keep_comments(item, k, out)
        return out

    # -------------------------------------------------------------- tasks
    def task_structure(self, t: Any, path: Path, in_loop: bool) -> None:
        with _KeepTrailers(t, self._handled):
            self._task_structure(t, path, in_loop)

    def _task_structure(self, t: Any, path: Path, in_loop: bool) -> None:
        kind = t.get("kind")
        if kind is None and "type" in t:
            _rename(t, "type", "kind")
            kind = t["kind"]
            self.change("M6", path + ("type",), "'type' -> 'kind'")
        if kind == "sink" or "sink" in t or "save" in t:
            for key in ("sink", "save"):
                if key in t:
                    self.problem("M6", path + (key,), f"'{key}' is not a tool field: store results with a task of "
                                 "their own (postgres, duckdb, http) that reads the result")
        if kind == "python":
            self.python_fields(t, path)
        elif kind == "http":
            self.http_fields(t, path)
        elif kind in ("postgres", "duckdb"):
            self.sql_fields(t, path, kind)
        elif kind == "playbook":
            if "return_step" in t:
                pass  # kept until the model is built (M7); removed there
            for key in ("payload", "data"):
                if key in t and "workload" not in t:
                    _rename(t, key, "workload")
                    self.change("M6", path + (key,), f"playbook '{key}' -> 'workload' (merged over the child's)")
        if "credential" in t or "credentials" in t:
            for key in ("credential", "credentials"):
                if key in t:
                    if "auth" not in t:
                        _rename(t, key, "auth")
                        self.change("M3", path + (key,), f"'{key}' -> 'auth' (a keychain entry)")
                    else:
                        t.pop(key)
                        self.change("M3", path + (key,), f"'{key}' dropped ('auth' is given)")
        if "auth" in t:
            self.auth(t, path, kind)
        if "timeout" in t and kind not in ("http", "wait"):
            timeout = t.pop("timeout")
            spec = t.setdefault("spec", _cmap())
            if _is_map(spec) and "timeout" not in spec:
                spec["timeout"] = timeout
            self.change("M6", path + ("timeout",), "'timeout' -> spec.timeout (seconds)")
        if "pool" in t or "pool_name" in t or "pool_params" in t:
            for key in ("pool", "pool_name", "pool_params"):
                if key in t:
                    t.pop(key)
                    self.change("M6", path + (key,), f"'{key}' dropped: the engine keeps one connection pool per "
                                                     "connection string on each worker")
        if "eval" in t:
            self.eval_block(t, path)
        spec = t.get("spec")
        if _is_map(spec) and "policy" in spec:
            self.policy(t, path)
        if "retry" in t:
            self.retry(t, path)
        for key in ("set", "set_ctx", "set_iter"):
            if key in t:
                self.task_set(t, path, key, in_loop)
        if "assert" in t:
            t.pop("assert")
            self.change("M6", path + ("assert",), "'assert' (input/output contract) dropped: the engine does not check it")
        if isinstance(kind, str) and kind in _FIELDS:
            for key in list(t.keys()):
                if key not in _FIELDS[kind] and key not in ("return_step",) and not self.reported(path + (key,)) \
                        and not (key == "output_select" and self._step is not None):  # the step's (step_output)
                    self.problem("M6", path + (key,), f"the {kind} tool has no field '{key}': "
                                 + _NO_FIELD.get(key, "remove it or express it another way (docs/tools.md)"))
        elif kind is not None and not (isinstance(kind, str) and kind in _FIELDS):
            self.problem("M6", path + ("kind",), f"tool kind {kind!r} has no canonical equivalent here "
                                                 f"(the kinds: {', '.join(sorted(_FIELDS))})")

    def python_fields(self, t: Any, path: Path) -> None:
        for key in ("code_b64", "code_base64"):
            if key in t and "code" not in t:
                try:
                    code = base64.b64decode(str(t[key]), validate=True).decode("utf-8")
                except (binascii.Error, UnicodeDecodeError):
                    self.problem("M5", path + (key,), f"'{key}' is not base64 of UTF-8 text")
                    continue
                from ruamel.yaml.scalarstring import LiteralScalarString

                _rename(t, key, "code")
                t["code"] = LiteralScalarString(code)
                self.change("M5", path + (key,), f"'{key}' decoded into 'code'")
        if "script" in t:
            self.script(t, path)
        libs = t.get("libs")
        if libs is not None:
            imports = _imports_of(libs)
            if imports is None:
                self.problem("M5", path + ("libs",), "'libs' must map aliases to modules")
            elif isinstance(t.get("code"), str):
                t.pop("libs")
                t["code"] = _styled(t["code"], "\n".join(imports) + "\n" + str(t["code"]))
                self.change("M5", path + ("libs",), "'libs' -> import statements at the top of the code")
        for key in ("with", "data"):
            if key in t and "args" not in t and "input" not in t:
                _rename(t, key, "args")
                self.change("M6", path + (key,), f"python '{key}' -> 'args'")

    def script(self, t: Any, path: Path) -> None:
        """``script:`` named a file holding the code: read and put into ``code`` when it lies in the
        playbook's folder (see :func:`read_script`), else it needs a person."""
        spath = path + ("script",)
        if "code" in t:
            self.problem("M5", spath, "'script' and 'code' both given: keep the one that is the code")
            return
        code, why = read_script(t["script"], self.source)
        if code is None:
            self.problem("M5", spath, f"code from a file ('script'): {why}: put the file's code into 'code'")
            return
        from ruamel.yaml.scalarstring import LiteralScalarString

        _rename(t, "script", "code")
        t["code"] = LiteralScalarString(code if code.endswith("\n") else code + "\n")
        self.change("M5", spath, f"'script' -> 'code': {why}")

    def http_fields(self, t: Any, path: Path) -> None:
        method = str(t.get("method", "GET")).upper()
        for key in ("payload", "data"):
            value = t.get(key)
            if value is None or (key == "data" and not _is_map(value)):
                continue
            if _is_map(value) and set(value.keys()) <= {"query", "body"} and value:
                t.pop(key)
                if "query" in value:
                    t["params"] = value["query"]
                if "body" in value:
                    t["json"] = value["body"]
                self.change("M6", path + (key,), f"http '{key}.query/body' -> 'params'/'json'")
                continue
            target = "params" if method == "GET" else "json"
            if target in t:
                self.problem("M6", path + (key,), f"http '{key}' and '{target}' both given: merge them by hand")
                continue
            _rename(t, key, target)
            self.change("M6", path + (key,), f"http '{key}' -> '{target}' (the {method} request's "
                                             + ("query parameters)" if target == "params" else "JSON body)"))
        if "verify_ssl" in t:
            if "verify" in t:
                self.problem("M6", path + ("verify_ssl",), "'verify_ssl' and 'verify' both given: keep one")
            else:
                _rename(t, "verify_ssl", "verify")
                self.change("M6", path + ("verify_ssl",), "http 'verify_ssl' -> 'verify'")

    def sql_fields(self, t: Any, path: Path, kind: str) -> None:
        if "commands" in t and "command" not in t and "query" not in t:
            cmds = t["commands"]
            if _is_seq(cmds) and all(isinstance(c, str) for c in cmds):
                from ruamel.yaml.scalarstring import LiteralScalarString

                text = "\n".join(c.rstrip().rstrip(";") + ";" for c in cmds) + "\n"
                _rename(t, "commands", "command")
                t["command"] = LiteralScalarString(text)
                self.change("M6", path + ("commands",), "'commands' (a list) -> one 'command' of several statements")
            elif isinstance(cmds, str):
                _rename(t, "commands", "command")
                self.change("M6", path + ("commands",), "'commands' -> 'command'")
        if kind == "postgres":
            for key in ("connection_string", "connection"):
                if key in t and "dsn" not in t and isinstance(t[key], str):
                    _rename(t, key, "dsn")
                    self.change("M6", path + (key,), f"'{key}' -> 'dsn'")
            if "database" in t:
                self.problem("M6", path + ("database",), "a task's 'database' cannot override the credential's: "
                             "store a credential for that database (dbname) and name it in 'auth', or give a 'dsn'")
        if kind == "duckdb":
            for key in ("database", "db", "path"):
                if key in t and "db_path" not in t:
                    _rename(t, key, "db_path")
                    self.change("M6", path + (key,), f"duckdb '{key}' -> 'db_path'")

    # -------------------------------------------------------------- M3: credentials
    def auth(self, t: Any, path: Path, kind: Any) -> None:
        auth = t["auth"]
        name = None
        if _is_map(auth):
            for key in ("credential", "key", "name"):
                if isinstance(auth.get(key), str):
                    name = auth[key]
                    break
            if name is None or (kind == "http" and auth.get("type") in ("bearer", "basic") and
                                ("token" in auth or "username" in auth)):
                if kind == "http" and name is None:
                    return  # an inline {type, token} / {type, username, password}: canonical as it is
                self.problem("M3", path + ("auth",), "an 'auth' mapping with no credential name: name a keychain entry")
                return
            t["auth"] = name
            self.change("M3", path + ("auth",), f"'auth: {{...}}' -> 'auth: {name}' (a keychain entry)")
        elif isinstance(auth, str):
            name = auth
        else:
            self.problem("M3", path + ("auth",), "'auth' must name a keychain entry")
            return
        expr = _bare_expr(name)
        if expr is not None:
            key = expr[len("workload."):] if expr.startswith("workload.") else expr
            default = self.doc.get("workload", {}).get(key) if _is_map(self.doc.get("workload")) else None
            if IDENT.match(key) and isinstance(default, str) and not _template(default):
                t["auth"] = default
                name = default
                self.change("M3", path + ("auth",), f"'auth: {auth}' -> '{default}' (the workload's default; a "
                            "credential name given at run time is no longer read: auth names a keychain entry)")
            else:
                self.problem("M3", path + ("auth",), "a templated 'auth': name the keychain entry itself")
                return
        if isinstance(name, str) and name not in self.credentials:
            self.credentials[name] = path + ("auth",)

    def keychain(self) -> None:
        """M3: each stored credential a tool names directly gets a keychain entry of that name."""
        kc = self.doc.get("keychain")
        if kc is not None and not _is_seq(kc):
            if _is_map(kc):  # {name: {...}} -> [{name, ...}]
                entries = _cseq()
                for k, v in kc.items():
                    entries.append(_cmap([("name", k)] + (list(v.items()) if _is_map(v) else [])))
                self.doc["keychain"] = kc = entries
                self.change("M3", ("keychain",), "keychain as a mapping -> a list of named entries")
            else:
                self.problem("M3", ("keychain",), "keychain must be a list of entries")
                return
        existing: set[str] = set()
        for i, e in enumerate(kc or []):
            if not _is_map(e):
                continue
            existing.add(str(e.get("name")))
            kind = e.get("kind")
            if kind not in ("credential", "static", "env"):
                if kind in ("postgres_credential", "credential_ref", "secret", "postgres", "http", "bearer",
                            "basic", "api_key") or kind is None:
                    e["kind"] = "credential"
                    if "credential" not in e and isinstance(e.get("key"), str):
                        _rename(e, "key", "credential")
                    self.change("M3", ("keychain", i, "kind"), f"keychain kind {kind!r} -> credential (a stored "
                                "credential: `noetl credential add`)")
                else:
                    self.problem("M3", ("keychain", i, "kind"), f"keychain kind {kind!r} has no canonical equivalent "
                                 "(credential, static, env): tokens obtained at run time need a task that fetches them")
        new = [(n, p) for n, p in self.credentials.items() if n not in existing]
        if not new:
            return
        if kc is None:
            kc = _cseq()
            keys = list(self.doc.keys())
            pos = keys.index("workload") + 1 if "workload" in keys else keys.index("workflow")
            self.doc.insert(pos, "keychain", kc)
        for name, p in new:
            kc.append(_flow(_cmap([("name", name), ("kind", "credential")])))
            self.change("M3", p, f"keychain entry '{name}' added (kind credential: the stored credential "
                                 f"'{name}', `noetl credential add {name} ...`)")

    # -------------------------------------------------------------- M6: policies
    def policy(self, t: Any, path: Path) -> None:
        spec = t["spec"]
        pol = spec["policy"]
        ppath = path + ("spec", "policy")
        if _is_seq(pol):
            spec["policy"] = pol = _cmap([("rules", pol)])
            self.change("M6", ppath, "a policy given as a list of rules -> {rules: [...]}")
        if not _is_map(pol) or not _is_seq(pol.get("rules")):
            return
        rules = pol["rules"]
        for i, rule in enumerate(rules):
            rpath = ppath + ("rules", i)
            if not _is_map(rule):
                continue
            if "else" in rule and _is_map(rule["else"]) and "then" not in rule["else"]:
                body = rule["else"]
                rule["else"] = _cmap([("then", body)])
                self.change("M6", rpath + ("else",), "'else:' without 'then:' -> 'else: {then: ...}'")
            if "when" in rule and isinstance(rule["when"], bool):
                if rule["when"] is True and i == len(rules) - 1 and not any(_is_map(r) and "else" in r for r in rules):
                    then = rule.get("then")
                    rules[i] = _cmap([("else", _cmap([("then", then)]))])
                    self.change("M6", rpath + ("when",), "'when: true' as the last rule -> 'else'")
                    rule = rules[i]
                else:
                    rule["when"] = "{{ %s }}" % ("true" if rule["when"] else "false")
                    self.change("M6", rpath + ("when",), "a boolean 'when' -> a template")
            if "expr" in rule and "when" not in rule:
                _rename(rule, "expr", "when")
                self.change("M6", rpath + ("expr",), "'expr' -> 'when'")
            then = rule.get("then") if "else" not in rule else (rule["else"] or {}).get("then")
            if "then" not in rule and "else" not in rule and "do" in rule:  # {when, do, ...} flat
                body = _cmap([(k, rule.pop(k)) for k in list(rule.keys()) if k != "when"])
                rule["then"] = then = body
                self.change("M6", rpath, "a rule's directive moved under 'then'")
            if _is_map(then):
                self.then_fields(then, rpath, in_loop=False)

    def then_fields(self, then: Any, rpath: Path, in_loop: bool) -> None:
        if then.get("backoff") == "fixed":
            then["backoff"] = "none"
            self.change("M6", rpath + ("then", "backoff"), "'backoff: fixed' -> 'none' (the same delay each time)")
        for old, new in (("max_attempts", "attempts"), ("delay_seconds", "delay"), ("max_delay_seconds", "max_delay")):
            if old in then and new not in then:
                _rename(then, old, new)
                self.change("M6", rpath + ("then", old), f"'{old}' -> '{new}'")
        if "set" in then:
            self.split_set(then, then.pop("set"), rpath + ("then", "set"), in_loop)

    def eval_block(self, t: Any, path: Path) -> None:
        """The legacy tool-level ``eval: [{expr|when, do, ...}, {else: {do...}}]`` -> spec.policy.rules."""
        ev = t.pop("eval")
        if not _is_seq(ev):
            self.problem("M6", path + ("eval",), "'eval' must be a list of rules")
            return
        rules = _cseq()
        for item in ev:
            if not _is_map(item):
                continue
            if "else" in item:
                body = item["else"]
                body = body.get("then", body) if _is_map(body) else _cmap([("do", "continue")])
                rules.append(_cmap([("else", _cmap([("then", body)]))]))
                continue
            when = item.get("when", item.get("expr"))
            body = item.get("then") if _is_map(item.get("then")) else \
                _cmap([(k, v) for k, v in item.items() if k not in ("when", "expr")])
            rules.append(_cmap([("when", when), ("then", body)]))
        spec = t.setdefault("spec", _cmap())
        pol = spec.setdefault("policy", _cmap())
        if _is_map(pol) and "rules" not in pol:
            pol["rules"] = rules
            self.change("M6", path + ("eval",), "'eval' -> spec.policy.rules (D9)")
        else:
            self.problem("M6", path + ("eval",), "'eval' and spec.policy both given: merge them by hand")

    def retry(self, t: Any, path: Path) -> None:
        """``retry:`` (a count or a block) -> a first policy rule that retries errors (D9)."""
        retry = t.pop("retry")
        rpath = path + ("retry",)
        then = _cmap([("do", "retry")])
        when = "{{ outcome.status == 'error' }}"
        if isinstance(retry, bool) or retry is None:
            if not retry:
                self.change("M6", rpath, "'retry: false' dropped")
                return
            attempts = None
        elif isinstance(retry, int):
            attempts = retry
        elif _is_map(retry):
            for key in ("on_success", "stop_when", "retry_when", "while", "until", "next_call", "collect", "poll"):
                if key in retry:
                    self.problem("M6", rpath + (key,), f"'retry.{key}' (pagination or polling by retry) has no "
                                 "canonical equivalent: page with a task policy that jumps back (docs/migrate.md)")
                    t["retry"] = retry
                    return
            if "when" in retry and isinstance(retry["when"], str):
                when = retry["when"]
            attempts = retry.get("max_attempts", retry.get("attempts"))
            backoff = retry.get("backoff")
            delay = retry.get("delay", retry.get("initial_delay", retry.get("delay_seconds")))
            max_delay = retry.get("max_delay", retry.get("max_delay_seconds"))
            kind = None
            if _is_map(backoff):
                kind = backoff.get("type")
                delay = backoff.get("delay_seconds", backoff.get("delay", delay))
                max_delay = backoff.get("max_delay_seconds", backoff.get("max_delay", max_delay))
                if backoff.get("jitter"):
                    then["jitter"] = True
            elif isinstance(backoff, str):
                kind = backoff
            elif isinstance(retry.get("backoff_multiplier"), (int, float)):
                kind = "exponential" if retry["backoff_multiplier"] != 1 else "none"
            if kind is not None:
                then["backoff"] = {"fixed": "none", "constant": "none"}.get(kind, kind)
            if delay is not None:
                then["delay"] = delay
            if max_delay is not None:
                then["max_delay"] = max_delay
        else:
            self.problem("M6", rpath, "'retry' must be a number of attempts or a mapping")
            return
        if attempts is not None:
            then.insert(1, "attempts", attempts)
        rule = _cmap([("when", when), ("then", _flow(then))])
        spec = t.setdefault("spec", _cmap())
        pol = spec.setdefault("policy", _cmap())
        if not _is_map(pol):
            self.problem("M6", rpath, "'retry' and a policy that is not a mapping: merge them by hand")
            return
        rules = pol.setdefault("rules", _cseq())
        rules.insert(0, rule)
        self.change("M6", rpath, "'retry' -> a first policy rule {do: retry}" +
                    (f" (attempts {attempts}, the first included)" if attempts is not None else ""))

    # -------------------------------------------------------------- M4: set
    def split_set(self, then: Any, values: Any, spath: Path, in_loop: bool, names: dict | None = None,
                  report: bool = True, carry_last: bool = False) -> None:
        """``set: {ctx.x: v, iter.y: v, z: v}`` (or a list of {name, value}) -> set_ctx / set_iter."""
        pairs: list[tuple[str, Any]] = []
        if _is_map(values):
            pairs = [(str(k), v) for k, v in values.items()]
        elif _is_seq(values):
            for item in values:
                if _is_map(item) and "name" in item:
                    pairs.append((str(item["name"]), item.get("value")))
        else:
            self.problem("M4", spath, "'set' must be a mapping")
            return
        for key, value in pairs:
            scope, _, name = key.partition(".")
            if not name:
                scope, name = ("iter" if in_loop else "ctx"), key
                if names is not None:
                    names[name] = scope
            elif scope == "vars":
                scope = "ctx"
            elif scope == "args":
                self.problem("M4", spath, f"'set: {{{key}: ...}}' in a policy: args are set on arcs")
                continue
            elif scope not in ("ctx", "iter"):
                self.problem("M4", spath, f"'set' key {key!r}: only ctx.* and iter.* can be set")
                continue
            if "." in name:
                self.problem("M4", spath, f"'set' key {key!r}: nested keys are not set one by one; set the whole "
                             f"value of '{name.split('.')[0]}'")
                continue
            target = then.setdefault(f"set_{scope}", _cmap())
            target[name] = value
            _carry_comment(values, key, target, name, carry_last)
        if report:
            self.change("M4", spath, "'set' -> " + " and ".join(sorted({f"set_{k.split('_')[1]}" for k in then
                                                                      if k in ("set_ctx", "set_iter")})))

    def _ok_policy(self, t: Any) -> tuple[Any, Any]:
        """The task's policy rules, made to exist: (rules, the else rule's 'then') where the else is the
        rule that applies to a successful outcome. A task without a policy gets {error: fail, else:
        continue}, which is what no policy does (D9)."""
        if hasattr(t, "fa") and t.fa.flow_style() and "spec" not in t:
            t.fa.set_block_style()  # a one-line task that gets a policy of several rules: written as a block
        spec = t.setdefault("spec", _cmap())
        pol = spec.setdefault("policy", _cmap())
        rules = pol.setdefault("rules", _cseq())
        for r in rules:
            if _is_map(r) and "else" in r and _is_map(r["else"]) and _is_map(r["else"].get("then")):
                return rules, r["else"]["then"]
        if not rules:
            rules.append(_cmap([("when", "{{ outcome.status == 'error' }}"), ("then", _flow(_cmap([("do", "fail")])))]))
        then = _cmap([("do", "continue")])
        rules.append(_cmap([("else", _cmap([("then", then)]))]))
        return rules, then

    def task_set(self, t: Any, path: Path, key: str, in_loop: bool) -> None:
        values = t.pop(key)
        self.task_set_output(values, path + (key,), t.get("kind"))
        rules, then = self._ok_policy(t)
        before = _writes_of(then)
        try:
            self._task_set(t, path, key, in_loop, values, then)
        finally:
            self._spread(rules, then, before)

    def _spread(self, rules: Any, then: Any, before: set[tuple[str, str]]) -> None:
        """The legacy runtime ran a ``set`` after the task (or step) whatever its policy decided: what
        the else rule now writes (new since ``before``) is written by every other rule that lets the
        pipeline go on (continue, jump) too, unless that rule writes the key itself."""
        new = [(scope, k) for scope, k in _writes_of(then) - before]
        if not new:
            return
        for r in rules:
            other = r.get("then") if _is_map(r) and "else" not in r else None
            if not _is_map(other) or other is then or other.get("do") not in ("continue", "jump"):
                continue
            for scope, k in sorted(new):
                target = other.setdefault(scope, _cmap())
                if k not in target:
                    target[k] = _copy(then[scope][k])

    def _task_set(self, t: Any, path: Path, key: str, in_loop: bool, values: Any, then: Any) -> None:
        if key == "set":
            st = self._step
            if st is not None and in_loop:
                self.split_set(then, values, path + (key,), in_loop, self.step_names_of(st))
                return
            if st is not None and _is_map(values):
                # a bare name that only this step's pipeline reads is the run's own: iter (D6, the
                # run's scratch scope outside loops); one another step reads is the execution's: ctx
                elsewhere = set().union(*(r for k, r in self._reads.items() if k != id(st)))
                names = self.step_names_of(st)
                local = _cmap()
                for k in list(values.keys()):
                    if "." not in str(k) and str(k) not in elsewhere:
                        _carry_comment(values, k, local, k)
                        local[k] = values.pop(k)
                        names[str(k)] = "iter"
                if local:
                    self.split_set(then, local, path + (key,), True, report=False, carry_last=True)
                    self.change("M4", path + (key,), f"the task's 'set' of {', '.join(map(str, local))} -> set_iter: "
                                "only later tasks of the same pipeline read it (iter is the run's own scope, D6)")
                if not values:
                    return
                self.split_set(then, values, path + (key,), in_loop, names)
                return
            self.split_set(then, values, path + (key,), in_loop)
        elif _is_map(values):
            target = then.setdefault(key, _cmap())
            for k, v in values.items():
                target[k] = v
            self.change("M4", path + (key,), f"the task's '{key}' -> its policy's else rule")

    def task_set_output(self, values: Any, spath: Path, kind: Any) -> None:
        """In a task's own ``set:`` the legacy ``output`` was the task's result; in the policy rule the set
        moves to, ``output`` is the outcome (D8): ``{{ output.data }}`` -> ``{{ outcome.result.data }}``
        (then read as the task's kind gives its result, M7)."""
        def resolve(ref: Ref) -> Any:
            if ref.root != "output":
                return None
            if kind == "http" and not ref.path:
                raise NeedsPerson("the whole result of an http task ('output') is now the response body (the legacy "
                                  "{status_code, headers, data} is gone): read 'outcome.result' knowing that")
            return Ref("outcome", [("attr", "result")] + ref.path)

        def walk(node: Any, p: Path) -> None:
            items = list(node.items()) if _is_map(node) else list(enumerate(node)) if _is_seq(node) else []
            for k, v in items:
                if isinstance(v, str) and _template(v):
                    out = rewrite(v, resolve)
                    for problem in out.problems:
                        self.problem("M4", p + (k,), problem)
                    if out.text != v and not out.problems:
                        node[k] = _styled(v, out.text)
                        for old, new in out.changed:
                            self.change("M4", p + (k,), f"{{{{ {old} }}}} -> {{{{ {new} }}}} (in a task's 'set', "
                                        "'output' was the task's result)")
                else:
                    walk(v, p + (k,))

        walk(values, spath)

    def step_set(self, st: Any, path: Path, key: str) -> None:
        values = st.pop(key)
        in_loop = "loop" in st
        tool = st.get("tool")
        if in_loop and key != "set_iter":
            self.problem("M4", path + (key,), f"a loop step's '{key}' ran once after the loop; the canonical policy "
                         "runs per iteration: compute it in the next step from the loop's result (event.result)")
            st[key] = values
            return
        if tool is None:
            self.problem("M4", path + (key,), f"'{key}' on a step without a tool: set it on the arc's args instead")
            st[key] = values
            return
        last = self._after_tool(st)
        names = self.step_names_of(st)
        rules, then = self._ok_policy(last)
        before = _writes_of(then)
        if key in ("set", "vars"):
            self.split_set(then, values, path + (key,), in_loop, names)
        else:
            target = then.setdefault(key, _cmap())
            for k, v in (values.items() if _is_map(values) else []):
                target[k] = v
            self.change("M4", path + (key,), f"the step's '{key}' -> the policy of its last task")
        self._spread(rules, then, before)

    def _after_tool(self, st: Any) -> Any:
        """The task whose policy runs what the legacy runtime ran after the step's tool: the last task,
        or a noop appended to pass its result through when that task has a policy of its own (or the
        last task of a list is not a task)."""
        tool = st["tool"]
        if _is_map(tool) or (_is_seq(tool) and len(tool) and _is_map(tool[-1])
                              and not ((tool[-1].get("spec") or {}).get("policy") if _is_map(tool[-1].get("spec"))
                                       else None)
                              or _is_seq(tool) and len(tool) and id(tool[-1]) in self._after_step):
            last = tool if _is_map(tool) else tool[-1]
        else:
            last = _cmap([("name", f"{st.get('step')}_set"), ("kind", "noop")])
            tool.append(last)
        self._after_step.add(id(last))
        return last

    def arc_set_ctx(self, st: Any, path: Path, index: int, writes: Any) -> None:
        """An arc's ``set: {ctx.x: v}``: an arc cannot write ctx (D12: only a task policy's ``set_ctx``
        does), so the write moves to the policy that runs after the step's tool (as a step's ``set``),
        in a rule that holds when that arc is the one taken."""
        spath = path + ("next", "arcs", index, "set")
        arcs = st["next"]["arcs"]
        try:
            self._arc_set_ctx(st, spath, arcs, index, writes)
        except _LeftOnTheArc:
            arc = arcs[index]  # what needs a person stays where it was written
            kept = arc.setdefault("set", _cmap())
            for k, v in writes.items():
                kept[f"ctx.{k}"] = v

    def _arc_set_ctx(self, st: Any, spath: Path, arcs: Any, index: int, writes: Any) -> None:
        exclusive = not (_is_map(st["next"].get("spec")) and st["next"]["spec"].get("mode") == "inclusive")
        if "loop" in st:
            self.problem("M4", spath, "a loop step's arc 'set' of ctx ran once after the loop; a task policy runs per "
                         "iteration: compute it in the next step from the loop's result (event.result)")
            raise _LeftOnTheArc
        if not st.get("tool"):
            self.problem("M4", spath, "an arc 'set' of ctx on a step without a tool: an arc cannot write ctx; pass "
                         "the values as arc args")
            raise _LeftOnTheArc
        conds = []
        for j, arc in enumerate(arcs):
            if j > index or (j < index and not exclusive):
                continue
            when = arc.get("when") if _is_map(arc) else None
            if when is None:
                if j < index:  # an earlier arc without a condition is taken on every success
                    self.problem("M4", spath, f"an arc 'set' of ctx on an arc that follows arc {j}, which has no "
                                 "'when': it is taken only when the step fails; write the ctx in a rule by hand")
                    raise _LeftOnTheArc
                continue
            expr = _bare_expr(when)
            if expr is None:
                self.problem("M4", spath, f"an arc 'set' of ctx under a 'when' that is not one expression ({when!r}): "
                             "write the rule that sets it in the step's last task policy by hand")
                raise _LeftOnTheArc
            conds.append(f"({expr})" if j == index else f"not ({expr})")
        if conds and len(conds) > 1:  # 'not (W0)' says nothing more when this arc's W1 is exactly that
            from .migrate_jinja import parse_expression

            def ast(text: str) -> Any:
                try:
                    return parse_expression(text)
                except Exception:  # noqa: BLE001 - not comparable: kept
                    return None

            own = ast(conds[-1])
            conds = [c for c in conds[:-1] if own is None or ast(c) != own] + conds[-1:]
        last = self._after_tool(st)
        rules, ok_then = self._ok_policy(last)
        if not conds:
            target = ok_then.setdefault("set_ctx", _cmap())
            for k, v in writes.items():
                target[k] = v
                _carry_comment(writes, k, target, k, last_too=True)
            self.change("M4", spath, "arc 'set' of ctx -> set_ctx in the policy after the step's tool (its else rule: "
                        "the arc is taken on every success)")
            return
        then = _cmap([("do", "continue")])
        both = _cmap()
        for k, v in (ok_then.get("set_ctx") or {}).items():
            both[k] = _copy(v)  # the else rule's own writes, which this rule would otherwise skip
        for k, v in writes.items():
            both[k] = v
            _carry_comment(writes, k, both, k, last_too=True)
        then["set_ctx"] = both
        for k in ("set_iter",):
            if k in ok_then:
                then[k] = _copy(ok_then[k])
        when = "{{ outcome.status == 'ok' and %s }}" % " and ".join(conds)
        at = next(n for n, r in enumerate(rules) if _is_map(r) and "else" in r)
        rules.insert(at, _cmap([("when", when), ("then", then)]))
        self.change("M4", spath, "arc 'set' of ctx -> a rule of the policy after the step's tool that sets it when "
                    "the arc is the one taken (an arc cannot write ctx, D12)")

    def step_names_of(self, st: Any) -> dict:
        return self._set_names.setdefault(id(st), {})

    # -------------------------------------------------------------- M6: step when, loop, next
    def step_when(self, st: Any, path: Path) -> None:
        when = st.pop("when")
        if isinstance(when, bool):
            when = "{{ %s }}" % ("true" if when else "false")
        spec = st.setdefault("spec", _cmap())
        pol = spec.setdefault("policy", _cmap())
        if "admit" in pol:
            self.problem("M6", path + ("when",), "a step 'when' and spec.policy.admit both given: merge them by hand")
            return
        pol["admit"] = _cmap([("rules", _cseq([
            _cmap([("when", when), ("then", _flow(_cmap([("allow", True)])))]),
            _cmap([("else", _cmap([("then", _flow(_cmap([("allow", False)])))]))])]))])
        self.change("M6", path + ("when",), "the step's 'when' -> spec.policy.admit.rules (D17)")

    def loop(self, st: Any, path: Path) -> None:
        loop = st["loop"]
        lpath = path + ("loop",)
        if not _is_map(loop):
            return
        for old, new in (("collection", "in"), ("items", "in"), ("element", "iterator"), ("item", "iterator")):
            if old in loop and new not in loop:
                _rename(loop, old, new)
                self.change("M6", lpath + (old,), f"loop '{old}' -> '{new}'")
        if "iterator" not in loop and "in" in loop:
            loop["iterator"] = "item"
            self.change("M6", lpath, "loop without an iterator name: 'item' (the legacy default)")
        for key in ("mode", "max_in_flight", "concurrency"):
            if key in loop:
                spec = loop.setdefault("spec", _cmap())
                new = "max_in_flight" if key == "concurrency" else key
                if new not in spec:
                    spec[new] = loop.pop(key)
                else:
                    loop.pop(key)
                self.change("M6", lpath + (key,), f"loop '{key}' -> loop.spec.{new}")
        spec = loop.get("spec")
        if _is_map(spec):
            pol = spec.get("policy")
            if _is_map(pol) and "mode" in pol and "mode" not in spec:
                pass  # read by the engine as it is
            mif = spec.get("max_in_flight")
            if isinstance(mif, str):
                expr = _bare_expr(mif)
                key = expr[len("workload."):] if expr and expr.startswith("workload.") else expr
                default = self.doc.get("workload", {}).get(key) if key and _is_map(self.doc.get("workload")) else None
                if isinstance(default, int) and not isinstance(default, bool):
                    spec["max_in_flight"] = default
                    self.change("M6", lpath + ("spec", "max_in_flight"), f"templated max_in_flight -> {default} (the "
                                "workload's default; it is a number fixed in the playbook, a value given at run "
                                "time is no longer read)")
                else:
                    self.problem("M6", lpath + ("spec", "max_in_flight"), "a templated max_in_flight: write a number")
            for key in ("batch_size", "on_error"):
                if key in spec:
                    value = spec.pop(key)
                    if key == "on_error" and value in ("continue", "ignore"):
                        sspec = st.setdefault("spec", _cmap())
                        pol = sspec.setdefault("policy", _cmap())
                        pol.setdefault("failure", _cmap([("mode", "best_effort")]))
                        self.change("M6", lpath + ("spec", key), "loop on_error: continue -> the step's "
                                    "spec.policy.failure.mode best_effort")
                    else:
                        self.change("M6", lpath + ("spec", key), f"loop spec.{key} dropped (no equivalent; "
                                    "iterations travel in chunks on their own)")

    def next(self, st: Any, path: Path) -> None:
        nxt = st.get("next")
        npath = path + ("next",)
        if nxt is None:
            return
        arcs = None
        mode = None
        if isinstance(nxt, str):
            arcs = _cseq([_cmap([("step", nxt)])])
        elif _is_seq(nxt):
            arcs = _cseq()
            for item in nxt:
                if isinstance(item, str):
                    arcs.append(_cmap([("step", item)]))
                elif _is_map(item) and ("then" in item or "else" in item) and "step" not in item:
                    when = item.get("when")
                    for target in _steps_of(item.get("then")):
                        arcs.append(_cmap([("step", target[0])] + ([("when", when)] if when is not None else [])
                                          + ([("args", target[1])] if target[1] is not None else [])))
                    if "else" in item and when is not None:
                        neg = "{{ not (%s) }}" % _bare_expr(when) if _bare_expr(when) else None
                        for target in _steps_of(item.get("else")):
                            if neg is None:
                                self.problem("M6", npath, "an 'else' of a non-expression 'when': write its arc by hand")
                                continue
                            arcs.append(_cmap([("step", target[0]), ("when", neg)]
                                              + ([("args", target[1])] if target[1] is not None else [])))
                elif _is_map(item):
                    arcs.append(item)
            whens = [a for a in arcs if "when" in a]
            mode = "inclusive" if len(arcs) - len(whens) > 1 else None
        elif _is_map(nxt) and "arcs" not in nxt and ("to" in nxt or "step" in nxt):
            arcs = _cseq([_cmap([("step", s)] + ([("args", a)] if a is not None else []))
                          for s, a in _steps_of(nxt.get("to", [nxt]))])
            if len(arcs) > 1:
                mode = "inclusive"
        if arcs is not None:
            router = _cmap()
            if mode:
                router["spec"] = _flow(_cmap([("mode", mode)]))
            router["arcs"] = arcs
            st["next"] = router
            self.change("M6", npath, "'next' list -> a router {arcs: [...]}" +
                        (f" (mode {mode}: the legacy runtime started every target)" if mode else ""))
        router = st.get("next")
        if not _is_map(router) or not _is_seq(router.get("arcs")):
            return
        for i, arc in enumerate(router["arcs"]):
            if not _is_map(arc):
                continue
            apath = npath + ("arcs", i)
            for old in ("data", "with", "input"):
                if old in arc and "args" not in arc:
                    _rename(arc, old, "args")
                    self.change("M6", apath + (old,), f"arc '{old}' -> 'args'")
            if isinstance(arc.get("when"), bool):
                if arc["when"] is True:
                    arc.pop("when")
                    self.change("M6", apath + ("when",), "arc 'when: true' dropped (an arc without when follows "
                                                        "step.done and loop.done)")
                else:
                    arc["when"] = "{{ false }}"
                    self.change("M6", apath + ("when",), "arc 'when: false' -> a template")
            if "set" in arc:
                comment = arc.ca.items.pop("set", None) if hasattr(arc, "ca") else None
                values = arc.pop("set")
                writes, kept, moved = _cmap(), _cmap(), 0
                for k, v in (values.items() if _is_map(values) else []):
                    scope, _, name = str(k).partition(".")
                    if not name:
                        scope, name = "args", str(k)
                    if scope == "vars":
                        scope = "ctx"
                    if scope == "ctx" and "." not in name:
                        writes[name] = v
                        _carry_comment(values, k, writes, name)
                        continue
                    if scope != "args":
                        self.problem("M4", apath + ("set",), f"arc 'set: {{{k}: ...}}': an arc cannot write {scope}"
                                     + ("" if scope != "ctx" else " key by key; set the whole value of "
                                        f"'{name.split('.')[0]}'") + ", or pass it as an arc arg")
                        kept[k] = v  # left on the arc, for the person
                        continue
                    arc.setdefault("args", _cmap())[name] = v
                    _carry_comment(values, k, arc["args"], name)
                    moved += 1
                if moved:
                    self.change("M4", apath + ("set",), "arc 'set' -> arc 'args'")
                if kept:
                    arc["set"] = kept
                    if comment is not None:
                        arc.ca.items["set"] = comment
                if writes:
                    self._arc_sets.append((st, path, i, writes))
                if comment and len(comment) > 2 and comment[2] is not None and "set" not in arc and len(arc):
                    # the comment after a flow 'set: {...}  # why' follows what the arc now ends with
                    _place_token(arc, list(arc.keys())[-1], comment[2], False)
            if "priority" in arc:
                arc.pop("priority")
                self.change("M8", apath + ("priority",), "arc 'priority' dropped: arcs are taken in order")

    def legacy_spec_key(self, st: Any, path: Path, key: str) -> None:
        spec = st.get("spec")
        where = st if key in st else (spec if _is_map(spec) and key in spec else None)
        if where is None:
            return
        value = where.pop(key)
        kpath = path + (("spec",) if where is spec else ()) + (key,)
        if key == "eval_mode" and value == "on_event":
            self.problem("M8", kpath, "eval_mode on_event (a step reacting to every event) has no canonical "
                         "equivalent: wait for a signal (kind: wait, D30) or a timer (D29) in a task")
        elif key == "case_mode" and value == "inclusive":
            nxt = st.get("next")
            if _is_map(nxt):
                spec2 = nxt.setdefault("spec", _cmap())
                spec2["mode"] = "inclusive"
            self.change("M8", kpath, "case_mode inclusive -> the router's mode inclusive")
        else:
            self.change("M8", kpath, f"'{key}: {value}' dropped (the canonical step has one pipeline and one router)")
        if _is_map(spec) and not spec:
            st.pop("spec")

    # -------------------------------------------------------------- M8: case
    def case(self, st: Any, path: Path) -> None:
        """``case: [{when, then}, ..., {else}]`` -> arcs (next), policy rules (set, retry, fail) and tasks
        reached by jumps (a branch's tasks), as docs/migrate.md (M8) says."""
        cases = st.pop("case")
        cpath = path + ("case",)
        if not _is_seq(cases):
            self.problem("M8", cpath, "'case' must be a list")
            return
        spec = st.get("spec") if _is_map(st.get("spec")) else {}
        if spec.get("eval_mode") == "on_event" or st.get("eval_mode") == "on_event":
            self.problem("M8", cpath, "a case evaluated on every event (eval_mode on_event) cannot be translated")
            return
        arcs = _cseq()
        rules = _cseq()
        branch_tasks: list[tuple[str, list[Any]]] = []
        tool = st.get("tool")
        for i, branch in enumerate(cases):
            bpath = cpath + (i,)
            if not _is_map(branch):
                continue
            if "else" in branch:
                when = None
                then = branch["else"]
                then = then.get("then", then) if _is_map(then) else then
            else:
                when = branch.get("when")
                then = branch.get("then")
            if isinstance(when, str) and _reads_event(when, ("step.enter", "call.started")):
                self.problem("M8", bpath, "a case on the step's entry (step.enter) cannot be translated: admission "
                             "(spec.policy.admit) decides before the step runs and cannot run tasks")
                continue
            actions = _actions_of(then)
            if actions is None:
                self.problem("M8", bpath + ("then",), "a case's 'then' must be a mapping or a list of actions")
                continue
            tasks_here = []
            rule_then = _cmap()
            for key, value in actions:
                if key == "next":
                    for target, args in _steps_of(value.get("to", value) if _is_map(value) else value):
                        arc = _cmap([("step", target)])
                        if when is not None:
                            arc["when"] = when
                        if args is not None:
                            arc["args"] = args
                        arcs.append(arc)
                elif key in ("set", "vars"):
                    self.split_set(rule_then, value, bpath + ("then", key), "loop" in st, self.step_names_of(st))
                elif key in ("set_ctx", "set_iter"):
                    rule_then[key] = value
                elif key == "retry":
                    rule_then["do"] = "retry"
                    if _is_map(value):
                        for k, v in value.items():
                            k = {"max_attempts": "attempts"}.get(str(k), str(k))
                            if k in ("attempts", "delay", "backoff", "max_delay", "jitter"):
                                rule_then[k] = {"fixed": "none"}.get(v, v) if k == "backoff" else v
                    elif isinstance(value, int):
                        rule_then["attempts"] = value
                elif key == "fail":
                    rule_then["do"] = "fail"
                elif key == "task":
                    tasks_here.append(value)
                else:
                    self.problem("M8", bpath + ("then", key), f"a case action '{key}' has no canonical equivalent")
            if tasks_here:
                if not tool:
                    st["tool"] = tool = _cseq(tasks_here)
                    tasks_here = []
                else:
                    first = tasks_here[0].get("name") if _is_map(tasks_here[0]) else None
                    rule_then["do"] = "jump"
                    rule_then["to"] = first
                    branch_tasks.append((str(first), tasks_here))
            if rule_then:
                rule_then = _cmap([("do", rule_then.get("do", "continue"))] +
                                  [(k, v) for k, v in rule_then.items() if k != "do"])
                if when is None:
                    rules.append(_cmap([("else", _cmap([("then", rule_then)]))]))
                else:
                    rules.append(_cmap([("when", when), ("then", rule_then)]))
        if arcs:
            if st.get("next") is not None:
                self.problem("M8", cpath, "a case with 'next' and the step's own 'next': merge the arcs by hand")
            else:
                st["next"] = _cmap([("arcs", arcs)])
        if rules or branch_tasks:
            if tool is None:
                self.problem("M8", cpath, "a case that sets variables or runs tasks on a step without a tool")
                return
            if _is_map(tool):
                name = tool.get("name") or f"{st.get('step')}_task"
                tool.insert(0, "name", name) if "name" not in tool else None
                st["tool"] = tool = _cseq([tool])
            last = tool[-1]
            spec_last = last.get("spec") if _is_map(last.get("spec")) else {}
            if _is_map(spec_last.get("policy")):
                self.problem("M8", cpath, "a case that sets variables or runs tasks after a task that has its own "
                             "policy: merge the rules by hand")
                return
            if not any("do: retry" in str(r) or "error" in str(r.get("when", "")) for r in rules if _is_map(r)):
                rules.insert(0, _cmap([("when", "{{ outcome.status == 'error' }}"),
                                       ("then", _flow(_cmap([("do", "fail")])))]))
            if branch_tasks and not any(_is_map(r) and "else" in r for r in rules):
                rules.append(_cmap([("else", _cmap([("then", _flow(_cmap([("do", "break")])))]))]))
            if hasattr(last, "fa") and last.fa.flow_style() and "spec" not in last:
                last.fa.set_block_style()  # a one-line task that gets a policy: written as a block
            last.setdefault("spec", _cmap())["policy"] = _cmap([("rules", rules)])
            self._after_step.add(id(last))
            for _, tasks in branch_tasks:
                for k, task in enumerate(tasks):
                    if k == len(tasks) - 1 and _is_map(task) and len(branch_tasks) > 1:
                        task.setdefault("spec", _cmap())["policy"] = _cmap([("rules", _cseq([
                            _cmap([("else", _cmap([("then", _flow(_cmap([("do", "break")])))]))])]))])
                    tool.append(task)
                    if _is_map(task):
                        self.task_structure(task, path + ("tool", len(tool) - 1), in_loop="loop" in st)
        self.change("M8", cpath, "'case' -> " + ", ".join(x for x in (
            "arcs" if arcs else "", "policy rules" if rules else "", "tasks reached by jump" if branch_tasks else "")
            if x))

    # -------------------------------------------------------------- workbook
    def workbook(self) -> None:
        wb = self.doc.get("workbook")
        if wb is None:
            return
        items = list(wb.items()) if _is_map(wb) else list(enumerate(wb)) if _is_seq(wb) else []
        for key, task in items:
            if not _is_map(task):
                continue
            path: Path = ("workbook", key)
            if _is_map(task.get("tool")) or isinstance(task.get("tool"), str):
                new = self.flatten_tool(task)
                wb[key] = task = new
                self.change("M6", path, "a workbook task's 'tool' flattened into the task")
            if "task" in task and "name" not in task and _is_seq(wb):
                _rename(task, "task", "name")
                self.change("M6", path + ("task",), "a workbook task's 'task' -> 'name'")
            self.task_structure(task, path, in_loop=False)

    # ======================================================================= model
    def build_model(self) -> None:
        self.steps = {}
        for i, st in enumerate(self.doc["workflow"]):
            if not _is_map(st) or not isinstance(st.get("step"), str):
                continue
            s = _Step(st["step"], st, i)
            loop = st.get("loop")
            if _is_map(loop):
                s.loop = True
                if isinstance(loop.get("iterator"), str):
                    s.iterator = loop["iterator"]
            s.set_names = dict(self._set_names.get(id(st), {}))
            tool = st.get("tool")
            if _is_map(tool):
                s.tasks = [self._task(tool, tool.get("name") or f"{s.name}_task", 0)]
            elif _is_seq(tool):
                s.tasks = [self._task(t, t.get("name") or f"task_{j}", j) for j, t in enumerate(tool) if _is_map(t)]
            self.steps[s.name] = s

    def _task(self, t: Any, name: str, index: int) -> _Task:
        task = _Task(str(name), str(t.get("kind")), t, index)
        if task.kind in ("postgres", "duckdb"):
            cmd = t.get("command", t.get("query"))
            if isinstance(cmd, str):
                from ..tools.postgres import split_statements

                try:
                    task.statements = max(1, len(split_statements(cmd)))
                except Exception:  # noqa: BLE001 - an unsplittable command: one statement
                    task.statements = 1
        if task.kind == "playbook" and "return_step" in t:
            task.return_step = str(t["return_step"])
        return task

    def drop_return_steps(self) -> None:
        """M7: ``return_step`` goes; the reads of the task's result were rewritten to read that step."""
        for s in self.steps.values():
            for t in s.tasks:
                if t.return_step is not None and "return_step" in t.node:
                    t.node.pop("return_step")
                    p = ("workflow", s.index, "tool") + ((t.index,) if _is_seq(s.node.get("tool")) else ())
                    self.change("M7", p + ("return_step",), f"'return_step: {t.return_step}' dropped: the task's "
                                f"result is the child's {{execution_id, status, ctx, steps}}; reads of it now read "
                                f"{s.name}.result.steps.{t.return_step}.result")

    def end_unrouted(self) -> bool:
        """A step named ``end`` that no arc goes to and that is not the entry step: canonically it never
        runs, so the playbook can only be legacy there (the legacy runtime went to ``end`` from every
        step without ``next``), whatever else of it reads as canonical."""
        from .validate import entry_step

        if "end" not in self.steps or entry_step(self.doc) == "end":
            return False
        for s in self.steps.values():
            nxt = s.node.get("next")
            arcs = nxt.get("arcs") if _is_map(nxt) else None
            if _is_seq(arcs) and any(_is_map(a) and a.get("step") == "end" for a in arcs):
                return False
        return True

    def implicit_end(self) -> None:
        """M6: the legacy runtime went on to the step named ``end`` from a step with no ``next``."""
        if "end" not in self.steps:
            return
        for s in self.steps.values():
            if s.name == "end" or "next" in s.node:
                continue
            _append_key(s.node, "next", _cmap([("arcs", _cseq([_cmap([("step", "end")])]))]))
            self.change("M6", ("workflow", s.index), "a step without 'next' -> an arc to 'end' (the legacy "
                                                    "runtime went there)")

    # ======================================================================= templates
    def bare_names_used(self) -> bool:
        """Does any template read a name the canonical language does not define where it stands, and
        that the legacy reading translates? A name nothing translates (it needs a person) is no sign of
        the dialect: it is left as it is, and a second migration must read the file as the first wrote
        it."""
        self.build_model()
        found = []

        def probe(site: _Site) -> Callable[[Ref], Any]:
            def resolve(ref: Ref) -> Any:
                if not self._canonical_root(ref.root, site):
                    try:
                        new, _ = self._resolve(ref, site)
                    except NeedsPerson:
                        new = None
                    if new is not None:
                        found.append(ref.root)
                return None
            return resolve

        for value, site, _ in self._template_sites():
            rewrite(value, probe(site))
            if found:
                return True
        return False

    def _canonical_root(self, root: str, site: _Site) -> bool:
        if root in TEMPLATE_GLOBALS or root in {"workload", "ctx", "args", "execution_id", "keychain"}:
            return True
        if site.kind in ("task", "policy", "workbook") and root in {"iter", "_prev", "_task", "_attempt"}:
            return True
        if site.kind == "policy" and root in {"outcome", "output"}:
            return True
        if site.kind == "arc" and root == "event":
            return True
        if root in self.steps:
            return True
        if site.step is not None and root in {t.name for t in site.step.tasks}:
            return True
        return False

    def _template_sites(self) -> Iterator[tuple[str, _Site, tuple]]:
        """Every template string: (text, site, (container, key, path))."""
        for s in list(self.steps.values()):
            st, base = s.node, ("workflow", s.index)
            loop = st.get("loop")
            if _is_map(loop) and "in" in loop:
                yield from self._strings(loop, "in", _Site("admit", s, None, base + ("loop", "in")),
                                         base + ("loop", "in"))
            spec = st.get("spec")
            admit = ((spec.get("policy") or {}).get("admit") if _is_map(spec) and _is_map(spec.get("policy")) else None)
            if _is_map(admit) and _is_seq(admit.get("rules")):
                for i, rule in enumerate(admit["rules"]):
                    p = base + ("spec", "policy", "admit", "rules", i)
                    if _is_map(rule):
                        yield from self._walk(rule, _Site("admit", s, None, p), p)
            tool = st.get("tool")
            tasks = [(tool, base + ("tool",))] if _is_map(tool) else \
                [(t, base + ("tool", j)) for j, t in enumerate(tool)] if _is_seq(tool) else []
            for (t, p), task in zip([x for x in tasks if _is_map(x[0])], s.tasks):
                for key in list(t.keys()):
                    if key in ("name", "kind", "desc") or (key == "code" and task.kind == "python"):
                        continue
                    if key == "spec":
                        yield from self._policy_sites(t, s, task, p)
                        continue
                    yield from self._strings(t, key, _Site("task", s, task, p + (key,)), p + (key,))
            nxt = st.get("next")
            if _is_map(nxt) and _is_seq(nxt.get("arcs")):
                for i, arc in enumerate(nxt["arcs"]):
                    p = base + ("next", "arcs", i)
                    if _is_map(arc):
                        for key in ("when", "args", "spec"):
                            if key in arc:
                                yield from self._strings(arc, key, _Site("arc", s, None, p + (key,)), p + (key,))
        wb = self.doc.get("workbook")
        items = list(wb.items()) if _is_map(wb) else list(enumerate(wb)) if _is_seq(wb) else []
        for key, t in items:
            if not _is_map(t):
                continue
            p = ("workbook", key)
            task = _Task(str(t.get("name", key)), str(t.get("kind")), t, 0)
            for k in list(t.keys()):
                if k in ("name", "kind", "desc") or (k == "code" and task.kind == "python"):
                    continue
                if k == "spec":
                    yield from self._policy_sites(t, None, task, p)
                    continue
                yield from self._strings(t, k, _Site("workbook", None, task, p + (k,)), p + (k,))

    def _policy_sites(self, t: Any, s: _Step | None, task: _Task, p: Path) -> Iterator:
        spec = t.get("spec")
        pol = spec.get("policy") if _is_map(spec) else None
        if _is_map(pol) and _is_seq(pol.get("rules")):
            for i, rule in enumerate(pol["rules"]):
                rp = p + ("spec", "policy", "rules", i)
                if _is_map(rule):
                    yield from self._walk(rule, _Site("policy", s, task, rp), rp)

    def _strings(self, container: Any, key: Any, site: _Site, path: Path) -> Iterator:
        value = container[key]
        if isinstance(value, str):
            if _template(value):
                yield value, site, (container, key, path)
        elif _is_map(value) or _is_seq(value):
            yield from self._walk(value, site, path)

    def _walk(self, node: Any, site: _Site, path: Path) -> Iterator:
        items = list(node.items()) if _is_map(node) else list(enumerate(node))
        for k, v in items:
            yield from self._strings(node, k, site, path + (k,))

    def templates(self) -> None:
        for value, site, (container, key, path) in list(self._template_sites()):
            if self.reported(path):
                continue  # a construct that could not be translated: its templates stay as they are
            resolver = self._resolver(site, path)
            out = rewrite(value, resolver)
            for problem in out.problems:
                self.problem("M1", path, problem)
            if out.text != value:
                container[key] = _styled(value, out.text)
                rule = ",".join(dict.fromkeys(resolver.rules)) or "M1"
                for old, new in out.changed:
                    self.change(rule, path, f"{{{{ {old} }}}} -> {{{{ {new} }}}}")

    def guard_conditions(self) -> None:
        """M7: a condition that reads into an error that is null. The legacy runtime read an attribute of
        a missing value as undefined, false in a condition; canonically a condition is strict (D9), so
        ``outcome.error.retryable`` on an ok outcome (its ``error`` is null) fails the pipeline, and
        ``event.error.kind`` on a done step ends its routing. Each such read is guarded by its error:
        ``(outcome.error and outcome.error.retryable)`` is that same false on success, and the value
        itself on an error. Reads under ``| default`` or ``is defined``, or guarded already, stay."""
        for value, site, (container, key, path) in list(self._template_sites()):
            if path[-1] != "when" or site.kind not in ("policy", "arc") or self.reported(path):
                continue
            if path[-3] != ("rules" if site.kind == "policy" else "arcs"):
                continue  # a rule's or an arc's own when, not a key 'when' in a value

            def resolve(ref: Ref, site: _Site = site) -> Any:
                if ref.tolerant or len(ref.path) < 2 or ref.path[0] != ("attr", "error"):
                    return None
                roots = {"outcome", "output"} if site.kind == "policy" else {"event"}
                tasks = {t.name for t in site.step.tasks} if site.step is not None and site.kind == "policy" else set()
                if ref.root not in roots and ref.root not in self.steps and ref.root not in tasks:
                    return None
                from .migrate_jinja import build

                return nodes.And(build(ref.root, ref.path[:1]), build(ref.root, ref.path))

            out = rewrite(value, resolve)
            if out.text != value and not out.problems:
                container[key] = _styled(value, out.text)
                for old, new in out.changed:
                    self.change("M7", path, f"{{{{ {old} }}}} -> {{{{ {new} }}}} (an error's field read where there "
                                "may be no error: the legacy runtime read it as false, a condition here fails on it)")

    # -------------------------------------------------------------- the resolver
    def _resolver(self, site: _Site, path: Path) -> Any:
        m = self

        class R:
            rules: list[str] = []
            event_names = ({"step.exit": "step.done", "call.exit": "call.done"} if site.kind == "arc" else
                           {"step.exit": "call.done", "step.done": "call.done"} if site.kind == "policy" else None)

            def __call__(self, ref: Ref) -> Any:
                new, rule = m._resolve(ref, site)
                if new is not None:
                    self.rules.append(rule)
                return new

        r = R()
        r.rules = []
        return r

    def _resolve(self, ref: Ref, site: _Site) -> tuple[Any, str]:
        root, path = ref.root, ref.path
        step = site.step
        tasks = {t.name: t for t in step.tasks} if step is not None else {}
        if root in TEMPLATE_GLOBALS:
            return None, ""
        if root in ("workload", "ctx", "args", "execution_id", "keychain", "iter", "_task", "_attempt"):
            return None, ""
        if root in ("outcome", "output") and site.kind == "policy":
            return self._reshape_outcome(root, path, site.task), "M7"
        if root == "event" and site.kind == "arc":
            if path[:1] == [("attr", "result")] and self.legacy and step is not None:
                new = self._reshape(step, path[1:], what=f"step '{step.name}'")
                return (Ref("event", [("attr", "result")] + new) if new != path[1:] else None), "M7"
            return None, ""
        if root == "event" and site.kind == "policy":  # a case's condition, now a task policy's (M8)
            if path[:1] == [("attr", "name")]:
                return nodes.CondExpr(nodes.Compare(_attr("outcome", "status"), [nodes.Operand("eq", nodes.Const("ok"))]),
                                      nodes.Const("call.done"), nodes.Const("call.error")), "M8"
            if path[:1] == [("attr", "result")]:
                return Ref("outcome", path), "M8"
            raise NeedsPerson(f"'event.{_path_text(path)}' in a task policy: only outcome is known there")
        if root == "_prev" and site.kind in ("task", "policy"):
            prev = _producer(step.tasks, site.task.index - 1) if step and site.task and site.task.index > 0 else None
            if prev is not None and self.legacy:
                new = self._reshape_task(prev, path, "_prev")
                return (new if new is not None else None), "M7"
            return None, ""
        if site.step is not None and root in tasks and site.kind in ("task", "policy"):
            return self._task_ref(tasks[root], path), "M2"
        if step is not None and root == step.name and site.kind == "policy" and site.task is not None and self.legacy:
            return self._own_step_ref(step, site.task, path), "M2"
        if root in self.steps:
            return self._step_ref(self.steps[root], path), "M2"
        if step is not None and root == step.iterator and site.kind in ("task", "policy"):
            return Ref(f"iter.{root}", path), "M1"
        if root in ("loop_index", "_index", "iteration_index") and site.kind in ("task", "policy"):
            return Ref("iter.index", path), "M1"
        if root == "job":
            if path and path[0][1] in ("execution_id", "id", "uuid", "job_id"):
                return Ref("execution_id", path[1:]), "M1"
            raise NeedsPerson(f"'job.{_path_text(path)}' has no canonical equivalent (only the execution's id: "
                              "execution_id)")
        if root in ("vars", "variables"):
            return Ref("ctx", path), "M1"
        if root == "payload":
            return Ref("workload", path), "M1"
        if root in ("env",) and path:
            raise NeedsPerson("'env.X' (the runtime's environment): declare a keychain entry {kind: env, var: X} "
                              "and read keychain.<entry>.value")
        if root in ("secret", "secrets"):
            raise NeedsPerson(f"'{root}.{_path_text(path)}': declare a keychain entry and read keychain.<entry>.<field>")
        if root in RESULT_WORDS or root == "data":
            if site.kind == "policy":
                return Ref("outcome", [("attr", "result")] + (self._reshape_task_path(site.task, path)
                                                              if self.legacy else path)), "M1"
            if site.kind == "arc" and step is not None:
                return Ref("event", [("attr", "result")] + self._reshape(step, path, f"step '{step.name}'")), "M1"
        if step is not None and root in step.set_names:
            return Ref(f"{step.set_names[root]}.{root}", path), "M1"
        for s in self.steps.values():
            if root in s.set_names and s.set_names[root] == "ctx":
                return Ref(f"ctx.{root}", path), "M1"
        if root in self.workload_keys:
            return Ref(f"workload.{root}", path), "M1"
        if root in ("outcome", "output", "event", "_prev", "iter") or root in RESERVED_NAMES:
            raise NeedsPerson(f"'{root}' is not defined where this template stands (D6)")
        raise NeedsPerson(f"'{root}' names nothing the engine defines here (D6): not a workload key, a step, a task "
                          "or a loop variable; give it a value (workload, args or ctx) and read it there")

    # -------------------------------------------------------------- M2 / M7: reading results
    def _step_ref(self, s: _Step, path: list) -> Ref | None:
        head = path[0] if path else None
        if head is None:
            if not self.legacy:
                return None
            kind = "loop" if s.loop else (s.result_task.kind if s.result_task else None)
            if kind == "http":
                raise NeedsPerson(f"the whole result of http step '{s.name}' is now the response body (the legacy "
                                  f"{{status_code, headers, data}} is gone): read '{s.name}.result' knowing that")
            return Ref(s.name, [("attr", "result")] + self._reshape(s, [], f"step '{s.name}'"))
        if head == ("attr", "result"):
            new = self._reshape(s, path[1:], f"step '{s.name}'") if self.legacy else path[1:]
            return Ref(s.name, [head] + new) if new != path[1:] else None
        if head[0] == "attr" and head[1] in STEP_VIEW:
            return None
        if head[0] == "attr" and head[1] in ("status", "data") and not self.legacy:
            return None
        return Ref(s.name, [("attr", "result")] + self._reshape(s, path, f"step '{s.name}'"))

    def _own_step_ref(self, s: _Step, task: _Task, path: list) -> Ref:
        """The step read by its own name in a policy of one of its tasks. The legacy runtime ran a
        step's ``set`` (and a case) after its tool, with the step's result in place; the canonical
        policy runs before the step has one, and there the result is the task's ``outcome.result``."""
        if s.loop:
            raise NeedsPerson(f"loop step '{s.name}' read by its own name in a task policy: the policy runs per "
                              "iteration, before the loop has a result; read the loop's result in its arcs "
                              "(event.result) or in the next step")
        if id(task.node) not in self._after_step and task is not s.tasks[-1]:
            raise NeedsPerson(f"step '{s.name}' read by its own name in the policy of its task '{task.name}', "
                              "which does not give the step's result: the step has no result there yet")
        producer = _producer(s.tasks, task.index) or task
        head = path[0] if path else None
        if head == ("attr", "error"):
            return Ref("outcome", path)
        if head is None:
            if producer.kind == "http":
                raise NeedsPerson(f"the whole result of http step '{s.name}' is now the response body (the legacy "
                                  "{status_code, headers, data} is gone): read 'outcome.result' knowing that")
            self._reshape_kind(producer.kind, producer, [], f"step '{s.name}'")  # a whole SQL result needs a person
            return Ref("outcome", [("attr", "result")])
        rest = path[1:] if head == ("attr", "result") else path
        if producer.kind == "http" and rest and rest[0][0] in ("attr", "key") and rest[0][1] in HTTP_META:
            return Ref("outcome", [("attr", a) for a in HTTP_META[rest[0][1]]] + rest[1:])
        return Ref("outcome", [("attr", "result")] + self._reshape_kind(producer.kind, producer, rest,
                                                                        f"step '{s.name}'"))

    def _task_ref(self, t: _Task, path: list) -> Ref | None:
        head = path[0] if path else None
        if head is None:
            if self.legacy:
                self._reshape_task_path(t, [])  # a whole SQL result needs a person
            return Ref(t.name, [("attr", "result")]) if self.legacy else None
        if head == ("attr", "result"):
            if not self.legacy:
                return None
            new = self._reshape_task(t, path, t.name)
            return new
        if head[0] == "attr" and (head[1] in TASK_VIEW or (head[1] in ("status", "data") and not self.legacy)):
            return None
        if t.kind == "http" and head[0] in ("attr", "key") and head[1] in HTTP_META:
            return Ref(t.name, [("attr", a) for a in HTTP_META[head[1]]] + path[1:])
        return Ref(t.name, [("attr", "result")] + self._reshape_task_path(t, path))

    def _reshape_task(self, t: _Task, path: list, root: str) -> Ref | None:
        """``root`` + path where root is the task's outcome view (a task name) or its result (_prev)."""
        if root == "_prev":
            if path and path[0][0] in ("attr", "key") and path[0][1] in HTTP_META and t.kind == "http":
                return Ref(t.name, [("attr", a) for a in HTTP_META[path[0][1]]] + path[1:])
            if not path and t.kind == "http":
                raise NeedsPerson(f"'_prev' after http task '{t.name}' is now the response body (the legacy "
                                  "{status_code, headers, data} is gone)")
            new = self._reshape_task_path(t, path)
            return Ref("_prev", new) if new != path else None
        new = self._reshape_task_path(t, path[1:])
        return Ref(root, [path[0]] + new) if new != path[1:] else None

    def _reshape_task_path(self, t: _Task | None, path: list) -> list:
        if t is None:
            return path
        return self._reshape_kind(t.kind, t, path, f"task '{t.name}'")

    def _reshape(self, s: _Step, path: list, what: str) -> list:
        if s.loop:
            if path and path[0] in (("attr", "results"), ("key", "results")):
                return path[1:]
            if path and path[0][0] == "attr" and path[0][1] in ("count", "total", "done", "failed"):
                raise NeedsPerson(f"'{path[0][1]}' of loop {what}: the loop's counts are event.total/done/failed on "
                                  "its arcs; its result is the list of iteration results")
            return path
        t = s.result_task
        if t is None:
            return path
        return self._reshape_kind(t.kind, t, path, what)

    def _reshape_kind(self, kind: str, t: _Task, path: list, what: str) -> list:
        """A path read from a legacy result of this kind, as it reads the canonical result (M7). ``[]``:
        the whole result is read."""
        if not path:
            if kind in ("postgres", "duckdb") and self.legacy:
                raise NeedsPerson(_SQL_WHOLE.format(kind=kind, what=what))
            return path
        head = path[0]
        key = head[1] if head[0] in ("attr", "key") else None
        if kind == "http":
            if key == "data":
                return path[1:]
            if key in ("status_code", "headers", "url", "elapsed"):
                raise NeedsPerson(f"'{key}' of the http result of {what}: the result is the response body; the "
                                  "status and headers are outcome.http.status/headers in the task's policy (keep "
                                  "them with set_ctx)")
            return path
        if kind in ("postgres", "duckdb"):
            if isinstance(key, str) and COMMAND_N.match(key):
                n = int(COMMAND_N.match(key).group(1))
                last = t.statements - 1
                if kind == "duckdb":
                    raise NeedsPerson(f"'{key}' of duckdb {what}: the result is the last statement's "
                                      "{rows, columns, row_count}")
                if n == last or t.statements == 1 and n == 0:
                    return path[1:]
                raise NeedsPerson(f"'{key}' of {what}: only the last statement's result is kept (command_{last}); "
                                  "run that statement in a task of its own")
            if head[0] == "key" and isinstance(key, int):
                return [("attr", "rows")] + path
            return path
        if kind == "playbook" and t.return_step:
            return [("attr", "steps"), ("attr", t.return_step), ("attr", "result")] + path
        return path

    def _reshape_outcome(self, root: str, path: list, t: _Task | None) -> Any:
        if not self.legacy or t is None or not path:
            return None
        head = path[0]
        if head in (("attr", "response"), ("key", "response")):
            # the legacy outcome's 'response' was the tool's result (as a bare 'response' was, M1)
            new = self._reshape_outcome(root, [("attr", "result")] + path[1:], t)
            return new if new is not None else Ref(root, [("attr", "result")] + path[1:])
        if head in (("attr", "data"), ("key", "data")):
            # '.data' aliases '.result' (D8): read it as the result it is, in the shape of the task's kind
            return self._reshape_outcome(root, [("attr", "result")] + path[1:], t)
        if head == ("attr", "result") and len(path) == 1:
            if t.kind == "http":
                raise NeedsPerson(f"the whole result of http task '{t.name}' ('{root}.{_path_text(path)}') is now the "
                                  "response body (the legacy {status_code, headers, data} is gone): read "
                                  "outcome.result knowing that, and outcome.http.status/headers")
            self._reshape_task_path(t, [])  # a whole SQL result needs a person
            return None
        if head == ("attr", "result") and len(path) > 1:
            second = path[1]
            if t.kind == "http" and second[0] in ("attr", "key") and second[1] in HTTP_META:
                return Ref(root, [("attr", a) for a in HTTP_META[second[1]]] + path[2:])
            new = self._reshape_task_path(t, path[1:])
            return Ref(root, [head] + new) if new != path[1:] else None
        return None

    # ======================================================================= M5: python
    def python(self) -> None:
        for s in self.steps.values():
            for t in s.tasks:
                if t.kind == "python":
                    self.python_task(t, s, ("workflow", s.index, "tool") + ((t.index,) if _is_seq(s.node["tool"]) else ()))
        wb = self.doc.get("workbook")
        items = list(wb.items()) if _is_map(wb) else list(enumerate(wb)) if _is_seq(wb) else []
        for key, t in items:
            if _is_map(t) and t.get("kind") == "python":
                self.python_task(_Task(str(t.get("name", key)), "python", t, 0), None, ("workbook", key))

    def python_task(self, t: _Task, s: _Step | None, path: Path) -> None:
        node = t.node
        code = node.get("code")
        if not isinstance(code, str):
            return
        try:
            facts = mpy.analyse(str(code))
        except SyntaxError as e:
            self.problem("M5", path + ("code",), f"the code does not parse as Python: {e.msg} (line {e.lineno})")
            return
        args_key = "args" if "args" in node else "input" if "input" in node else None
        args = node.get(args_key) if args_key else None
        if args is not None and not _is_map(args):
            return  # templated args: their keys are not known here
        arg_names = {str(k) for k in args} if args is not None else set()
        new_args: list[tuple[str, Any]] = []
        site = _Site("task", s, t, path)
        text = str(code)
        notes: list[str] = []
        if facts.context_attrs and facts.context_keys is not None and "context" in facts.free - arg_names:
            # first, on the code as analysed (the edits keep every line where it was)
            text = mpy.attributes_as_keys(text, facts.context_attrs)
            notes.append("the context's fields read as attributes (" + ", ".join(sorted(
                {f"context.{a.attr}" for a in facts.context_attrs})) + ") -> read by key from the 'context' arg")
        # a top-level return is the result
        if facts.returns and facts.main_params is None:
            if len(facts.returns) == 1 and _last_statement_is(text, facts.returns[0]):
                text = mpy.replace_last_return(text, facts.returns[0])
                notes.append("the top-level 'return' -> 'result ='")
            elif facts.star_import or facts.future_end:
                self.problem("M5", path + ("code",), "a top-level 'return' inside a block: rewrite the code to assign "
                                                     "'result'")
            else:
                text = mpy.wrap_in_function(text)
                notes.append("code that returns from the top level -> a function whose return value is the result")
        # main(...) parameters the legacy runtime took from the context
        for pname, has_default in facts.main_params or []:
            if pname in arg_names or has_default:
                continue
            if pname == "context":
                facts.free.add("context")
                continue
            value = self._context_value(pname, site)
            if value is None:
                self.problem("M5", path + ("code",), f"main() parameter '{pname}' gets no value: add it to args")
            else:
                new_args.append((pname, value))
        free = facts.free - arg_names - {n for n, _ in new_args}
        imports = [mpy.PRELOADED[n] for n in sorted(free & set(mpy.PRELOADED))]
        if imports:
            notes.append(f"imports the legacy runtime gave the code added ({', '.join(sorted(free & set(mpy.PRELOADED)))})")
        prelude: list[str] = []
        if "input_data" in free:
            prelude.append("input_data = {" + ", ".join(f"{k!r}: {k}" for k in sorted(arg_names) if IDENT.match(k)) + "}")
            notes.append("'input_data' (the task's args as one mapping) defined from the args")
        if "context" in free:
            keys = facts.context_keys
            if keys is None:
                self.problem("M5", path + ("code",), "the code uses 'context' (the legacy render context) other than "
                             "by constant keys (context['k'], context.get('k'), context.k): pass what it needs in "
                             "args; " + _CONTEXT_MAP)
            else:
                ctx = _cmap()
                for k in sorted(keys):
                    value = self._context_value(k, site)
                    if value is None:
                        self.problem("M5", path + ("code",), f"context[{k!r}]: nothing of that name is known here; "
                                     "pass it in args; " + _CONTEXT_MAP)
                    else:
                        ctx[k] = value
                new_args.append(("context", ctx))
                notes.append("'context' passed as an arg with the keys the code reads")
        for name in sorted(free & mpy.LEGACY_HELPERS):
            self.problem("M5", path + ("code",), f"'{name}' was a helper of the legacy runtime: define it in the code")
        leftover = free - set(mpy.PRELOADED) - mpy.LEGACY_HELPERS - {"input_data", "context"}
        for name in sorted(leftover):
            if s is not None and (name in s.set_names or any(o.set_names.get(name) == "ctx" for o in self.steps.values())):
                value = self._context_value(name, site)  # a name a 'set' wrote: the legacy runtime gave it
                if value is not None:
                    new_args.append((name, value))
                    continue
            self.problem("M5", path + ("code",), f"the code reads '{name}', which nothing defines: pass it in args")
        if imports or prelude:
            text = mpy.insert_lines(text, facts.future_end, imports + prelude)
        if new_args:
            if args is None:
                args = _cmap()
                node.insert(list(node.keys()).index("code") if "code" in node else len(node), "args", args)
            for k, v in new_args:
                args[k] = v
            notes.append("args added for what the code read from the context: " + ", ".join(k for k, _ in new_args))
        if text != str(code):
            node["code"] = _styled(code, text)
        for note in notes:
            self.change("M5", path + ("code",), note)

    def _context_value(self, name: str, site: _Site) -> Any:
        """The template that gives what the legacy context held under ``name``, or None."""
        if name in ("workload", "ctx", "execution_id"):
            return "{{ %s }}" % name
        if name == "job" and name not in self.steps and name not in self.workload_keys:
            # the legacy job object: its ids were the execution's (M1: job.execution_id -> execution_id)
            return _flow(_cmap([(k, "{{ execution_id }}") for k in ("execution_id", "id")]))
        try:
            new, _ = self._resolve(Ref(name, []), site)
        except NeedsPerson:
            return None
        if isinstance(new, Ref):
            from .migrate_jinja import build, unparse

            return "{{ %s }}" % unparse(build(new.root, new.path))
        return None


# ------------------------------------------------------------------------------------ small helpers


MAX_SCRIPT_BYTES = 256 * 1024  # a python task's code read from a file (M5); a bigger file needs a person


def _script_name(spec: Any) -> tuple[str | None, str]:
    """The relative path a legacy ``script`` names: a string, or ``{path | file | uri, source: {type:
    file}}``; (None, why) for anything else (a bucket, a URL, a template)."""
    if _is_map(spec):
        source = spec.get("source")
        kind = source.get("type") if _is_map(source) else source
        if kind not in (None, "file", "local"):
            return None, f"the file is read from {kind!r}, which migrate does not fetch"
        name = next((spec[k] for k in ("path", "file", "uri") if isinstance(spec.get(k), str)), None)
        if name is None and _is_map(source):
            name = next((source[k] for k in ("path", "file", "uri") if isinstance(source.get(k), str)), None)
    else:
        name = spec
    if not isinstance(name, str) or not name.strip():
        return None, "it names no file"
    name = str(name)
    if name.startswith("file://"):
        name = name[len("file://"):]
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", name):
        return None, f"{name!r} is not a local file"
    if _template(name):
        return None, f"{name!r} is a template: the file is known only at run time"
    if "\0" in name:
        return None, "the path holds a NUL character"
    return name, ""


def read_script(spec: Any, source: str | os.PathLike | None) -> tuple[str | None, str]:
    """(the code, where it was read) of the file a ``script`` names, or (None, why not). Read only when
    ``source`` (the playbook's file) is known, only a regular file inside the playbook's folder (after
    every symbolic link is followed: ``..``, an absolute path or a link elsewhere is refused), at most
    :data:`MAX_SCRIPT_BYTES`, UTF-8 text."""
    name, why = _script_name(spec)
    if name is None:
        return None, why
    if source is None:
        return None, f"{name!r} is read only next to the playbook, whose file is not known here"
    if os.path.isabs(name) or name.startswith("~"):
        return None, f"{name!r} is not a path relative to the playbook's folder"
    folder = os.path.realpath(os.path.dirname(os.path.abspath(os.fspath(source))))
    target = os.path.realpath(os.path.join(folder, name))
    if os.path.commonpath([folder, target]) != folder or target == folder:
        return None, f"{name!r} lies outside the playbook's folder, which is all migrate reads"
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        return None, f"{name!r} cannot be read next to the playbook ({e.strerror})"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, f"{name!r} is not a regular file"
        if info.st_size > MAX_SCRIPT_BYTES:
            return None, f"{name!r} is {info.st_size} bytes, more than the {MAX_SCRIPT_BYTES} migrate inlines"
        data = b""
        while len(data) <= MAX_SCRIPT_BYTES:
            chunk = os.read(fd, MAX_SCRIPT_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_SCRIPT_BYTES:
        return None, f"{name!r} is more than the {MAX_SCRIPT_BYTES} bytes migrate inlines"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"{name!r} is not UTF-8 text (byte {e.start})"
    if "\0" in text:
        return None, f"{name!r} holds a NUL character: not Python source"
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n"), f"the code of {name!r}, read next to the playbook"


_SQL_WHOLE = ("the whole result of {kind} {what}: the legacy result read whole here was the statements' results "
              "(command_0, command_1, ...) or the rows; canonically it is the last statement's {{rows, columns, "
              "row_count}} (D27): read .result.rows for the rows (.result.rows[0].n for a field of the first), "
              ".result.row_count for their number, .result.columns for the column names")


_CONTEXT_MAP = ("the legacy context's fields are, canonically: execution_id (or job.execution_id) -> "
                "{{ execution_id }}; workload -> {{ workload }}; a workload key k -> {{ workload.k }}; vars -> "
                "{{ ctx }}; a key a set wrote -> {{ ctx.k }}; a step's name -> its result {{ <step>.result }}; "
                "the loop's item -> {{ iter.<iterator> }}; catalog_id, path, version, parent_execution_id: none")


_NO_FIELD = {
    "database": "store a credential for that database and name it in 'auth'",
    "script": "put the code inline in 'code'",
    "return_step": "read the child's step from the result: <task>.result.steps.<step>.result",
}


_KEY_LINE = re.compile(r"^( *)(?:- +)?[^\s#-][^#]*:\s*(#.*)?$")


def _guess_indent(text: str) -> tuple[int, int, int]:
    """The indentation the text uses, as ruamel.yaml's (mapping, sequence, offset), so that a rewritten
    playbook keeps its layout: the most common step from a key to its nested mapping, and from a key
    to the dash of its nested list."""
    from collections import Counter

    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    maps, seqs = Counter(), Counter()
    for a, b in zip(lines, lines[1:]):
        m = _KEY_LINE.match(a)
        if not m:
            continue
        base = len(m.group(1)) + (len(a) - len(a.lstrip(" -")) - len(m.group(1)) if a.lstrip().startswith("- ") else 0)
        ind = len(b) - len(b.lstrip(" "))
        if ind <= base:
            continue
        (seqs if b.lstrip().startswith("- ") or b.strip() == "-" else maps)[ind - base] += 1
    mapping = maps.most_common(1)[0][0] if maps else 2
    offset = seqs.most_common(1)[0][0] if seqs else 0
    return mapping, offset + 2, offset


def _names_read(node: Any, script: Callable[[Any], str | None] | None = None) -> set[str]:
    """The root names the templates in ``node`` read, and the names its Python code reads from outside
    (``script``: the code of a python task's ``script``, when there is one to read)."""
    found: set[str] = set()

    def probe(ref: Ref) -> Any:
        found.add(ref.root)
        return None

    def walk(n: Any, key: Any = None) -> None:
        if _is_map(n):
            for k, v in n.items():
                if k == "script" and script is not None and "code" not in n:
                    code = script(v)
                    if code is not None:
                        walk(code, "code")
                        continue
                walk(v, k)
        elif _is_seq(n):
            for v in n:
                walk(v, key)
        elif isinstance(n, str):
            if key == "code":  # Python (whatever spelling of the tool holds it)
                try:
                    facts = mpy.analyse(n)
                except SyntaxError:
                    facts = None
                if facts is not None:
                    found.update(facts.free)
                    found.update(p for p, _ in facts.main_params or [])
                    return
            if _template(n):
                rewrite(n, probe)

    walk(node)
    return found


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


def _attr(*names: str) -> nodes.Expr:
    node: nodes.Expr = nodes.Name(names[0], "load")
    for n in names[1:]:
        node = nodes.Getattr(node, n, "load")
    return node


def _path_text(path: list) -> str:
    out = []
    for kind, value in path:
        out.append(str(value) if kind in ("attr", "key") else "[...]")
    return ".".join(out)


def _steps_of(value: Any) -> list[tuple[str, Any]]:
    """(step, args) of each target of a legacy next/then: a name, {step, args|data|with}, or a list."""
    out: list[tuple[str, Any]] = []
    items = value if _is_seq(value) else [value] if value is not None else []
    for item in items:
        if isinstance(item, str):
            out.append((item, None))
        elif _is_map(item) and isinstance(item.get("step"), str):
            args = item.get("args", item.get("data", item.get("with")))
            out.append((item["step"], args))
    return out


def _actions_of(then: Any) -> list[tuple[str, Any]] | None:
    """A case branch's actions in order: (key, value); a task is ("task", {name, kind...})."""
    if then is None:
        return []
    out: list[tuple[str, Any]] = []
    if _is_map(then):
        for k, v in then.items():
            out.append((str(k), v))
        return out
    if not _is_seq(then):
        return None
    for item in then:
        if not _is_map(item) or len(item) != 1:
            if _is_map(item) and "kind" in item:
                out.append(("task", item))
                continue
            return None
        key, value = next(iter(item.items()))
        if key in ("next", "set", "vars", "set_ctx", "set_iter", "retry", "fail"):
            out.append((str(key), value))
        elif _is_map(value):
            task = _cmap([("name", str(key) if key != "sink" else "sink")])
            inner = value
            if _is_map(inner.get("tool")):
                for k, v in inner["tool"].items():
                    task[k] = v
                for k, v in inner.items():
                    if k != "tool":
                        task[k] = v
            else:
                for k, v in inner.items():
                    task[k] = v
            out.append(("task", task))
        else:
            return None
    return out


def _reads_event(when: str, names: tuple[str, ...]) -> bool:
    try:
        ast = _ENV.parse(when)
    except Exception:  # noqa: BLE001
        return False
    return any(isinstance(c, nodes.Const) and c.value in names for c in ast.find_all(nodes.Const))


def _imports_of(libs: Any) -> list[str] | None:
    if not _is_map(libs):
        return None
    out = []
    for alias, module in libs.items():
        if isinstance(module, str):
            out.append(f"import {module}" if alias == module else f"import {module} as {alias}")
        elif _is_map(module) and module.get("from") and module.get("import"):
            name = module["import"]
            out.append(f"from {module['from']} import {name}" + ("" if alias == name else f" as {alias}"))
        else:
            return None
    return out


def _last_statement_is(code: str, node: Any) -> bool:
    import ast as pyast

    tree = pyast.parse(code)
    return bool(tree.body) and isinstance(tree.body[-1], pyast.Return) and tree.body[-1].lineno == node.lineno
