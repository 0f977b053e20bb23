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
    forward_places: dict[str, list[Place]] = field(default_factory=dict)
    back_places: dict[str, list[Place]] = field(default_factory=dict)
    # for each join J and each of its forward places p: the steps that can put a token on p
    # without passing through J (p.source included). Filled on first use, one search per key.
    feeders: dict[tuple[str, Place], frozenset[str]] = field(default_factory=dict, repr=False, compare=False)
    by_arc: dict[tuple[str, int], Place] = field(default_factory=dict)  # (source, arc index) -> place
    _reach: dict[str, frozenset[str]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.feeders = _Feeders(self)

    @classmethod
    def build(cls, steps: Iterable[tuple[str, list[str]]]) -> "WorkflowGraph":
        """``steps``: (name, [arc target, ...]) in workflow order; unknown targets are ignored
        (the validator reports them). Linear in steps + arcs: an arc into a step is a back-edge when
        its source is reachable from that step, i.e. when both are in one strongly connected
        component (one pass of Tarjan's algorithm, not a search per step)."""
        steps = list(steps)
        order = [name for name, _ in steps]
        known = set(order)
        places = [Place(name, i, t) for name, targets in steps for i, t in enumerate(targets)
                  if isinstance(t, str) and t in known]
        g = cls(order=order, places=places)
        successors: dict[str, dict[str, None]] = {n: {} for n in order}  # ordered sets
        predecessors: dict[str, dict[str, None]] = {n: {} for n in order}
        for p in places:
            successors[p.source][p.target] = None
            predecessors[p.target][p.source] = None
            g.by_arc[(p.source, p.index)] = p
        g.successors = {n: list(s) for n, s in successors.items()}
        g.predecessors = {n: list(s) for n, s in predecessors.items()}
        component = _components(g.order, g.successors)
        g.forward_places = {n: [] for n in order}
        g.back_places = {n: [] for n in order}
        for p in places:
            (g.back_places if component[p.source] == component[p.target] else g.forward_places)[p.target].append(p)
        return g

    def is_join(self, step: str) -> bool:
        """D16: two or more forward inputs make a step a join (unless its spec says ``join: any``)."""
        return len(self.forward_places.get(step, ())) >= 2

    def reachable_from(self, entry: str) -> frozenset[str]:
        """The steps reachable from ``entry`` (itself included); empty for an unknown step."""
        if entry not in self.successors:
            return frozenset()
        found = self._reach.get(entry)
        if found is None:
            found = self._reach[entry] = frozenset(_bfs(entry, self.successors))
        return found

    def can_still_feed(self, join: str, place: Place, active_steps: Iterable[str]) -> bool:
        """Can a pending token or running step run at any of ``active_steps`` still put a token on
        ``place`` (a forward input of ``join``) without passing through the join?"""
        feeders = self.feeders[(join, place)]
        return any(s in feeders for s in active_steps)


class _Feeders(dict):
    """``feeders`` computed when first read: a search per (join, place) actually waited on, instead
    of one per forward place of every join when the graph is built."""

    def __init__(self, graph: WorkflowGraph):
        super().__init__()
        self.graph = graph

    def __missing__(self, key: tuple[str, Place]) -> frozenset[str]:
        join, place = key
        found = self[key] = frozenset(_bfs(place.source, self.graph.predecessors, avoid=join))
        return found


def _components(order: list[str], successors: dict[str, list[str]]) -> dict[str, int]:
    """Strongly connected components (Tarjan), iteratively: step -> component number."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    component: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    counter = 0
    for root in order:
        if root in index:
            continue
        work = [(root, iter(successors[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(successors[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component[member] = index[node]
                        if member == node:
                            break
    return component


def _bfs(start: str, edges: dict[str, list[str]], avoid: str | None = None) -> set[str]:
    seen = {start}
    queue = deque([start])
    while queue:
        for nxt in edges.get(queue.popleft(), ()):
            if nxt != avoid and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen
