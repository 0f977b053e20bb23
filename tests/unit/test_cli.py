"""D26 `noetl validate` and `noetl schema`."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from noetl_mesh.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
BROKEN = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: bad, path: t/bad}
vars: {}
workflow:
  - step: start
    tool: {kind: htp, url: x}
    next: {arcs: [{step: ned}]}
  - step: end
    tool: {kind: noop}
"""


def test_validate_examples_exit_0(capsys):
    assert main(["validate", *map(str, EXAMPLES)]) == 0
    out = capsys.readouterr().out
    assert all(f"{p}: valid" in out for p in EXAMPLES)


def test_validate_broken_exits_2_and_names_every_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN)
    assert main(["validate", str(EXAMPLES[0]), str(bad)]) == 2
    out = capsys.readouterr().out
    assert f"{bad}: error: vars:" in out
    assert f"{bad}: error: workflow[0].step=start.tool.kind: unknown tool kind 'htp'" in out
    assert f"{bad}: error: workflow[0].step=start.next.arcs[0].step: arc to unknown step 'ned'" in out
    assert "invalid (3 error(s))" in out


def test_validate_missing_file_exits_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read file" in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys):
    assert main(["validate"]) == 2


@pytest.fixture(scope="module")
def schema():
    from noetl_mesh.lang.model import json_schema

    s = json_schema()
    jsonschema.Draft202012Validator.check_schema(s)
    return s


def test_schema_command_prints_json(capsys):
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["title"].startswith("NoETL playbook")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_schema(schema, path):
    jsonschema.validate(yaml.safe_load(path.read_text()), schema)


def test_schema_rejects_unknown_tool_field(schema):
    doc = yaml.safe_load((Path(__file__).parents[2] / "examples" / "hello.yaml").read_text())
    jsonschema.validate(doc, schema)
    doc["workflow"][0]["tool"]["codee"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


# ------------------------------------------------------------------------------ no traceback, ever
def test_validate_a_binary_file_exits_2_naming_it(tmp_path, capsys):
    blob = tmp_path / "logo.png"
    blob.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    assert main(["validate", str(blob)]) == 2
    out = capsys.readouterr()
    assert f"{blob}: error: line 1, column 1: the text is not UTF-8" in out.out and "Traceback" not in out.out + out.err


def test_a_gateway_that_does_not_answer_is_one_line_and_exit_4(capsys):
    nothing = "http://127.0.0.1:1"  # nothing listens on port 1
    assert main(["status", "x1", "--gateway", nothing]) == 4
    assert main(["run", str(EXAMPLES[0]), "--gateway", nothing]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"noetl: cannot reach the gateway at {nothing} (All connection attempts failed)"] * 2


@pytest.mark.parametrize("url", ["foo", "http://[::1", "http://127.0.0.1:99999", "ftp://h/x"])
def test_a_gateway_url_that_cannot_be_one_exits_2(url, capsys):
    assert main(["status", "x1", "--gateway", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"noetl: --gateway {url}: ") and err.count("\n") == 1


def test_an_unexpected_error_is_one_line_unless_debug(monkeypatch, capsys):
    from noetl_mesh.cli import playbooks

    def broken(args):
        raise RuntimeError("no such thing\nsecond line")

    monkeypatch.setattr(playbooks, "cmd_schema", broken)
    assert main(["schema"]) == 70
    err = capsys.readouterr().err
    assert err == "noetl: unexpected error: RuntimeError: no such thing; run with --debug for the traceback\n"
    for argv in (["--debug", "schema"], ["schema", "--debug"]):
        assert main(argv) == 70
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "in broken" in err
        assert err.rstrip().endswith("noetl: unexpected error: RuntimeError: no such thing")


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(monkeypatch, capsys):
    from noetl_mesh.cli import playbooks

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(playbooks, "cmd_schema", interrupted)
    assert main(["schema"]) == 130
    assert capsys.readouterr().err == "noetl: interrupted (SIGINT)\n"


def test_a_home_or_out_directory_that_cannot_be_made_exits_2(capsys):
    assert main(["up", "--home", "/proc/no/such/home"]) == 2
    assert capsys.readouterr().err == "noetl: --home /proc/no/such/home: cannot make the directory (No such file or directory)\n"
    assert main(["nats-credentials", "--out", "/proc/no/such/dir"]) == 2
    assert capsys.readouterr().err == "noetl: --out /proc/no/such/dir: No such file or directory\n"


# ------------------------------------------------------------------------------ one stack per home
def test_a_second_up_on_a_home_says_a_stack_runs_there(tmp_path, capsys):
    from noetl_mesh.home import HomeLock

    first = HomeLock(str(tmp_path))
    assert first.acquire() is None
    try:
        assert main(["up", "--home", str(tmp_path)]) == 5  # before starting anything
        assert "a noetl stack is already starting or running from" in capsys.readouterr().err
        first.record({"pid": 4242, "gateway": "http://127.0.0.1:5555", "nats": "nats://127.0.0.1:4444"})
        assert main(["up", "--home", str(tmp_path), "--in-process"]) == 5
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"a noetl stack already runs from {tmp_path} (pid 4242): gateway http://127.0.0.1:5555" in err
        assert f"use it (noetl commands find it with --home {tmp_path} or NOETL_HOME={tmp_path})" in err
        assert "kill 4242" in err
    finally:
        first.release()
    assert not (tmp_path / "stack.json").exists()  # a stopped stack leaves no description behind
    second = HomeLock(str(tmp_path))
    assert second.acquire() is None  # free again
    second.release()


def test_up_names_the_servers_a_killed_stack_left_running(tmp_path, capsys):
    import json
    import subprocess
    import sys

    from noetl_mesh.home import HomeLock

    # a process that looks like an orphaned nats-server (its command line says so)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "nats-server"])
    try:
        (tmp_path / "stack.json").write_text(json.dumps({"pid": 1, "gateway": "http://127.0.0.1:5555",
                                                         "pids": {"nats-server": orphan.pid, "postgres": 2 ** 22 + 7}}))
        assert main(["up", "--home", str(tmp_path)]) == 5
        err = capsys.readouterr().err
        assert f"still run (nats-server pid {orphan.pid})" in err and f"kill {orphan.pid}" in err
        assert (tmp_path / "stack.json").exists()  # kept: it is how the next attempt knows
    finally:
        orphan.kill()
        orphan.wait()
    lock = HomeLock(str(tmp_path))
    assert lock.acquire() is None and lock.leftovers() is None  # gone: a new stack may start
    lock.release()


# ------------------------------------------------------------------------------ help and version
def _parsers(parser, path=("noetl",)):
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                assert helps.get(name), f"{' '.join(path)} {name} has no help"
                yield from _parsers(child, (*path, name))


def test_every_option_of_every_command_has_help_and_shows_its_default():
    import argparse

    from noetl_mesh.cli import build_parser

    seen = 0
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            seen += 1
            where = f"{' '.join(path)} {action.option_strings[0]}"
            assert action.help and len(action.help) > 8, f"{where} has no help"
        text = parser.format_help()
        for action in parser._actions:
            if action.option_strings and isinstance(action.default, (int, float, str)) \
                    and not isinstance(action.default, bool) and action.default not in ("", argparse.SUPPRESS):
                assert f"default: {action.default}" in " ".join(text.split()) or "default" in action.help, \
                    f"{' '.join(path)} {action.option_strings[0]}: default {action.default!r} not shown"
    assert seen > 60


def test_a_gateway_option_given_without_help_gets_the_common_one(monkeypatch):
    import argparse

    from noetl_mesh.cli import build_parser, common, users

    real = users.add_commands

    def more(sub):  # a command added without a word on --gateway
        real(sub)
        sub.add_parser("later", help="a later command").add_argument("--gateway")

    monkeypatch.setattr(users, "add_commands", more)
    later = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)][0].choices["later"]
    option = next(a for a in later._actions if a.dest == "gateway")
    assert option.help == common.GATEWAY_HELP and "NOETL_GATEWAY_URL" in option.help and option.metavar == "URL"


