"""M5, Python task code (docs/migrate.md): the legacy runtime's conventions (preloaded modules,
``context``, ``input_data``, a top-level ``return``, ``main``'s parameters filled from the context,
``libs:`` imports, code from a ``script`` file) made explicit in the code and the task's args, with
:mod:`.python` (Python's ``ast``); :func:`read_script`, the one file migrate reads."""
from __future__ import annotations

import os
import re
import stat
from typing import Any

from ..diagnostics import Path
from . import python as mpy
from .structure import IDENT, _Site, _Step, _Task, _cmap, _flow, _is_map, _is_seq, _styled, _template
from .templates import NeedsPerson, Ref, build, unparse


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


_CONTEXT_MAP = ("the legacy context's fields are, canonically: execution_id (or job.execution_id) -> "
                "{{ execution_id }}; workload -> {{ workload }}; a workload key k -> {{ workload.k }}; vars -> "
                "{{ ctx }}; a key a set wrote -> {{ ctx.k }}; a step's name -> its result {{ <step>.result }}; "
                "the loop's item -> {{ iter.<iterator> }}; catalog_id, path, version, parent_execution_id: none")


def _last_statement_is(code: str, node: Any) -> bool:
    import ast as pyast

    tree = pyast.parse(code)
    return bool(tree.body) and isinstance(tree.body[-1], pyast.Return) and tree.body[-1].lineno == node.lineno


class Code:
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
            return "{{ %s }}" % unparse(build(new.root, new.path))
        return None
