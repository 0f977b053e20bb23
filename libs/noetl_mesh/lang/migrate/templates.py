"""Template rewriting for ``noetl migrate``: Jinja2's own parser and AST, never regular expressions.

A template is cut into its parts by the engine environment's own lexer: text, ``{{ expression }}``,
``{% statement %}`` and ``{# comment #}``. Each expression (of a ``{{ }}``, and of the statements
``if``, ``elif``, ``for ... in ... if ...`` and ``set x = ...``) is parsed by the environment's parser
into its AST; a caller-given function rewrites each *reference* in it (a name and the chain of
attributes and subscripts read from it: ``producer.tag``, ``item['id']``); when anything changed, the
expression's text is regenerated from the AST (:func:`unparse`) and put back in place of the old one.
Every other character of the template stays as it was, so a template that needs nothing keeps its
exact text, and rewriting a rewritten template changes nothing more.

The regenerated text is checked: parsed again, it must give the same AST, else the expression keeps
its old text and the rewrite is reported as not done. Pure functions; no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from jinja2 import nodes
from jinja2.exceptions import TemplateSyntaxError
from jinja2.parser import Parser

from ..templates import _ENV

# One step of a reference: ("attr", name) for .name, ("key", constant) for ['k'] / [0],
# ("expr", node) for a computed subscript [x + 1], ("slice", node) for [a:b].
Accessor = tuple[str, Any]


@dataclass
class Ref:
    """A reference read by a template: ``root`` followed by ``path``. ``whole`` is True when nothing
    more is read from it in place (no attribute, subscript or call follows)."""

    root: str
    path: list[Accessor]
    # read where a missing value is no error: under ``| default``, ``is defined``, or guarded by the
    # expression itself (``a.b and a.b.c``, ``a.b.c if a.b``: the guard's chain is a prefix of it)
    tolerant: bool = False


class NeedsPerson(Exception):
    """A reference the rewriter knows it cannot translate; the message says why and what to do."""


# resolver(ref) -> None (leave it), the new reference (root may be dotted: "workload.x" is the name
# workload with .x), an expression AST to put in its place, or raise NeedsPerson. A resolver may have
# an attribute ``event_names``: {old: new} for string constants compared with ``event.name``.
Resolver = Callable[[Ref], "Ref | nodes.Expr | None"]


@dataclass
class Rewrite:
    text: str
    changed: list[tuple[str, str]] = field(default_factory=list)  # (old expression, new expression)
    problems: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ unparse

_LEVEL = {  # binding strength of each expression node (higher binds tighter); see jinja2.parser
    nodes.CondExpr: 1, nodes.Or: 2, nodes.And: 3, nodes.Not: 4, nodes.Compare: 5,
    nodes.Add: 6, nodes.Sub: 6, nodes.Concat: 7, nodes.Mul: 8, nodes.Div: 8, nodes.FloorDiv: 8,
    nodes.Mod: 8, nodes.Pow: 9, nodes.Neg: 10, nodes.Pos: 10, nodes.Filter: 11, nodes.Test: 11,
}
_POSTFIX = 12  # attribute, subscript, call: and every atom (names, literals)
_BINOP = {nodes.Add: "+", nodes.Sub: "-", nodes.Mul: "*", nodes.Div: "/", nodes.FloorDiv: "//",
          nodes.Mod: "%", nodes.Pow: "**", nodes.And: "and", nodes.Or: "or"}
# (left operand's level, right operand's level): all of them associate to the left
_SIDES = {6: (6, 7), 8: (8, 9), 9: (9, 10), 2: (2, 3), 3: (3, 4)}
_CMP = {"eq": "==", "ne": "!=", "gt": ">", "gteq": ">=", "lt": "<", "lteq": "<=", "in": "in", "notin": "not in"}


class UnparseError(ValueError):
    pass


def _level(node: nodes.Node) -> int:
    return _LEVEL.get(type(node), _POSTFIX)


def _at(node: nodes.Node, level: int) -> str:
    text = unparse(node)
    return f"({text})" if _level(node) < level else text


def _const(value: Any) -> str:
    if value is None:
        return "none"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = repr(value)
        if text in ("inf", "-inf", "nan"):
            raise UnparseError(f"no literal for {text}")
        return text
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_const, value)) + ("," if len(value) == 1 else "") + ")"
    raise UnparseError(f"no literal for a {type(value).__name__}")


def _call_args(node: Any) -> str:
    parts = [unparse(a) for a in node.args]
    parts += [f"{k.key}={unparse(k.value)}" for k in node.kwargs]
    if node.dyn_args is not None:
        parts.append("*" + _at(node.dyn_args, _POSTFIX))
    if node.dyn_kwargs is not None:
        parts.append("**" + _at(node.dyn_kwargs, _POSTFIX))
    return ", ".join(parts)


def unparse(node: nodes.Node) -> str:
    """The text of an expression AST, parenthesised where the grammar needs it."""
    t = type(node)
    if t is nodes.Name:
        return node.name
    if t is nodes.Const:
        return _const(node.value)
    if t is nodes.Getattr:
        return f"{_at(node.node, _POSTFIX)}.{node.attr}"
    if t is nodes.Getitem:
        return f"{_at(node.node, _POSTFIX)}[{unparse(node.arg)}]"
    if t is nodes.Slice:
        parts = ["" if x is None else unparse(x) for x in (node.start, node.stop)]
        text = ":".join(parts)
        return text + (":" + unparse(node.step) if node.step is not None else "")
    if t is nodes.Call:
        return f"{_at(node.node, _POSTFIX)}({_call_args(node)})"
    if t is nodes.Filter or t is nodes.Test:
        if node.node is None:
            raise UnparseError("a filter without its operand")
        head = _at(node.node, 10)
        args = _call_args(node)
        if t is nodes.Filter:
            return f"{head} | {node.name}" + (f"({args})" if args else "")
        return f"{head} is {node.name}" + (f"({args})" if args else "")
    if t is nodes.Not:
        inner = node.node
        if type(inner) is nodes.Test:  # the spelling it came from: x is not defined
            args = _call_args(inner)
            return f"{_at(inner.node, 10)} is not {inner.name}" + (f"({args})" if args else "")
        return "not " + _at(inner, 4)
    if t is nodes.Neg:
        return "-" + _at(node.node, _POSTFIX)
    if t is nodes.Pos:
        return "+" + _at(node.node, _POSTFIX)
    if t in _BINOP:
        lv = _LEVEL[t]
        left, right = _SIDES[lv]
        return f"{_at(node.left, left)} {_BINOP[t]} {_at(node.right, right)}"
    if t is nodes.Concat:
        return " ~ ".join(_at(n, 8) for n in node.nodes)
    if t is nodes.Compare:
        out = _at(node.expr, 6)
        for op in node.ops:
            out += f" {_CMP[op.op]} {_at(op.expr, 6)}"
        return out
    if t is nodes.CondExpr:
        text = f"{_at(node.expr1, 2)} if {_at(node.test, 2)}"
        return text + (f" else {_at(node.expr2, 1)}" if node.expr2 is not None else "")
    if t is nodes.List:
        return "[" + ", ".join(unparse(i) for i in node.items) + "]"
    if t is nodes.Tuple:
        items = [unparse(i) for i in node.items]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if t is nodes.Dict:
        return "{" + ", ".join(f"{unparse(p.key)}: {unparse(p.value)}" for p in node.items) + "}"
    raise UnparseError(f"cannot write a {t.__name__} back as text")


def parse_expression(text: str) -> nodes.Expr:
    """One expression, as the engine's environment parses the inside of ``{{ }}``."""
    parser = Parser(_ENV, text, state="variable")
    expr = parser.parse_expression()
    if not parser.stream.eos:
        raise TemplateSyntaxError(f"unexpected {parser.stream.current.value!r} after the expression", 1)
    return expr


