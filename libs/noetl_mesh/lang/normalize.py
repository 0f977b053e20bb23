"""Normalisation of the accepted task shapes (D4) and spec layering (D5). Pure functions."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def normalize_tasks(step_name: str, tool: Any) -> list[dict[str, Any]]:
    """D4: a list of ``{name?, kind, ...}`` (unnamed -> ``task_<i>``) or one ``{kind, ...}`` object
    (-> one task named ``<step>_task``) becomes one list of named tasks. Inputs are not mutated."""
    if tool is None:
        return []
    if isinstance(tool, Mapping):
        task = dict(tool)
        task.setdefault("name", f"{step_name}_task")
        return [task]
    out = []
    for i, item in enumerate(tool):
        task = dict(item)
        if not task.get("name"):
            task["name"] = f"task_{i}"
        out.append(task)
    return out


def normalize_workbook(workbook: Any) -> list[dict[str, Any]]:
    """The root ``workbook`` as a list of named tasks; a mapping ``{name: task}`` is accepted too."""
    if workbook is None:
        return []
    if isinstance(workbook, Mapping):
        return [{"name": name, **dict(task)} for name, task in workbook.items()]
    return [dict(t) for t in workbook]


def normalize_document(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a (shape-valid) raw document with every step's ``tool`` and the workbook in canonical
    form. Done once at load; everything downstream reads the canonical form only."""
    out = copy_value(dict(doc))
    for step in out.get("workflow", []):
        if "tool" in step:
            step["tool"] = normalize_tasks(step["step"], step["tool"])
    if "workbook" in out:
        out["workbook"] = normalize_workbook(out["workbook"])
    return out


def copy_value(value: Any) -> Any:
    """A deep copy of a JSON-like value (mappings, lists, scalars), several times faster than
    ``copy.deepcopy``; a container that appears twice (a YAML alias) is copied twice. Recursive: the
    nesting is bounded by max_document_depth."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is dict or isinstance(value, Mapping):
        return {k: copy_value(v) for k, v in value.items()}
    if kind is list:
        return [copy_value(v) for v in value]
    return value


def deep_merge(*layers: Mapping[str, Any] | None) -> dict[str, Any]:
    """D5: later layers win; maps merge recursively; scalars and lists are replaced."""
    out: dict[str, Any] = {}
    for layer in layers:
        if not layer:
            continue
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), dict):
                out[key] = deep_merge(out[key], value)
            elif isinstance(value, Mapping):
                out[key] = deep_merge(value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def effective_spec(
    kind_defaults: Mapping[str, Any] | None,
    executor_spec: Mapping[str, Any] | None,
    step_spec: Mapping[str, Any] | None,
    loop_spec: Mapping[str, Any] | None,
    task_spec: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """D5: effective task spec = merge(kind defaults, executor.spec, step.spec, loop.spec, task.spec).
    Without ``task_spec`` it is the step's effective spec (D9 reads ``max_steps`` there)."""
    return deep_merge(kind_defaults, executor_spec, step_spec, loop_spec, task_spec)
