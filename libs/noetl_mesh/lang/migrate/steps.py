"""The structural rules on steps and tasks (docs/migrate.md): M0 the document header; the shapes of a
step and its tasks (the ``tool: <kind>`` shorthand, label-shaped tasks, a step's ``input``/``output``,
legacy fields of python, http and SQL tasks); M3 credentials named directly (and the keychain they
need); M6 a step's ``when``, ``loop`` and ``next`` spellings; M8 ``case``/``then``; the workbook."""
from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from jinja2 import nodes

from ..diagnostics import Path
from ..templates import _ENV
from .code import read_script
from .structure import (
    API_VERSION, _FIELDS, IDENT, _STEP_KEYS, _TOOL_FIELDS_AT_STEP, _KeepTrailers, _actions_of, _bare_expr,
    _carry_comment, _cmap, _copy, _cseq, _flow, _insert_after, _is_map, _is_seq, _keep_comments, _place_token, _rename,
    _steps_of, _styled, _template,
)
from .templates import _chain, parse_expression


_NO_FIELD = {
    "database": "store a credential for that database and name it in 'auth'",
    "script": "put the code inline in 'code'",
    "return_step": "read the child's step from the result: <task>.result.steps.<step>.result",
}


def _reads_event(when: str, names: tuple[str, ...]) -> bool:
    try:
        ast = _ENV.parse(when)
    except Exception:  # noqa: BLE001
        return False
    return any(isinstance(c, nodes.Const) and c.value in names for c in ast.find_all(nodes.Const))


def _imports_of(libs: Any) -> list[str] | None:
    if not _is_map(libs):
        return None
    out = []
    for alias, module in libs.items():
        if isinstance(module, str):
            out.append(f"import {module}" if alias == module else f"import {module} as {alias}")
        elif _is_map(module) and module.get("from") and module.get("import"):
            name = module["import"]
            out.append(f"from {module['from']} import {name}" + ("" if alias == name else f" as {alias}"))
        else:
            return None
    return out


