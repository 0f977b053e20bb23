"""``noetl migrate``: a legacy NoETL playbook rewritten into the canonical language (docs/migrate.md).

Two dialects come in: the one NoETL runs in production (bare names in templates, a step's name for
its result, ``set:`` with scoped keys, label-shaped tasks, ``retry:`` blocks, ...), and the older
``case``/``then`` dialect. :func:`migrate_text` takes a playbook's text and gives the canonical text,
the list of changes it made and the list of what it could not translate (each with its location),
in three passes over a round-trip YAML tree (ruamel.yaml: comments, key order and quoting kept):

1. structure: the document header, tool and task shapes, legacy fields, ``set``, ``retry``, ``case``,
   ``next`` spellings, loop spellings, credentials (rules M0, M3, M4, M6, M7, M8: :mod:`.steps`,
   :mod:`.policies`);
2. templates: every template string is rewritten by :mod:`.templates` (Jinja2's own AST) with a
   resolver that knows where the template stands (a task field, a policy rule, an arc, admission),
   the steps and tasks and their kinds, the loop variable and the workload (rules M1, M2, M7:
   :mod:`.references`);
3. Python task code, by :mod:`.python` (Python's ``ast``) (rule M5: :mod:`.code`).

The result is then validated (D1): a validation error becomes a finding that needs a person. A
playbook that is already canonical comes out byte for byte as it went in. No I/O, but one read: the
file a python task's ``script`` names, when the playbook's own path is given and the file lies in its
folder (:func:`read_script`).

The modules: :mod:`.rules` (the migrator: the order of the passes), the groups of rules above,
:mod:`.structure` (the tree: round-trip editing, comments kept, the model of steps and tasks),
:mod:`.report` (what a migration gives: :class:`Migration`, :class:`Finding`).
"""
from __future__ import annotations

import os

from ..documents import parse
from .code import MAX_SCRIPT_BYTES, read_script
from .report import Finding, Migration
from .rules import _Migrator

__all__ = ["MAX_SCRIPT_BYTES", "Finding", "Migration", "migrate_text", "read_script"]


def migrate_text(text: str | bytes, source: str | os.PathLike | None = None) -> Migration:
    """The canonical form of a playbook's text (see the module's doc). ``source``: the file the text was
    read from; given, a python task's ``script`` naming a file in that file's folder is read and
    inlined (M5), and nothing else is read."""
    if isinstance(text, (bytes, bytearray)):
        from ..documents import _decode

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
