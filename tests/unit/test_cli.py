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
