"""D5 spec layering, D4 normalisation and the D16 static graph."""
from __future__ import annotations

from noetl_mesh.lang.graph import Place, WorkflowGraph
from noetl_mesh.lang.normalize import deep_merge, effective_spec, normalize_tasks, normalize_workbook


def test_layering_scalars_inner_wins_maps_merge_lists_replace():
    spec = effective_spec(
        {"timeout": 30, "policy": {"limits": {"a": 1}}, "tags": ["k"]},
        {"timeout": 10, "policy": {"limits": {"b": 2}}},
        {"policy": {"limits": {"a": 3}}, "tags": ["s1", "s2"]},
        {"max_in_flight": 4},
        {"timeout": 5, "tags": []},
    )
    assert spec == {"timeout": 5, "policy": {"limits": {"a": 3, "b": 2}}, "tags": [], "max_in_flight": 4}


def test_layering_none_layers_and_no_aliasing():
    inner = {"m": {"x": [1]}}
    merged = deep_merge(None, inner, {})
    merged["m"]["x"].append(2)
    assert inner == {"m": {"x": [1]}}


def test_map_replaces_scalar_and_scalar_replaces_map():
    assert deep_merge({"a": 1}, {"a": {"b": 2}}) == {"a": {"b": 2}}
    assert deep_merge({"a": {"b": 2}}, {"a": 1}) == {"a": 1}


def test_normalize_shapes():
    assert normalize_tasks("s", {"kind": "noop"}) == [{"kind": "noop", "name": "s_task"}]
    assert normalize_tasks("s", [{"kind": "noop"}, {"name": "n", "kind": "noop"}]) == [
        {"kind": "noop", "name": "task_0"},
        {"name": "n", "kind": "noop"},
    ]
    assert normalize_tasks("s", None) == []
    assert normalize_workbook({"w": {"kind": "noop"}}) == [{"name": "w", "kind": "noop"}]


def graph(*steps):
    return WorkflowGraph.build(steps)


def test_fork_join_forward_inputs():
    g = graph(("start", ["a", "b"]), ("a", ["join"]), ("b", ["join"]), ("join", []))
    assert g.is_join("join") and not g.is_join("a")
    assert [p.source for p in g.forward_places["join"]] == ["a", "b"]
    assert g.back_places["join"] == []
    assert g.reachable_from("start") == {"start", "a", "b", "join"}


def test_back_edge_is_not_a_forward_input():
    # loop: start -> work -> check -> work (back-edge) | done
    g = graph(("start", ["work"]), ("work", ["check"]), ("check", ["work", "done"]), ("done", []))
    assert [p.source for p in g.forward_places["work"]] == ["start"]
    assert [p.source for p in g.back_places["work"]] == ["check"]
    assert not g.is_join("work")


def test_self_loop_is_a_back_edge():
    g = graph(("poll", ["poll", "end"]), ("end", []))
    assert g.back_places["poll"] == [Place("poll", 0, "poll")]
    assert g.forward_places["poll"] == []


def test_cycle_upstream_of_a_join_feeds_its_place():
    # start -> a -> a2 -> a (cycle) ; a2 -> join ; start -> b -> join
    g = graph(("start", ["a", "b"]), ("a", ["a2"]), ("a2", ["a", "join"]), ("b", ["join"]), ("join", []))
    assert g.is_join("join")
    place_a = next(p for p in g.forward_places["join"] if p.source == "a2")
    assert g.feeders[("join", place_a)] == {"a2", "a", "start"}
    assert g.can_still_feed("join", place_a, ["a"])
    assert not g.can_still_feed("join", place_a, ["b"])


def test_arc_from_a_step_the_join_reaches_is_a_back_edge():
    # join -> x -> a -> join: a's arc is a back-edge of join, so join has one forward input (from b)
    g = graph(("start", ["a", "b"]), ("a", ["join"]), ("b", ["join"]), ("join", ["x"]), ("x", ["a"]))
    assert [p.source for p in g.forward_places["join"]] == ["b"]
    assert [p.source for p in g.back_places["join"]] == ["a"]
    assert not g.is_join("join")


def test_two_arcs_from_one_step_are_two_places():
    g = graph(("start", ["j", "j"]), ("j", []))
    assert len(g.forward_places["j"]) == 2 and g.is_join("j")


def test_unknown_targets_ignored():
    g = graph(("start", ["nowhere"]))
    assert g.places == []
