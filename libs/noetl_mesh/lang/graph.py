"""The static graph of a workflow (D16): arcs as places, forward inputs, back-edges, joins, reach.

Everything here follows the static arcs whatever their ``when``; it is computed once per playbook and
read by the execution core on every routing decision.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple


class Place(NamedTuple):
    """One arc of the net: the ``index``-th arc of step ``source``, pointing at ``target``."""

    source: str
    index: int
    target: str

    @property
    def id(self) -> str:
        return f"{self.source}#{self.index}->{self.target}"


@dataclass
class WorkflowGraph:
    order: list[str]  # step names in workflow order
    places: list[Place]
    successors: dict[str, list[str]] = field(default_factory=dict)
    predecessors: dict[str, list[str]] = field(default_factory=dict)
    reach: dict[str, frozenset[str]] = field(default_factory=dict)  # reflexive-transitive
    forward_places: dict[str, list[Place]] = field(default_factory=dict)
    back_places: dict[str, list[Place]] = field(default_factory=dict)
    # for each join J and each of its forward places p: the steps that can put a token on p
    # without passing through J (p.source included).
    feeders: dict[tuple[str, Place], frozenset[str]] = field(default_factory=dict)

    @classmethod
    def build(cls, steps: Iterable[tuple[str, list[str]]]) -> "WorkflowGraph":
        """``steps``: (name, [arc target, ...]) in workflow order; unknown targets are ignored
        (the validator reports them)."""
        steps = list(steps)
        order = [name for name, _ in steps]
        known = set(order)
        places = [Place(name, i, t) for name, targets in steps for i, t in enumerate(targets) if t in known]
        g = cls(order=order, places=places)
        g.successors = {n: [] for n in order}
        g.predecessors = {n: [] for n in order}
        for p in places:
            if p.target not in g.successors[p.source]:
                g.successors[p.source].append(p.target)
            if p.source not in g.predecessors[p.target]:
                g.predecessors[p.target].append(p.source)
        g.reach = {n: frozenset(_bfs(n, g.successors)) for n in order}
        for n in order:
            g.forward_places[n] = [p for p in places if p.target == n and p.source not in g.reach[n]]
            g.back_places[n] = [p for p in places if p.target == n and p.source in g.reach[n]]
        for n in order:
            if len(g.forward_places[n]) >= 2:
                for p in g.forward_places[n]:
                    g.feeders[(n, p)] = frozenset(_bfs(p.source, g.predecessors, avoid=n))
        return g

    def is_join(self, step: str) -> bool:
        """D16: two or more forward inputs make a step a join (unless its spec says ``join: any``)."""
        return len(self.forward_places.get(step, ())) >= 2

    def reachable_from(self, entry: str) -> frozenset[str]:
        return self.reach.get(entry, frozenset())

    def can_still_feed(self, join: str, place: Place, active_steps: Iterable[str]) -> bool:
        """Can a pending token or running step run at any of ``active_steps`` still put a token on
        ``place`` (a forward input of ``join``) without passing through the join?"""
        feeders = self.feeders[(join, place)]
        return any(s in feeders for s in active_steps)


def _bfs(start: str, edges: dict[str, list[str]], avoid: str | None = None) -> set[str]:
    seen = {start}
    queue = deque([start])
    while queue:
        for nxt in edges.get(queue.popleft(), ()):
            if nxt != avoid and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen
