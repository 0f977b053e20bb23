"""Validation time against playbook size (noetl_mesh.lang.validate), and hostile documents.

Run: python bench/bench_validate.py [--quick]
Prints milliseconds per validation for playbooks of 100 to 2,000 steps (YAML text: load + validate;
an already-parsed mapping: validate only; the same playbook with every arc misspelt, which asks for a
"did you mean" per arc), and the time and peak memory to refuse an alias bomb. No assertions.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import yaml

from noetl_mesh import limits
from noetl_mesh.lang.validate import validate, validate_text

try:
    from noetl_mesh.lang.documents import load_document
except ImportError:  # before the safe loader existed
    load_document = None


def playbook(n: int, misspelt: bool = False) -> dict:
    """``n`` steps in a chain; every tenth step forks to two branches that join again (D16), each
    step with a templated python task, a noop with a policy rule, and a templated arc."""
    steps = []
    i = 0
    while len(steps) < n:
        name = f"step_{i:05d}"
        nxt = f"step_{i + 1:05d}"
        if i % 10 == 0 and len(steps) + 3 < n:  # fork: name -> a, b -> join (named nxt)
            a, b = f"branch_{i:05d}_a", f"branch_{i:05d}_b"
            steps.append(_step(name, [a, b]))
            steps.append(_step(a, [nxt]))
            steps.append(_step(b, [nxt]))
        else:
            steps.append(_step(name, [nxt] if len(steps) + 1 < n else []))
        i += 1
    names = {s["step"] for s in steps}
    for s in steps:  # a fork may name a step past the end: point it at the last
        for arc in (s.get("next") or {}).get("arcs", []):
            if arc["step"] not in names:
                arc["step"] = steps[-1]["step"]
            if misspelt:
                arc["step"] = arc["step"].replace("step_", "stp_")
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook",
            "metadata": {"name": f"bench{n}", "path": f"bench/validate/{n}"},
            "workload": {"base": "https://api.example.com", "pages": 3},
            "workflow": steps}


def _step(name: str, targets: list[str]) -> dict:
    step: dict = {"step": name, "desc": f"step {name}", "tool": [
        {"name": "fetch", "kind": "python", "args": {"page": "{{ workload.pages }}", "who": name},
         "code": "result = {'n': page}"},
        {"name": "check", "kind": "noop", "result": "{{ fetch.result.n + 1 }}",
         "spec": {"policy": {"rules": [{"when": "{{ outcome.status == 'error' }}",
                                        "then": {"do": "retry", "attempts": 3}}]}}},
    ]}
    if targets:
        step["next"] = {"arcs": [{"step": t, "when": "{{ ctx.go | default(true) }}"} for t in targets]}
    return step


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="100 and 500 steps only, one repeat")
    parser.add_argument("--bomb-levels", type=int, default=9, help="10^(levels+1) values once expanded; 0: skip")
    args = parser.parse_args()
    sizes = (100, 500) if args.quick else (100, 500, 1000, 2000)
    repeat = 1 if args.quick else 3
    print(f"{'steps':>6} {'YAML KiB':>9} {'text: load+validate ms':>23} {'mapping: validate ms':>21}"
          f" {'misspelt arcs ms':>17}")
    with limits.override(max_steps=100_000):
        for n in sizes:
            doc = playbook(n)
            text = yaml.safe_dump(doc, sort_keys=False)
            bad = playbook(n, misspelt=True)
            assert validate(doc).ok, validate(doc).errors[:3]
            t_text = timed(lambda: validate_text(text), repeat)
            t_doc = timed(lambda: validate(doc), repeat)
            t_bad = timed(lambda: validate(bad), repeat)
            print(f"{n:>6} {len(text) / 1024:>9.0f} {t_text:>23.1f} {t_doc:>21.1f} {t_bad:>17.1f}")
    if not args.bomb_levels:
        return
    text = bomb(args.bomb_levels)
    tracemalloc.start()
    start = time.perf_counter()
    result = validate_text(text)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"alias bomb ({len(text)} bytes, 10^{args.bomb_levels + 1} values expanded): refused={not result.ok} in "
          f"{elapsed * 1000:.1f} ms, peak {peak / 1024:.0f} KiB traced"
          + (f": {result.errors[0].message[:100]}" if result.errors else ""))


if __name__ == "__main__":
    main()