# ----------------------------------------------------------------------------------- references


def _chain(node: nodes.Node) -> tuple[nodes.Node, list[Accessor]]:
    path: list[Accessor] = []
    while True:
        if type(node) is nodes.Getattr:
            path.append(("attr", node.attr))
            node = node.node
        elif type(node) is nodes.Getitem:
            arg = node.arg
            if type(arg) is nodes.Const and isinstance(arg.value, (str, int)) and not isinstance(arg.value, bool):
                path.append(("key", arg.value))
            elif type(arg) is nodes.Slice:
                path.append(("slice", arg))
            else:
                path.append(("expr", arg))
            node = node.node
        else:
            break
    path.reverse()
    return node, path


def build(root: str, path: list[Accessor]) -> nodes.Expr:
    """The AST of ``root`` (dotted names allowed: ``iter.item``) followed by ``path``."""
    names = root.split(".")
    node: nodes.Expr = nodes.Name(names[0], "load")
    for attr in names[1:]:
        node = nodes.Getattr(node, attr, "load")
    for kind, value in path:
        if kind == "attr":
            node = nodes.Getattr(node, value, "load")
        elif kind == "key":
            node = nodes.Getitem(node, nodes.Const(value), "load")
        else:
            node = nodes.Getitem(node, value, "load")
    return node


