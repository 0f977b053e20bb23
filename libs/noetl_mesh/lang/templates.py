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

The budget (D7; docs/dsl.md "The template budget"): every call of :func:`render`, :func:`render_text`,
:func:`evaluate` or :func:`truthy` gets ``limits.template_max_ms`` of CPU time (its thread's: a render that waits for a core on a loaded
machine is not charged for the wait) and may build at most
``limits.template_max_output`` characters or list items in all (each string and list a template makes
counts, the text it returns too), and no integer above ``limits.template_max_int_digits`` digits. A
nested value of a mapping shares its call's budget; :func:`shared_budget` makes several calls share one.
Going over is a :class:`TemplateError` naming the limit. How it is enforced:

* sizes are checked *before* building wherever the size is known in advance (``*``, ``+``, ``~``,
  ``%`` and ``format`` widths, ``center``, ``indent``, ``join``, ``replace``, ``str.center`` & co., text
  of containers); results at most a few times their input are counted right after they are built;
* time is checked at each loop iteration, call and building filter by reading a flag, and the
  watchdog thread that sets the flag also raises an exception in the rendering thread, so pure-Python
  code the hooks do not reach (inside a filter) stops too; a single C-level operation is bounded by
  its input size, which the size checks keep small;
* compiling never evaluates user expressions (no constant folding), so validating a template is cheap.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import gc
import itertools
import json
import math
import os
import re
import threading
import time
import weakref
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from functools import lru_cache
from types import BuiltinMethodType, MethodType
from typing import Any

from jinja2 import meta, nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError
from jinja2.filters import make_attrgetter
from jinja2.parser import Parser
from jinja2.runtime import Context as _Context
from jinja2.runtime import StrictUndefined, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, missing, object_type_repr, pass_environment
from markupsafe import EscapeFormatter, Markup

from .. import limits
from ..contracts import refs
from ..limits import LimitExceeded

__all__ = [
    "TemplateError",
    "is_template",
    "render",
    "render_text",
    "evaluate",
    "truthy",
    "check_syntax",
    "referenced_names",
    "shared_budget",
]

CACHE_SIZE = 4096
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
        """The message without the location: reason and the quoted template (if one is to blame)."""
        src = self.template
        if not src:
            return self.reason
        if len(src) > _QUOTE_LIMIT:
            src = src[:_QUOTE_LIMIT] + "…"
        quoted = json.dumps(src, ensure_ascii=False)
        # Syntax-error reasons already say "template".
        glue = " in " if self.reason.startswith("template syntax error") else " in template "
        return f"{self.reason}{glue}{quoted}"

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}" if self.where else self.detail


# --------------------------------------------------------------------------------------------- budget
#
# One _Budget per thread (renders never interleave within a thread: they are synchronous). It is
# "active" while a top-level call runs (_budgeted arms and disarms it); nested calls (a mapping's
# values) find it active and share it.


class _Timeout(BaseException):
    """Raised *asynchronously* in a thread whose render ran past template_max_ms (see _watch).

    A BaseException so that no ``except Exception`` inside Jinja or a filter swallows it; only the
    entry points of this module catch it, and turn it into a TemplateError.
    """


class _Budget:
    __slots__ = ("tid", "clock", "active", "start", "expired", "pending", "used", "lim", "group", "paused",
                 "__weakref__")

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self.clock = time.pthread_getcpuclockid(tid)  # the thread's CPU time, readable from the watchdog
        self.active = self.expired = self.pending = False
        self.start = 0.0
        self.used = 0
        self.lim: limits.Limits = limits.current()
        self.group: _Group | None = None
        self.paused: float | None = None  # the thread's CPU time when a garbage collection began in it


class _Group:
    """The budget that :func:`shared_budget` spreads over several top-level calls."""

    __slots__ = ("start", "used")

    def __init__(self, start: float) -> None:
        self.start, self.used = start, 0


_local = threading.local()
_lock = threading.Lock()  # the watchdog's scan and a render's exit after the watchdog fired
_budgets: weakref.WeakValueDictionary[int, _Budget] = weakref.WeakValueDictionary()
_GROUP: contextvars.ContextVar[_Group | None] = contextvars.ContextVar("noetl_template_budget", default=None)
_cpu = time.thread_time  # the calling thread's CPU time; the watchdog reads a budget's own clock


def _gc_paused(phase: str, info: dict) -> None:
    """A full collection of the process's garbage is not the template's work: its CPU time is left out
    of the budget of a render (or shared group) running in the collecting thread, and the watchdog
    sees the budget's clock stand still while it runs. A render in a big process (a service with a
    large cache, the test suite) otherwise ran out of template_max_ms on a one-line `when` whenever a
    generation-2 collection fell inside it."""
    if info.get("generation") != 2:
        return
    b = getattr(_local, "budget", None)
    if b is None:
        return
    if phase == "start":
        b.paused = _cpu()
        return
    at, b.paused = b.paused, None
    if at is None:
        return
    spent = _cpu() - at
    if b.active:
        b.start += spent
    g = _GROUP.get()
    if g is not None:  # a render of the group copies its start from the group's: both move
        g.start += spent


gc.callbacks.append(_gc_paused)


def _budget() -> _Budget:
    """This thread's budget."""
    try:
        return _local.budget
    except AttributeError:
        b = _local.budget = _Budget(threading.get_ident())
        with _lock:
            _budgets[b.tid] = b
        return b


def _time_error(b: _Budget) -> LimitExceeded:
    return LimitExceeded("template_max_ms", round((_spent(b)) * 1000))


def _spent(b: _Budget) -> float:
    """CPU seconds the budget's thread has run since the budget's start (standing still while a
    garbage collection runs in it: :func:`_gc_paused`)."""
    paused = b.paused
    return (paused if paused is not None else time.clock_gettime(b.clock)) - b.start


def _out_of_time(b: _Budget) -> None:
    raise _time_error(b)


def _grow(b: _Budget, n: int, what: str) -> None:
    """Count ``n`` more characters or items built; refuse when the total would pass the limit."""
    used = b.used + n
    if used > b.lim.template_max_output:
        raise LimitExceeded("template_max_output", used, what=f"what this template builds (at {what})")
    b.used = used


