"""What the templates read (docs/migrate.md): the model of steps and tasks the structural rules left,
then every template's names rewritten by :mod:`.templates` with a resolver that knows where the
template stands: M1 bare names, M2 a step's name as its result, M7 result shapes (SQL statements,
HTTP status and headers, a child playbook's step), the guards of legacy conditions."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from jinja2 import nodes

from ..diagnostics import Path
from ..lint import error_certain
from ..model import RESERVED_NAMES
from .structure import (
    COMMAND_N, HTTP_META, RESULT_WORDS, STEP_VIEW, TASK_VIEW, TEMPLATE_GLOBALS, _Site, _Step, _Task, _append_key, _cmap,
    _bare_expr, _cseq, _is_map, _is_seq, _producer, _styled, _template,
)
from .templates import NeedsPerson, Ref, _chain, build, parse_expression, rewrite


_SQL_WHOLE = ("the whole result of {kind} {what}: the legacy result read whole here was the statements' results "
              "(command_0, command_1, ...) or the rows; canonically it is the last statement's {{rows, columns, "
              "row_count}} (D27): read .result.rows for the rows (.result.rows[0].n for a field of the first), "
              ".result.row_count for their number, .result.columns for the column names")


def _attr(*names: str) -> nodes.Expr:
    node: nodes.Expr = nodes.Name(names[0], "load")
    for n in names[1:]:
        node = nodes.Getattr(node, n, "load")
    return node


def _path_text(path: list) -> str:
    out = []
    for kind, value in path:
        out.append(str(value) if kind in ("attr", "key") else "[...]")
    return ".".join(out)



def _router_mode(step: Any) -> Any:
    """The mode of a step's router (``next.spec.mode``), or None."""
    nxt = step.get("next")
    spec = nxt.get("spec") if _is_map(nxt) else None
    return spec.get("mode") if _is_map(spec) else None


def _whole_chain(value: str) -> bool:
    """Is the template exactly ``{{ a.b.c }}``, one chain read whole (its value is the template's)?"""
    expr = _bare_expr(value)
    if expr is None:
        return False
    try:
        node = parse_expression(expr)
    except Exception:  # noqa: BLE001 - not an expression: not a chain
        return False
    return type(node) in (nodes.Getattr, nodes.Getitem) and type(_chain(node)[0]) is nodes.Name


