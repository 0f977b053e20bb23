"""The template engine of the playbook language (D6, D7): sandboxed Jinja2, pure Python, no I/O.

Rendering rules (D7):

* A string that is exactly one ``{{ expression }}`` (surrounding whitespace allowed) renders to the
  expression's *native* value: ``"{{ [1, 2] }}"`` -> ``[1, 2]``, ``"{{ none }}"`` -> ``None``.
* Any other string holding a template renders to text: ``"page-{{ n }}"`` -> ``"page-3"``.
* Strings without ``{{``, ``{%`` or ``{#`` and non-string scalars are returned as they are.
* Maps and lists are rendered recursively (values, not keys) into new containers.
* An undefined name is an error, except under ``| default(...)`` and ``is defined`` which work on
  whole chains (``a.b.c | default(1)`` when ``a.b`` is missing).
* ``a.b`` on a mapping reads the key ``b`` before any attribute of the same name.

The caller builds the render context (a plain mapping); this module only renders.
Compiled templates are cached by source string (bounded LRU).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from jinja2 import meta, nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError
from jinja2.parser import Parser
from jinja2.runtime import Context as _Context
from jinja2.runtime import StrictUndefined, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import missing, object_type_repr

__all__ = [
    "TemplateError",
    "is_template",
    "render",
    "render_text",
    "evaluate",
    "truthy",
    "check_syntax",
    "referenced_names",
]

CACHE_SIZE = 4096
_MAX_SEQUENCE = 1_000_000  # longest str/list that `*` may build
_MAX_POW_BITS = 1_000_000  # largest integer (in bits) that `**` may build
_QUOTE_LIMIT = 300  # template sources longer than this are shortened in messages
_FALSY_STRINGS = frozenset({"false", "no", "0", "", "none", "null"})


# --------------------------------------------------------------------------------------------- errors


class TemplateError(Exception):
    """A template failed to compile or to render.

    ``template`` is the source string, ``where`` the location given by the caller (extended while
    rendering nested values), ``reason`` what went wrong.
    """

    def __init__(self, template: str, where: str, reason: str) -> None:
        super().__init__(template, where, reason)
        self.template = template
        self.where = where
        self.reason = reason

    @property
    def detail(self) -> str:
        """The message without the location: reason and the quoted template."""
        src = self.template
        if len(src) > _QUOTE_LIMIT:
            src = src[:_QUOTE_LIMIT] + "…"
        quoted = json.dumps(src, ensure_ascii=False)
        # Syntax-error reasons already say "template".
        glue = " in " if self.reason.startswith("template syntax error") else " in template "
        return f"{self.reason}{glue}{quoted}"

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}" if self.where else self.detail


# ------------------------------------------------------------------------------------------ undefined


class _Undefined(StrictUndefined):
    """Strict (printing, comparing, iterating, arithmetic all fail) but chainable.

    ``a.b.c`` where ``a.b`` is missing stays undefined (the message names the first missing link),
    so ``| default(...)`` and ``is defined`` work on whole chains.
    """

    __slots__ = ()

    @property
    def _undefined_message(self) -> str:
        if self._undefined_hint:
            return self._undefined_hint
        name = self._undefined_name
        if self._undefined_obj is missing:
            return f"undefined name {name!r}"
        what = "attribute" if isinstance(name, str) else "item"
        return f"undefined {what} {name!r} of {object_type_repr(self._undefined_obj)}"

    def __getattr__(self, name: str) -> Any:
        # Private/dunder names and the hooks Jinja probes on callables are not chained.
        if name[:1] == "_" or name in ("unsafe_callable", "alters_data", "jinja_pass_arg"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key: Any) -> Any:
        return self


# -------------------------------------------------------------------------------------- environment


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def getattr(self, obj: Any, attribute: str) -> Any:
        # D7: on a mapping the key wins over a method of the same name (workload.items).
        if type(obj) is dict or (isinstance(obj, Mapping) and not isinstance(obj, Undefined)):
            try:
                return obj[attribute]
            except (LookupError, TypeError):
                pass
        return super().getattr(obj, attribute)

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        # Fail at once instead of handing back an undefined that `default` could swallow.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_SEQUENCE:
                    raise SecurityError(f"'*' would build a sequence longer than {_MAX_SEQUENCE}")
            return left * right
        if operator == "**":
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and right > 0
                and abs(left) > 1
                and left.bit_length() * right > _MAX_POW_BITS
            ):
                raise SecurityError(f"'**' would build an integer larger than {_MAX_POW_BITS} bits")
            return left**right
        return super().call_binop(context, operator, left, right)


def _to_json(value: Any, indent: int | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, default=str, indent=indent, sort_keys=sort_keys)


def _from_json(value: Any) -> Any:
    if isinstance(value, (str, bytes, bytearray)):
        return json.loads(value)
    if isinstance(value, Undefined):
        value._fail_with_undefined_error()
    return value  # already decoded


def _to_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in _FALSY_STRINGS
    return bool(value)


def _make_env() -> _Environment:
    env = _Environment(
        loader=None,
        autoescape=False,
        undefined=_Undefined,
        keep_trailing_newline=True,
        cache_size=0,
        auto_reload=False,
    )
    for name in ("lipsum", "cycler", "joiner"):
        env.globals.pop(name, None)
    env.filters["to_json"] = _to_json
    env.filters["from_json"] = _from_json
    env.filters["bool"] = _to_bool
    return env


_ENV = _make_env()

# Tags that would load other templates; with no loader they cannot work anyway, reject them early.
_FORBIDDEN = {nodes.Extends: "extends", nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from"}
# Expression nodes that can build a container holding an undefined value ({{ [a, 1] }}).
_MAY_NEST = (nodes.List, nodes.Tuple, nodes.Dict, nodes.Call, nodes.Filter)


# -------------------------------------------------------------------------------------------- compile


class _Compiled:
    __slots__ = ("template", "render_func", "blocks", "globals", "native", "check_nested")

    def __init__(self, template: Any, native: bool, check_nested: bool = False) -> None:
        self.template = template
        self.render_func = template.root_render_func
        self.blocks = template.blocks
        # Plain-dict snapshot of the (fixed) globals: Template.new_context would copy a ChainMap per call.
        self.globals = dict(template.globals)
        self.native = native
        self.check_nested = check_nested


def _single_expression(source: str, ast: nodes.Template) -> nodes.Expr | None:
    """The expression node when ``source`` is exactly one ``{{ ... }}`` (whitespace around allowed)."""
    s = source.strip()
    if not (s.startswith("{{") and s.endswith("}}")):
        return None
    if len(ast.body) != 1 or not isinstance(ast.body[0], nodes.Output):
        return None
    found = None
    for node in ast.body[0].nodes:
        if isinstance(node, nodes.TemplateData):
            if node.data.strip():
                return None
            continue
        if found is not None:
            return None
        found = node
    return found


def _native_template(expr: nodes.Expr) -> _Compiled:
    body = nodes.Template([nodes.Assign(nodes.Name("result", "store"), expr, lineno=1)], lineno=1)
    body.set_environment(_ENV)
    check = isinstance(expr, _MAY_NEST) or any(True for _ in expr.find_all(_MAY_NEST))
    return _Compiled(_ENV.from_string(body), native=True, check_nested=check)


@lru_cache(maxsize=CACHE_SIZE)
def _compile(source: str, mode: str) -> _Compiled:
    """Compile ``source``. mode: "auto" (native when one expression), "text", or "expr" (bare expression).

    Raises TemplateError (with an empty ``where``) on a syntax error. Cached by (source, mode).
    """
    try:
        if mode == "expr":
            parser = Parser(_ENV, source, state="variable")
            expr = parser.parse_expression()
            if not parser.stream.eos:
                tok = parser.stream.current
                raise TemplateSyntaxError(f"unexpected {tok.value!r} after expression", tok.lineno)
            return _native_template(expr)
        ast = _ENV.parse(source)
        for node_type, tag in _FORBIDDEN.items():
            if ast.find(node_type) is not None:
                raise TemplateSyntaxError(f"'{{% {tag} %}}' is not allowed in playbook templates", 1)
        if mode == "auto":
            expr = _single_expression(source, ast)
            if expr is not None:
                return _native_template(expr)
        return _Compiled(_ENV.from_string(ast), native=False)
    except TemplateSyntaxError as e:
        raise TemplateError(source, "", f"template syntax error: {e.message or e}") from None
    except Exception as e:  # codegen trouble we did not foresee: still a template problem
        raise TemplateError(source, "", f"template syntax error: {type(e).__name__}: {e}") from None


def _find_undefined(value: Any) -> Undefined | None:
    if isinstance(value, Undefined):
        return value
    t = type(value)
    if t is list or t is tuple:
        for item in value:
            u = _find_undefined(item)
            if u is not None:
                return u
    elif t is dict:
        for item in value.values():
            u = _find_undefined(item)
            if u is not None:
                return u
    return None


def _run(compiled: _Compiled, source: str, context: Mapping[str, Any] | None, where: str) -> Any:
    try:
        # What Template.new_context does, minus its per-call ChainMap copies.
        gl = compiled.globals
        ctx = _Context(_ENV, {**gl, **context} if context else dict(gl), None, compiled.blocks, gl)
        if not compiled.native:
            return "".join(compiled.render_func(ctx))
        for _ in compiled.render_func(ctx):
            pass
        rv = ctx.vars["result"]
        if isinstance(rv, Undefined):
            rv._fail_with_undefined_error()
        if compiled.check_nested and isinstance(rv, (list, tuple, dict)):
            u = _find_undefined(rv)
            if u is not None:
                u._fail_with_undefined_error()
        if type(rv) is not str and isinstance(rv, str):  # Markup from tojson & co.
            rv = str(rv)
        return rv
    except TemplateError as e:
        raise TemplateError(source, where, e.reason) from None
    except UndefinedError as e:
        raise TemplateError(source, where, str(e.message)) from None
    except Exception as e:
        raise TemplateError(source, where, f"{type(e).__name__}: {e}") from None


def _get(source: str, mode: str, where: str) -> _Compiled:
    try:
        return _compile(source, mode)
    except TemplateError as e:
        raise TemplateError(source, where, e.reason) from None


# ------------------------------------------------------------------------------------------------ API


def is_template(value: str) -> bool:
    """True when ``value`` is a string holding ``{{``, ``{%`` or ``{#``."""
    return isinstance(value, str) and ("{{" in value or "{%" in value or "{#" in value)


def render(value: Any, context: Mapping[str, Any], where: str = "") -> Any:
    """Render ``value`` recursively (D7); single-expression strings give native values."""
    if isinstance(value, str):
        if "{{" not in value and "{%" not in value and "{#" not in value:
            return value
        return _run(_get(value, "auto", where), value, context, where)
    if isinstance(value, Mapping):
        prefix = where + "." if where else ""
        return {k: render(v, context, f"{prefix}{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, context, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(render(v, context, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def render_text(source: str, context: Mapping[str, Any], where: str = "") -> str:
    """Render ``source`` to text, even when it is a single expression."""
    if not isinstance(source, str):
        source = str(source)
    if "{{" not in source and "{%" not in source and "{#" not in source:
        return source
    return _run(_get(source, "text", where), source, context, where)


def evaluate(expr_or_template: str, context: Mapping[str, Any], where: str = "") -> Any:
    """Native value of ``"{{ x > 1 }}"`` or of a bare expression ``"x > 1"``.

    A text template (``"a-{{ x }}"``) gives its text; non-strings are returned as they are.
    """
    if not isinstance(expr_or_template, str):
        return expr_or_template
    if is_template(expr_or_template):
        return render(expr_or_template, context, where)
    return _run(_get(expr_or_template, "expr", where), expr_or_template, context, where)


def truthy(value_or_template: Any, context: Mapping[str, Any], where: str = "") -> bool:
    """Truth of a ``when`` condition: render (native), then Python truthiness, except that the
    strings "false", "no", "0", "", "none", "null" (any case, stripped) are False."""
    value = render(value_or_template, context, where)
    if isinstance(value, str):
        return value.strip().lower() not in _FALSY_STRINGS
    return bool(value)


def check_syntax(value: Any, where: str = "") -> list[tuple[str, str]]:
    """``(where, message)`` for every template in ``value`` (recursively) that fails to compile."""
    out: list[tuple[str, str]] = []
    _check(value, where, out)
    return out


def _check(value: Any, where: str, out: list[tuple[str, str]]) -> None:
    if isinstance(value, str):
        if is_template(value):
            try:
                _compile(value, "auto")
            except TemplateError as e:
                out.append((where, e.detail))
    elif isinstance(value, Mapping):
        prefix = where + "." if where else ""
        for k, v in value.items():
            _check(v, f"{prefix}{k}", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]", out)


@lru_cache(maxsize=CACHE_SIZE)
def _names(source: str) -> frozenset[str]:
    try:
        return frozenset(meta.find_undeclared_variables(_ENV.parse(source)))
    except Exception:
        return frozenset()  # syntax errors are check_syntax's business


def referenced_names(value: Any) -> set[str]:
    """Top-level names the templates in ``value`` (recursively) read; unparsable templates add none."""
    out: set[str] = set()
    _collect(value, out)
    return out


def _collect(value: Any, out: set[str]) -> None:
    if isinstance(value, str):
        if is_template(value):
            out |= _names(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _collect(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)