_LOG10_2 = math.log10(2)


def _check_bits(b: _Budget, bits: float, what: str) -> None:
    digits = int(bits * _LOG10_2) + 1
    if digits > b.lim.template_max_int_digits:
        raise LimitExceeded("template_max_int_digits", digits, what=f"an integer this template builds (at {what})")


def _check_int(value: Any, what: str) -> Any:
    if type(value) is int and value.bit_length() > 64:
        _check_bits(_budget(), value.bit_length(), what)
    return value


@contextlib.contextmanager
def shared_budget() -> Iterator[None]:
    """Make every render inside the block (in this thread or task) share one budget: one
    ``template_max_ms`` counted from the block's start and one ``template_max_output``.

    For a caller that renders many templates for one decision (all the arcs of a router, all the
    fields of a task). Nested blocks join the outer one.
    """
    if _GROUP.get() is not None:
        yield
        return
    token = _GROUP.set(_Group(_cpu()))
    try:
        yield
    finally:
        _GROUP.reset(token)


# ------------------------------------------------------------------------------------------- watchdog
#
# The thread scans the active budgets every template_max_ms / 5 (at most 50 ms). For a render running
# longer than template_max_ms it sets ``expired`` (the hooks raise at their next check) and raises
# _Timeout in the rendering thread with PyThreadState_SetAsyncExc, once per render. The exception
# arrives at the thread's next bytecode, wherever it is inside the render. So that it never arrives
# outside one (or in the next render of the same thread), under _lock the watchdog sets ``pending``
# and only then checks once more that this render is active and over time before raising; disarming
# (_budgeted) clears ``active`` and then, if ``pending``, waits for _lock and cancels whatever was not
# delivered.
# Asleep (no thread waking up) when no render ran for a second.

_async_proto = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)
_clear_proto = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_raise_async = _async_proto(("PyThreadState_SetAsyncExc", ctypes.pythonapi))
_clear_async = _clear_proto(("PyThreadState_SetAsyncExc", ctypes.pythonapi))


def _set_async_exc(tid: int, exc: type[BaseException] | None) -> None:
    if exc is None:
        _clear_async(tid, None)
    else:
        _raise_async(tid, exc)


_wd_thread: threading.Thread | None = None
_wd_idle = True
_wd_event = threading.Event()
_IDLE_AFTER = 1.0  # seconds without an active render before the watchdog sleeps


def _wake_watchdog() -> None:
    global _wd_thread, _wd_idle
    with _lock:
        if _wd_thread is None:
            _wd_thread = threading.Thread(target=_watch, name="noetl-template-watchdog", daemon=True)
            _wd_thread.start()
        _wd_idle = False
    _wd_event.set()


def _watch() -> None:
    global _wd_thread, _wd_idle
    try:
        _watch_loop()
    finally:  # whatever ended this thread, the next render starts another
        with _lock:
            if _wd_thread is threading.current_thread():
                _wd_thread = None
            _wd_idle = True


def _watch_loop() -> None:
    global _wd_idle
    quiet = 0.0
    while True:
        period = min(0.05, max(0.002, limits.current().template_max_ms / 5000))
        time.sleep(period)
        busy = False
        max_s = limits.current().template_max_ms / 1000
        with _lock:
            for b in list(_budgets.values()):
                if not b.active:
                    continue
                busy = True
                if b.expired or _spent(b) <= max_s:
                    continue
                # Announce, then look again: the render may have ended, and the thread started another
                # (whose disarm would now wait for _lock), between the look above and this one.
                b.pending = True
                if b.active and not b.expired and _spent(b) > max_s:
                    b.expired = True
                    _set_async_exc(b.tid, _Timeout)
                else:
                    b.pending = False
        if busy:
            quiet = 0.0
            continue
        quiet += period
        if quiet < _IDLE_AFTER:
            continue
        _wd_idle = True
        if any(b.active for b in list(_budgets.values())):  # a render armed before it saw _wd_idle
            _wd_idle = False
            continue
        _wd_event.wait()
        _wd_event.clear()
        quiet = 0.0