class _Rewriter:
    def __init__(self, resolve: Resolver, local: set[str]) -> None:
        self.resolve, self.local = resolve, local
        self.problems: list[str] = []
        self.changed = False
        self.tolerant: set[int] = set()  # ids of chains read under | default or is defined
        self.guards: list[tuple[str, list]] = []  # chains known to hold a value where the visit is

    def _guarded(self, root: str, path: list) -> bool:
        return any(g[0] == root and len(g[1]) < len(path) and path[:len(g[1])] == g[1] for g in self.guards)

    def _guard_of(self, node: Any) -> tuple[str, list] | None:
        if type(node) in (nodes.Getattr, nodes.Getitem, nodes.Name):
            base, path = _chain(node)
            if type(base) is nodes.Name:
                return base.name, path
        return None

    def visit(self, node: Any) -> Any:
        if type(node) is nodes.Filter and node.name in ("default", "d") or \
                type(node) is nodes.Test and node.name in ("defined", "undefined"):
            if node.node is not None:
                self.tolerant.add(id(node.node))
        elif type(node) is nodes.And or type(node) is nodes.CondExpr:
            first, second = ("left", "right") if type(node) is nodes.And else ("test", "expr1")
            setattr(node, first, self.visit(getattr(node, first)))
            guard = self._guard_of(getattr(node, first))
            self.guards.append(guard) if guard else None
            try:
                setattr(node, second, self.visit(getattr(node, second)))
            finally:
                self.guards.pop() if guard else None
            if type(node) is nodes.CondExpr and node.expr2 is not None:
                node.expr2 = self.visit(node.expr2)
            return node
        if type(node) in (nodes.Getattr, nodes.Getitem, nodes.Name):
            tolerant = id(node) in self.tolerant
            base, path = _chain(node)
            path = [(k, self.visit(v)) if k in ("expr", "slice") else (k, v) for k, v in path]
            if type(base) is nodes.Name:
                if base.name in self.local:
                    return build(base.name, path)
                try:
                    new = self.resolve(Ref(base.name, list(path), tolerant or self._guarded(base.name, path)))
                except NeedsPerson as e:
                    self.problems.append(str(e))
                    new = None
                if isinstance(new, nodes.Expr):
                    self.changed = True
                    return new
                if new is not None:
                    self.changed = True
                    return build(new.root, new.path)
                return build(base.name, path)
            base = self.visit(base)
            out = base
            for kind, value in path:
                if kind == "attr":
                    out = nodes.Getattr(out, value, "load")
                elif kind == "key":
                    out = nodes.Getitem(out, nodes.Const(value), "load")
                else:
                    out = nodes.Getitem(out, value, "load")
            return out
        if type(node) is nodes.Compare:
            self._event_names(node)
        if isinstance(node, nodes.Node):
            for name in node.fields:
                value = getattr(node, name)
                if isinstance(value, list):
                    setattr(node, name, [self.visit(v) for v in value])
                elif isinstance(value, nodes.Node):
                    setattr(node, name, self.visit(value))
            return node
        return node


    def _event_names(self, node: nodes.Compare) -> None:
        """``event.name == 'step.exit'``: the constant renamed as the resolver says (before the
        reference itself is rewritten)."""
        names = getattr(self.resolve, "event_names", None)
        if not names:
            return
        sides = [node.expr] + [op.expr for op in node.ops]
        if not any(_chain(s)[0] == nodes.Name("event", "load") and _chain(s)[1] == [("attr", "name")] for s in sides):
            return
        for op in node.ops:
            if type(op.expr) is nodes.Const and op.expr.value in names:
                op.expr = nodes.Const(names[op.expr.value])
                self.changed = True
            elif type(op.expr) in (nodes.List, nodes.Tuple):
                for i, item in enumerate(op.expr.items):
                    if type(item) is nodes.Const and item.value in names:
                        op.expr.items[i] = nodes.Const(names[item.value])
                        self.changed = True
        if type(node.expr) is nodes.Const and node.expr.value in names:
            node.expr = nodes.Const(names[node.expr.value])
            self.changed = True


