"""Validation time against playbook size (noetl_mesh.lang.validate), and hostile documents.

Run: python bench/bench_validate.py [--quick]
Prints CPU milliseconds per validation for playbooks of 100 to 2,000 steps (YAML text: load + validate;
an already-parsed mapping: validate only; the same playbook with every arc misspelt, which asks for a
"did you mean" per arc), and the time and peak memory to refuse an alias bomb. No assertions.

Figures on the project's machine (2 shared cores), CPU ms, best of 3; "before" is the validator as it
was before the safe loader (yaml.safe_load, a search per step for the graph, "did you mean" for every
reference), "after" the current one:

    steps   text: load+validate    mapping: validate    misspelt arcs       unique templates
            before     after       before    after      before    after     before  compiled  parsed
      100      273        37           33       20         184      178        392      344      90
      500    1,268       167          204       67       5,111      235      2,272    1,531     473
    1,000    3,988       441          718      203      23,359      388      5,754    3,692   1,056
    2,000    9,781     1,082        2,449      393      76,629      375      9,819    8,159   2,030

    alias bomb, 10^6 values expanded (374 bytes): 9,780 ms before (walked value by value), 1.9 ms after
    alias bomb, 10^10 values (610 bytes): refused in 2.0 ms, 13 KiB peak (tracemalloc)

"unique templates" was dominated by compiling each template (about 0.8 ms each): validation now only
parses them and looks up the filters and tests they name ("parsed", about 0.25 ms each), and refuses a
playbook whose templates add up to more than max_template_chars before parsing any (190,000 tiny
distinct templates, 3.9 MiB of YAML: 17 s of CPU parsed, 0.7 s refused).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import yaml

from noetl_mesh import limits
from noetl_mesh.lang.validate import validate, validate_text

DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def playbook(n: int, misspelt: bool = False, unique: str = "") -> dict:
    """``n`` steps in a chain; every tenth step forks to two branches that join again (D16), each
    step with a templated python task, a noop with a policy rule, and a templated arc. ``unique``:
    a salt that makes every template differ (as in real playbooks): none comes from the template cache."""
    steps = []
    i = 0
    while len(steps) < n:
        name = f"step_{i:05d}"
        nxt = f"step_{i + 1:05d}"
        if i % 10 == 0 and len(steps) + 3 < n:  # fork: name -> a, b -> join (named nxt)
            a, b = f"branch_{i:05d}_a", f"branch_{i:05d}_b"
            steps.append(_step(name, [a, b], unique))
            steps.append(_step(a, [nxt], unique))
            steps.append(_step(b, [nxt], unique))
        else:
            steps.append(_step(name, [nxt] if len(steps) + 1 < n else [], unique))
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


def _step(name: str, targets: list[str], unique: str) -> dict:
    tag = f" ~ '{unique}{name}'" if unique else ""
    step: dict = {"step": name, "desc": f"step {name}", "tool": [
        {"name": "fetch", "kind": "python", "args": {"page": "{{ workload.pages%s }}" % tag, "who": name},
         "code": "result = {'n': page}"},
        {"name": "check", "kind": "noop", "result": "{{ fetch.result.n + 1%s }}" % tag,
         "spec": {"policy": {"rules": [{"when": "{{ outcome.status == 'error'%s }}" % tag,
                                        "then": {"do": "retry", "attempts": 3}}]}}},
    ]}
    if targets:
        step["next"] = {"arcs": [{"step": t, "when": "{{ ctx.go | default(true)%s }}" % tag} for t in targets]}
    return step


def timed(fn, repeat: int) -> float:
    """Best of ``repeat`` runs, in CPU milliseconds of this process (the machine is shared: wall
    time would measure the neighbours too)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
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
          f" {'misspelt arcs ms':>17} {'unique templates ms':>20}")
    with limits.override(max_steps=100_000):
        for n in sizes:
            doc = playbook(n)
            text = yaml.dump(doc, Dumper=DUMPER, sort_keys=False)
            bad = playbook(n, misspelt=True)
            assert validate(doc).ok, validate(doc).errors[:3]
            t_text = timed(lambda: validate_text(text), repeat)
            t_doc = timed(lambda: validate(doc), repeat)
            t_bad = timed(lambda: validate(bad), repeat)
            fresh = [playbook(n, unique=f"run{i}-") for i in range(repeat)]  # new templates each run
            t_unique = timed(lambda: validate(fresh.pop()), repeat) if not args.quick else float("nan")
            print(f"{n:>6} {len(text) / 1024:>9.0f} {t_text:>23.1f} {t_doc:>21.1f} {t_bad:>17.1f}"
                  f" {t_unique:>20.1f}")
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