def _after_fork() -> None:
    global _wd_thread, _wd_idle, _wd_event, _lock
    _wd_thread, _wd_idle, _wd_event, _lock = None, True, threading.Event(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


# ------------------------------------------------------------------------------------ size estimates


def _str_len(s: str | bytes, json_mode: bool) -> int:
    """Length of ``s`` as an item of a container's text (repr or JSON), give or take escapes."""
    n = len(s)
    if isinstance(s, str):
        plain = s.isprintable() and (not json_mode or s.isascii())
        return n + 2 if plain else 6 * n + 2
    return 4 * n + 3  # bytes: b'\x00'


def _text_size(value: Any, cap: int, json_mode: bool = False, indent: int = 0) -> int:
    """About ``len(str(value))`` (or of its JSON with ``indent``); stops counting once past ``cap``."""
    if isinstance(value, str):
        return len(value)
    total = 0
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack:
        for v in stack[-1]:
            if indent:
                total += 1 + indent * len(stack)
            t = type(v)
            if t is str or isinstance(v, (str, bytes, bytearray)):
                total += _str_len(v, json_mode)
            elif t is int:
                total += int(v.bit_length() * _LOG10_2) + 2
            elif t is float or t is bool or v is None:
                total += 24
            elif isinstance(v, Mapping):
                total += 2 + 2 * len(v)
                stack.append(itertools.chain.from_iterable(v.items()))
                break
            elif isinstance(v, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
                total += 2 + 2 * len(v)
                stack.append(iter(v))
                break
            elif isinstance(v, Namespace):
                total += 14
                stack.append(iter((object.__getattribute__(v, "_Namespace__attrs"),)))
                break
            else:
                total += 64  # a function, range, generator, loop: a short repr
            if total > cap:
                return total
        else:
            stack.pop()
        if total > cap:
            return total
    return total


def _left(b: _Budget) -> int:
    return b.lim.template_max_output - b.used


def _text(value: Any, what: str) -> str:
    """``str(value)``, refused before it is built when it would not fit."""
    if isinstance(value, str):
        return value
    t = type(value)
    if t is int or t is float or t is bool or value is None:
        return str(value)
    b = _budget()
    est = _text_size(value, _left(b))
    _grow(b, est, what)
    s = str(value)
    _grow(b, len(s) - est, what)
    return s


def _line_count(s: str) -> int:
    """An upper bound of ``len(s.splitlines())``."""
    return 1 + sum(s.count(c) for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def _escaped_len(s: str) -> int:
    """``len(markupsafe.escape(s))``."""
    return len(s) + 4 * s.count("&") + 3 * (s.count("<") + s.count(">")) + 4 * (s.count('"') + s.count("'"))


# ----------------------------------------------------------------------------- formatting (%, format)

_PCT_TAIL = re.compile(r"[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)?", re.S)
_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d*))?([a-zA-Z%]?)\Z", re.S)
_HUGE = 10**18


def _digits(spec: str | None) -> int:
    if not spec or spec == "*":
        return 0
    return int(spec) if len(spec) < 19 else _HUGE


def _field_size(value: Any, kind: str, width: int, prec: int | None, cap: int) -> int:
    """How long one formatted field can be."""
    if kind == "%":
        return max(width, 1)
    if kind in "sra" or kind == "":
        natural = _text_size(value, cap)
        if prec is not None and kind in "sra":
            natural = min(natural, prec)
    elif kind in "eEfFgG%n" or isinstance(value, float):
        natural = 320 + (prec or 0)
    else:  # integers in any base, characters
        bits = value.bit_length() if type(value) is int else 64
        natural = max(bits // 3 + 2, prec or 0)
        natural += natural // 3  # grouping separators
    return max(width, natural)


def _percent_size(fmt: str | bytes, args: Any, cap: int) -> int:
    """An upper bound of ``len(fmt % args)``; reads the widths and precisions before Python does."""
    is_bytes = not isinstance(fmt, str)
    text = fmt.decode("latin-1") if is_bytes else fmt
    positional = list(args) if type(args) is tuple else [args]
    mapping = args if isinstance(args, Mapping) else None
    size = len(text)
    pos = text.find("%")
    while pos != -1 and size <= cap:
        i, key = pos + 1, None
        if text.startswith("(", i):  # a mapping key; parentheses nest, as in Python's parser
            depth, j = 1, i + 1
            while j < len(text) and depth:
                depth += 1 if text[j] == "(" else -1 if text[j] == ")" else 0
                j += 1
            key, i = text[i + 1:j - 1], j
        m = _PCT_TAIL.match(text, i)
        width_s, prec_s, kind = m.group(1), m.group(2), m.group(3) or ""
        width: Any = positional.pop(0) if width_s == "*" and positional else _digits(width_s)
        prec: Any = None
        if prec_s is not None:
            prec = positional.pop(0) if prec_s == "*" and positional else _digits(prec_s)
        if not isinstance(width, int) or not isinstance(prec, (int, type(None))):
            return size  # Python raises for these
        if kind == "%":
            value: Any = "%"
        elif key is not None and mapping is not None:
            try:
                value = mapping[key.encode("latin-1") if is_bytes else key]
            except (KeyError, TypeError):
                return size  # Python raises
        elif positional:
            value = positional.pop(0)
        elif mapping is not None:
            value = mapping
        else:
            return size  # not enough arguments: Python raises
        size += _field_size(value, kind, abs(width), prec, cap - size)
        pos = text.find("%", m.end())
    return size


def _format_spec_size(value: Any, spec: str, cap: int) -> int:
    m = _SPEC.match(spec)
    if m is None:
        return _text_size(value, cap)  # an invalid spec: Python raises
    width = _digits(m.group(1))
    prec = _digits(m.group(2)) if m.group(2) else None
    kind = m.group(3)
    if isinstance(value, (int, float)) and not kind:
        kind = "g" if isinstance(value, float) else "d"
    return _field_size(value, kind, width, prec, cap)


class _Formatter(SandboxedFormatter):
    """``str.format`` in the sandbox, with every field's width and precision checked first."""

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:  # {!r}, {!s}: the text is built before format_field sees it
            b = _budget()
            est = _text_size(value, _left(b))
            if est > _left(b):  # refused; when it fits, format_field counts the field made of it
                _grow(b, est, "format")
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        b = _budget()
        est = _format_spec_size(value, format_spec, _left(b))
        _grow(b, est, "format")
        rv = super().format_field(value, format_spec)
        _grow(b, len(rv) - est, "format")
        return rv


class _EscapeFormatter(_Formatter, EscapeFormatter):
    pass


def _b_percent(b: _Budget, fmt: Any, args: Any, what: str) -> Any:
    est = _percent_size(fmt, args, _left(b))
    _grow(b, est, what)
    rv = fmt % args
    _grow(b, len(rv) - est, what)
    return rv


# ------------------------------------------------------------------- operators, text, joins, loops
# Called from the generated code (see _CodeGenerator), with these names in the template's module.


def _noetl_add(left: Any, right: Any) -> Any:
    t = type(left)
    if t is int or t is float:
        rv = left + right
        if type(rv) is int and rv.bit_length() > 64:
            _check_bits(_budget(), rv.bit_length(), "'+'")
        return rv
    if t is str or t is list or t is tuple or isinstance(left, (str, list, tuple, bytes)):
        try:
            n = len(left) + len(right)
        except TypeError:
            return left + right  # Python raises
        b = _budget()
        _grow(b, n, "'+'")
        rv = left + right
        if isinstance(rv, Markup):  # Markup escapes the other side: a few times longer at most
            _grow(b, len(rv) - n, "'+'")
        return rv
    return left + right


def _noetl_sub(left: Any, right: Any) -> Any:
    rv = left - right
    if type(rv) is int and rv.bit_length() > 64:
        _check_bits(_budget(), rv.bit_length(), "'-'")
    return rv


def _noetl_mul(left: Any, right: Any) -> Any:
    if type(left) is int and type(right) is int:
        bits = left.bit_length() + right.bit_length()
        if bits > 64:
            _check_bits(_budget(), bits, "'*'")
        return left * right
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple, bytes, bytearray)) and isinstance(n, int):
            _grow(_budget(), len(seq) * max(n, 0), "'*'")
            break
    return left * right


def _noetl_pow(left: Any, right: Any) -> Any:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _check_bits(_budget(), math.log2(abs(left)) * right, "'**'")
    return left**right


