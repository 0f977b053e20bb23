"""Playbook documents: the one way from text (or bytes, or an already-parsed value) to the JSON-like
value the validator checks. Pure: no I/O but :func:`read_document`.

A playbook travels as JSON (events, the catalog, Postgres), so a document is accepted only when it is
JSON data that every later stage can store as it is: mappings with string keys, lists, strings
without NUL characters or lone surrogates, 64-bit integers, finite floats, booleans and null. Every
other input gets a located :class:`~.diagnostics.Diagnostic` instead of an exception:

* bytes are UTF-8, or UTF-8/16/32 with a byte-order mark; anything else (Latin-1 included: it cannot be
  told apart from other legacy encodings) is refused naming the first bad byte's offset, line and column;
* the text is at most ``max_document_bytes``; NUL characters and lone surrogates are refused;
* YAML is read event by event (libyaml's C parser when installed) and built without recursion, so
  nesting deeper than ``max_document_depth`` is refused as soon as it is seen, and aliases are never
  expanded: each alias adds its anchor's size, so a "billion laughs" document is refused after a few
  hundred events when its expanded values pass ``max_document_nodes`` or its expanded text passes
  ``max_document_bytes``; an alias inside its own anchor (a recursive document) is refused;
* tags beyond JSON's types (``!!binary``, ``!!set``, ``!!omap``, ``!!python/...``, unknown ones) and
  values their tag cannot read (``!!int 0x_``, ``!!bool maybe``) are located errors; timestamps stay
  the strings they were written as (JSON has no date type); duplicate keys are errors (YAML would keep
  the last one silently); merge keys (``<<``) work as in YAML 1.1.

:func:`check_value` applies the same rules to a value parsed elsewhere (a JSON request body, a mapping
built in code), following shared containers once and refusing cyclic ones.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from collections.abc import Mapping
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.events import (
    AliasEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.nodes import ScalarNode

from .. import limits
from .diagnostics import Diagnostic, Path, locate

LOADER = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader  # libyaml's parser when installed
MAX_ERRORS = 100  # value errors reported per document before giving up
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what JSON encoders (orjson) and the event log take

_Y = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL, TIMESTAMP, MERGE_TAG, VALUE_TAG, YAML_TAG, SEQ, MAP = (
    _Y + t for t in ("str", "int", "float", "bool", "null", "timestamp", "merge", "value", "yaml", "seq", "map"))
_NOT_JSON = {_Y + t: f"'!!{t}'" for t in ("binary", "set", "omap", "pairs")}
_BAD_CHARS = re.compile("[\x00\ud800-\udfff]")
_BOMS = (  # longest first: the UTF-32-LE mark starts with the UTF-16-LE one
    (b"\x00\x00\xfe\xff", "utf-32-be"), (b"\xff\xfe\x00\x00", "utf-32-le"),
    (b"\xef\xbb\xbf", "utf-8"), (b"\xfe\xff", "utf-16-be"), (b"\xff\xfe", "utf-16-le"),
)
_INT_CHARS = 70  # longer (without '_') is not a 64-bit integer: 0b + 64 digits + sign
_JSON_TYPES = "mappings, lists, strings, numbers, booleans and null"


@dataclass
class Parsed:
    """What :func:`parse` found: the value (None when there is an error), every diagnostic, and where
    each mapping key and list item starts (for locating later findings; see :func:`position`)."""

    value: Any
    diagnostics: list[Diagnostic]
    positions: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id(container) -> (mark, marks)

    @property
    def ok(self) -> bool:
        return not any(d.severity == "error" for d in self.diagnostics)


class _Refused(Exception):
    """Stops reading: a limit, a syntax error, or too many errors. ``args[0]``: the diagnostic, if
    it is not reported yet."""


def load_document(source: str | bytes) -> tuple[Any, list[Diagnostic]]:
    """The value of a playbook text and its diagnostics; the value is None when there is an error."""
    parsed = parse(source)
    return parsed.value, parsed.diagnostics


def parse(source: str | bytes, positions: bool = False) -> Parsed:
    """:func:`load_document` with, when ``positions``, the line and column of every key and item."""
    builder = _Builder(positions)
    try:
        text = _decode(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
        if not isinstance(text, str):
            raise _refused("", f"a playbook is text (YAML or JSON), got {type(source).__name__}")
        value = builder.build(_checked_text(text))
    except _Refused as exc:
        builder.errors.extend(exc.args)
        value = None
    if builder.errors:
        return Parsed(None, builder.errors)
    return Parsed(value, [], builder.positions)


def read_document(path: str | FsPath) -> tuple[str | None, list[Diagnostic]]:
    """A playbook file's text, decoded as :func:`load_document` decodes bytes; or why it cannot be had.
    Reads at most ``max_document_bytes`` + 1 bytes."""
    limit = limits.current().max_document_bytes
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        return None, [Diagnostic("error", "", f"cannot read file: {exc.strerror or exc}")]
    try:
        return _decode(data), []
    except _Refused as exc:
        return None, [exc.args[0]]


def _decode(data: bytes | bytearray | memoryview) -> str:
    """UTF-8, or UTF-8/16/32 with a byte-order mark. Raises :class:`_Refused` (its ``args[0]`` is the
    diagnostic) for anything else, naming the first byte that cannot be read."""
    data = bytes(data)
    limit = limits.current().max_document_bytes
    if len(data) > limit:
        raise _Refused(_limit_diagnostic("", "max_document_bytes", len(data), "the playbook text"))
    encoding, skip = "utf-8", 0
    for bom, name in _BOMS:
        if data.startswith(bom):
            encoding, skip = name, len(bom)
            break
    try:
        return data[skip:].decode(encoding)
    except UnicodeDecodeError as exc:
        at = skip + exc.start
        line = data.count(b"\n", 0, at) + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        bad = data[at:at + 1].hex().upper()
        if encoding == "utf-8":
            why = (f"the text is not UTF-8: byte 0x{bad} at offset {at} (line {line}) cannot be read; "
                   "playbooks are UTF-8, or UTF-16/UTF-32 with a byte-order mark: convert the file "
                   "(e.g. iconv -f latin1 -t utf-8)")
        else:
            why = f"the text is not valid {encoding.upper()} (byte-order mark): {exc.reason} at byte offset {at}"
        raise _Refused(Diagnostic("error", f"line {line}, column {column}", why, line=line, column=column)) from None


def check_value(doc: Any) -> list[Diagnostic]:
    """The rules of :func:`load_document` for a value parsed elsewhere: nesting, size (shared
    containers counted each time they appear, without walking them again), key and value types.
    Every finding is located by its path in ``doc``; [] when the value is a valid document."""
    return _Walker(doc).run()


def position(parsed: Parsed, path: Path) -> tuple[int, int] | None:
    """Line and column (1-based) where ``path`` starts in the parsed text; for a path that leaves the
    document (a missing key) the deepest place it reaches."""
    node = parsed.value
    entry = parsed.positions.get(id(node)) if isinstance(node, (dict, list)) else None
    where = entry[0] if entry else None
    for key in path:
        if entry is None:
            break
        marks = entry[1]
        if isinstance(node, dict) and key in marks:
            where = marks[key]
        elif isinstance(node, list) and marks is not None and isinstance(key, int) and 0 <= key < len(node):
            where = marks[key]
        else:
            break
        node = node[key]
        entry = parsed.positions.get(id(node)) if isinstance(node, (dict, list)) else None
    return _at(where) if where is not None else None


# --------------------------------------------------------------------------------------------- text
def _checked_text(text: str) -> str:
    limit = limits.current().max_document_bytes
    if len(text) > limit or (len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit):
        size = len(text.encode("utf-8", "surrogatepass"))
        raise _Refused(_limit_diagnostic("", "max_document_bytes", size, "the playbook text"))
    if text.startswith("\ufeff"):
        text = text[1:]
    bad = _BAD_CHARS.search(text)
    if bad:
        at = bad.start()
        line = text.count("\n", 0, at) + 1
        column = at - (text.rfind("\n", 0, at) + 1) + 1
        if bad.group() == "\x00":
            why = "a NUL character (U+0000) is not allowed in a playbook"
            if text.count("\x00") * 4 >= len(text):
                why += ": the text looks like UTF-16 or UTF-32 without a byte-order mark; save it as UTF-8"
        else:
            why = f"an unpaired surrogate (U+{ord(bad.group()):04X}) is not a character: the text is not valid Unicode"
        raise _refused(f"line {line}, column {column}", why, (line, column))
    return text


def _refused(where: str, message: str, mark: tuple[int, int] | None = None) -> _Refused:
    return _Refused(Diagnostic("error", where, message, line=mark[0] if mark else None,
                               column=mark[1] if mark else None))


def _limit_diagnostic(where: str, name: str, actual: int | None, what: str, mark: tuple[int, int] | None = None) -> Diagnostic:
    message = str(limits.LimitExceeded(name, actual, what=what))
    return Diagnostic("error", where, message, line=mark[0] if mark else None, column=mark[1] if mark else None)


# --------------------------------------------------------------------------------------------- YAML
_NO_KEY, _SKIP, _MERGE = object(), object(), object()
_OPEN = object()  # an anchor whose node is still being read
_IMPLICIT = LOADER.yaml_implicit_resolvers  # first character -> [(tag, regexp)] for plain scalars
_DECIMAL = re.compile(r"(?:0|-?[1-9][0-9]{0,17})\Z")  # surely a 64-bit integer, read by int()


class _Frame:
    """An open mapping or list. Marks are the parser's (0-based ``line``, ``column``), converted
    only when a finding or a position needs them."""

    __slots__ = ("value", "mark", "anchor", "nodes0", "chars0", "height", "key", "key_mark", "marks", "merges")

    def __init__(self, value: Any, mark: Any, anchor: str | None, nodes0: int, chars0: int, marks: Any):
        self.value, self.mark, self.anchor = value, mark, anchor
        self.nodes0, self.chars0, self.height = nodes0, chars0, 0
        self.key: Any = _NO_KEY
        self.key_mark = mark
        self.marks = marks  # mapping: key -> mark (duplicates, positions); list: item marks or None
        self.merges: list[tuple[Any, Any]] = []


class _Builder:
    """Builds the value of one YAML document from parser events, with an explicit stack."""

    def __init__(self, positions: bool):
        self.want_positions = positions
        self.positions: dict[int, tuple[Any, Any]] = {}
        self.errors: list[Diagnostic] = []
        lim = limits.current()
        self.max_depth, self.max_nodes, self.max_chars = (
            lim.max_document_depth, lim.max_document_nodes, lim.max_document_bytes)

    # ---------------------------------------------------------------- findings
    def error(self, mark: Any, message: str) -> None:
        line, column = _at(mark)
        self.errors.append(Diagnostic("error", f"line {line}, column {column}", message, line=line, column=column))
        if len(self.errors) >= MAX_ERRORS:
            raise _refused("", f"too many errors: stopped after {MAX_ERRORS}")

    @staticmethod
    def refuse(mark: Any, message: str) -> _Refused:
        line, column = _at(mark)
        return _refused(f"line {line}, column {column}", message, (line, column))

    @staticmethod
    def refuse_limit(mark: Any, name: str, actual: int | None, what: str) -> _Refused:
        line, column = _at(mark)
        return _Refused(_limit_diagnostic(f"line {line}, column {column}", name, actual, what, (line, column)))

    # ---------------------------------------------------------------- reading
    def build(self, text: str) -> Any:
        loader = LOADER(text)
        try:
            loader.get_event()  # stream start
            if loader.check_event(StreamEndEvent):
                return None  # an empty text
            loader.get_event()  # document start
            value = self.node(loader)
            loader.get_event()  # document end
            if not loader.check_event(StreamEndEvent):
                raise self.refuse(loader.peek_event().start_mark,
                                  "a second YAML document ('---'): a playbook is one document")
            return value
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            problem = exc.problem or str(exc)
            if "maximum nesting depth" in problem:  # libyaml's own bound (1,000 levels), met before ours
                raise self.refuse_limit(mark, "max_document_depth", None, "the nesting of the playbook") from None
            context = exc.context_mark
            if exc.context and context and mark and (context.line, context.column) != (mark.line, mark.column):
                problem += f" ({exc.context} at line {context.line + 1}, column {context.column + 1})"
            if mark is None:
                raise _refused("", f"YAML syntax error: {problem}") from None
            raise self.refuse(mark, f"YAML syntax error: {problem}") from None
        except yaml.YAMLError as exc:
            raise _refused("", f"YAML error: {exc}") from None
        finally:
            loader.dispose()

    def node(self, loader: Any) -> Any:
        """One node (the document's root) and everything under it, iteratively. Every value is
        counted (an alias by its anchor's size) and its depth checked before it is built."""
        stack: list[_Frame] = []
        anchors: dict[str, Any] = {}
        max_depth, max_nodes, max_chars = self.max_depth, self.max_nodes, self.max_chars
        positions = self.want_positions
        nodes = chars = 0
        get_event = loader.get_event
        while True:
            event = get_event()
            kind = type(event)
            if kind is ScalarEvent:
                text = event.value
                tag = event.tag
                if tag is None:  # plain: resolved by the first character's patterns; quoted: a string
                    tag = STR
                    if event.implicit[0]:
                        for candidate, pattern in _IMPLICIT.get(text[:1], ()):
                            if pattern.match(text):
                                tag = candidate
                                break
                if tag == STR and event.style != '"':  # only escapes can add NUL or surrogates
                    value = text
                elif tag == INT and _DECIMAL.match(text):
                    value = int(text)
                else:
                    value = self.scalar(event, tag, stack)
                nodes += 1
                chars += len(text)
                height = 0
                if nodes > max_nodes or chars > max_chars:
                    self.over(event.start_mark, nodes, chars)
                if event.anchor is not None:
                    self.anchor(anchors, event, (value, 1, len(text), 0))
                mark = event.start_mark
            elif kind is AliasEvent:
                anchored = anchors.get(event.anchor)
                if anchored is None:
                    raise self.refuse(event.start_mark, f"YAML alias *{event.anchor} names no anchor before it")
                if anchored is _OPEN:
                    raise self.refuse(event.start_mark, f"YAML alias *{event.anchor} is inside its own anchor:"
                                                        " a recursive document cannot be stored as JSON")
                value, size, length, height = anchored
                if len(stack) + height > max_depth:
                    raise self.refuse_limit(event.start_mark, "max_document_depth", len(stack) + height,
                                            "the nesting of the playbook (YAML aliases expanded)")
                nodes += size
                chars += length
                mark = event.start_mark
                if nodes > max_nodes or chars > max_chars:
                    self.over(mark, nodes, chars)
            elif kind is SequenceStartEvent or kind is MappingStartEvent:
                mark = event.start_mark
                if len(stack) >= max_depth:
                    raise self.refuse_limit(mark, "max_document_depth", len(stack) + 1, "the nesting of the playbook")
                mapping = kind is MappingStartEvent
                if event.tag not in (None, "!", MAP if mapping else SEQ):
                    self.error(mark, _tag_message(event.tag, "a mapping" if mapping else "a list"))
                if stack and stack[-1].key is _NO_KEY and stack[-1].marks.__class__ is dict:
                    self.error(mark, f"a mapping key must be a string, got {'a mapping' if mapping else 'a list'}")
                nodes += 1
                if nodes > max_nodes:
                    self.over(mark, nodes, chars)
                if event.anchor is not None:
                    self.anchor(anchors, event, _OPEN)
                marks: Any = {} if mapping else ([] if positions else None)
                stack.append(_Frame({} if mapping else [], mark, event.anchor, nodes - 1, chars, marks))
                continue
            elif kind is SequenceEndEvent or kind is MappingEndEvent:
                frame = stack.pop()
                if frame.merges:
                    self.merge(frame)
                value, mark, height = frame.value, frame.mark, frame.height + 1
                if positions:
                    self.positions[id(value)] = (mark, frame.marks)
                if frame.anchor is not None:
                    anchors[frame.anchor] = (value, nodes - frame.nodes0, chars - frame.chars0, height)
            else:  # pragma: no cover - the parser gives no other event inside a document
                raise _refused("", f"unexpected YAML event {kind.__name__}")
            if not stack:
                return value
            parent = stack[-1]
            if height > parent.height:
                parent.height = height
            if parent.marks.__class__ is dict:
                self.add(parent, value, mark)
            else:
                parent.value.append(value)
                if positions:
                    parent.marks.append(mark)

    def over(self, mark: Any, nodes: int, chars: int) -> None:
        if nodes > self.max_nodes:
            raise self.refuse_limit(mark, "max_document_nodes", nodes,
                                    "the number of values in the playbook (YAML aliases expanded)")
        raise self.refuse_limit(mark, "max_document_bytes", chars, "the playbook's text with its YAML aliases expanded")

    def add(self, parent: _Frame, value: Any, mark: Any) -> None:
        """A key, or the value of the pending key, of an open mapping."""
        key = parent.key
        if key is _NO_KEY:  # this value is a key
            if value is not _MERGE and value.__class__ is not str:
                if not isinstance(value, (dict, list)):  # collections were reported when they started
                    self.error(mark, f"a mapping key must be a string, got {_describe(value)}{_quote_hint(value)}")
                value = _SKIP
            parent.key, parent.key_mark = value, mark
            return
        parent.key = _NO_KEY
        if key is _SKIP:
            return
        if key is _MERGE:
            parent.merges.append((value, mark))
            return
        first = parent.marks.get(key)
        if first is not None:
            self.error(parent.key_mark, f"duplicate key '{_short(key)}' (first at line {first.line + 1}): "
                                        "YAML would keep only the last value")
            return
        parent.value[key] = value
        parent.marks[key] = parent.key_mark

    def merge(self, frame: _Frame) -> None:
        """YAML merge keys (``<<: *a`` or ``<<: [*a, *b]``): keys of the mapping win, then the first
        merged mapping, and so on; merged keys come first, as PyYAML orders them."""
        merged: dict[str, Any] = {}
        for value, mark in frame.merges:
            sources = value if isinstance(value, list) else [value]
            if not sources or not all(isinstance(s, dict) for s in sources):
                self.error(mark, f"a merge key '<<' takes a mapping or a list of mappings, got {_describe(value)}")
                continue
            for source in reversed(sources):
                merged.update(source)
        merged.update(frame.value)
        frame.value.clear()
        frame.value.update(merged)

    def scalar(self, event: ScalarEvent, tag: str, stack: list[_Frame]) -> Any:
        """The value of a scalar whose tag is not the common case (a string or a decimal integer)."""
        value = event.value
        mark = event.start_mark
        explicit = event.tag is not None and event.tag != "!"
        if event.tag == "!":  # the non-specific tag: as the resolver says
            tag = _RESOLVER.resolve(ScalarNode, value, event.implicit)
        if tag == STR or tag == YAML_TAG or tag == VALUE_TAG:
            bad = _BAD_CHARS.search(value) if event.style == '"' else None
            if bad:
                self.error(mark, "a NUL character (\\0) is not allowed in a playbook value" if bad.group() == "\x00"
                           else f"an unpaired surrogate (U+{ord(bad.group()):04X}) is not a character")
            return value
        if tag == NULL:
            return None
        if tag == BOOL:
            found = SafeConstructor.bool_values.get(value.lower())
            if found is None:
                self.error(mark, f"'{_short(value)}' is not a boolean ('!!bool' takes true/false, yes/no, on/off)")
            return found
        if tag == INT:
            return self.integer(value, mark)
        if tag == FLOAT:
            try:
                number = _RESOLVER.construct_yaml_float(ScalarNode(tag, value))
            except Exception:  # noqa: BLE001 - whatever the text, a located error
                self.error(mark, f"'{_short(value)}' is not a number")
                return None
            if not math.isfinite(number):
                self.error(mark, f"'{_short(value)}' is not a JSON number (infinity and NaN cannot be stored): "
                                 "write a string")
                return None
            return number
        if tag == TIMESTAMP:
            if explicit and not SafeConstructor.timestamp_regexp.match(value):
                self.error(mark, f"'{_short(value)}' is not a timestamp")
            return value  # JSON has no date type: the text as written
        if tag == MERGE_TAG:  # '<<' is a merge only as a key
            key_position = bool(stack) and stack[-1].key is _NO_KEY and stack[-1].marks.__class__ is dict
            return _MERGE if key_position else value
        self.error(mark, _tag_message(tag, "a scalar"))
        return None

    def integer(self, value: str, mark: Any) -> int | None:
        out_of_range = (f"the integer '{_short(value)}' is out of range: a playbook's integers are 64-bit"
                        " (write a bigger number as a string)")
        if len(value.replace("_", "")) > _INT_CHARS:  # before int(): sexagesimal '1:2:3...' is quadratic
            self.error(mark, out_of_range)
            return None
        try:
            number = _RESOLVER.construct_yaml_int(ScalarNode(INT, value))
        except Exception:  # noqa: BLE001 - whatever the text, a located error
            self.error(mark, f"'{_short(value)}' is not an integer")
            return None
        if not INT_MIN <= number <= INT_MAX:
            self.error(mark, out_of_range)
            return None
        return number

    def anchor(self, anchors: dict[str, Any], event: Any, entry: Any) -> None:
        if event.anchor in anchors:
            self.error(event.start_mark, f"duplicate YAML anchor &{event.anchor}")
        anchors[event.anchor] = entry


_RESOLVER = LOADER("")  # resolve() and the scalar constructors only read the class tables
_RESOLVER.dispose()
assert None not in _IMPLICIT, "a resolver for any first character: _Builder.node must try it too"


def _at(mark: Any) -> tuple[int, int]:
    """A parser mark as 1-based (line, column)."""
    return mark.line + 1, mark.column + 1


def _tag_message(tag: str, what: str) -> str:
    if tag in _NOT_JSON:
        return f"the YAML tag {_NOT_JSON[tag]} has no JSON form: a playbook holds only {_JSON_TYPES}"
    if tag.startswith(_Y):
        short = "!!" + tag[len(_Y):]
        if tag[len(_Y):] in ("str", "int", "float", "bool", "null", "timestamp", "seq", "map"):
            return f"the YAML tag '{_short(short)}' cannot be applied to {what}"
        return f"unknown YAML tag '{_short(short)}': a playbook holds only {_JSON_TYPES}"
    return f"unknown YAML tag '{_short(tag)}': a playbook holds only {_JSON_TYPES}"


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, (int, float)):
        return f"the number {_short(repr(value))}"
    return f"{_short(repr(value))} ({type(value).__name__})"


def _quote_hint(value: Any) -> str:
    if isinstance(value, (bool, int, float)) or value is None:
        return ": quote it to make it a string"
    return ""


def _short(text: Any, size: int = 60) -> str:
    text = str(text)
    return text if len(text) <= size else text[: size - 3] + "..."


# --------------------------------------------------------------------------------------------- values
class _Walker:
    """check_value: an explicit-stack walk; containers met again are counted from a memo. Paths are
    built only for findings (the stack holds each container's key in its parent)."""

    def __init__(self, doc: Any):
        self.doc = doc
        self.errors: list[Diagnostic] = []
        lim = limits.current()
        self.max_depth, self.max_nodes, self.max_chars = (
            lim.max_document_depth, lim.max_document_nodes, lim.max_document_bytes)

    def run(self) -> list[Diagnostic]:
        try:
            self.walk()
        except _Refused as exc:
            self.errors.extend(exc.args)
        return self.errors

    def error(self, path: Path, message: str, stop: bool = False) -> None:
        self.errors.append(Diagnostic("error", locate(self.doc, path), message, path))
        if stop:
            raise _Refused()
        if len(self.errors) >= MAX_ERRORS:
            raise _refused("", f"too many errors: stopped after {MAX_ERRORS}")

    def limit(self, path: Path, name: str, actual: int, what: str) -> None:
        self.error(path, str(limits.LimitExceeded(name, actual, what=what)), stop=True)

    def walk(self) -> None:
        doc = self.doc
        if not _is_container(doc):
            problem = _scalar_problem(doc)
            if problem:
                self.error((), problem)
            return
        max_depth, max_nodes, max_chars = self.max_depth, self.max_nodes, self.max_chars
        search = _BAD_CHARS.search
        nodes, chars = 1, 0
        memo: dict[int, tuple[int, int, int]] = {}  # finished containers: (nodes, chars, height)
        # a frame: [container, (key, value) iterator, key in the parent, nodes and chars before it,
        # height of its children, is a mapping]
        stack: list[list[Any]] = [[doc, _items(doc), None, 0, 0, 0, isinstance(doc, Mapping)]]
        on_path = {id(doc)}

        def path(key: Any) -> Path:
            return tuple(f[2] for f in stack[1:]) + (key,)

        while stack:
            frame = stack[-1]
            is_map = frame[6]
            for key, value in frame[1]:
                if is_map:
                    nodes += 1
                    if type(key) is str:
                        chars += len(key)
                        if search(key):
                            self.error(path(key), _bad_char_message(key))
                    else:
                        self.error(path(key), f"a mapping key must be a string, got {_describe(key)}")
                kind = type(value)
                if kind is str:
                    nodes += 1
                    chars += len(value)
                    if search(value):
                        self.error(path(key), _bad_char_message(value))
                elif kind is dict or kind is list or (kind not in _SCALARS and _is_container(value)):
                    vid = id(value)
                    if vid in on_path:
                        self.error(path(key), "the value contains itself: a recursive document cannot be"
                                              " stored as JSON", stop=True)
                    known = memo.get(vid)
                    if known is None:
                        if len(stack) + 1 > max_depth:
                            self.limit(path(key), "max_document_depth", len(stack) + 1, "the nesting of the playbook")
                        nodes += 1
                        stack.append([value, _items(value), key, nodes - 1, chars, 0, kind is dict or
                                      (kind is not list and isinstance(value, Mapping))])
                        on_path.add(vid)
                        break
                    # a shared container: counted again, not walked again
                    if len(stack) + known[2] > max_depth:
                        self.limit(path(key), "max_document_depth", len(stack) + known[2], "the nesting of the playbook")
                    nodes += known[0]
                    chars += known[1]
                    if known[2] > frame[5]:
                        frame[5] = known[2]
                else:
                    nodes += 1
                    problem = _scalar_problem(value)
                    if problem:
                        self.error(path(key), problem)
                if nodes > max_nodes:
                    self.limit(path(key), "max_document_nodes", nodes, "the number of values in the playbook")
                if chars > max_chars:
                    self.limit(path(key), "max_document_bytes", chars, "the playbook's text")
            else:  # every item seen: the container is finished
                stack.pop()
                on_path.discard(id(frame[0]))
                height = frame[5] + 1
                memo[id(frame[0])] = (nodes - frame[3], chars - frame[4], height)
                if stack and height > stack[-1][5]:
                    stack[-1][5] = height


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _is_container(value: Any) -> bool:
    return isinstance(value, (Mapping, list))


def _scalar_problem(value: Any) -> str | None:
    """Why a scalar cannot be in a document, or None."""
    kind = type(value)
    if kind is str:
        return _bad_char_message(value) if _BAD_CHARS.search(value) else None
    if kind is bool or value is None:
        return None
    if kind is int:
        if INT_MIN <= value <= INT_MAX:
            return None
        return (f"the integer {_short(value)} is out of range: a playbook's integers are 64-bit"
                " (write a bigger number as a string)")
    if kind is float:
        if math.isfinite(value):
            return None
        return f"{value!r} is not a JSON number (infinity and NaN cannot be stored): write a string"
    if isinstance(value, str):
        return _scalar_problem(str(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return _scalar_problem(int(value))
    if isinstance(value, float):
        return _scalar_problem(float(value))
    return f"{_describe(value)} is not a JSON value: a playbook holds only {_JSON_TYPES}"


def _items(container: Any) -> Any:
    if type(container) is dict or (type(container) is not list and isinstance(container, Mapping)):
        return iter(container.items())
    return enumerate(container)


def _bad_char_message(text: str) -> str:
    bad = _BAD_CHARS.search(text).group()
    if bad == "\x00":
        return "a NUL character (U+0000) is not allowed in a playbook (JSON in Postgres cannot store it)"
    return f"an unpaired surrogate (U+{ord(bad):04X}) is not a character"
