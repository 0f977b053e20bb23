"""The migrator: the rules of docs/migrate.md, by concern, and the order they run in.

Each group of rules is a class of methods over the one tree being rewritten (:class:`_Migrator` is
all of them); :meth:`_Migrator.run` is the order of the passes. A new rule joins the group of its
concern and, when it is a pass of its own, that order; a translation of a paging ``retry`` block
registers in :attr:`_Migrator.RETRY_LOOPS`.

====  ==============================================  =====================================
rule  what (docs/migrate.md)                          where
====  ==============================================  =====================================
M0    the document header                             :mod:`.steps` (``header``)
M1    bare names in templates                         :mod:`.references` (the resolver)
M2    a step's name is its result                     :mod:`.references` (``_step_ref``)
M3    credentials named directly                      :mod:`.steps` (``auth``, ``keychain``)
M4    ``set:`` with scoped keys                       :mod:`.policies` (``split_set``, ...)
M5    Python task conventions                         :mod:`.code`
M6    spellings, legacy fields, structure             :mod:`.steps`; policies, ``eval``,
                                                      ``retry``: :mod:`.policies`; pagination
                                                      by retry: :mod:`.paginate`
M7    result shapes; an error's field guarded         :mod:`.references` (``_reshape*``,
                                                      ``guard_conditions``, ``guard_values``)
M8    ``case`` / ``then`` / ``eval_mode``             :mod:`.steps` (``case``)
V     what validation and lint still find             :mod:`.report`
====  ==============================================  =====================================
"""
from __future__ import annotations

import io
import os
from typing import Any, Callable

from ..diagnostics import Path
from ..documents import parse
from .code import Code, read_script
from .paginate import paging_retry
from .policies import Policies
from .references import References
from .report import Finding, Migration, Reporting
from .steps import Steps
from .structure import _Step, _guess_indent, _is_map, _names_read


class _Migrator(Reporting, Steps, Policies, References, Code):
    # Translations of a legacy ``retry:`` block that pages or polls (``while``, ``next_call``,
    # ``collect``, ...: M6), tried in order before that block is reported as needing a person: each is
    # ``translate(migrator, task, path, retry) -> bool``, True when it dealt with the block (rewrote the
    # task and reported the change, or left the block on it and reported precisely why it needs a
    # person); False leaves the task as it was, for the next.
    RETRY_LOOPS: tuple[Callable[[Any, Any, Path, Any], bool], ...] = (paging_retry,)

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
        # id(task node) whose policy a translation wrote reading its outcome canonically: the template
        # pass leaves those reads alone (M7 would read them as the legacy result's)
        self._canonical_outcome: set[int] = set()

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
            self.guard_values()
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