def _noetl_mod(left: Any, right: Any) -> Any:
    if isinstance(left, (str, bytes, bytearray)):
        return _b_percent(_budget(), left, right, "'%'")
    return left % right


def _noetl_concat(parts: tuple[Any, ...], b: _Budget) -> str:
    """``a ~ b ~ c``."""
    texts = [p if type(p) is str else _text(p, "'~'") for p in parts]
    _grow(b, sum(map(len, texts)), "'~'")
    return "".join(texts)


def _noetl_text(value: Any, b: _Budget) -> str:
    """What ``{{ value }}`` writes in text: a string as it is, anything else as its text, counted."""
    t = type(value)
    if t is str:
        return value
    if t is int or t is float or t is bool or value is None:
        s = str(value)
        used = b.used + len(s)
        if used > b.lim.template_max_output:
            _grow(b, len(s), "the output")
        b.used = used
        return s
    return _text(value, "the output")


def _noetl_sliced(value: Any, b: _Budget) -> Any:
    """``x[a:b]``: the copy is at most as long as ``x``, counted once made."""
    n = _size_of(value)
    if n:
        _grow(b, n, "a slice")
    return value


def _noetl_join(parts: Any) -> str:
    """The text of a macro, a call block, ``{% set %}…{% endset %}``, a filter block, a block."""
    if type(parts) is not list:
        parts = list(parts)
    _grow(_budget(), sum(map(len, parts)), "a macro or block")
    return "".join(parts)


def _noetl_out_of_time() -> None:
    _out_of_time(_budget())


_noetl_local = _local  # the generated code reads this thread's budget once per render

_RUNTIME = {name: globals()[name] for name in ("_noetl_add", "_noetl_sub", "_noetl_mul", "_noetl_pow", "_noetl_mod",
                                               "_noetl_concat", "_noetl_text", "_noetl_sliced", "_noetl_out_of_time",
                                               "_noetl_local")}


# ----------------------------------------------------------------------------------- code generator


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator with the budget's hooks, and no evaluation at compile time."""

    def __init__(self, environment: Any, name: Any, filename: Any, stream: Any = None,
                 defer_init: bool = False, optimized: bool = True) -> None:
        # optimized=False: no constant folding (it would run `'x'|center(999999999)` while compiling).
        super().__init__(environment, name, filename, stream, defer_init, optimized=False)

    def _output_child_to_const(self, node: nodes.Expr, frame: Any, finalize: Any) -> str:
        # Jinja evaluates constant output expressions while compiling; only literal text may be.
        if isinstance(node, nodes.TemplateData):
            return super()._output_child_to_const(node, frame, finalize)
        raise nodes.Impossible()

    def _output_child_pre(self, node: nodes.Expr, frame: Any, finalize: Any) -> None:
        # `{{ x }}` in text: a string as it is (no call), anything else through _noetl_text.
        self.write("(_noetl_v if (_noetl_v := ")

    def _output_child_post(self, node: nodes.Expr, frame: Any, finalize: Any) -> None:
        self.write(").__class__ is str else _noetl_text(_noetl_v, _noetl_b))")

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        # The budget's local (see write_commons) only when the code will read it.
        self._uses_budget = any(True for _ in node.find_all((nodes.For, nodes.Output, nodes.Concat, nodes.Slice,
                                                              nodes.Macro, nodes.CallBlock)))
        super().visit_Template(node, frame)

    def _binop(self, name: str, node: nodes.BinExpr, frame: Any) -> None:
        if name in ("add", "sub") and any(isinstance(n, nodes.Const) and type(n.value) in (int, float)
                                          for n in (node.left, node.right)):
            # A number literal: the result is a number one bit longer at most, or a TypeError.
            self.write("(")
            self.visit(node.left, frame)
            self.write(" + " if name == "add" else " - ")
            self.visit(node.right, frame)
            self.write(")")
            return
        self.write(f"_noetl_{name}(")
        self.visit(node.left, frame)
        self.write(", ")
        self.visit(node.right, frame)
        self.write(")")

    def visit_Add(self, node: nodes.Add, frame: Any) -> None:
        self._binop("add", node, frame)

    def visit_Sub(self, node: nodes.Sub, frame: Any) -> None:
        self._binop("sub", node, frame)

    def visit_Mul(self, node: nodes.Mul, frame: Any) -> None:
        self._binop("mul", node, frame)

    def visit_Pow(self, node: nodes.Pow, frame: Any) -> None:
        self._binop("pow", node, frame)

    def visit_Mod(self, node: nodes.Mod, frame: Any) -> None:
        self._binop("mod", node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("_noetl_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("), _noetl_b)")

    def visit_Getitem(self, node: nodes.Getitem, frame: Any) -> None:
        if isinstance(node.arg, nodes.Slice):
            self.write("_noetl_sliced(")
            super().visit_Getitem(node, frame)
            self.write(", _noetl_b)")
        else:
            super().visit_Getitem(node, frame)

    def write_commons(self) -> None:
        # The start of the template's function and of each block's: this thread's budget in a local.
        super().write_commons()
        if getattr(self, "_uses_budget", True):
            self.writeline("_noetl_b = _noetl_local.budget")

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        # The time check of each iteration, first in the body and before the loop's `if` test.
        if not (node.body and isinstance(node.body[0], nodes.ExprStmt) and _is_tick(node.body[0].node)):
            node.body.insert(0, nodes.ExprStmt(_tick(node.lineno), lineno=node.lineno))
            if node.test is not None:
                node.test = nodes.Or(_tick(node.lineno), node.test, lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Call(self, node: nodes.Call, frame: Any, forward_caller: bool = False) -> None:
        if _is_tick(node):
            self.write("(_noetl_b.expired and _noetl_out_of_time())")
            return
        super().visit_Call(node, frame, forward_caller=forward_caller)


def _tick(lineno: int) -> nodes.Call:
    """A node for the time check, a call of an InternalName (Jinja allows no custom node types; an
    InternalName cannot come from a template, so this one is ours)."""
    name = object.__new__(nodes.InternalName)  # how Parser.free_identifier makes one
    nodes.Node.__init__(name, "_noetl_tick", lineno=lineno)
    return nodes.Call(name, [], [], None, None, lineno=lineno)


def _is_tick(node: nodes.Node) -> bool:
    return (isinstance(node, nodes.Call) and isinstance(node.node, nodes.InternalName)
            and node.node.name == "_noetl_tick")


class _Tracking(meta.TrackingCodeGenerator, _CodeGenerator):
    """``meta.find_undeclared_variables`` without constant folding (see _CodeGenerator)."""


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


def _size_of(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, bytearray, list, tuple, dict)) else 0