def _local_names(ast: nodes.Template) -> set[str]:
    """Names the template binds itself (for targets, set, macro and call arguments, with)."""
    out: set[str] = {"loop", "caller", "varargs", "kwargs"}

    def targets(node: Any) -> None:
        for n in node.find_all(nodes.Name) if not isinstance(node, nodes.Name) else [node]:
            if n.ctx in ("store", "param"):
                out.add(n.name)

    for n in ast.find_all((nodes.For, nodes.Assign, nodes.AssignBlock, nodes.With, nodes.Macro, nodes.CallBlock)):
        if isinstance(n, (nodes.For, nodes.Assign, nodes.AssignBlock)):
            targets(n.target)
        elif isinstance(n, nodes.With):
            for t in n.targets:
                targets(t)
        else:
            if isinstance(n, nodes.Macro):
                out.add(n.name)
            for a in n.args:
                targets(a)
    return out


def _rewrite_expression(text: str, resolve: Resolver, local: set[str], out: Rewrite) -> str:
    """``text`` (an expression, with its surrounding spaces) rewritten, or as it was."""
    try:
        expr = parse_expression(text)
    except TemplateSyntaxError as e:
        out.problems.append(f"the expression {text.strip()!r} does not parse ({e.message})")
        return text
    r = _Rewriter(resolve, local)
    new = r.visit(expr)
    out.problems += r.problems
    if not r.changed:
        return text
    try:
        new_text = unparse(new)
        if parse_expression(new_text) != new:
            raise UnparseError("it reads back differently")
    except (UnparseError, TemplateSyntaxError) as e:
        out.problems.append(f"the expression {text.strip()!r} could not be written back ({e})")
        return text
    lead = text[: len(text) - len(text.lstrip())]
    trail = text[len(text.rstrip()):]
    out.changed.append((text.strip(), new_text))
    return lead + new_text + trail


def _tokens(source: str) -> list[tuple[str, str, int, int]] | None:
    """(type, value, start, end) of each token, located in ``source``; None when they cannot all be
    placed (the lexer normalised something), so the caller leaves the template alone."""
    out, pos = [], 0
    for _, kind, value in _ENV.lex(source):
        if kind == "whitespace" or value == "":
            at = source.find(value, pos) if value else pos
        else:
            at = source.find(value, pos)
        if at < 0 or source[pos:at].strip():
            return None
        out.append((kind, value, at, at + len(value)))
        pos = at + len(value)
    return out if not source[pos:].strip() else None


