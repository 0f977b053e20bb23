"""Shell completion made from the parser: bash completes commands, sub-commands, options and their
choices (driven here through bash itself); the zsh and fish scripts name the same commands."""
from __future__ import annotations

import shutil
import subprocess

from noetl_mesh.cli import build_parser
from noetl_mesh.cli.completion import script


def complete(words: list[str]) -> list[str]:
    code = script("bash", build_parser()) + (
        f"\nCOMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}; _noetl_complete;"
        ' printf "%s\\n" "${COMPREPLY[@]}"')
    out = subprocess.run([shutil.which("bash") or "/bin/bash", "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_bash_completes_commands_options_and_choices():
    assert complete(["noetl", "sch"]) == ["schema", "schedule"]
    assert complete(["noetl", "schedule", "pa"]) == ["pause"]
    assert complete(["noetl", "ls", "--status", "FA"]) == ["FAILED"]
    assert complete(["noetl", "restart", "--fr"]) == ["--from"]
    assert "--allow-net" in complete(["noetl", "run", "--"])


def test_every_command_is_in_every_shells_script():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for shell in ("bash", "zsh", "fish"):
        text = script(shell, parser)
        assert all(name in text for name in commands), shell