def _m_width(s: Any, width: Any = 0, *_: Any, **__: Any) -> int:
    return max(len(s), width) if isinstance(width, int) else 0


def _m_expandtabs(s: Any, tabsize: Any = 8, *_: Any, **__: Any) -> int:
    tab = "\t" if isinstance(s, str) else b"\t"
    return len(s) + s.count(tab) * max(tabsize, 0) if isinstance(tabsize, int) else 0


def _m_replace(s: Any, old: Any = None, new: Any = None, count: Any = -1, *_: Any, **__: Any) -> int:
    if type(old) is not type(new) or not isinstance(old, (str, bytes)) or not isinstance(count, int):
        return 0
    hits = len(s) + 1 if not old else s.count(old)
    if count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _m_translate(s: Any, table: Any = None, *_: Any, **__: Any) -> int:
    if isinstance(s, str) and isinstance(table, Mapping):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
        return len(s) * max(longest, 1)
    return len(s)


# Methods of str/bytes whose result can be much longer than the string: its size, from the arguments.
_TEXT_METHOD_SIZE = {"center": _m_width, "ljust": _m_width, "rjust": _m_width, "zfill": _m_width,
                     "expandtabs": _m_expandtabs, "replace": _m_replace, "translate": _m_translate}
_TEXT_TYPES = (str, bytes, bytearray)


class _Environment(ImmutableSandboxedEnvironment):
    code_generator_class = _CodeGenerator
    # Not compiled through call_binop (the code generator calls _noetl_*), but listing them here keeps
    # Jinja from evaluating them at compile time in any code path we missed.
    intercepted_binops = frozenset({"+", "-", "*", "**", "%"})

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

    def wrap_str_format(self, value: Any) -> Any:
        """The sandbox's ``str.format``/``format_map``, with our formatter (widths checked)."""
        if not isinstance(value, (MethodType, BuiltinMethodType)) or value.__name__ not in ("format", "format_map"):
            return None
        f_self = value.__self__
        if not isinstance(f_self, str):
            return None
        str_type = type(f_self)
        is_format_map = value.__name__ == "format_map"
        formatter = _EscapeFormatter(self, escape=f_self.escape) if isinstance(f_self, Markup) else _Formatter(self)

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            rv = formatter.vformat(f_self, args, kwargs)
            _grow(_budget(), len(rv), "format")
            return str_type(rv)

        wrapper.__name__ = value.__name__
        return wrapper

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _budget()
        if b.expired:
            _out_of_time(b)
        t = type(__obj)
        if t is BuiltinMethodType or t is MethodType:
            owner = __obj.__self__
            if isinstance(owner, _TEXT_TYPES):
                return __self._call_text_method(b, __context, __obj, owner, args, kwargs)
            if type(owner) is int and __obj.__name__ == "to_bytes" and args and isinstance(args[0], int):
                _grow(b, args[0], "int.to_bytes")
        rv = super().call(__context, __obj, *args, **kwargs)
        if __obj is dict or (t is BuiltinMethodType and __obj.__name__ in ("copy", "fromkeys")):
            _grow(b, _size_of(rv), f"{__obj.__name__}()")
        elif __obj is Namespace:
            _grow(b, len(object.__getattribute__(rv, "_Namespace__attrs")), "namespace()")
        return _check_int(rv, "a call") if type(rv) is int else rv

    def _call_text_method(self, b: _Budget, context: Any, method: Any, owner: Any, args: tuple, kwargs: dict) -> Any:
        name = method.__name__
        what = f".{name}()"
        est = 0
        if name == "join" and args:
            items = args[0] if type(args[0]) in (list, tuple) else list(args[0])
            args = (items, *args[1:])
            cap = _left(b)
            est = len(owner) * max(len(items) - 1, 0)
            for item in items:
                est += len(item) if isinstance(item, _TEXT_TYPES) else _text_size(item, cap - est)
                if est > cap:
                    break
        else:
            size = _TEXT_METHOD_SIZE.get(name)
            if size is not None:
                est = size(owner, *args, **kwargs)
        _grow(b, est, what)
        rv = super().call(context, method, *args, **kwargs)
        _grow(b, (0 if rv is owner else _size_of(rv)) - est, what)
        return _check_int(rv, what) if type(rv) is int else rv


# ------------------------------------------------------------------------------------------ filters
#
# Each filter that builds a string or a list runs through a wrapper: the time check, a size check
# before it runs when its size is known from the arguments, and its result counted after. Filters
# that only pick or test (default, first, length, int, map, select, ...) are left as Jinja has them.


