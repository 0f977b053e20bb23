"""Micro-benchmark of the template engine (noetl_mesh.lang.templates).

Run: python bench/bench_templates.py [--quick]
Prints renders per second and microseconds per render (CPU time of the rendering thread, best of 5
rounds, so that other processes on a shared machine disturb it less), then how long hostile templates
take to be refused by the budget (template_max_ms, template_max_output, wall time); no assertions.
"""

from __future__ import annotations

import sys
import time

from noetl_mesh import limits
from noetl_mesh.lang.templates import TemplateError, check_syntax, render, truthy

CONTEXT = {
    "workload": {"n": 41, "name": "alice", "base_url": "https://api.example.com", "limit": 50},
    "ctx": {"page": 3, "token": "abc"},
    "iter": {"row": {"id": 7, "email": "a@example.com"}},
    "execution_id": "e-123",
    "outcome": {"result": {"data": {"items": [1, 2, 3]}}},
}

NESTED = {
    "url": "{{ workload.base_url }}/users/{{ iter.row.id }}",
    "method": "{{ 'GET' }}",
    "headers": {
        "Authorization": "Bearer {{ ctx.token }}",
        "X-Execution": "{{ execution_id }}",
        "X-Page": "{{ ctx.page }}",
    },
    "params": {
        "limit": "{{ workload.limit }}",
        "offset": "{{ (ctx.page - 1) * workload.limit }}",
        "email": "{{ iter.row.email }}",
    },
    "tags": ["{{ workload.name }}", "{{ workload.n + 1 }}"],
}

CASES = [
    ("plain string (fast path)", lambda: render("https://api.example.com/users", CONTEXT, "w")),
    ("native {{ workload.n + 1 }}", lambda: render("{{ workload.n + 1 }}", CONTEXT, "w")),
    ("text, two expressions", lambda: render("{{ workload.base_url }}/page-{{ ctx.page }}", CONTEXT, "w")),
    ("nested dict, 10 templated values", lambda: render(NESTED, CONTEXT, "w")),
    (
        "truthy() when condition",
        lambda: truthy("{{ outcome.result.data.paging.hasMore | default(false) or ctx.page < 5 }}", CONTEXT, "w"),
    ),
    ("loop of 100, writing numbers", lambda: render("{% for i in range(100) %}{{ i }},{% endfor %}", CONTEXT, "w")),
    ("filters: join, upper, tojson", lambda: render("{{ ctx | tojson }} {{ ['a', 'b'] | join('-') | upper }}", CONTEXT, "w")),
]

ATTACKS = [
    ("nested range loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
    ("exponential macro", "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"),
    ("'%0999999999d' % 1", "{{ '%0999999999d' % 1 }}"),
    ("'x'|center(999999999)", "{{ 'x' | center(999999999) }}"),
    ("namespace string doubled 40 times",
     "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"),
]


def bench(fn, iterations: int) -> float:
    fn()  # warm the compile cache
    start = time.thread_time()
    for _ in range(iterations):
        fn()
    return time.thread_time() - start


def main(quick: bool) -> None:
    iterations = 500 if quick else 5000
    print(f"{'case':<36} {'iterations':>10} {'renders/s':>12} {'us/render':>10}")
    print("-" * 71)
    for name, fn in CASES:
        elapsed = min(bench(fn, iterations) for _ in range(5))
        per = elapsed / iterations
        print(f"{name:<36} {iterations:>10} {1 / per:>12,.0f} {per * 1e6:>10.2f}")
    lim = limits.current()
    print(f"\nhostile templates (template_max_ms = {lim.template_max_ms}, template_max_output = {lim.template_max_output:,})")
    print(f"{'template':<36} {'refused after':>14} {'check_syntax':>13}  limit")
    print("-" * 90)
    for name, source in ATTACKS:
        t0 = time.perf_counter()
        check_syntax(source)  # compiles (first time for this source): what validation costs
        compiled = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            render(source, {}, "w")
            reason = "rendered"
        except TemplateError as e:
            reason = e.reason.split(" over the limit ")[-1].split(" = ")[0]
        refused = time.perf_counter() - t0
        print(f"{name:<36} {refused * 1000:>11.1f} ms {compiled * 1000:>10.2f} ms  {reason}")


if __name__ == "__main__":
    main("--quick" in sys.argv)