def test_no_module_imports_the_command_line_back_and_its_start_stays_light():
    """cli/app.py assembles the parser from the command modules: none of them imports it (nor the
    package), no module of the library imports the command line, and building the parser (every
    `noetl`'s start) loads neither asyncio, httpx, yaml nor importlib.metadata."""
    import ast
    import subprocess
    import sys

    libs = Path(__file__).parents[2] / "libs"
    for path in (libs / "noetl_mesh").rglob("*.py"):
        package = list(path.relative_to(libs).parent.parts)
        if package == ["noetl_mesh", "cli"] and path.name in ("__init__.py", "__main__.py", "app.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + (node.module.split(".") if node.module else []))
                imported = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
                for name in imported:  # the command modules share common.py and output.py, nothing else
                    assert not f"{name}.".startswith("noetl_mesh.cli.") or package == ["noetl_mesh", "cli"] and \
                        name not in ("noetl_mesh.cli", "noetl_mesh.cli.app"), f"{path}: {name}"
    code = ("import sys; from noetl_mesh.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('asyncio', 'httpx', 'yaml', 'importlib.metadata') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"noetl {version('noetl-mesh')}\n"


def test_help_lists_the_exit_codes(capsys):
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "3 --timeout passed" in text and "4 no gateway at --gateway" in text and "130/143" in text
    assert "--timeout SECONDS seconds to wait for the end; then exit 3 (default: 3600.0)" in text


# ------------------------------------------------------------------------------ what noetl run shows
def _loop_events(n: int, failed: set[int], t0: float = 1000.0) -> list[dict]:
    events = [{"name": "step.started", "step": "s", "step_run_id": "r1", "timestamp": t0},
              {"name": "loop.started", "step": "s", "step_run_id": "r1", "timestamp": t0,
               "data": {"items": list(range(n))}}]
    for i in range(n):
        bad = i in failed
        events.append({"name": "loop.iteration.failed" if bad else "loop.iteration.done", "step": "s",
                       "step_run_id": "r1", "iteration": i, "timestamp": t0 + 0.5 * (i + 1),
                       "data": {"error": {"kind": "python_error", "message": f"boom {i}"}} if bad else {"result": i}})
    events.append({"name": "loop.done", "step": "s", "step_run_id": "r1", "timestamp": t0 + 0.5 * n,
                   "data": {"total": n, "done": n - len(failed), "failed": len(failed)}})
    return events


def test_loop_progress_when_piped_is_plain_lines(capsys):
    import io

    from noetl_mesh.cli.output import Progress

    out = io.StringIO()
    progress = Progress(out=out, tty=False)
    for event in _loop_events(8, failed={2, 3, 4, 5}):
        progress(event)
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "  step.started       s"
    failures = [line for line in lines if "iteration.failed" in line]
    assert failures[0] == "  iteration.failed   s[2] (boom 2)"
    assert len(failures) == 3 and failures[-1].endswith("(boom 4); further failures only counted")
    assert "  loop               s 8/8 iterations, 4 failed, 2.0/s, 4.0s" in lines  # the events' own times
    assert lines[-1] == "  loop.done          s"
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_loop_progress_on_a_terminal_is_a_bar_redrawn_in_place():
    import io

    from noetl_mesh.cli.output import Progress

    out = io.StringIO()
    progress = Progress(out=out, tty=True)
    events = _loop_events(4, failed=set())
    for event in events[:4]:  # started, and two iterations of four
        progress(event)
    assert out.getvalue().endswith("\r\x1b[K  s [##########..........] 2/4 2.0/s 0.0s ETA 1s")  # 2 left at 2/s
    for event in events[4:]:
        progress(event)
    progress.close()
    text = out.getvalue()
    assert "\r\x1b[K  loop               s 4/4 iterations, 2.0/s, 2.0s\n  loop.done          s\n" in text
    assert text.endswith("\n")  # no bar left behind


def test_the_outcome_is_yaml_not_python_reprs():
    from noetl_mesh.cli.output import outcome_text

    final = {"execution_id": "x1", "status": "FAILED",
             "steps": {"start": {"status": "done", "runs": 1, "result": {"count": 2, "names": ["a", "b"]}},
                       "mid": {"status": "done", "runs": 1, "result": list(range(40))},
                       "big": {"status": "done", "runs": 3, "result": [{"i": i, "text": "y" * 30} for i in range(50)]},
                       "boom": {"status": "failed", "runs": 1, "result": None}},
             "error": {"kind": "python_error", "message": "boom", "retryable": False,
                       "traceback": "Traceback (most recent call last):\n  File \"<x>\", line 1\nRuntimeError: boom\n"}}
    text = outcome_text(final, 1.25)
    assert text.splitlines()[:2] == ["execution x1: FAILED in 1.2s", "  start  done  {count: 2, names: [a, b]}"]
    assert "  mid    done\n      [0, 1, 2, 3," in text
    assert "  big    done (3 runs)\n      - i: 0\n        text: yyyyyyyyyy" in text
    assert "      ... (70 more lines: --json shows everything)\n  boom" in text
    assert "  boom   failed\nerror:\n  kind: python_error\n  message: boom\n  retryable: false\n" in text
    assert "  traceback: |\n    Traceback (most recent call last):\n      File \"<x>\", line 1\n    RuntimeError: boom" in text
    assert "{'" not in text and "None" not in text and "False" not in text


def test_a_reader_that_goes_away_is_not_an_error():
    """`noetl schema | head -1`: the rest of the output has nowhere to go; no traceback, no message."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "noetl_mesh.cli", "schema"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away before the command writes (its imports take longer)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == ""


def test_bad_sandbox_settings_stop_run_up_and_a_worker_before_anything_starts(tmp_path, capsys, monkeypatch):
    """D33: ``--allow-net`` and NOETL_SANDBOX_* are read before a server starts; the error names the
    option or variable and the entry."""
    monkeypatch.delenv("NOETL_SANDBOX_ALLOW_NET", raising=False)
    assert main(["up", "--home", str(tmp_path / "home"), "--allow-net", "10.0.0.1:8080", "--allow-net", "x/y"]) == 2
    assert capsys.readouterr().err == "noetl: --allow-net: 'x/y' is neither an address, a network nor a host name\n"
    assert not (tmp_path / "home").exists()
    monkeypatch.setenv("NOETL_SANDBOX_ALLOW_NET", "[::1")
    assert main(["service", "worker", "--nats-url", "nats://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == "noetl: NOETL_SANDBOX_ALLOW_NET: '[::1': a '[' without its ']'\n"
    assert main(["run", str(EXAMPLES[0])]) == 2
    assert capsys.readouterr().err == "noetl: NOETL_SANDBOX_ALLOW_NET: '[::1': a '[' without its ']'\n"


def test_bootstrap_gives_up_after_its_timeout_when_no_nats_answers(capsys):
    # connecting retries for ever (a service waits for NATS); the command is bounded by --timeout
    assert main(["bootstrap", "--out", "-", "--nats-url", "nats://127.0.0.1:1", "--timeout", "1.5"]) == 4
    assert "no NATS or no sessions service answered at nats://127.0.0.1:1 within 1.5s" in capsys.readouterr().err
