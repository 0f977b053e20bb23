"""The AsyncAPI 3.0 document of the engine's NATS side, generated from :mod:`.subjects` (every channel,
stream, KV bucket and object store) and :mod:`.messages` (the JSON Schemas of what travels). Pure:
``noetl asyncapi`` prints it, the gateway serves it at ``/asyncapi.json``."""
from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from . import messages
from .subjects import CHANNELS, STREAMS, Channel

REF = "#/components/schemas/{model}"


def _schemas() -> dict[str, Any]:
    """Every model's JSON Schema, their shared definitions hoisted into components/schemas."""
    out: dict[str, Any] = {}
    for name, model in sorted(messages.MODELS.items()):
        schema = model.model_json_schema(ref_template=REF)
        for dname, d in (schema.pop("$defs", None) or {}).items():
            out.setdefault(dname, d)
        out[name] = schema
    return out


def _message(name: str) -> dict[str, Any]:
    model: type[BaseModel] = messages.MODELS[name]
    doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    out = {"name": name, "title": name, "contentType": "application/json",
           "payload": {"$ref": REF.format(model=name)}}
    if doc:
        out["summary"] = doc
    return out


def _channel(c: Channel) -> tuple[dict[str, Any], dict[str, Any] | None]:
    body: dict[str, Any] = {"address": c.address, "description": c.description,
                            "messages": {c.message: {"$ref": f"#/components/messages/{c.message}"}},
                            "x-noetl-kind": c.kind}
    if c.stream:
        body["x-noetl-stream"] = c.stream
    if c.queue:
        body["x-noetl-queue-group"] = c.queue
    if c.parameters:
        body["parameters"] = {k: {"description": v} for k, v in c.parameters.items()}
    reply = None
    if c.reply:
        reply = {"address": None, "description": f"the answer to {c.address}: the requester's inbox",
                 "messages": {c.reply: {"$ref": f"#/components/messages/{c.reply}"},
                              "ErrorReply": {"$ref": "#/components/messages/ErrorReply"}}}
    return body, reply


def _operations(c: Channel) -> dict[str, Any]:
    ref = {"$ref": f"#/channels/{c.id}"}
    msgs = [{"$ref": f"#/channels/{c.id}/messages/{c.message}"}]
    out: dict[str, Any] = {}
    if c.kind == "request":
        group = f" (queue group {c.queue})" if c.queue else " (each replica)"
        out[f"{c.id}.answer"] = {
            "action": "receive", "channel": ref, "messages": msgs,
            "summary": f"{', '.join(c.receivers)} answers{group}, asked by {', '.join(c.senders)}",
            **({"bindings": {"nats": {"queue": c.queue, "bindingVersion": "0.1.0"}}} if c.queue else {}),
            "reply": {"address": {"location": "$message.header#/replyTo",
                                  "description": "the requester's inbox (_INBOX.<its public key>.>)"},
                      "channel": {"$ref": f"#/channels/{c.id}-reply"},
                      "messages": [{"$ref": f"#/channels/{c.id}-reply/messages/{c.reply}"},
                                   {"$ref": f"#/channels/{c.id}-reply/messages/ErrorReply"}]}}
        return out
    if c.senders:
        out[f"{c.id}.send"] = {"action": "send", "channel": ref, "messages": msgs,
                               "summary": "sent by " + ", ".join(c.senders)}
    if c.receivers:
        out[f"{c.id}.receive"] = {"action": "receive", "channel": ref, "messages": msgs,
                                  "summary": "received by " + ", ".join(c.receivers)}
    return out


def document(version: str = "0.1.0") -> dict[str, Any]:
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    used = {"ErrorReply"}
    for c in CHANNELS:
        body, reply = _channel(c)
        channels[c.id] = body
        used.add(c.message)
        if reply is not None:
            channels[f"{c.id}-reply"] = reply
            used.add(c.reply)
        operations.update(_operations(c))
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "noetl-mesh",
            "version": version,
            "description": "The NATS side of the engine: events (JetStream NOETL_EVENTS), commands (NOETL_COMMANDS), "
                           "request/reply reads and writes, broadcasts, KV buckets and the payload object store. "
                           "Every connection is an nkey user of its own (docs/nats-security.md); payloads are "
                           "JSON. Generated from libs/noetl_mesh/contracts.",
        },
        "defaultContentType": "application/json",
        "servers": {"nats": {"host": "localhost:4222", "protocol": "nats", "description": "the NATS server "
                             "(NOETL_NATS_URL); JetStream on"}},
        "channels": channels,
        "operations": operations,
        "components": {"schemas": copy.deepcopy(_schemas()),
                       "messages": {name: _message(name) for name in sorted(used)}},
        "x-noetl-streams": [{"name": s.name, "subjects": list(s.subjects), "retention": s.retention,
                             "description": s.description, **({"bucket": s.bucket} if s.bucket else {})}
                            for s in STREAMS],
    }