def _split(tokens: list, start: int, stop: int, word: str) -> int | None:
    """Index of the name token ``word`` at bracket depth 0 in tokens[start:stop]."""
    depth = 0
    for i in range(start, stop):
        kind, value = tokens[i][0], tokens[i][1]
        if kind == "operator" and value in "([{":
            depth += 1
        elif kind == "operator" and value in ")]}":
            depth -= 1
        elif depth == 0 and ((kind == "name" and value == word) or (kind == "operator" and value == word)):
            return i
    return None


def _is_template(value: str) -> bool:
    return "{{" in value or "{%" in value or "{#" in value


def rewrite(source: str, resolve: Resolver) -> Rewrite:
    """Rewrite every reference in the template ``source`` through ``resolve``.

    Names the template binds itself (``{% for row in rows %}``, ``{% set x = 1 %}``) are left alone.
    A statement that is not ``if``/``elif``/``for``/``set`` is left alone; when it reads a name the
    resolver would change, that is reported as a problem.
    """
    out = Rewrite(source)
    if not _is_template(source):
        return out
    try:
        ast = _ENV.parse(source)
    except TemplateSyntaxError as e:
        out.problems.append(f"the template does not parse ({e.message})")
        return out
    local = _local_names(ast)
    tokens = _tokens(source)
    if tokens is None:
        out.problems.append("the template could not be cut into its parts")
        return out
    edits: list[tuple[int, int, str]] = []

    def expression(a: int, b: int) -> None:
        """Rewrite the text between token index a (first) and b (exclusive)."""
        if a >= b:
            return
        s, e = tokens[a][2], tokens[b - 1][3]
        text = source[s:e]
        new = _rewrite_expression(text, resolve, local, out)
        if new != text:
            edits.append((s, e, new))

    i = 0
    while i < len(tokens):
        kind = tokens[i][0]
        if kind == "variable_begin":
            j = i + 1
            while tokens[j][0] != "variable_end":
                j += 1
            expression(i + 1, j)
            i = j + 1
            continue
        if kind == "block_begin":
            j = i + 1
            while tokens[j][0] != "block_end":
                j += 1
            body = [k for k in range(i + 1, j) if tokens[k][0] != "whitespace"]
            tag = tokens[body[0]][1] if body else ""
            first = body[1] if len(body) > 1 else j
            if tag in ("if", "elif"):
                expression(first, j)
            elif tag == "for":
                k_in = _split(tokens, first, j, "in")
                if k_in is None:
                    out.problems.append("a for statement without 'in'")
                else:
                    k_if = _split(tokens, k_in + 1, j, "if")
                    k_rec = _split(tokens, k_in + 1, j, "recursive")
                    end_iter = min(x for x in (k_if, k_rec, j) if x is not None)
                    expression(k_in + 1, end_iter)
                    if k_if is not None:
                        expression(k_if + 1, k_rec if k_rec is not None else j)
            elif tag == "set":
                k_eq = _split(tokens, first, j, "=")
                if k_eq is not None:
                    expression(k_eq + 1, j)
            elif tag not in ("else", "endif", "endfor", "endset", "raw", "endraw", ""):
                names = {tokens[k][1] for k in range(first, j) if tokens[k][0] == "name"
                         and not (k > 0 and tokens[k - 1][1] == ".")}
                for name in sorted(names - local):
                    try:
                        if resolve(Ref(name, [])) is not None:
                            out.problems.append(f"the statement '{{% {tag} %}}' reads {name!r}, which needs "
                                                "rewriting: rewrite it by hand")
                    except NeedsPerson as e:
                        out.problems.append(str(e))
            i = j + 1
            continue
        i += 1
    text = source
    for s, e, new in sorted(edits, reverse=True):
        text = text[:s] + new + text[e:]
    out.text = text
    return out