class Steps:
    # ======================================================================= M0: header
    def header(self) -> None:
        doc = self.doc
        if doc.get("apiVersion") != API_VERSION:
            old = doc.get("apiVersion")
            if "apiVersion" in doc:
                doc["apiVersion"] = API_VERSION
            else:
                doc.insert(0, "apiVersion", API_VERSION)
            self.change("M0", ("apiVersion",), f"apiVersion {old!r} -> {API_VERSION!r}" if old else
                        f"apiVersion: {API_VERSION} added")
        if doc.get("kind") != "Playbook":
            if "kind" in doc:
                doc["kind"] = "Playbook"
            else:
                _insert_after(doc, "apiVersion", "kind", "Playbook")
            self.change("M0", ("kind",), "kind: Playbook")
        meta = doc.get("metadata")
        if not _is_map(meta):
            meta = _cmap()
            _insert_after(doc, "kind", "metadata", meta)
            self.change("M0", ("metadata",), "metadata added")
        for key in ("name", "path", "version", "description"):
            if key in doc and key not in meta:
                meta[key] = doc.pop(key)
                self.change("M0", (key,), f"root '{key}' moved into metadata")
        if "name" not in meta:
            meta["name"] = "migrated"
            self.problem("M0", ("metadata",), "metadata has no name: 'migrated' was put there; give the playbook its name")
        if "path" not in meta:
            meta["path"] = str(meta.get("name"))
            self.change("M0", ("metadata",), "metadata.path set to the playbook's name (the catalog path)")
        if "vars" in doc:
            self.problem("M4", ("vars",), "root 'vars' has no canonical equivalent: move constants into workload, "
                                          "state into ctx (set_ctx)")

    # ======================================================================= structure
    def step_structure(self, st: Any, path: Path) -> None:
        with _KeepTrailers(st, self._handled):
            self._step_structure(st, path)

    def _step_structure(self, st: Any, path: Path) -> None:
        name = st.get("step")
        if "type" in st:
            kind = st.get("type")
            if kind in ("start", "end", "router") :
                st.pop("type")
                self.change("M6", path + ("type",), f"'type: {kind}' dropped (a step needs no type)")
            elif isinstance(kind, str) and "tool" not in st:
                st.pop("type")
                st.insert(1, "tool", kind)
                self.change("M6", path + ("type",), f"'type: {kind}' -> 'tool: {{kind: {kind}}}'")
        tool = st.get("tool")
        if isinstance(tool, str):
            self.tool_shorthand(st, path)
        elif _is_map(tool) and "kind" not in tool and len(tool) == 1 and _is_map(next(iter(tool.values()))):
            label = next(iter(tool))
            st["tool"] = _cseq([self.label_task(label, tool[label])])
            self.change("M6", path + ("tool",), f"the task '{label}: {{...}}' -> '- name: {label}'")
        tool = st.get("tool")
        if _is_seq(tool):
            for j, item in enumerate(list(tool)):
                if _is_map(item) and "kind" not in item and "tool" not in item and len(item) == 1 \
                        and _is_map(next(iter(item.values()))):
                    label = next(iter(item))
                    tool[j] = self.label_task(label, item[label])
                    self.change("M6", path + ("tool", j), f"the task '{label}: {{...}}' -> '- name: {label}'")
                elif _is_map(item) and _is_map(item.get("tool")):
                    tool[j] = self.flatten_tool(item)
                    self.change("M6", path + ("tool", j), "a task's nested 'tool: {kind...}' flattened")
        elif _is_map(tool) and _is_map(tool.get("tool")):
            st["tool"] = self.flatten_tool(tool)
            self.change("M6", path + ("tool",), "a task's nested 'tool: {kind...}' flattened")
        tool = st.get("tool")
        tasks: list[tuple[Any, Path]] = []
        if _is_map(tool):
            tasks = [(tool, path + ("tool",))]
        elif _is_seq(tool):
            tasks = [(t, path + ("tool", j)) for j, t in enumerate(tool) if _is_map(t)]
        for key in ("input", "args", "with"):
            if key in st:
                self.step_input(st, path, key, tasks)
        selections = [(st, path, k) for k in ("output", "output_select") if k in st]
        selections += [(t, p, "output_select") for t, p in tasks if "output_select" in t]
        step_retry = st.pop("retry", None)
        for task, tpath in tasks:
            if step_retry is not None and "retry" not in task:
                task["retry"] = _copy(step_retry)
            self.task_structure(task, tpath, in_loop="loop" in st)
        if step_retry is not None:
            if not tasks:
                self.problem("M6", path + ("retry",), "'retry' on a step without a tool: dropped")
            else:
                self.change("M6", path + ("retry",), "the step's 'retry' moved to its task(s) (as a policy rule)")
        if "when" in st:
            self.step_when(st, path)
        if "loop" in st:
            self.loop(st, path)
        if "case" in st:
            self.case(st, path)
        for key in ("eval_mode", "case_mode", "next_policy", "branch_order"):
            self.legacy_spec_key(st, path, key)
        self.next(st, path)
        # step-level set (M4): after the pipeline
        for key in ("set", "set_ctx", "set_iter", "vars"):
            if key in st:
                self.step_set(st, path, key)
        for arc_set in [a for a in self._arc_sets if a[0] is st]:
            self.arc_set_ctx(*arc_set)
        if selections:
            self.step_output(st, path, tasks, selections)
        if "pool" in st:
            pool = st.pop("pool")
            spec = st.setdefault("spec", _cmap())
            if _is_map(spec):
                spec["pool"] = pool
            self.change("M6", path + ("pool",), "the step's 'pool' -> spec.pool (the worker pool)")
        if name == "end" and "tool" not in st and "next" not in st:
            st["tool"] = _flow(_cmap([("kind", "noop")]))
            self.change("M6", path, "the 'end' step gets a noop tool (a step needs a tool or a next, D4)")
        for key in list(st.keys()):
            if key not in _STEP_KEYS and not self.reported(path + (key,)):
                self.problem("M6", path + (key,), f"step key '{key}' has no canonical equivalent: "
                             + ("save results with a task of the pipeline" if key in ("save", "sink") else
                                "remove it or move it into a task"))

    def step_input(self, st: Any, path: Path, key: str, tasks: list[tuple[Any, Path]]) -> None:
        """A step's ``input:`` (or ``args:``, ``with:``) was what its tool received: canonically a task
        receives its ``args`` (D25, D4: python binds each as a variable, a playbook task passes them to the
        child's entry step, a workbook task to the workbook task); a step has none."""
        values = st[key]
        ipath = path + (key,)
        if not _is_map(values):
            self.problem("M6", ipath, f"the step's '{key}' is not a mapping: give the task its args by hand")
            return
        takers = [(t, p) for t, p in tasks if "args" in _FIELDS.get(str(t.get("kind")), ())]
        if len(tasks) != 1 or len(takers) != 1:
            kinds = ", ".join(str(t.get("kind")) for t, _ in tasks) or "none"
            self.problem("M6", ipath, f"the step's '{key}' (what its tool received): a step has no args; only a "
                         f"python, playbook or workbook task takes args, and this step's tool is {len(tasks)} task(s) "
                         f"({kinds}): give each task that reads these values its own args, or write them into its "
                         "fields")
            return
        task, tpath = takers[0]
        own_key = next((k for k in ("args", "input", "with") if k in task), None)
        own = task.get(own_key) if own_key else None
        if own is not None and not _is_map(own):
            self.problem("M6", ipath, f"the step's '{key}' and the task's own '{own_key}', which is not a mapping: "
                         "merge them by hand")
            return
        clash = sorted(str(k) for k in values if own is not None and k in own)
        if clash:
            self.problem("M6", ipath, f"the step's '{key}' and the task's '{own_key}' both give {', '.join(clash)}: "
                         "keep one value of each in the task's args")
            return
        st.pop(key)
        if own is None:
            keys = list(task.keys())
            at = next((k for k in ("code", "script", "code_b64", "code_base64") if k in keys), None)
            task.insert(keys.index(at) if at else len(keys), "args", values)
        else:
            for k, v in values.items():
                own[k] = v
                _keep_comments(values, k, own)
        self.change("M6", ipath, f"the step's '{key}' -> the task's args (a task receives args; a step has none)")

    def step_output(self, st: Any, path: Path, tasks: list[tuple[Any, Path]],
                    selections: list[tuple[Any, Path, str]]) -> None:
        """A step's ``output: {select: PATH}`` (or ``output_select: PATH`` on the step or its last task)
        chose the part of the tool's result the step stored. Canonically a step's result is its last
        task's result (D11), and a ``noop`` task's ``result:`` is what it renders (D10): a noop that
        renders ``{{ _prev.PATH }}`` is appended (PATH then read as the task's kind gives its result,
        M7). Anything else that shapes the result needs a person."""
        why = None
        (holder, hpath, key), = selections if len(selections) == 1 else ((None, path, "output"),)
        kpath = hpath + (key,) if holder is not None else path
        value = holder.get(key) if holder is not None else None
        if len(selections) > 1:
            why = "several of 'output' and 'output_select' are given"
        elif "loop" in st:
            why = "on a loop step the selection applied to the list of iteration results; a task of the loop runs " \
                  "per iteration: select in the next step from the loop's result"
        elif holder is not st and (not tasks or holder is not tasks[-1][0]):
            why = "on a task that is not the step's last, the selection changed what later tasks read as its " \
                  "result: read the part itself where it is used (<task>.result.PATH)"
        elif not tasks:
            why = "a step without a tool stores nothing to select from"
        selector = None
        if why is None:
            selector = value.get("select", value.get("path")) if key == "output" and _is_map(value) and \
                set(value) <= {"select", "path"} else value if key == "output_select" else None
            if not isinstance(selector, str) or not selector.strip():
                why = ("it shapes the result ('output' other than {select: PATH})" if key == "output"
                       else "it is not a path into the result")
        expr = None
        if why is None:
            text = selector.strip()
            text = text[2:] if text.startswith("$.") else text
            try:
                base, chain = _chain(parse_expression("_prev." + text))
                ok = type(base) is nodes.Name and base.name == "_prev" and all(k in ("attr", "key") for k, _ in chain)
            except Exception:  # noqa: BLE001 - not a path
                ok = False
            if not ok or _template(text):
                why = f"{selector!r} is not a path of names and indexes into the result"
            else:
                expr = "{{ _prev.%s }}" % text
        name = f"{st.get('step')}_output"
        if why is None and any(_is_map(t) and t.get("name") == name for t, _ in tasks):
            why = f"a task named '{name}' is there already"
        if why is not None:
            self.problem("M6", kpath, f"'{key}' chose what the step stores, and {why}. A step's result is its last "
                         "task's result (D11): append a noop task whose result: renders what the step should store "
                         "from _prev (D10), e.g. {name: " + name + ", kind: noop, result: \"{{ _prev.items }}\"}")
            return
        holder.pop(key)
        tool = st["tool"]
        if _is_map(tool):
            if "name" not in tool:
                tool.insert(0, "name", f"{st.get('step')}_task")  # its name as a single task (D4), kept
            st["tool"] = tool = _cseq([tool])
        tool.append(_flow(_cmap([("name", name), ("kind", "noop"), ("result", expr)])))
        self.change("M6", kpath, f"'{key}: {selector}' -> a noop task '{name}' whose result is {expr} (a step's result "
                    "is its last task's, D10, D11)")

    def tool_shorthand(self, st: Any, path: Path) -> None:
        kind = st.pop("tool")
        if kind in ("router", "start", "end", "noop"):
            if kind == "noop":
                st.insert(1, "tool", _flow(_cmap([("kind", "noop")])))
            self.change("M6", path + ("tool",), f"'tool: {kind}' shorthand" + (" -> {kind: noop}" if kind == "noop"
                                                                               else " dropped"))
            return
        task = _cmap([("kind", kind)])
        for key in list(st.keys()):
            if key in _TOOL_FIELDS_AT_STEP or (kind == "workbook" and key == "name"):
                task[key] = st.pop(key)
        if kind == "workbook" and "name" in task and "task" not in task:
            _rename(task, "name", "task")
        keys = list(st.keys())
        pos = keys.index("desc") + 1 if "desc" in keys else 1
        st.insert(pos, "tool", task)
        self.change("M6", path + ("tool",), f"'tool: {kind}' with the tool's fields on the step -> "
                                            f"'tool: {{kind: {kind}, ...}}'")

    def label_task(self, label: str, inner: Any) -> Any:
        task = _cmap([("name", label)])
        if _is_map(inner.get("tool")):
            inner = self.flatten_tool(inner)
        for k, v in inner.items():
            if k != "name":
                task[k] = v
                _keep_comments(inner, k, task)
            elif _nats_object_name(inner):  # the object's name, not the task's
                task["key"] = v
        return task

    def flatten_tool(self, item: Any) -> Any:
        """``{name?, tool: {kind, ...}, retry?, ...}`` (a task wrapping its tool) -> one task mapping."""
        out = _cmap()
        for k, v in item.items():
            if k == "tool" and _is_map(v):
                for k2, v2 in v.items():
                    out[k2] = v2
                    _keep_comments(v, k2, out)
            elif k == "tool" and isinstance(v, str):
                out["kind"] = v
            else:
                out[k] = v
                _keep_comments(item, k, out)
        return out

    # -------------------------------------------------------------- tasks
    def task_structure(self, t: Any, path: Path, in_loop: bool) -> None:
        with _KeepTrailers(t, self._handled):
            self._task_structure(t, path, in_loop)

    def _task_structure(self, t: Any, path: Path, in_loop: bool) -> None:
        kind = t.get("kind")
        if kind is None and "type" in t:
            _rename(t, "type", "kind")
            kind = t["kind"]
            self.change("M6", path + ("type",), "'type' -> 'kind'")
        if kind == "artifact" and self.artifact_get(t, path):
            kind = "noop"
        if kind == "sink" or "sink" in t or "save" in t:
            for key in ("sink", "save"):
                if key in t:
                    self.problem("M6", path + (key,), f"'{key}' is not a tool field: store results with a task of "
                                 "their own (postgres, duckdb, http) that reads the result")
        if kind == "python":
            self.python_fields(t, path)
        elif kind == "http":
            self.http_fields(t, path)
        elif kind in ("postgres", "duckdb"):
            self.sql_fields(t, path, kind)
        elif kind == "nats":
            self.nats_fields(t, path)
        elif kind == "playbook":
            if "return_step" in t:
                pass  # kept until the model is built (M7); removed there
            for key in ("payload", "data"):
                if key in t and "workload" not in t:
                    _rename(t, key, "workload")
                    self.change("M6", path + (key,), f"playbook '{key}' -> 'workload' (merged over the child's)")
        if "credential" in t or "credentials" in t:
            for key in ("credential", "credentials"):
                if key in t:
                    if "auth" not in t:
                        _rename(t, key, "auth")
                        self.change("M3", path + (key,), f"'{key}' -> 'auth' (a keychain entry)")
                    else:
                        t.pop(key)
                        self.change("M3", path + (key,), f"'{key}' dropped ('auth' is given)")
        if "auth" in t:
            self.auth(t, path, kind)
        if "timeout" in t and kind not in ("http", "wait"):
            timeout = t.pop("timeout")
            spec = t.setdefault("spec", _cmap())
            if _is_map(spec) and "timeout" not in spec:
                spec["timeout"] = timeout
            self.change("M6", path + ("timeout",), "'timeout' -> spec.timeout (seconds)")
        if "pool" in t or "pool_name" in t or "pool_params" in t:
            for key in ("pool", "pool_name", "pool_params"):
                if key in t:
                    t.pop(key)
                    self.change("M6", path + (key,), f"'{key}' dropped: the engine keeps one connection pool per "
                                                     "connection string on each worker")
        if "eval" in t:
            self.eval_block(t, path)
        spec = t.get("spec")
        if _is_map(spec) and "policy" in spec:
            self.policy(t, path)
        if "retry" in t:
            self.retry(t, path)
        for key in ("set", "set_ctx", "set_iter"):
            if key in t:
                self.task_set(t, path, key, in_loop)
        if "assert" in t:
            t.pop("assert")
            self.change("M6", path + ("assert",), "'assert' (input/output contract) dropped: the engine does not check it")
        if isinstance(kind, str) and kind in _FIELDS:
            for key in list(t.keys()):
                if key not in _FIELDS[kind] and key not in ("return_step",) and not self.reported(path + (key,)) \
                        and not (key == "output_select" and self._step is not None):  # the step's (step_output)
                    self.problem("M6", path + (key,), f"the {kind} tool has no field '{key}': "
                                 + _NO_FIELD.get(key, "remove it or express it another way (docs/tools.md)"))
        elif kind is not None and not (isinstance(kind, str) and kind in _FIELDS) and not self.reported(path + ("kind",)):
            self.problem("M6", path + ("kind",), f"tool kind {kind!r} has no canonical equivalent here "
                                                 f"(the kinds: {', '.join(sorted(_FIELDS))})")

    def python_fields(self, t: Any, path: Path) -> None:
        for key in ("code_b64", "code_base64"):
            if key in t and "code" not in t:
                try:
                    code = base64.b64decode(str(t[key]), validate=True).decode("utf-8")
                except (binascii.Error, UnicodeDecodeError):
                    self.problem("M5", path + (key,), f"'{key}' is not base64 of UTF-8 text")
                    continue
                from ruamel.yaml.scalarstring import LiteralScalarString

                _rename(t, key, "code")
                t["code"] = LiteralScalarString(code)
                self.change("M5", path + (key,), f"'{key}' decoded into 'code'")
        if "script" in t:
            self.script(t, path)
        libs = t.get("libs")
        if libs is not None:
            imports = _imports_of(libs)
            if imports is None:
                self.problem("M5", path + ("libs",), "'libs' must map aliases to modules")
            elif isinstance(t.get("code"), str):
                t.pop("libs")
                t["code"] = _styled(t["code"], "\n".join(imports) + "\n" + str(t["code"]))
                self.change("M5", path + ("libs",), "'libs' -> import statements at the top of the code")
        for key in ("with", "data"):
            if key in t and "args" not in t and "input" not in t:
                _rename(t, key, "args")
                self.change("M6", path + (key,), f"python '{key}' -> 'args'")

    def script(self, t: Any, path: Path) -> None:
        """``script:`` named a file holding the code: read and put into ``code`` when it lies in the
        playbook's folder (see :func:`read_script`), else it needs a person."""
        spath = path + ("script",)
        if "code" in t:
            self.problem("M5", spath, "'script' and 'code' both given: keep the one that is the code")
            return
        code, why = read_script(t["script"], self.source)
        if code is None:
            self.problem("M5", spath, f"code from a file ('script'): {why}: put the file's code into 'code'")
            return
        from ruamel.yaml.scalarstring import LiteralScalarString

        _rename(t, "script", "code")
        t["code"] = LiteralScalarString(code if code.endswith("\n") else code + "\n")
        self.change("M5", spath, f"'script' -> 'code': {why}")

    def http_fields(self, t: Any, path: Path) -> None:
        method = str(t.get("method", "GET")).upper()
        for key in ("payload", "data"):
            value = t.get(key)
            if value is None or (key == "data" and not _is_map(value)):
                continue
            if _is_map(value) and set(value.keys()) <= {"query", "body"} and value:
                t.pop(key)
                if "query" in value:
                    t["params"] = value["query"]
                if "body" in value:
                    t["json"] = value["body"]
                self.change("M6", path + (key,), f"http '{key}.query/body' -> 'params'/'json'")
                continue
            target = "params" if method == "GET" else "json"
            if target in t:
                self.problem("M6", path + (key,), f"http '{key}' and '{target}' both given: merge them by hand")
                continue
            _rename(t, key, target)
            self.change("M6", path + (key,), f"http '{key}' -> '{target}' (the {method} request's "
                                             + ("query parameters)" if target == "params" else "JSON body)"))
        if "verify_ssl" in t:
            if "verify" in t:
                self.problem("M6", path + ("verify_ssl",), "'verify_ssl' and 'verify' both given: keep one")
            else:
                _rename(t, "verify_ssl", "verify")
                self.change("M6", path + ("verify_ssl",), "http 'verify_ssl' -> 'verify'")

    def sql_fields(self, t: Any, path: Path, kind: str) -> None:
        if "commands" in t and "command" not in t and "query" not in t:
            cmds = t["commands"]
            if _is_seq(cmds) and all(isinstance(c, str) for c in cmds):
                from ruamel.yaml.scalarstring import LiteralScalarString

                text = "\n".join(c.rstrip().rstrip(";") + ";" for c in cmds) + "\n"
                _rename(t, "commands", "command")
                t["command"] = LiteralScalarString(text)
                self.change("M6", path + ("commands",), "'commands' (a list) -> one 'command' of several statements")
            elif isinstance(cmds, str):
                _rename(t, "commands", "command")
                self.change("M6", path + ("commands",), "'commands' -> 'command'")
        if kind == "postgres":
            for key in ("connection_string", "connection"):
                if key in t and "dsn" not in t and isinstance(t[key], str):
                    _rename(t, key, "dsn")
                    self.change("M6", path + (key,), f"'{key}' -> 'dsn'")
            if "database" in t:
                self.problem("M6", path + ("database",), "a task's 'database' cannot override the credential's: "
                             "store a credential for that database (dbname) and name it in 'auth', or give a 'dsn'")
        if kind == "duckdb":
            for key in ("database", "db", "path"):
                if key in t and "db_path" not in t:
                    _rename(t, key, "db_path")
                    self.change("M6", path + (key,), f"duckdb '{key}' -> 'db_path'")

    def artifact_get(self, t: Any, path: Path) -> bool:
        """The legacy ``artifact`` tool, ``action: get`` of ``result_ref: "{{ <step>._ref }}"``: it fetched
        a step's result that had been stored aside. Results here are always whole (a large one is kept in
        the payload store and read back transparently), so it is that step's result: a ``noop`` whose
        ``result`` reads the step (M2 then spells the read). Anything else needs a person."""
        inp = t.get("input") if _is_map(t.get("input")) else None
        ref = (inp or t).get("result_ref")
        match = _ARTIFACT_REF.fullmatch(ref) if isinstance(ref, str) else None
        extra = [k for k in t if k not in ("kind", "name", "action", "input", "result_ref", "desc", "spec")]
        extra += [f"input.{k}" for k in (inp or {}) if k != "result_ref"]
        if t.get("action", "get") != "get" or match is None or extra:
            why = (f"fields {', '.join(extra)}" if extra and match else
                   f"action {t.get('action')!r}" if t.get("action", "get") != "get" else "its result_ref")
            self.problem("M6", path + ("kind",), f"an artifact task is translated only as 'action: get' of "
                         f"'result_ref: \"{{{{ <step>._ref }}}}\"' (that step's result); this one has {why}")
            return False
        for key in ("action", "input", "result_ref"):
            t.pop(key, None)
        t["kind"] = "noop"
        t["result"] = f"{{{{ {match.group(1)} }}}}"
        self.change("M6", path + ("kind",), f"artifact get of step '{match.group(1)}''s stored result -> a noop "
                    f"whose result is that step's (results are whole here; a large one is read back from the "
                    f"payload store)")
        return True

    def nats_fields(self, t: Any, path: Path) -> None:
        if _nats_object_name(t):
            _rename(t, "name", "key")
            self.change("M6", path + ("name",), "nats 'name' (the object's) -> 'key' ('name' is the task's)")
        if "ttl" in t:
            t.pop("ttl")
            self.change("M6", path + ("ttl",), "nats 'ttl' dropped: a key lives as long as its bucket's max_age says")

    # -------------------------------------------------------------- M3: credentials
    def auth(self, t: Any, path: Path, kind: Any) -> None:
        auth = t["auth"]
        name = None
        if _is_map(auth):
            for key in ("credential", "key", "name"):
                if isinstance(auth.get(key), str):
                    name = auth[key]
                    break
            if name is None or (kind == "http" and auth.get("type") in ("bearer", "basic") and
                                ("token" in auth or "username" in auth)):
                if kind == "http" and name is None:
                    return  # an inline {type, token} / {type, username, password}: canonical as it is
                self.problem("M3", path + ("auth",), "an 'auth' mapping with no credential name: name a keychain entry")
                return
            t["auth"] = name
            self.change("M3", path + ("auth",), f"'auth: {{...}}' -> 'auth: {name}' (a keychain entry)")
        elif isinstance(auth, str):
            name = auth
        else:
            self.problem("M3", path + ("auth",), "'auth' must name a keychain entry")
            return
        expr = _bare_expr(name)
        if expr is not None:
            key = expr[len("workload."):] if expr.startswith("workload.") else expr
            default = self.doc.get("workload", {}).get(key) if _is_map(self.doc.get("workload")) else None
            if IDENT.match(key) and isinstance(default, str) and not _template(default):
                t["auth"] = default
                name = default
                self.change("M3", path + ("auth",), f"'auth: {auth}' -> '{default}' (the workload's default; a "
                            "credential name given at run time is no longer read: auth names a keychain entry)")
            else:
                self.problem("M3", path + ("auth",), "a templated 'auth': name the keychain entry itself")
                return
        if isinstance(name, str) and name not in self.credentials:
            self.credentials[name] = path + ("auth",)

    def keychain(self) -> None:
        """M3: each stored credential a tool names directly gets a keychain entry of that name."""
        kc = self.doc.get("keychain")
        if kc is not None and not _is_seq(kc):
            if _is_map(kc):  # {name: {...}} -> [{name, ...}]
                entries = _cseq()
                for k, v in kc.items():
                    entries.append(_cmap([("name", k)] + (list(v.items()) if _is_map(v) else [])))
                self.doc["keychain"] = kc = entries
                self.change("M3", ("keychain",), "keychain as a mapping -> a list of named entries")
            else:
                self.problem("M3", ("keychain",), "keychain must be a list of entries")
                return
        existing: set[str] = set()
        for i, e in enumerate(kc or []):
            if not _is_map(e):
                continue
            existing.add(str(e.get("name")))
            kind = e.get("kind")
            if kind not in ("credential", "static", "env"):
                if kind in ("postgres_credential", "credential_ref", "secret", "postgres", "http", "bearer",
                            "basic", "api_key") or kind is None:
                    e["kind"] = "credential"
                    if "credential" not in e and isinstance(e.get("key"), str):
                        _rename(e, "key", "credential")
                    self.change("M3", ("keychain", i, "kind"), f"keychain kind {kind!r} -> credential (a stored "
                                "credential: `noetl credential add`)")
                else:
                    self.problem("M3", ("keychain", i, "kind"), f"keychain kind {kind!r} has no canonical equivalent "
                                 "(credential, static, env): tokens obtained at run time need a task that fetches them")
        new = [(n, p) for n, p in self.credentials.items() if n not in existing]
        if not new:
            return
        if kc is None:
            kc = _cseq()
            keys = list(self.doc.keys())
            pos = keys.index("workload") + 1 if "workload" in keys else keys.index("workflow")
            self.doc.insert(pos, "keychain", kc)
        for name, p in new:
            kc.append(_flow(_cmap([("name", name), ("kind", "credential")])))
            self.change("M3", p, f"keychain entry '{name}' added (kind credential: the stored credential "
                                 f"'{name}', `noetl credential add {name} ...`)")

    # -------------------------------------------------------------- M6: step when, loop, next
    def step_when(self, st: Any, path: Path) -> None:
        when = st.pop("when")
        if isinstance(when, bool):
            when = "{{ %s }}" % ("true" if when else "false")
        spec = st.setdefault("spec", _cmap())
        pol = spec.setdefault("policy", _cmap())
        if "admit" in pol:
            self.problem("M6", path + ("when",), "a step 'when' and spec.policy.admit both given: merge them by hand")
            return
        pol["admit"] = _cmap([("rules", _cseq([
            _cmap([("when", when), ("then", _flow(_cmap([("allow", True)])))]),
            _cmap([("else", _cmap([("then", _flow(_cmap([("allow", False)])))]))])]))])
        self.change("M6", path + ("when",), "the step's 'when' -> spec.policy.admit.rules (D17)")

    def loop(self, st: Any, path: Path) -> None:
        loop = st["loop"]
        lpath = path + ("loop",)
        if not _is_map(loop):
            return
        for old, new in (("collection", "in"), ("items", "in"), ("element", "iterator"), ("item", "iterator")):
            if old in loop and new not in loop:
                _rename(loop, old, new)
                self.change("M6", lpath + (old,), f"loop '{old}' -> '{new}'")
        if "iterator" not in loop and "in" in loop:
            loop["iterator"] = "item"
            self.change("M6", lpath, "loop without an iterator name: 'item' (the legacy default)")
        for key in ("mode", "max_in_flight", "concurrency"):
            if key in loop:
                spec = loop.setdefault("spec", _cmap())
                new = "max_in_flight" if key == "concurrency" else key
                if new not in spec:
                    spec[new] = loop.pop(key)
                else:
                    loop.pop(key)
                self.change("M6", lpath + (key,), f"loop '{key}' -> loop.spec.{new}")
        spec = loop.get("spec")
        if _is_map(spec):
            pol = spec.get("policy")
            if _is_map(pol) and "mode" in pol and "mode" not in spec:
                pass  # read by the engine as it is
            mif = spec.get("max_in_flight")
            if isinstance(mif, str):
                expr = _bare_expr(mif)
                key = expr[len("workload."):] if expr and expr.startswith("workload.") else expr
                default = self.doc.get("workload", {}).get(key) if key and _is_map(self.doc.get("workload")) else None
                if isinstance(default, int) and not isinstance(default, bool):
                    spec["max_in_flight"] = default
                    self.change("M6", lpath + ("spec", "max_in_flight"), f"templated max_in_flight -> {default} (the "
                                "workload's default; it is a number fixed in the playbook, a value given at run "
                                "time is no longer read)")
                else:
                    self.problem("M6", lpath + ("spec", "max_in_flight"), "a templated max_in_flight: write a number")
            for key in ("batch_size", "on_error"):
                if key in spec:
                    value = spec.pop(key)
                    if key == "on_error" and value in ("continue", "ignore"):
                        sspec = st.setdefault("spec", _cmap())
                        pol = sspec.setdefault("policy", _cmap())
                        pol.setdefault("failure", _cmap([("mode", "best_effort")]))
                        self.change("M6", lpath + ("spec", key), "loop on_error: continue -> the step's "
                                    "spec.policy.failure.mode best_effort")
                    else:
                        self.change("M6", lpath + ("spec", key), f"loop spec.{key} dropped (no equivalent; "
                                    "iterations travel in chunks on their own)")

    def next(self, st: Any, path: Path) -> None:
        nxt = st.get("next")
        npath = path + ("next",)
        if nxt is None:
            return
        arcs = None
        mode = None
        if isinstance(nxt, str):
            arcs = _cseq([_cmap([("step", nxt)])])
        elif _is_seq(nxt):
            arcs = _cseq()
            for item in nxt:
                if isinstance(item, str):
                    arcs.append(_cmap([("step", item)]))
                elif _is_map(item) and ("then" in item or "else" in item) and "step" not in item:
                    when = item.get("when")
                    for target in _steps_of(item.get("then")):
                        arcs.append(_cmap([("step", target[0])] + ([("when", when)] if when is not None else [])
                                          + ([("args", target[1])] if target[1] is not None else [])))
                    if "else" in item and when is not None:
                        neg = "{{ not (%s) }}" % _bare_expr(when) if _bare_expr(when) else None
                        for target in _steps_of(item.get("else")):
                            if neg is None:
                                self.problem("M6", npath, "an 'else' of a non-expression 'when': write its arc by hand")
                                continue
                            arcs.append(_cmap([("step", target[0]), ("when", neg)]
                                              + ([("args", target[1])] if target[1] is not None else [])))
                elif _is_map(item):
                    arcs.append(item)
            whens = [a for a in arcs if "when" in a]
            mode = "inclusive" if len(arcs) - len(whens) > 1 else None
        elif _is_map(nxt) and "arcs" not in nxt and ("to" in nxt or "step" in nxt):
            arcs = _cseq([_cmap([("step", s)] + ([("args", a)] if a is not None else []))
                          for s, a in _steps_of(nxt.get("to", [nxt]))])
            if len(arcs) > 1:
                mode = "inclusive"
        if arcs is not None:
            router = _cmap()
            if mode:
                router["spec"] = _flow(_cmap([("mode", mode)]))
            router["arcs"] = arcs
            st["next"] = router
            self.change("M6", npath, "'next' list -> a router {arcs: [...]}" +
                        (f" (mode {mode}: the legacy runtime started every target)" if mode else ""))
        router = st.get("next")
        if not _is_map(router) or not _is_seq(router.get("arcs")):
            return
        for i, arc in enumerate(router["arcs"]):
            if not _is_map(arc):
                continue
            apath = npath + ("arcs", i)
            for old in ("data", "with", "input"):
                if old in arc and "args" not in arc:
                    _rename(arc, old, "args")
                    self.change("M6", apath + (old,), f"arc '{old}' -> 'args'")
            if isinstance(arc.get("when"), bool):
                if arc["when"] is True:
                    arc.pop("when")
                    self.change("M6", apath + ("when",), "arc 'when: true' dropped (an arc without when follows "
                                                        "step.done and loop.done)")
                else:
                    arc["when"] = "{{ false }}"
                    self.change("M6", apath + ("when",), "arc 'when: false' -> a template")
            if "set" in arc:
                comment = arc.ca.items.pop("set", None) if hasattr(arc, "ca") else None
                values = arc.pop("set")
                writes, kept, moved = _cmap(), _cmap(), 0
                for k, v in (values.items() if _is_map(values) else []):
                    scope, _, name = str(k).partition(".")
                    if not name:
                        scope, name = "args", str(k)
                    if scope == "vars":
                        scope = "ctx"
                    if scope == "ctx" and "." not in name:
                        writes[name] = v
                        _carry_comment(values, k, writes, name)
                        continue
                    if scope != "args":
                        self.problem("M4", apath + ("set",), f"arc 'set: {{{k}: ...}}': an arc cannot write {scope}"
                                     + ("" if scope != "ctx" else " key by key; set the whole value of "
                                        f"'{name.split('.')[0]}'") + ", or pass it as an arc arg")
                        kept[k] = v  # left on the arc, for the person
                        continue
                    arc.setdefault("args", _cmap())[name] = v
                    _carry_comment(values, k, arc["args"], name)
                    moved += 1
                if moved:
                    self.change("M4", apath + ("set",), "arc 'set' -> arc 'args'")
                if kept:
                    arc["set"] = kept
                    if comment is not None:
                        arc.ca.items["set"] = comment
                if writes:
                    self._arc_sets.append((st, path, i, writes))
                if comment and len(comment) > 2 and comment[2] is not None and "set" not in arc and len(arc):
                    # the comment after a flow 'set: {...}  # why' follows what the arc now ends with
                    _place_token(arc, list(arc.keys())[-1], comment[2], False)
            if "priority" in arc:
                arc.pop("priority")
                self.change("M8", apath + ("priority",), "arc 'priority' dropped: arcs are taken in order")

    def legacy_spec_key(self, st: Any, path: Path, key: str) -> None:
        spec = st.get("spec")
        where = st if key in st else (spec if _is_map(spec) and key in spec else None)
        if where is None:
            return
        value = where.pop(key)
        kpath = path + (("spec",) if where is spec else ()) + (key,)
        if key == "eval_mode" and value == "on_event":
            self.problem("M8", kpath, "eval_mode on_event (a step reacting to every event) has no canonical "
                         "equivalent: wait for a signal (kind: wait, D30) or a timer (D29) in a task")
        elif key == "case_mode" and value == "inclusive":
            nxt = st.get("next")
            if _is_map(nxt):
                spec2 = nxt.setdefault("spec", _cmap())
                spec2["mode"] = "inclusive"
            self.change("M8", kpath, "case_mode inclusive -> the router's mode inclusive")
        else:
            self.change("M8", kpath, f"'{key}: {value}' dropped (the canonical step has one pipeline and one router)")
        if _is_map(spec) and not spec:
            st.pop("spec")

    # -------------------------------------------------------------- M8: case
    def case(self, st: Any, path: Path) -> None:
        """``case: [{when, then}, ..., {else}]`` -> arcs (next), policy rules (set, retry, fail) and tasks
        reached by jumps (a branch's tasks), as docs/migrate.md (M8) says."""
        cases = st.pop("case")
        cpath = path + ("case",)
        if not _is_seq(cases):
            self.problem("M8", cpath, "'case' must be a list")
            return
        spec = st.get("spec") if _is_map(st.get("spec")) else {}
        if spec.get("eval_mode") == "on_event" or st.get("eval_mode") == "on_event":
            self.problem("M8", cpath, "a case evaluated on every event (eval_mode on_event) cannot be translated")
            return
        arcs = _cseq()
        rules = _cseq()
        branch_tasks: list[tuple[str, list[Any]]] = []
        tool = st.get("tool")
        for i, branch in enumerate(cases):
            bpath = cpath + (i,)
            if not _is_map(branch):
                continue
            if "else" in branch:
                when = None
                then = branch["else"]
                then = then.get("then", then) if _is_map(then) else then
            else:
                when = branch.get("when")
                then = branch.get("then")
            if isinstance(when, str) and _reads_event(when, ("step.enter", "call.started")):
                self.problem("M8", bpath, "a case on the step's entry (step.enter) cannot be translated: admission "
                             "(spec.policy.admit) decides before the step runs and cannot run tasks")
                continue
            actions = _actions_of(then)
            if actions is None:
                self.problem("M8", bpath + ("then",), "a case's 'then' must be a mapping or a list of actions")
                continue
            tasks_here = []
            rule_then = _cmap()
            for key, value in actions:
                if key == "next":
                    for target, args in _steps_of(value.get("to", value) if _is_map(value) else value):
                        arc = _cmap([("step", target)])
                        if when is not None:
                            arc["when"] = when
                        if args is not None:
                            arc["args"] = args
                        arcs.append(arc)
                elif key in ("set", "vars"):
                    self.split_set(rule_then, value, bpath + ("then", key), "loop" in st, self.step_names_of(st))
                elif key in ("set_ctx", "set_iter"):
                    rule_then[key] = value
                elif key == "retry":
                    rule_then["do"] = "retry"
                    if _is_map(value):
                        for k, v in value.items():
                            k = {"max_attempts": "attempts"}.get(str(k), str(k))
                            if k in ("attempts", "delay", "backoff", "max_delay", "jitter"):
                                rule_then[k] = {"fixed": "none"}.get(v, v) if k == "backoff" else v
                    elif isinstance(value, int):
                        rule_then["attempts"] = value
                elif key == "fail":
                    rule_then["do"] = "fail"
                elif key == "task":
                    tasks_here.append(value)
                else:
                    self.problem("M8", bpath + ("then", key), f"a case action '{key}' has no canonical equivalent")
            if tasks_here:
                if not tool:
                    st["tool"] = tool = _cseq(tasks_here)
                    tasks_here = []
                else:
                    first = tasks_here[0].get("name") if _is_map(tasks_here[0]) else None
                    rule_then["do"] = "jump"
                    rule_then["to"] = first
                    branch_tasks.append((str(first), tasks_here))
            if rule_then:
                rule_then = _cmap([("do", rule_then.get("do", "continue"))] +
                                  [(k, v) for k, v in rule_then.items() if k != "do"])
                if when is None:
                    rules.append(_cmap([("else", _cmap([("then", rule_then)]))]))
                else:
                    rules.append(_cmap([("when", when), ("then", rule_then)]))
        if arcs:
            if st.get("next") is not None:
                self.problem("M8", cpath, "a case with 'next' and the step's own 'next': merge the arcs by hand")
            else:
                st["next"] = _cmap([("arcs", arcs)])
        if rules or branch_tasks:
            if tool is None:
                self.problem("M8", cpath, "a case that sets variables or runs tasks on a step without a tool")
                return
            if _is_map(tool):
                name = tool.get("name") or f"{st.get('step')}_task"
                tool.insert(0, "name", name) if "name" not in tool else None
                st["tool"] = tool = _cseq([tool])
            last = tool[-1]
            spec_last = last.get("spec") if _is_map(last.get("spec")) else {}
            if _is_map(spec_last.get("policy")):
                self.problem("M8", cpath, "a case that sets variables or runs tasks after a task that has its own "
                             "policy: merge the rules by hand")
                return
            if not any("do: retry" in str(r) or "error" in str(r.get("when", "")) for r in rules if _is_map(r)):
                rules.insert(0, _cmap([("when", "{{ outcome.status == 'error' }}"),
                                       ("then", _flow(_cmap([("do", "fail")])))]))
            if branch_tasks and not any(_is_map(r) and "else" in r for r in rules):
                rules.append(_cmap([("else", _cmap([("then", _flow(_cmap([("do", "break")])))]))]))
            if hasattr(last, "fa") and last.fa.flow_style() and "spec" not in last:
                last.fa.set_block_style()  # a one-line task that gets a policy: written as a block
            last.setdefault("spec", _cmap())["policy"] = _cmap([("rules", rules)])
            self._after_step.add(id(last))
            for _, tasks in branch_tasks:
                for k, task in enumerate(tasks):
                    if k == len(tasks) - 1 and _is_map(task) and len(branch_tasks) > 1:
                        task.setdefault("spec", _cmap())["policy"] = _cmap([("rules", _cseq([
                            _cmap([("else", _cmap([("then", _flow(_cmap([("do", "break")])))]))])]))])
                    tool.append(task)
                    if _is_map(task):
                        self.task_structure(task, path + ("tool", len(tool) - 1), in_loop="loop" in st)
        self.change("M8", cpath, "'case' -> " + ", ".join(x for x in (
            "arcs" if arcs else "", "policy rules" if rules else "", "tasks reached by jump" if branch_tasks else "")
            if x))

    # -------------------------------------------------------------- workbook
    def workbook(self) -> None:
        wb = self.doc.get("workbook")
        if wb is None:
            return
        items = list(wb.items()) if _is_map(wb) else list(enumerate(wb)) if _is_seq(wb) else []
        for key, task in items:
            if not _is_map(task):
                continue
            path: Path = ("workbook", key)
            if _is_map(task.get("tool")) or isinstance(task.get("tool"), str):
                new = self.flatten_tool(task)
                wb[key] = task = new
                self.change("M6", path, "a workbook task's 'tool' flattened into the task")
            if "task" in task and "name" not in task and _is_seq(wb):
                _rename(task, "task", "name")
                self.change("M6", path + ("task",), "a workbook task's 'task' -> 'name'")
            self.task_structure(task, path, in_loop=False)


_ARTIFACT_REF = re.compile(r"\s*\{\{\s*([A-Za-z_]\w*)\._ref\s*\}\}\s*")


def _nats_object_name(t: Any) -> bool:
    """A legacy nats task naming its object with ``name`` (an object operation without ``key``)."""
    return (t.get("kind") == "nats" and "name" in t and "key" not in t
            and str(t.get("operation") or "").startswith("object_"))
