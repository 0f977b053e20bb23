"""The tree a migration edits: the canonical shapes it knows (the fields of each task kind), the model
of steps and tasks read from it, and round-trip editing (ruamel.yaml: mappings and lists made and
renamed in place, comments and blank lines kept where their text goes, the file's indentation
guessed), with the walks the rules share (the names a step reads, the targets of a legacy ``next``,
the actions of a ``case`` branch)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..diagnostics import Path
from ..model import TASK_MODELS
from ..templates import _ENV
from . import python as mpy
from .templates import Ref, rewrite


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
