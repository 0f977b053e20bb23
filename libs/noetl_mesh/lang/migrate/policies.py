"""The structural rules on what a task decides after it ran (docs/migrate.md): M6 policies (their legacy
spellings, ``eval``, ``retry``) and M4 ``set`` (on a task, on a step, on an arc: into ``set_ctx`` and
``set_iter``, and written by every rule that lets the step go on, as the legacy runtime did)."""
from __future__ import annotations

from typing import Any

from ..diagnostics import Path
from .structure import (
    _LeftOnTheArc, _bare_expr, _carry_comment, _cmap, _copy, _cseq, _flow, _is_map, _is_seq, _rename, _styled,
    _template, _writes_of,
)
from .paginate import _on_error, _Unsure
from .templates import NeedsPerson, Ref, parse_expression, rewrite


class Policies:
    # -------------------------------------------------------------- M6: policies
    def policy(self, t: Any, path: Path) -> None:
        spec = t["spec"]
        pol = spec["policy"]
        ppath = path + ("spec", "policy")
        if _is_seq(pol):
            spec["policy"] = pol = _cmap([("rules", pol)])
            self.change("M6", ppath, "a policy given as a list of rules -> {rules: [...]}")
        if not _is_map(pol) or not _is_seq(pol.get("rules")):
            return
        rules = pol["rules"]
        for i, rule in enumerate(rules):
            rpath = ppath + ("rules", i)
            if not _is_map(rule):
                continue
            if "else" in rule and _is_map(rule["else"]) and "then" not in rule["else"]:
                body = rule["else"]
                rule["else"] = _cmap([("then", body)])
                self.change("M6", rpath + ("else",), "'else:' without 'then:' -> 'else: {then: ...}'")
            if "when" in rule and isinstance(rule["when"], bool):
                if rule["when"] is True and i == len(rules) - 1 and not any(_is_map(r) and "else" in r for r in rules):
                    then = rule.get("then")
                    rules[i] = _cmap([("else", _cmap([("then", then)]))])
                    self.change("M6", rpath + ("when",), "'when: true' as the last rule -> 'else'")
                    rule = rules[i]
                else:
                    rule["when"] = "{{ %s }}" % ("true" if rule["when"] else "false")
                    self.change("M6", rpath + ("when",), "a boolean 'when' -> a template")
            if "expr" in rule and "when" not in rule:
                _rename(rule, "expr", "when")
                self.change("M6", rpath + ("expr",), "'expr' -> 'when'")
            then = rule.get("then") if "else" not in rule else (rule["else"] or {}).get("then")
            if "then" not in rule and "else" not in rule and "do" in rule:  # {when, do, ...} flat
                body = _cmap([(k, rule.pop(k)) for k in list(rule.keys()) if k != "when"])
                rule["then"] = then = body
                self.change("M6", rpath, "a rule's directive moved under 'then'")
            if _is_map(then):
                self.then_fields(then, rpath, in_loop=False)

    def then_fields(self, then: Any, rpath: Path, in_loop: bool) -> None:
        if then.get("backoff") == "fixed":
            then["backoff"] = "none"
            self.change("M6", rpath + ("then", "backoff"), "'backoff: fixed' -> 'none' (the same delay each time)")
        for old, new in (("max_attempts", "attempts"), ("delay_seconds", "delay"), ("max_delay_seconds", "max_delay")):
            if old in then and new not in then:
                _rename(then, old, new)
                self.change("M6", rpath + ("then", old), f"'{old}' -> '{new}'")
        if "set" in then:
            self.split_set(then, then.pop("set"), rpath + ("then", "set"), in_loop)

    def eval_block(self, t: Any, path: Path) -> None:
        """The legacy tool-level ``eval: [{expr|when, do, ...}, {else: {do...}}]`` -> spec.policy.rules."""
        ev = t.pop("eval")
        if not _is_seq(ev):
            self.problem("M6", path + ("eval",), "'eval' must be a list of rules")
            return
        rules = _cseq()
        for item in ev:
            if not _is_map(item):
                continue
            if "else" in item:
                body = item["else"]
                body = body.get("then", body) if _is_map(body) else _cmap([("do", "continue")])
                rules.append(_cmap([("else", _cmap([("then", body)]))]))
                continue
            when = item.get("when", item.get("expr"))
            body = item.get("then") if _is_map(item.get("then")) else \
                _cmap([(k, v) for k, v in item.items() if k not in ("when", "expr")])
            rules.append(_cmap([("when", when), ("then", body)]))
        spec = t.setdefault("spec", _cmap())
        pol = spec.setdefault("policy", _cmap())
        if _is_map(pol) and "rules" not in pol:
            pol["rules"] = rules
            self.change("M6", path + ("eval",), "'eval' -> spec.policy.rules (D9)")
        else:
            self.problem("M6", path + ("eval",), "'eval' and spec.policy both given: merge them by hand")

    def retry(self, t: Any, path: Path) -> None:
        """``retry:`` (a count or a block) -> a first policy rule that retries errors (D9)."""
        retry = t.pop("retry")
        rpath = path + ("retry",)
        then = _cmap([("do", "retry")])
        when = "{{ outcome.status == 'error' }}"
        if isinstance(retry, bool) or retry is None:
            if not retry:
                self.change("M6", rpath, "'retry: false' dropped")
                return
            attempts = None
        elif isinstance(retry, int):
            attempts = retry
        elif _is_map(retry):
            if any(translate(self, t, path, retry) for translate in self.RETRY_LOOPS):
                return
            for key in ("on_success", "stop_when", "retry_when", "while", "until", "next_call", "collect", "poll"):
                if key in retry:
                    self.problem("M6", rpath + (key,), f"'retry.{key}' (pagination or polling by retry) has no "
                                 "canonical equivalent: page with a task policy that jumps back (docs/migrate.md)")
                    t["retry"] = retry
                    return
            if "on_error" in retry:
                self.retry_on_error(t, rpath, retry)
                return
            if "when" in retry and isinstance(retry["when"], str):
                when = retry["when"]
            attempts = retry.get("max_attempts", retry.get("attempts"))
            backoff = retry.get("backoff")
            delay = retry.get("delay", retry.get("initial_delay", retry.get("delay_seconds")))
            max_delay = retry.get("max_delay", retry.get("max_delay_seconds"))
            kind = None
            if _is_map(backoff):
                kind = backoff.get("type")
                delay = backoff.get("delay_seconds", backoff.get("delay", delay))
                max_delay = backoff.get("max_delay_seconds", backoff.get("max_delay", max_delay))
                if backoff.get("jitter"):
                    then["jitter"] = True
            elif isinstance(backoff, str):
                kind = backoff
            elif isinstance(retry.get("backoff_multiplier"), (int, float)):
                kind = "exponential" if retry["backoff_multiplier"] != 1 else "none"
            if kind is not None:
                then["backoff"] = {"fixed": "none", "constant": "none"}.get(kind, kind)
            if delay is not None:
                then["delay"] = delay
            if max_delay is not None:
                then["max_delay"] = max_delay
        else:
            self.problem("M6", rpath, "'retry' must be a number of attempts or a mapping")
            return
        if attempts is not None:
            then.insert(1, "attempts", attempts)
        self._retry_rule(t, rpath, _cmap([("when", when), ("then", _flow(then))]), retry)

    def retry_on_error(self, t: Any, rpath: Path, retry: Any) -> None:
        """``retry: {on_error: {when, max_attempts, initial_delay, ...}}`` without ``on_success``: the
        retry of a failed call, as :mod:`.paginate` translates it next to ``on_success``."""
        try:
            for key in retry:
                if key != "on_error":
                    raise _Unsure(rpath + (key,), f"'retry.{key}' next to 'on_error': the legacy runtime read "
                                                  "on_error's own; merge them into 'on_error' by hand")
            rule = _on_error(retry["on_error"], t.get("kind"), rpath + ("on_error",))
        except _Unsure as e:
            self.problem("M6", e.path, e.message)
            t["retry"] = retry
            return
        self._retry_rule(t, rpath, rule, retry)

    def _retry_rule(self, t: Any, rpath: Path, rule: Any, retry: Any) -> None:
        spec = t.setdefault("spec", _cmap())
        pol = spec.setdefault("policy", _cmap())
        if not _is_map(pol):
            self.problem("M6", rpath, "'retry' and a policy that is not a mapping: merge them by hand")
            t["retry"] = retry
            return
        rules = pol.setdefault("rules", _cseq())
        rules.insert(0, rule)
        attempts = rule["then"].get("attempts")
        self.change("M6", rpath, "'retry' -> a first policy rule {do: retry}" +
                    (f" (attempts {attempts}, the first included)" if attempts is not None else ""))

    # -------------------------------------------------------------- M4: set
    def split_set(self, then: Any, values: Any, spath: Path, in_loop: bool, names: dict | None = None,
                  report: bool = True, carry_last: bool = False) -> None:
        """``set: {ctx.x: v, iter.y: v, z: v}`` (or a list of {name, value}) -> set_ctx / set_iter."""
        pairs: list[tuple[str, Any]] = []
        if _is_map(values):
            pairs = [(str(k), v) for k, v in values.items()]
        elif _is_seq(values):
            for item in values:
                if _is_map(item) and "name" in item:
                    pairs.append((str(item["name"]), item.get("value")))
        else:
            self.problem("M4", spath, "'set' must be a mapping")
            return
        for key, value in pairs:
            scope, _, name = key.partition(".")
            if not name:
                scope, name = ("iter" if in_loop else "ctx"), key
                if names is not None:
                    names[name] = scope
            elif scope == "vars":
                scope = "ctx"
            elif scope == "args":
                self.problem("M4", spath, f"'set: {{{key}: ...}}' in a policy: args are set on arcs")
                continue
            elif scope not in ("ctx", "iter"):
                self.problem("M4", spath, f"'set' key {key!r}: only ctx.* and iter.* can be set")
                continue
            if "." in name:
                self.problem("M4", spath, f"'set' key {key!r}: nested keys are not set one by one; set the whole "
                             f"value of '{name.split('.')[0]}'")
                continue
            target = then.setdefault(f"set_{scope}", _cmap())
            target[name] = value
            _carry_comment(values, key, target, name, carry_last)
        if report:
            self.change("M4", spath, "'set' -> " + " and ".join(sorted({f"set_{k.split('_')[1]}" for k in then
                                                                      if k in ("set_ctx", "set_iter")})))

    def _ok_policy(self, t: Any) -> tuple[Any, Any]:
        """The task's policy rules, made to exist: (rules, the else rule's 'then') where the else is the
        rule that applies to a successful outcome. A task without a policy gets {error: fail, else:
        continue}, which is what no policy does (D9)."""
        if hasattr(t, "fa") and t.fa.flow_style() and "spec" not in t:
            t.fa.set_block_style()  # a one-line task that gets a policy of several rules: written as a block
        spec = t.setdefault("spec", _cmap())
        pol = spec.setdefault("policy", _cmap())
        rules = pol.setdefault("rules", _cseq())
        for r in rules:
            if _is_map(r) and "else" in r and _is_map(r["else"]) and _is_map(r["else"].get("then")):
                return rules, r["else"]["then"]
        if not rules:
            rules.append(_cmap([("when", "{{ outcome.status == 'error' }}"), ("then", _flow(_cmap([("do", "fail")])))]))
        then = _cmap([("do", "continue")])
        rules.append(_cmap([("else", _cmap([("then", then)]))]))
        return rules, then

    def task_set(self, t: Any, path: Path, key: str, in_loop: bool) -> None:
        values = t.pop(key)
        self.task_set_output(values, path + (key,), t.get("kind"))
        rules, then = self._ok_policy(t)
        before = _writes_of(then)
        try:
            self._task_set(t, path, key, in_loop, values, then)
        finally:
            self._spread(rules, then, before)

    def _spread(self, rules: Any, then: Any, before: set[tuple[str, str]]) -> None:
        """The legacy runtime ran a ``set`` after the task (or step) whatever its policy decided: what
        the else rule now writes (new since ``before``) is written by every other rule that lets the
        pipeline go on (continue, jump) too, unless that rule writes the key itself."""
        new = [(scope, k) for scope, k in _writes_of(then) - before]
        if not new:
            return
        for r in rules:
            other = r.get("then") if _is_map(r) and "else" not in r else None
            if not _is_map(other) or other is then or other.get("do") not in ("continue", "jump"):
                continue
            for scope, k in sorted(new):
                target = other.setdefault(scope, _cmap())
                if k not in target:
                    target[k] = _copy(then[scope][k])

    def _task_set(self, t: Any, path: Path, key: str, in_loop: bool, values: Any, then: Any) -> None:
        if key == "set":
            st = self._step
            if st is not None and in_loop:
                self.split_set(then, values, path + (key,), in_loop, self.step_names_of(st))
                return
            if st is not None and _is_map(values):
                # a bare name that only this step's pipeline reads is the run's own: iter (D6, the
                # run's scratch scope outside loops); one another step reads is the execution's: ctx
                elsewhere = set().union(*(r for k, r in self._reads.items() if k != id(st)))
                names = self.step_names_of(st)
                local = _cmap()
                for k in list(values.keys()):
                    if "." not in str(k) and str(k) not in elsewhere:
                        _carry_comment(values, k, local, k)
                        local[k] = values.pop(k)
                        names[str(k)] = "iter"
                if local:
                    self.split_set(then, local, path + (key,), True, report=False, carry_last=True)
                    self.change("M4", path + (key,), f"the task's 'set' of {', '.join(map(str, local))} -> set_iter: "
                                "only later tasks of the same pipeline read it (iter is the run's own scope, D6)")
                if not values:
                    return
                self.split_set(then, values, path + (key,), in_loop, names)
                return
            self.split_set(then, values, path + (key,), in_loop)
        elif _is_map(values):
            target = then.setdefault(key, _cmap())
            for k, v in values.items():
                target[k] = v
            self.change("M4", path + (key,), f"the task's '{key}' -> its policy's else rule")

    def task_set_output(self, values: Any, spath: Path, kind: Any) -> None:
        """In a task's own ``set:`` the legacy ``output`` was the task's result; in the policy rule the set
        moves to, ``output`` is the outcome (D8): ``{{ output.data }}`` -> ``{{ outcome.result.data }}``
        (then read as the task's kind gives its result, M7)."""
        def resolve(ref: Ref) -> Any:
            if ref.root != "output":
                return None
            if kind == "http" and not ref.path:
                raise NeedsPerson("the whole result of an http task ('output') is now the response body (the legacy "
                                  "{status_code, headers, data} is gone): read 'outcome.result' knowing that")
            return Ref("outcome", [("attr", "result")] + ref.path)

        def walk(node: Any, p: Path) -> None:
            items = list(node.items()) if _is_map(node) else list(enumerate(node)) if _is_seq(node) else []
            for k, v in items:
                if isinstance(v, str) and _template(v):
                    out = rewrite(v, resolve)
                    for problem in out.problems:
                        self.problem("M4", p + (k,), problem)
                    if out.text != v and not out.problems:
                        node[k] = _styled(v, out.text)
                        for old, new in out.changed:
                            self.change("M4", p + (k,), f"{{{{ {old} }}}} -> {{{{ {new} }}}} (in a task's 'set', "
                                        "'output' was the task's result)")
                else:
                    walk(v, p + (k,))

        walk(values, spath)

    def step_set(self, st: Any, path: Path, key: str) -> None:
        values = st.pop(key)
        in_loop = "loop" in st
        tool = st.get("tool")
        if in_loop and key != "set_iter":
            self.problem("M4", path + (key,), f"a loop step's '{key}' ran once after the loop; the canonical policy "
                         "runs per iteration: compute it in the next step from the loop's result (event.result)")
            st[key] = values
            return
        if tool is None:
            self.problem("M4", path + (key,), f"'{key}' on a step without a tool: set it on the arc's args instead")
            st[key] = values
            return
        last = self._after_tool(st)
        names = self.step_names_of(st)
        rules, then = self._ok_policy(last)
        before = _writes_of(then)
        if key in ("set", "vars"):
            self.split_set(then, values, path + (key,), in_loop, names)
        else:
            target = then.setdefault(key, _cmap())
            for k, v in (values.items() if _is_map(values) else []):
                target[k] = v
            self.change("M4", path + (key,), f"the step's '{key}' -> the policy of its last task")
        self._spread(rules, then, before)

    def _after_tool(self, st: Any) -> Any:
        """The task whose policy runs what the legacy runtime ran after the step's tool: the last task,
        or a noop appended to pass its result through when that task has a policy of its own (or the
        last task of a list is not a task)."""
        tool = st["tool"]
        if _is_map(tool) or (_is_seq(tool) and len(tool) and _is_map(tool[-1])
                              and not ((tool[-1].get("spec") or {}).get("policy") if _is_map(tool[-1].get("spec"))
                                       else None)
                              or _is_seq(tool) and len(tool) and id(tool[-1]) in self._after_step):
            last = tool if _is_map(tool) else tool[-1]
        else:
            last = _cmap([("name", f"{st.get('step')}_set"), ("kind", "noop")])
            tool.append(last)
        self._after_step.add(id(last))
        return last

    def arc_set_ctx(self, st: Any, path: Path, index: int, writes: Any) -> None:
        """An arc's ``set: {ctx.x: v}``: an arc cannot write ctx (D12: only a task policy's ``set_ctx``
        does), so the write moves to the policy that runs after the step's tool (as a step's ``set``),
        in a rule that holds when that arc is the one taken."""
        spath = path + ("next", "arcs", index, "set")
        arcs = st["next"]["arcs"]
        try:
            self._arc_set_ctx(st, spath, arcs, index, writes)
        except _LeftOnTheArc:
            arc = arcs[index]  # what needs a person stays where it was written
            kept = arc.setdefault("set", _cmap())
            for k, v in writes.items():
                kept[f"ctx.{k}"] = v

    def _arc_set_ctx(self, st: Any, spath: Path, arcs: Any, index: int, writes: Any) -> None:
        exclusive = not (_is_map(st["next"].get("spec")) and st["next"]["spec"].get("mode") == "inclusive")
        if "loop" in st:
            self.problem("M4", spath, "a loop step's arc 'set' of ctx ran once after the loop; a task policy runs per "
                         "iteration: compute it in the next step from the loop's result (event.result)")
            raise _LeftOnTheArc
        if not st.get("tool"):
            self.problem("M4", spath, "an arc 'set' of ctx on a step without a tool: an arc cannot write ctx; pass "
                         "the values as arc args")
            raise _LeftOnTheArc
        conds = []
        for j, arc in enumerate(arcs):
            if j > index or (j < index and not exclusive):
                continue
            when = arc.get("when") if _is_map(arc) else None
            if when is None:
                if j < index:  # an earlier arc without a condition is taken on every success
                    self.problem("M4", spath, f"an arc 'set' of ctx on an arc that follows arc {j}, which has no "
                                 "'when': it is taken only when the step fails; write the ctx in a rule by hand")
                    raise _LeftOnTheArc
                continue
            expr = _bare_expr(when)
            if expr is None:
                self.problem("M4", spath, f"an arc 'set' of ctx under a 'when' that is not one expression ({when!r}): "
                             "write the rule that sets it in the step's last task policy by hand")
                raise _LeftOnTheArc
            conds.append(f"({expr})" if j == index else f"not ({expr})")
        if conds and len(conds) > 1:  # 'not (W0)' says nothing more when this arc's W1 is exactly that
            def ast(text: str) -> Any:
                try:
                    return parse_expression(text)
                except Exception:  # noqa: BLE001 - not comparable: kept
                    return None

            own = ast(conds[-1])
            conds = [c for c in conds[:-1] if own is None or ast(c) != own] + conds[-1:]
        last = self._after_tool(st)
        rules, ok_then = self._ok_policy(last)
        if not conds:
            target = ok_then.setdefault("set_ctx", _cmap())
            for k, v in writes.items():
                target[k] = v
                _carry_comment(writes, k, target, k, last_too=True)
            self.change("M4", spath, "arc 'set' of ctx -> set_ctx in the policy after the step's tool (its else rule: "
                        "the arc is taken on every success)")
            return
        then = _cmap([("do", "continue")])
        both = _cmap()
        for k, v in (ok_then.get("set_ctx") or {}).items():
            both[k] = _copy(v)  # the else rule's own writes, which this rule would otherwise skip
        for k, v in writes.items():
            both[k] = v
            _carry_comment(writes, k, both, k, last_too=True)
        then["set_ctx"] = both
        for k in ("set_iter",):
            if k in ok_then:
                then[k] = _copy(ok_then[k])
        when = "{{ outcome.status == 'ok' and %s }}" % " and ".join(conds)
        at = next(n for n, r in enumerate(rules) if _is_map(r) and "else" in r)
        rules.insert(at, _cmap([("when", when), ("then", then)]))
        self.change("M4", spath, "arc 'set' of ctx -> a rule of the policy after the step's tool that sets it when "
                    "the arc is the one taken (an arc cannot write ctx, D12)")

    def step_names_of(self, st: Any) -> dict:
        return self._set_names.setdefault(id(st), {})