def _wrap(name: str, func: Any, before: Any = None, counted: bool = True) -> Any:
    skip = 1 if hasattr(func, "jinja_pass_arg") else 0

    def checked(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        if b.expired:
            _out_of_time(b)
        est = before(b, *args[skip:], **kwargs) if before is not None else 0
        if est:
            _grow(b, est, f"|{name}")
        rv = func(*args, **kwargs)
        if counted:
            value = args[skip] if len(args) > skip else None
            _grow(b, (0 if rv is value else _size_of(rv)) - est, f"|{name}")
        return _check_int(rv, f"|{name}") if type(rv) is int else rv

    if skip:
        checked.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
    checked.__name__ = f"{name}_filter"
    return checked


def _text_of(b: _Budget, value: Any) -> int:
    return len(value) if isinstance(value, str) else _text_size(value, _left(b))


def _before_center(b: _Budget, value: Any, width: Any = 80, *_: Any, **__: Any) -> int:
    n = _text_of(b, value)
    return max(n, width) if isinstance(width, int) else n


def _as_text(value: Any, what: str) -> str:
    """The text a filter makes of its input first (built and counted here, so its size is known)."""
    return value if isinstance(value, str) else _text(value, what)


def _before_indent(b: _Budget, s: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    step = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
    if step > _left(b) or not isinstance(s, str):  # `" " * width` comes first, even when `s` is no text
        return max(step, 0)
    return len(s) + 1 + _line_count(s) * max(step, 0)


def _before_format(b: _Budget, value: Any, *args: Any, **kwargs: Any) -> int:
    return _percent_size(_as_text(value, "|format"), kwargs or args, _left(b))


def _before_replace(b: _Budget, s: Any, old: Any = "", new: Any = "", count: Any = None, *_: Any, **__: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        text = _text_of(b, s)  # the filter turns them into text first: assume a match everywhere
        return text + (text + 1) * _text_of(b, new) + _text_of(b, old)
    hits = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _before_wordwrap(b: _Budget, s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                     *_: Any, **__: Any) -> int:
    if not isinstance(s, str) or not isinstance(width, int) or width < 1:
        return 0
    sep = len(wrapstring) if isinstance(wrapstring, str) else _text_of(b, wrapstring) if wrapstring else 1
    return len(s) + (len(s) // width + _line_count(s)) * sep


def _before_batch(b: _Budget, value: Any, linecount: Any = 1, fill_with: Any = None, *_: Any, **__: Any) -> int:
    return linecount if fill_with is not None and isinstance(linecount, int) else 0


def _before_slice(b: _Budget, value: Any, slices: Any = 1, fill_with: Any = None, *_: Any, **__: Any) -> int:
    return slices if isinstance(slices, int) else 0


def _before_text(b: _Budget, value: Any, *_: Any, **__: Any) -> int:
    return 0 if isinstance(value, str) else _text_size(value, _left(b))


def _before_escape(b: _Budget, value: Any, *_: Any, **__: Any) -> int:
    return _escaped_len(_as_text(value, "|escape"))


def _json_indent(indent: Any) -> int:
    return indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0


def _before_tojson(b: _Budget, value: Any, indent: Any = None, *_: Any, **__: Any) -> int:
    return _text_size(value, _left(b), json_mode=True, indent=_json_indent(indent))


def _before_to_json(b: _Budget, value: Any, indent: Any = None, *_: Any, **__: Any) -> int:
    return _text_size(value, _left(b), indent=_json_indent(indent))


def _before_pprint(b: _Budget, value: Any, *_: Any, **__: Any) -> int:
    return _text_size(value, _left(b), indent=1)


def _before_urlize(b: _Budget, value: Any, trim_url_limit: Any = None, nofollow: Any = False, target: Any = None,
                   rel: Any = None, *_: Any, **__: Any) -> int:
    value = _as_text(value, "|urlize")
    links = value.count(".") + value.count(":") + value.count("@")
    extra = sum(len(x) for x in (target, rel) if isinstance(x, str))
    return 2 * _escaped_len(value) + links * (extra + 48)


def _before_urlencode(b: _Budget, value: Any, *_: Any, **__: Any) -> int:
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return len(raw) + 2 * len(raw.translate(None, _URL_SAFE))
    return 3 * _text_size(value, _left(b)) + 3


_URL_SAFE = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-~/"


def _before_xmlattr(b: _Budget, d: Any, *_: Any, **__: Any) -> int:
    if not isinstance(d, Mapping):
        return 0
    size = 0
    for k, v in d.items():
        size += 4 + (_escaped_len(k) if isinstance(k, str) else 64)
        size += _escaped_len(v) if isinstance(v, str) else _text_size(v, _left(b) - size)
        if size > _left(b):
            break
    return size


@pass_environment
def _join(environment: Any, value: Any, d: Any = "", attribute: Any = None) -> str:
    """Jinja's ``join`` (autoescape is off here), with the text's size known before it is built."""
    if attribute is not None:
        value = map(make_attrgetter(environment, attribute), value)
    items = value if type(value) in (list, tuple) else list(value)
    b = _budget()
    sep = _text(d, "|join")
    cap = _left(b)
    size = len(sep) * max(len(items) - 1, 0)
    for item in items:
        size += len(item) if type(item) is str else _text_size(item, cap - size)
        if size > cap:
            break
    _grow(b, size, "|join")
    rv = sep.join(map(str, items))
    _grow(b, len(rv) - size, "|join")
    return rv


@pass_environment
def _sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's ``sum``; lists and tuples are joined in one pass (``sum`` would copy them over and over)."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    kind = type(start)
    if kind is not list and kind is not tuple:
        return _check_int(sum(iterable, start), "|sum")
    items = list(iterable)
    for item in items:
        if type(item) is not kind:
            raise TypeError(f'can only concatenate {kind.__name__} (not "{type(item).__name__}") to {kind.__name__}')
    _grow(_budget(), len(start) + sum(map(len, items)), "|sum")
    return kind(itertools.chain(start, *items))


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


def _before_from_json(b: _Budget, value: Any, *_: Any, **__: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, bytearray)) else 0


# name -> (size check before, count the result). Filters not listed keep Jinja's function unwrapped.
_FILTER_CHECKS: dict[str, tuple[Any, bool]] = {
    "center": (_before_center, True),
    "indent": (_before_indent, True),
    "format": (_before_format, True),
    "replace": (_before_replace, True),
    "wordwrap": (_before_wordwrap, True),
    "batch": (_before_batch, False),
    "slice": (_before_slice, False),
    "string": (_before_text, True),
    "safe": (_before_text, True),
    "capitalize": (_before_text, True),
    "title": (_before_text, True),
    "upper": (_before_text, True),
    "lower": (_before_text, True),
    "trim": (_before_text, True),
    "truncate": (_before_text, True),
    "striptags": (_before_text, True),
    "escape": (_before_escape, True),
    "e": (_before_escape, True),
    "forceescape": (_before_escape, True),
    "tojson": (_before_tojson, True),
    "to_json": (_before_to_json, True),
    "pprint": (_before_pprint, True),
    "urlize": (_before_urlize, True),
    "urlencode": (_before_urlencode, True),
    "xmlattr": (_before_xmlattr, True),
    "from_json": (_before_from_json, False),
    "list": (None, True),
    "reverse": (None, True),
    "sort": (None, True),
    "dictsort": (None, True),
    "groupby": (None, True),
    "join": (None, False),  # _join checks itself
    "sum": (None, False),  # _sum checks itself
}


def _make_env() -> _Environment:
    env = _Environment(
        loader=None,
        autoescape=False,
        undefined=_Undefined,
        keep_trailing_newline=True,
        cache_size=0,
        auto_reload=False,
        optimized=False,
    )
    for name in ("lipsum", "cycler", "joiner"):
        env.globals.pop(name, None)
    env.concat = _noetl_join  # type: ignore[assignment]  # joins the buffers of macros and blocks
    env.filters["to_json"] = _to_json
    env.filters["from_json"] = _from_json
    env.filters["bool"] = _to_bool
    env.filters["join"] = _join
    env.filters["sum"] = _sum
    for name, (before, counted) in _FILTER_CHECKS.items():
        env.filters[name] = _wrap(name, env.filters[name], before, counted)
    return env


_ENV = _make_env()

# Tags that would load other templates; with no loader they cannot work anyway, reject them early.
_FORBIDDEN = {nodes.Extends: "extends", nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from"}
# Expression nodes that can build a container holding an undefined value ({{ [a, 1] }}).
_MAY_NEST = (nodes.List, nodes.Tuple, nodes.Dict, nodes.Call, nodes.Filter)
# The nodes of an expression that only reads its context ({{ workload.rows }}, {{ steps.a.result[0] }}):
# what it gives was checked where it entered the engine (a request, a task's result, a template that
# made it). Any other expression (arithmetic, a literal, a call, a filter: '{}' | from_json, map(...))
# makes a value, which is checked before it goes anywhere (contracts/refs.py ``unsendable``: a payload
# reference, D23; an integer past 64 bits; a number that is not finite).
_READS = (nodes.Name, nodes.Getattr, nodes.Getitem, nodes.Const)


# -------------------------------------------------------------------------------------------- compile


class _Compiled:
    __slots__ = ("template", "render_func", "blocks", "globals", "native", "check_nested", "makes_value")

    def __init__(self, template: Any, native: bool, check_nested: bool = False, makes_value: bool = False) -> None:
        self.template = template
        self.render_func = template.root_render_func
        # The budget's hooks, looked up by the generated code as globals of its module.
        self.render_func.__globals__.update(_RUNTIME)
        self.blocks = template.blocks
        # Plain-dict snapshot of the (fixed) globals: Template.new_context would copy a ChainMap per call.
        self.globals = dict(template.globals)
        self.native = native
        self.check_nested = check_nested
        self.makes_value = makes_value


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
    makes = not all(isinstance(n, _READS) and (not isinstance(n, nodes.Const) or refs.unsendable(n.value) is None)
                    for n in (expr, *expr.find_all(nodes.Node)))  # a literal may be a number the log cannot hold
    return _Compiled(_ENV.from_string(body), native=True, check_nested=check, makes_value=makes)


@lru_cache(maxsize=CACHE_SIZE)
def _compile(source: str, mode: str) -> _Compiled:
    """Compile ``source``. mode: "auto" (native when one expression), "text", or "expr" (bare expression).

    Raises TemplateError (with an empty ``where``) on a syntax error. Cached by (source, mode).
    Never evaluates any part of the template.
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


@lru_cache(maxsize=CACHE_SIZE)
def _parse_only(source: str) -> None:
    """What validation needs of a template, for a quarter of the cost of compiling it: it parses, it
    uses no forbidden tag, and every filter and test it names exists (wherever it is)."""
    try:
        ast = _ENV.parse(source)
    except TemplateSyntaxError as e:
        raise TemplateError(source, "", f"template syntax error: {e.message or e}") from None
    except Exception as e:  # noqa: BLE001 - parser trouble we did not foresee: still a template problem
        raise TemplateError(source, "", f"template syntax error: {type(e).__name__}: {e}") from None
    for node_type, tag in _FORBIDDEN.items():
        if ast.find(node_type) is not None:
            raise TemplateError(source, "", f"template syntax error: '{{% {tag} %}}' is not allowed in playbook templates")
    for node in ast.find_all((nodes.Filter, nodes.Test)):
        known = _ENV.filters if isinstance(node, nodes.Filter) else _ENV.tests
        if node.name not in known:
            what = "filter" if isinstance(node, nodes.Filter) else "test"
            raise TemplateError(source, "", f"template syntax error: No {what} named {node.name!r}.")


_NESTING = (Undefined, list, tuple, dict)


def _find_undefined(value: Any) -> Undefined | None:
    if isinstance(value, Undefined):
        return value
    t = type(value)
    if t is list or t is tuple:
        items = value
    elif t is dict:
        items = value.values()
    else:
        return None
    if not any(issubclass(k, _NESTING) for k in set(map(type, items))):
        return None  # flat: one pass in C instead of one Python call per item
    for item in items:
        u = _find_undefined(item)
        if u is not None:
            return u
    return None


def _run(compiled: _Compiled, source: str, context: Mapping[str, Any] | None, where: str, b: _Budget) -> Any:
    try:
        if b.expired:
            _out_of_time(b)
        # What Template.new_context does, minus its per-call ChainMap copies.
        gl = compiled.globals
        ctx = _Context(_ENV, {**gl, **context} if context else dict(gl), None, compiled.blocks, gl)
        if not compiled.native:
            parts = [*compiled.render_func(ctx)]
            size = sum(map(len, parts))
            if b.used + size > b.lim.template_max_output:
                _grow(b, size, "the output")
            b.used += size
            return "".join(parts)
        for _ in compiled.render_func(ctx):
            pass
        rv = ctx.vars["result"]
        if isinstance(rv, Undefined):
            rv._fail_with_undefined_error()
        if compiled.check_nested and isinstance(rv, (list, tuple, dict)):
            u = _find_undefined(rv)
            if u is not None:
                u._fail_with_undefined_error()
        if compiled.makes_value and (wrong := refs.unsendable(rv, b.lim.max_value_depth)) is not None:
            at, why = wrong
            raise TemplateError(source, where, f"the value it gives{' at ' + refs.shown(at) if at else ''}: {why}")
        if type(rv) is not str and isinstance(rv, str):  # Markup from tojson & co.
            rv = str(rv)
        return rv
    except TemplateError as e:
        raise TemplateError(source, where, e.reason) from None
    except LimitExceeded as e:
        raise TemplateError(source, where, str(e)) from None
    except _Timeout:
        raise TemplateError(source, where, str(_time_error(b))) from None
    except UndefinedError as e:
        raise TemplateError(source, where, str(e.message)) from None
    except Exception as e:
        raise TemplateError(source, where, f"{type(e).__name__}: {e}") from None


def _get(source: str, mode: str, where: str) -> _Compiled:
    try:
        return _compile(source, mode)
    except TemplateError as e:
        raise TemplateError(source, where, e.reason) from None


def _budgeted(func: Any, value: Any, context: Any, where: str) -> Any:
    """Run ``func(value, context, where, budget)`` as a top-level call (or inside the active one)."""
    try:
        b = _local.budget
    except AttributeError:
        b = _budget()
    if b.active:
        return func(value, context, where, b)
    # Arm: the current limits, the clock and the count start (or the shared group's).
    b.lim = lim = limits.current()
    g = b.group = _GROUP.get()
    b.expired = b.pending = False
    if g is None:
        b.start = _cpu()
        b.used = 0
    else:
        b.start, b.used = g.start, g.used
        b.expired = _cpu() - g.start > lim.template_max_ms / 1000
    b.active = True  # the watchdog looks at active budgets only: everything above is set first
    if _wd_idle:
        _wake_watchdog()
    try:
        try:
            return func(value, context, where, b)
        finally:
            # Disarm. After this the watchdog can no longer raise in this thread.
            b.active = False
            if b.pending:  # it is firing or has fired: drop an exception not yet delivered
                with _lock:
                    _set_async_exc(b.tid, None)
                    b.pending = False
            if g is not None:
                g.used = b.used
    except _Timeout:  # arrived outside _run (between the values of a mapping, or while disarming)
        b.active = False
        source = value if isinstance(value, str) else ""
        raise TemplateError(source, where, str(_time_error(b))) from None


# ------------------------------------------------------------------------------------------------ API


def within_depth(value: Any, where: str) -> Any:
    """``value`` (a rendered ``set_ctx``/``set_iter`` patch, an arc's ``args``), or a
    :class:`TemplateError` when the mappings a playbook wrote around the values it reads nest deeper
    than ``max_value_depth`` (D23): no single template made that value, so no render checked it."""
    depth = limits.current().max_value_depth
    if refs.too_deep(value, depth):
        raise TemplateError("", where, f"it builds {refs.TOO_DEEP.format(min(depth, refs.MAX_DEPTH))}")
    return value


def is_template(value: str) -> bool:
    """True when ``value`` is a string holding ``{{``, ``{%`` or ``{#``."""
    return isinstance(value, str) and ("{{" in value or "{%" in value or "{#" in value)


def render(value: Any, context: Mapping[str, Any], where: str = "") -> Any:
    """Render ``value`` recursively (D7); single-expression strings give native values."""
    if isinstance(value, str):
        if "{{" not in value and "{%" not in value and "{#" not in value:
            return value
        return _budgeted(_render_template, value, context, where)
    if not isinstance(value, (Mapping, list, tuple)):
        return value
    return _budgeted(_render, value, context, where)


def _render_template(source: str, context: Mapping[str, Any], where: str, b: _Budget) -> Any:
    return _run(_get(source, "auto", where), source, context, where, b)


def _render(value: Any, context: Mapping[str, Any], where: str, b: _Budget) -> Any:
    if isinstance(value, str):
        if "{{" not in value and "{%" not in value and "{#" not in value:
            return value
        return _render_template(value, context, where, b)
    if isinstance(value, Mapping):
        prefix = where + "." if where else ""
        return {k: _render(v, context, f"{prefix}{k}", b) for k, v in value.items()}
    if isinstance(value, list):
        return [_render(v, context, f"{where}[{i}]", b) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_render(v, context, f"{where}[{i}]", b) for i, v in enumerate(value))
    return value


def render_text(source: str, context: Mapping[str, Any], where: str = "") -> str:
    """Render ``source`` to text, even when it is a single expression."""
    if not isinstance(source, str):
        source = str(source)
    if "{{" not in source and "{%" not in source and "{#" not in source:
        return source
    return _budgeted(_render_text, source, context, where)


def _render_text(source: str, context: Mapping[str, Any], where: str, b: _Budget) -> str:
    return _run(_get(source, "text", where), source, context, where, b)


def evaluate(expr_or_template: str, context: Mapping[str, Any], where: str = "") -> Any:
    """Native value of ``"{{ x > 1 }}"`` or of a bare expression ``"x > 1"``.

    A text template (``"a-{{ x }}"``) gives its text; non-strings are returned as they are.
    """
    if not isinstance(expr_or_template, str):
        return expr_or_template
    if is_template(expr_or_template):
        return render(expr_or_template, context, where)
    return _budgeted(_evaluate, expr_or_template, context, where)


def _evaluate(expr: str, context: Mapping[str, Any], where: str, b: _Budget) -> Any:
    return _run(_get(expr, "expr", where), expr, context, where, b)


def truthy(value_or_template: Any, context: Mapping[str, Any], where: str = "") -> bool:
    """Truth of a ``when`` condition: render (native), then Python truthiness, except that the
    strings "false", "no", "0", "", "none", "null" (any case, stripped) are False."""
    value = render(value_or_template, context, where)
    if isinstance(value, str):
        return value.strip().lower() not in _FALSY_STRINGS
    return bool(value)


def check_syntax(value: Any, where: str = "") -> list[tuple[str, str]]:
    """``(where, message)`` for every template in ``value`` (recursively) that does not parse, uses a
    forbidden tag or names a filter or test that does not exist. Nothing is compiled or evaluated."""
    out: list[tuple[str, str]] = []
    _check(value, where, out)
    return out


def _check(value: Any, where: str, out: list[tuple[str, str]]) -> None:
    if isinstance(value, str):
        if is_template(value):
            try:
                _parse_only(value)
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
        tracker = _Tracking(_ENV)
        tracker.visit(_ENV.parse(source))
        return frozenset(tracker.undeclared_identifiers)
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
