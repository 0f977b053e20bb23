"""Micro-benchmark of the template engine (noetl_mesh.lang.templates).

Run: python bench/bench_templates.py
Prints renders per second and microseconds per render; no assertions.
"""

from __future__ import annotations

import time

from noetl_mesh.lang.templates import render, truthy

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
]


def bench(fn, iterations: int) -> float:
    fn()  # warm the compile cache
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return time.perf_counter() - start


def main() -> None:
    iterations = 5000
    print(f"{'case':<36} {'iterations':>10} {'renders/s':>12} {'us/render':>10}")
    print("-" * 71)
    for name, fn in CASES:
        elapsed = min(bench(fn, iterations) for _ in range(3))
        per = elapsed / iterations
        print(f"{name:<36} {iterations:>10} {1 / per:>12,.0f} {per * 1e6:>10.2f}")


if __name__ == "__main__":
    main()
