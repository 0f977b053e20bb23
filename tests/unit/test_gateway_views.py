"""The gateway's bounded reading back of values held by reference (D23, max_view_bytes): counted as they
are read, the references inside what a reference stands for included."""
from __future__ import annotations

import asyncio

import pytest
from fastapi import HTTPException

from noetl_mesh import limits
from noetl_mesh.contracts.refs import STORE
from noetl_mesh.infra.payloads import PayloadStore
from noetl_mesh.services.gateway.app import Views


def ref(key: str, size: int) -> dict:
    return {"store": STORE, "key": key, "size": size, "checksum": f"sha256:{key}"}


class Store:
    """The object store's reads; the walk over references is the real one (``PayloadStore.expand``)."""
    expand = PayloadStore.expand

    def __init__(self, objects: dict):
        self.objects, self.read = objects, []

    async def get(self, r: dict):
        self.read.append(r["key"])
        value = self.objects[r["key"]]
        if isinstance(value, Exception):
            raise value
        return value


class Bus:
    def __init__(self, objects: dict):
        self.payloads = Store(objects)


def view(objects: dict, reply, limit: int):
    views = Views(Bus(objects))
    with limits.override(max_view_bytes=limit):
        return asyncio.run(views.expand(reply, "execution x", "ask for less")), views.bus.payloads.read


def test_values_within_the_limit_are_read_back_whole():
    got, read = view({"a": {"rows": [1, 2]}, "b": "text"}, {"steps": [ref("a", 100), ref("b", 50)]}, 1000)
    assert got == {"steps": [{"rows": [1, 2]}, "text"]} and sorted(read) == ["a", "b"]


def test_over_the_limit_on_their_face_nothing_is_read():
    with pytest.raises(HTTPException) as over:
        view({"a": "x"}, {"steps": [ref("a", 2000)]}, 1000)
    assert over.value.status_code == 413 and "max_view_bytes" in over.value.detail["message"]
    assert "ask for less" in over.value.detail["message"]


def test_a_small_reference_to_a_value_holding_big_ones_is_counted_as_it_is_read():
    objects = {"outer": {"inner": ref("big", 10 ** 9)}, "big": "never read"}
    with pytest.raises(HTTPException) as over:
        view(objects, {"result": ref("outer", 200)}, 1000)
    assert over.value.status_code == 413
    views = Views(Bus(objects))  # and the big one is never fetched
    with limits.override(max_view_bytes=1000), pytest.raises(HTTPException):
        asyncio.run(views.expand({"result": ref("outer", 200)}, "execution x", "ask for less"))
    assert views.bus.payloads.read == ["outer"]


def test_a_value_that_does_not_match_its_checksum_is_503_not_500():
    with pytest.raises(HTTPException) as bad:
        view({"a": ValueError("payload a does not match its checksum")}, {"r": ref("a", 10)}, 1000)
    assert bad.value.status_code == 503 and "checksum" in bad.value.detail["message"]
