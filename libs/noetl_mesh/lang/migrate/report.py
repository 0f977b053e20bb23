"""What a migration gives (:class:`Migration`): the rewritten text, the changes made and what needs a
person, each a :class:`Finding` with its location; and the migrator's side of it (:class:`Reporting`):
a finding recorded where it was found, the result validated and linted."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..diagnostics import Path, locate
from ..documents import position


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

    def text(self, file: str, what: str) -> str:
        """The line ``noetl migrate`` prints for it: ``file:line: what: rule: location: message``
        (``what``: changed, needs a person)."""
        return f"{file}:{self.line or 0}: {what}: {self.rule}: {self.location or '<document>'}: {self.message}"


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


class Reporting:
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

    def validate(self, text: str) -> None:
        from ..validate import validate_text

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
        from ..lint import lint_text

        for f in lint_text(text).findings:
            if f.severity != "error" or f.code == "L000":
                continue
            at = f", line {f.line}, column {f.column} of the migrated text" if f.line is not None else ""
            finding = Finding("V", f.location, f"the migrated playbook fails when this runs: {f.message} "
                              f"(noetl lint {f.code}{at})", *(self._where(f.path) if self._line(f.path)
                                                               else (f.line, f.column)))
            if finding not in self.problems:
                self.problems.append(finding)
