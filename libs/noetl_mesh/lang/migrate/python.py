"""Python task code for ``noetl migrate``: read with Python's ``ast``, edited in place.

The code is parsed with :mod:`ast` to find what the legacy runtime gave it that the engine does not
(D25): the names it reads without defining them (``json``, ``os``, ``datetime`` and ``uuid`` were
imported for it; ``context`` was the whole render context; ``input_data`` the task's arguments as one
mapping), a ``return`` at the top level as the result, and ``main`` parameters filled from the
context rather than from ``args``. The edits are made on the text at the places the AST gives, so
comments, blank lines and formatting stay as they were. Pure functions; no I/O.
"""
from __future__ import annotations

import ast
import builtins
import io
import tokenize
from dataclasses import dataclass, field

# Modules the legacy runtime put in every task's globals.
PRELOADED = {"json": "import json", "os": "import os", "datetime": "import datetime", "uuid": "import uuid"}
# Helpers of the legacy runtime that the engine does not have.
LEGACY_HELPERS = {"get_val", "make_serializable", "now_utc", "format_iso8601", "deep_merge"}
WRAPPER = "_noetl_main"


@dataclass
class Facts:
    """What the code reads and defines."""

    free: set[str] = field(default_factory=set)  # read at some point, bound nowhere
    main_params: list[tuple[str, bool]] | None = None  # (name, has a default) of a top-level main()
    returns: list[ast.Return] = field(default_factory=list)  # top-level returns (outside any def)
    context_keys: set[str] | None = field(default_factory=set)  # None: context is used in other ways
    context_attrs: list[ast.Attribute] = field(default_factory=list)  # context.execution_id: read as a key
    star_import: bool = False
    future_end: int = 0  # line after the last `from __future__` import / module docstring


def analyse(code: str) -> Facts:
    """Facts about ``code``; raises SyntaxError when it does not parse."""
    tree = ast.parse(code)
    facts = Facts()
    bound: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    facts.star_import = True
                bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            pass
        elif isinstance(node, ast.MatchAs) and node.name:
            bound.add(node.name)
    facts.free = loaded - bound - set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main":
            a = node.args
            positional = a.posonlyargs + a.args
            defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
            facts.main_params = list(zip([p.arg for p in positional], defaults))
            facts.main_params += [(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    facts.returns = _top_level_returns(tree)
    facts.context_keys = _context_keys(tree, facts.context_attrs)
    end = 0
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            end = node.end_lineno or node.lineno
        elif i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            end = node.end_lineno or node.lineno
        else:
            break
    facts.future_end = end
    return facts


def _top_level_returns(tree: ast.Module) -> list[ast.Return]:
    out: list[ast.Return] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Return):
                out.append(child)
            walk(child)

    walk(tree)
    return out


# Methods of the legacy context (a mapping); any other attribute read from it is one of its fields.
_MAPPING_METHODS = {"get", "keys", "items", "values", "copy", "setdefault", "pop", "update", "to_dict", "dict"}


def _context_keys(tree: ast.Module, attrs: list[ast.Attribute] | None = None) -> set[str] | None:
    """The constant keys read from ``context`` (``context['k']``, ``context.get('k')``, and a field read
    as an attribute, ``context.execution_id``, each put in ``attrs``); None when it is used any other
    way (passed whole, iterated, a computed key, written)."""
    keys: set[str] = set()
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and node.id == "context" and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.slice, ast.Constant) \
                and isinstance(parent.slice.value, str):
            keys.add(parent.slice.value)
            continue
        if isinstance(parent, ast.Attribute) and parent.attr == "get":
            call = parents.get(parent)
            if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant) \
                    and isinstance(call.args[0].value, str):
                keys.add(call.args[0].value)
                continue
        if isinstance(parent, ast.Attribute) and parent.value is node and isinstance(parent.ctx, ast.Load) \
                and parent.attr not in _MAPPING_METHODS and not parent.attr.startswith("_") \
                and parent.lineno == parent.end_lineno:
            keys.add(parent.attr)
            if attrs is not None:
                attrs.append(parent)
            continue
        return None
    return keys


def _lines(code: str) -> list[str]:
    return code.splitlines(keepends=True)


def string_continuation_lines(code: str) -> set[int]:
    """1-based numbers of the lines that start inside a multi-line string (they must not be indented)."""
    out: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.STRING or getattr(tokenize, "FSTRING_MIDDLE", -1) == tok.type:
                if tok.end[0] > tok.start[0]:
                    out.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def insert_lines(code: str, after_line: int, new: list[str]) -> str:
    """``new`` lines inserted after line ``after_line`` (0: at the top)."""
    lines = _lines(code)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines[:after_line] + [line + "\n" for line in new] + lines[after_line:])


def replace_last_return(code: str, node: ast.Return) -> str:
    """``return X`` (a statement of the module body) made ``result = X``."""
    lines = _lines(code)
    i = node.lineno - 1
    line = lines[i]
    col = len(line.encode("utf-8")[: node.col_offset].decode("utf-8", "replace"))
    head, rest = line[:col], line[col:]
    assert rest.startswith("return")
    rest = rest[len("return"):]
    lines[i] = head + ("result =" + rest if node.value is not None else "result = None" + rest)
    return "".join(lines)


def attributes_as_keys(code: str, attrs: list[ast.Attribute]) -> str:
    """Each ``x.name`` of ``attrs`` (one line each) made ``x["name"]``: the legacy context was an object
    whose fields read as attributes; the mapping passed in its place is read by key."""
    lines = _lines(code)
    for node in sorted(attrs, key=lambda n: (n.lineno, n.end_col_offset or 0), reverse=True):
        i = node.lineno - 1
        raw = lines[i].encode("utf-8")
        start, end = node.value.end_col_offset, node.end_col_offset
        if start is None or end is None:
            continue
        piece = raw[start:end].decode("utf-8")
        if piece.replace(" ", "") != "." + node.attr:
            continue  # a line continuation or a comment between: left alone
        lines[i] = (raw[:start] + f"[{node.attr!r}]".encode("utf-8") + raw[end:]).decode("utf-8")
    return "".join(lines)


def module_names(code: str) -> list[str]:
    """Names the code binds at its top level (outside functions, classes, lambdas, comprehensions)."""
    tree = ast.parse(code)
    out: dict[str, None] = {}

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[child.name] = None
                continue
            if isinstance(child, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                continue
            if isinstance(child, ast.Name) and not isinstance(child.ctx, ast.Load):
                out[child.id] = None
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for alias in child.names:
                    out[(alias.asname or alias.name).split(".")[0]] = None
            walk(child)

    walk(tree)
    return list(out)


def wrap_in_function(code: str) -> str:
    """The code as the body of a function whose return value is the result (for code that returns
    from the top level in more than one place). The names it binds stay global, as they were; lines
    inside multi-line strings keep their text."""
    keep = string_continuation_lines(code)
    names = [n for n in module_names(code) if n != "result"]
    lines = _lines(code)
    body = ["    global " + ", ".join(names) + "\n"] if names else []
    for n, line in enumerate(lines, start=1):
        if n in keep or not line.strip():
            body.append(line)
        else:
            body.append("    " + line)
    if body and not body[-1].endswith("\n"):
        body[-1] += "\n"
    return f"def {WRAPPER}():\n" + "".join(body) + f"result = {WRAPPER}()\n"