class References:
    # ======================================================================= model
    def build_model(self) -> None:
        self.steps = {}
        for i, st in enumerate(self.doc["workflow"]):
            if not _is_map(st) or not isinstance(st.get("step"), str):
                continue
            s = _Step(st["step"], st, i)
            loop = st.get("loop")
            if _is_map(loop):
                s.loop = True
                if isinstance(loop.get("iterator"), str):
                    s.iterator = loop["iterator"]
            s.set_names = dict(self._set_names.get(id(st), {}))
            tool = st.get("tool")
            if _is_map(tool):
                s.tasks = [self._task(tool, tool.get("name") or f"{s.name}_task", 0)]
            elif _is_seq(tool):
                s.tasks = [self._task(t, t.get("name") or f"task_{j}", j) for j, t in enumerate(tool) if _is_map(t)]
            self.steps[s.name] = s

    def _task(self, t: Any, name: str, index: int) -> _Task:
        task = _Task(str(name), str(t.get("kind")), t, index)
        if task.kind in ("postgres", "duckdb"):
            cmd = t.get("command", t.get("query"))
            if isinstance(cmd, str):
                from ...tools.postgres import split_statements

                try:
                    task.statements = max(1, len(split_statements(cmd)))
                except Exception:  # noqa: BLE001 - an unsplittable command: one statement
                    task.statements = 1
        if task.kind == "playbook" and "return_step" in t:
            task.return_step = str(t["return_step"])
        return task

    def drop_return_steps(self) -> None:
        """M7: ``return_step`` goes; the reads of the task's result were rewritten to read that step."""
        for s in self.steps.values():
            for t in s.tasks:
                if t.return_step is not None and "return_step" in t.node:
                    t.node.pop("return_step")
                    p = ("workflow", s.index, "tool") + ((t.index,) if _is_seq(s.node.get("tool")) else ())
                    self.change("M7", p + ("return_step",), f"'return_step: {t.return_step}' dropped: the task's "
                                f"result is the child's {{execution_id, status, ctx, steps}}; reads of it now read "
                                f"{s.name}.result.steps.{t.return_step}.result")

    def end_unrouted(self) -> bool:
        """A step named ``end`` that no arc goes to and that is not the entry step: canonically it never
        runs, so the playbook can only be legacy there (the legacy runtime went to ``end`` from every
        step without ``next``), whatever else of it reads as canonical."""
        from ..validate import entry_step

        if "end" not in self.steps or entry_step(self.doc) == "end":
            return False
        for s in self.steps.values():
            nxt = s.node.get("next")
            arcs = nxt.get("arcs") if _is_map(nxt) else None
            if _is_seq(arcs) and any(_is_map(a) and a.get("step") == "end" for a in arcs):
                return False
        return True

    def implicit_end(self) -> None:
        """M6: the legacy runtime went on to the step named ``end`` from a step with no ``next``."""
        if "end" not in self.steps:
            return
        for s in self.steps.values():
            if s.name == "end" or "next" in s.node:
                continue
            _append_key(s.node, "next", _cmap([("arcs", _cseq([_cmap([("step", "end")])]))]))
            self.change("M6", ("workflow", s.index), "a step without 'next' -> an arc to 'end' (the legacy "
                                                    "runtime went there)")

    # ======================================================================= templates
    def bare_names_used(self) -> bool:
        """Does any template read a name the canonical language does not define where it stands, and
        that the legacy reading translates? A name nothing translates (it needs a person) is no sign of
        the dialect: it is left as it is, and a second migration must read the file as the first wrote
        it."""
        self.build_model()
        found = []

        def probe(site: _Site) -> Callable[[Ref], Any]:
            def resolve(ref: Ref) -> Any:
                if not self._canonical_root(ref.root, site):
                    try:
                        new, _ = self._resolve(ref, site)
                    except NeedsPerson:
                        new = None
                    if new is not None:
                        found.append(ref.root)
                return None
            return resolve

        for value, site, _ in self._template_sites():
            rewrite(value, probe(site))
            if found:
                return True
        return False

    def _canonical_root(self, root: str, site: _Site) -> bool:
        if root in TEMPLATE_GLOBALS or root in {"workload", "ctx", "args", "execution_id", "keychain"}:
            return True
        if site.kind in ("task", "policy", "workbook") and root in {"iter", "_prev", "_task", "_attempt"}:
            return True
        if site.kind == "policy" and root in {"outcome", "output"}:
            return True
        if site.kind == "arc" and root == "event":
            return True
        if root in self.steps:
            return True
        if site.step is not None and root in {t.name for t in site.step.tasks}:
            return True
        return False

    def _template_sites(self) -> Iterator[tuple[str, _Site, tuple]]:
        """Every template string: (text, site, (container, key, path))."""
        for s in list(self.steps.values()):
            st, base = s.node, ("workflow", s.index)
            loop = st.get("loop")
            if _is_map(loop) and "in" in loop:
                yield from self._strings(loop, "in", _Site("admit", s, None, base + ("loop", "in")),
                                         base + ("loop", "in"))
            spec = st.get("spec")
            admit = ((spec.get("policy") or {}).get("admit") if _is_map(spec) and _is_map(spec.get("policy")) else None)
            if _is_map(admit) and _is_seq(admit.get("rules")):
                for i, rule in enumerate(admit["rules"]):
                    p = base + ("spec", "policy", "admit", "rules", i)
                    if _is_map(rule):
                        yield from self._walk(rule, _Site("admit", s, None, p), p)
            tool = st.get("tool")
            tasks = [(tool, base + ("tool",))] if _is_map(tool) else \
                [(t, base + ("tool", j)) for j, t in enumerate(tool)] if _is_seq(tool) else []
            for (t, p), task in zip([x for x in tasks if _is_map(x[0])], s.tasks):
                for key in list(t.keys()):
                    if key in ("name", "kind", "desc") or (key == "code" and task.kind == "python"):
                        continue
                    if key == "spec":
                        yield from self._policy_sites(t, s, task, p)
                        continue
                    yield from self._strings(t, key, _Site("task", s, task, p + (key,)), p + (key,))
            nxt = st.get("next")
            if _is_map(nxt) and _is_seq(nxt.get("arcs")):
                for i, arc in enumerate(nxt["arcs"]):
                    p = base + ("next", "arcs", i)
                    if _is_map(arc):
                        for key in ("when", "args", "spec"):
                            if key in arc:
                                yield from self._strings(arc, key, _Site("arc", s, None, p + (key,)), p + (key,))
        wb = self.doc.get("workbook")
        items = list(wb.items()) if _is_map(wb) else list(enumerate(wb)) if _is_seq(wb) else []
        for key, t in items:
            if not _is_map(t):
                continue
            p = ("workbook", key)
            task = _Task(str(t.get("name", key)), str(t.get("kind")), t, 0)
            for k in list(t.keys()):
                if k in ("name", "kind", "desc") or (k == "code" and task.kind == "python"):
                    continue
                if k == "spec":
                    yield from self._policy_sites(t, None, task, p)
                    continue
                yield from self._strings(t, k, _Site("workbook", None, task, p + (k,)), p + (k,))

    def _policy_sites(self, t: Any, s: _Step | None, task: _Task, p: Path) -> Iterator:
        spec = t.get("spec")
        pol = spec.get("policy") if _is_map(spec) else None
        if _is_map(pol) and _is_seq(pol.get("rules")):
            for i, rule in enumerate(pol["rules"]):
                rp = p + ("spec", "policy", "rules", i)
                if _is_map(rule):
                    yield from self._walk(rule, _Site("policy", s, task, rp), rp)

    def _strings(self, container: Any, key: Any, site: _Site, path: Path) -> Iterator:
        value = container[key]
        if isinstance(value, str):
            if _template(value):
                yield value, site, (container, key, path)
        elif _is_map(value) or _is_seq(value):
            yield from self._walk(value, site, path)

    def _walk(self, node: Any, site: _Site, path: Path) -> Iterator:
        items = list(node.items()) if _is_map(node) else list(enumerate(node))
        for k, v in items:
            yield from self._strings(node, k, site, path + (k,))

    def templates(self) -> None:
        for value, site, (container, key, path) in list(self._template_sites()):
            if self.reported(path):
                continue  # a construct that could not be translated: its templates stay as they are
            resolver = self._resolver(site, path)
            out = rewrite(value, resolver)
            for problem in out.problems:
                self.problem("M1", path, problem)
            if out.text != value:
                container[key] = _styled(value, out.text)
                rule = ",".join(dict.fromkeys(resolver.rules)) or "M1"
                for old, new in out.changed:
                    self.change(rule, path, f"{{{{ {old} }}}} -> {{{{ {new} }}}}")

    def guard_conditions(self) -> None:
        """M7: a condition that reads into an error that is null. The legacy runtime read an attribute of
        a missing value as undefined, false in a condition; canonically a condition is strict (D9), so
        ``outcome.error.retryable`` on an ok outcome (its ``error`` is null) fails the pipeline, and
        ``event.error.kind`` on a done step ends its routing. Each such read is guarded by its error:
        ``(outcome.error and outcome.error.retryable)`` is that same false on success, and the value
        itself on an error. Reads under ``| default`` or ``is defined``, or guarded already, stay."""
        for value, site, (container, key, path) in list(self._template_sites()):
            if path[-1] != "when" or site.kind not in ("policy", "arc") or self.reported(path):
                continue
            if path[-3] != ("rules" if site.kind == "policy" else "arcs"):
                continue  # a rule's or an arc's own when, not a key 'when' in a value

            def resolve(ref: Ref, site: _Site = site) -> Any:
                if ref.tolerant or len(ref.path) < 2 or ref.path[0] != ("attr", "error"):
                    return None
                roots = {"outcome", "output"} if site.kind == "policy" else {"event"}
                tasks = {t.name for t in site.step.tasks} if site.step is not None and site.kind == "policy" else set()
                if ref.root not in roots and ref.root not in self.steps and ref.root not in tasks:
                    return None
                return nodes.And(build(ref.root, ref.path[:1]), build(ref.root, ref.path))

            out = rewrite(value, resolve)
            if out.text != value and not out.problems:
                container[key] = _styled(value, out.text)
                for old, new in out.changed:
                    self.change("M7", path, f"{{{{ {old} }}}} -> {{{{ {new} }}}} (an error's field read where there "
                                "may be no error: the legacy runtime read it as false, a condition here fails on it)")

    def guard_values(self) -> None:
        """M7: a value that reads into an error that may be null. A policy rule that also runs on an ok
        outcome (an ``else``, a ``when`` that is not about an error) or an arc that also fires after a
        done step has no error to read: ``{{ outcome.error.message }}`` in its ``set_ctx`` or ``args``
        was undefined in the legacy runtime and fails canonically (D7). Each such read becomes
        ``outcome.error.message if outcome.error else none``: the field on an error, null without one
        (``''`` in text or inside a larger expression, where the legacy runtime printed nothing). A rule
        or arc that runs only on an error (:func:`..lint.error_certain`, the test ``noetl lint`` L411
        makes), reads under ``| default`` or ``is defined``, and reads guarded already stay."""
        for value, site, (container, key, path) in list(self._template_sites()):
            if site.kind not in ("policy", "arc") or self.reported(path):
                continue
            condition = path[-1] == "when" and path[-3] == ("rules" if site.kind == "policy" else "arcs")
            if condition:
                continue  # a condition: guard_conditions
            roots = ("outcome", "output") if site.kind == "policy" else ("event",)
            error_only = error_certain(self._conditions_up_to(site), roots)
            missing = None if _whole_chain(value) else ""

            def resolve(ref: Ref, site: _Site = site, roots: tuple = roots, error_only: bool = error_only,
                        missing: Any = missing) -> Any:
                if ref.tolerant or len(ref.path) < 2 or ref.path[0] != ("attr", "error"):
                    return None
                tasks = {t.name for t in site.step.tasks} if site.step is not None and site.kind == "policy" else set()
                if ref.root in roots:
                    if error_only:
                        return None
                elif ref.root not in self.steps and ref.root not in tasks:
                    return None
                return nodes.CondExpr(build(ref.root, ref.path[:1]), build(ref.root, ref.path), nodes.Const(missing))

            out = rewrite(value, resolve)
            if out.text != value and not out.problems:
                container[key] = _styled(value, out.text)
                for old, new in out.changed:
                    self.change("M7", path, f"{{{{ {old} }}}} -> {{{{ {new} }}}} (an error's field read in a value "
                                "where there may be no error: the legacy runtime read it as undefined, here it "
                                "fails on it)")

    def _conditions_up_to(self, site: _Site) -> list[Any]:
        """The ``when`` of the policy rule or arc a value stands in, after those of the rules (the arcs of
        an exclusive router) before it, which are tried first (None: no ``when``)."""
        cut = -1 if site.kind == "policy" else -2  # (..., rules, i) or (..., arcs, i, key)
        node: Any = self.doc
        for k in site.path[:cut]:
            node = node[k]
        index = site.path[cut]
        inclusive = site.kind == "arc" and _router_mode(self.doc["workflow"][site.step.index]) == "inclusive"
        return [x.get("when") for x in list(node)[index if inclusive else 0:index + 1] if _is_map(x)]

    # -------------------------------------------------------------- the resolver
    def _resolver(self, site: _Site, path: Path) -> Any:
        m = self

        class R:
            rules: list[str] = []
            event_names = ({"step.exit": "step.done", "call.exit": "call.done"} if site.kind == "arc" else
                           {"step.exit": "call.done", "step.done": "call.done"} if site.kind == "policy" else None)

            def __call__(self, ref: Ref) -> Any:
                new, rule = m._resolve(ref, site)
                if new is not None:
                    self.rules.append(rule)
                return new

        r = R()
        r.rules = []
        return r

    def _resolve(self, ref: Ref, site: _Site) -> tuple[Any, str]:
        root, path = ref.root, ref.path
        step = site.step
        tasks = {t.name: t for t in step.tasks} if step is not None else {}
        if root in TEMPLATE_GLOBALS:
            return None, ""
        if root in ("workload", "ctx", "args", "execution_id", "keychain", "iter", "_task", "_attempt"):
            return None, ""
        if root in ("outcome", "output") and site.kind == "policy":
            if site.task is not None and id(site.task.node) in self._canonical_outcome:
                return None, ""
            return self._reshape_outcome(root, path, site.task), "M7"
        if root == "event" and site.kind == "arc":
            if path[:1] == [("attr", "result")] and self.legacy and step is not None:
                new = self._reshape(step, path[1:], what=f"step '{step.name}'")
                return (Ref("event", [("attr", "result")] + new) if new != path[1:] else None), "M7"
            return None, ""
        if root == "event" and site.kind == "policy":  # a case's condition, now a task policy's (M8)
            if path[:1] == [("attr", "name")]:
                return nodes.CondExpr(nodes.Compare(_attr("outcome", "status"), [nodes.Operand("eq", nodes.Const("ok"))]),
                                      nodes.Const("call.done"), nodes.Const("call.error")), "M8"
            if path[:1] == [("attr", "result")]:
                return Ref("outcome", path), "M8"
            raise NeedsPerson(f"'event.{_path_text(path)}' in a task policy: only outcome is known there")
        if root == "_prev" and site.kind in ("task", "policy"):
            prev = _producer(step.tasks, site.task.index - 1) if step and site.task and site.task.index > 0 else None
            if prev is not None and self.legacy:
                new = self._reshape_task(prev, path, "_prev")
                return (new if new is not None else None), "M7"
            return None, ""
        if site.step is not None and root in tasks and site.kind in ("task", "policy"):
            return self._task_ref(tasks[root], path), "M2"
        if step is not None and root == step.name and site.kind == "policy" and site.task is not None and self.legacy:
            return self._own_step_ref(step, site.task, path), "M2"
        if root in self.steps:
            return self._step_ref(self.steps[root], path), "M2"
        if step is not None and root == step.iterator and site.kind in ("task", "policy"):
            return Ref(f"iter.{root}", path), "M1"
        if root in ("loop_index", "_index", "iteration_index") and site.kind in ("task", "policy"):
            return Ref("iter.index", path), "M1"
        if root == "job":
            if path and path[0][1] in ("execution_id", "id", "uuid", "job_id"):
                return Ref("execution_id", path[1:]), "M1"
            raise NeedsPerson(f"'job.{_path_text(path)}' has no canonical equivalent (only the execution's id: "
                              "execution_id)")
        if root in ("vars", "variables"):
            return Ref("ctx", path), "M1"
        if root == "payload":
            return Ref("workload", path), "M1"
        if root in ("env",) and path:
            raise NeedsPerson("'env.X' (the runtime's environment): declare a keychain entry {kind: env, var: X} "
                              "and read keychain.<entry>.value")
        if root in ("secret", "secrets"):
            raise NeedsPerson(f"'{root}.{_path_text(path)}': declare a keychain entry and read keychain.<entry>.<field>")
        if root in RESULT_WORDS or root == "data":
            if site.kind == "policy":
                return Ref("outcome", [("attr", "result")] + (self._reshape_task_path(site.task, path)
                                                              if self.legacy else path)), "M1"
            if site.kind == "arc" and step is not None:
                return Ref("event", [("attr", "result")] + self._reshape(step, path, f"step '{step.name}'")), "M1"
        if step is not None and root in step.set_names:
            return Ref(f"{step.set_names[root]}.{root}", path), "M1"
        for s in self.steps.values():
            if root in s.set_names and s.set_names[root] == "ctx":
                return Ref(f"ctx.{root}", path), "M1"
        if root in self.workload_keys:
            return Ref(f"workload.{root}", path), "M1"
        if root in ("outcome", "output", "event", "_prev", "iter") or root in RESERVED_NAMES:
            raise NeedsPerson(f"'{root}' is not defined where this template stands (D6)")
        raise NeedsPerson(f"'{root}' names nothing the engine defines here (D6): not a workload key, a step, a task "
                          "or a loop variable; give it a value (workload, args or ctx) and read it there")

    # -------------------------------------------------------------- M2 / M7: reading results
    def _step_ref(self, s: _Step, path: list) -> Ref | None:
        head = path[0] if path else None
        if head is None:
            if not self.legacy:
                return None
            kind = "loop" if s.loop else (s.result_task.kind if s.result_task else None)
            if kind == "http":
                raise NeedsPerson(f"the whole result of http step '{s.name}' is now the response body (the legacy "
                                  f"{{status_code, headers, data}} is gone): read '{s.name}.result' knowing that")
            return Ref(s.name, [("attr", "result")] + self._reshape(s, [], f"step '{s.name}'"))
        if head == ("attr", "result"):
            new = self._reshape(s, path[1:], f"step '{s.name}'") if self.legacy else path[1:]
            return Ref(s.name, [head] + new) if new != path[1:] else None
        if head[0] == "attr" and head[1] in STEP_VIEW:
            return None
        if head[0] == "attr" and head[1] in ("status", "data") and not self.legacy:
            return None
        return Ref(s.name, [("attr", "result")] + self._reshape(s, path, f"step '{s.name}'"))

    def _own_step_ref(self, s: _Step, task: _Task, path: list) -> Ref:
        """The step read by its own name in a policy of one of its tasks. The legacy runtime ran a
        step's ``set`` (and a case) after its tool, with the step's result in place; the canonical
        policy runs before the step has one, and there the result is the task's ``outcome.result``."""
        if s.loop:
            raise NeedsPerson(f"loop step '{s.name}' read by its own name in a task policy: the policy runs per "
                              "iteration, before the loop has a result; read the loop's result in its arcs "
                              "(event.result) or in the next step")
        if id(task.node) not in self._after_step and task is not s.tasks[-1]:
            raise NeedsPerson(f"step '{s.name}' read by its own name in the policy of its task '{task.name}', "
                              "which does not give the step's result: the step has no result there yet")
        producer = _producer(s.tasks, task.index) or task
        head = path[0] if path else None
        if head == ("attr", "error"):
            return Ref("outcome", path)
        if head is None:
            if producer.kind == "http":
                raise NeedsPerson(f"the whole result of http step '{s.name}' is now the response body (the legacy "
                                  "{status_code, headers, data} is gone): read 'outcome.result' knowing that")
            self._reshape_kind(producer.kind, producer, [], f"step '{s.name}'")  # a whole SQL result needs a person
            return Ref("outcome", [("attr", "result")])
        rest = path[1:] if head == ("attr", "result") else path
        if producer.kind == "http" and rest and rest[0][0] in ("attr", "key") and rest[0][1] in HTTP_META:
            return Ref("outcome", [("attr", a) for a in HTTP_META[rest[0][1]]] + rest[1:])
        return Ref("outcome", [("attr", "result")] + self._reshape_kind(producer.kind, producer, rest,
                                                                        f"step '{s.name}'"))

    def _task_ref(self, t: _Task, path: list) -> Ref | None:
        head = path[0] if path else None
        if head is None:
            if self.legacy:
                self._reshape_task_path(t, [])  # a whole SQL result needs a person
            return Ref(t.name, [("attr", "result")]) if self.legacy else None
        if head == ("attr", "result"):
            if not self.legacy:
                return None
            new = self._reshape_task(t, path, t.name)
            return new
        if head[0] == "attr" and (head[1] in TASK_VIEW or (head[1] in ("status", "data") and not self.legacy)):
            return None
        if t.kind == "http" and head[0] in ("attr", "key") and head[1] in HTTP_META:
            return Ref(t.name, [("attr", a) for a in HTTP_META[head[1]]] + path[1:])
        return Ref(t.name, [("attr", "result")] + self._reshape_task_path(t, path))

    def _reshape_task(self, t: _Task, path: list, root: str) -> Ref | None:
        """``root`` + path where root is the task's outcome view (a task name) or its result (_prev)."""
        if root == "_prev":
            if path and path[0][0] in ("attr", "key") and path[0][1] in HTTP_META and t.kind == "http":
                return Ref(t.name, [("attr", a) for a in HTTP_META[path[0][1]]] + path[1:])
            if not path and t.kind == "http":
                raise NeedsPerson(f"'_prev' after http task '{t.name}' is now the response body (the legacy "
                                  "{status_code, headers, data} is gone)")
            new = self._reshape_task_path(t, path)
            return Ref("_prev", new) if new != path else None
        new = self._reshape_task_path(t, path[1:])
        return Ref(root, [path[0]] + new) if new != path[1:] else None

    def _reshape_task_path(self, t: _Task | None, path: list) -> list:
        if t is None:
            return path
        return self._reshape_kind(t.kind, t, path, f"task '{t.name}'")

    def _reshape(self, s: _Step, path: list, what: str) -> list:
        if s.loop:
            if path and path[0] in (("attr", "results"), ("key", "results")):
                return path[1:]
            if path and path[0][0] == "attr" and path[0][1] in ("count", "total", "done", "failed"):
                raise NeedsPerson(f"'{path[0][1]}' of loop {what}: the loop's counts are event.total/done/failed on "
                                  "its arcs; its result is the list of iteration results")
            return path
        t = s.result_task
        if t is None:
            return path
        return self._reshape_kind(t.kind, t, path, what)

    def _reshape_kind(self, kind: str, t: _Task, path: list, what: str) -> list:
        """A path read from a legacy result of this kind, as it reads the canonical result (M7). ``[]``:
        the whole result is read."""
        if not path:
            if kind in ("postgres", "duckdb") and self.legacy:
                raise NeedsPerson(_SQL_WHOLE.format(kind=kind, what=what))
            return path
        head = path[0]
        key = head[1] if head[0] in ("attr", "key") else None
        if kind == "http":
            if key == "data":
                return path[1:]
            if key in ("status_code", "headers", "url", "elapsed"):
                raise NeedsPerson(f"'{key}' of the http result of {what}: the result is the response body; the "
                                  "status and headers are outcome.http.status/headers in the task's policy (keep "
                                  "them with set_ctx)")
            return path
        if kind in ("postgres", "duckdb"):
            if isinstance(key, str) and COMMAND_N.match(key):
                n = int(COMMAND_N.match(key).group(1))
                last = t.statements - 1
                if kind == "duckdb":
                    raise NeedsPerson(f"'{key}' of duckdb {what}: the result is the last statement's "
                                      "{rows, columns, row_count}")
                if n == last or t.statements == 1 and n == 0:
                    return path[1:]
                raise NeedsPerson(f"'{key}' of {what}: only the last statement's result is kept (command_{last}); "
                                  "run that statement in a task of its own")
            if head[0] == "key" and isinstance(key, int):
                return [("attr", "rows")] + path
            return path
        if kind == "playbook" and t.return_step:
            return [("attr", "steps"), ("attr", t.return_step), ("attr", "result")] + path
        return path

    def _reshape_outcome(self, root: str, path: list, t: _Task | None) -> Any:
        if not self.legacy or t is None or not path:
            return None
        head = path[0]
        if head in (("attr", "response"), ("key", "response")):
            # the legacy outcome's 'response' was the tool's result (as a bare 'response' was, M1)
            new = self._reshape_outcome(root, [("attr", "result")] + path[1:], t)
            return new if new is not None else Ref(root, [("attr", "result")] + path[1:])
        if head in (("attr", "data"), ("key", "data")):
            # '.data' aliases '.result' (D8): read it as the result it is, in the shape of the task's kind
            return self._reshape_outcome(root, [("attr", "result")] + path[1:], t)
        if head == ("attr", "result") and len(path) == 1:
            if t.kind == "http":
                raise NeedsPerson(f"the whole result of http task '{t.name}' ('{root}.{_path_text(path)}') is now the "
                                  "response body (the legacy {status_code, headers, data} is gone): read "
                                  "outcome.result knowing that, and outcome.http.status/headers")
            self._reshape_task_path(t, [])  # a whole SQL result needs a person
            return None
        if head == ("attr", "result") and len(path) > 1:
            second = path[1]
            if t.kind == "http" and second[0] in ("attr", "key") and second[1] in HTTP_META:
                return Ref(root, [("attr", a) for a in HTTP_META[second[1]]] + path[2:])
            new = self._reshape_task_path(t, path[1:])
            return Ref(root, [head] + new) if new != path[1:] else None
        return None
