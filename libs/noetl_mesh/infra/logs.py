"""Log lines of the services: the service, and the execution and trace they are about.

The shells bind the execution a piece of work is for (:func:`bind`: a control-plane delivery, a
worker's command, a request naming one); every record made meanwhile, by any logger, carries
``execution_id`` and the current ``trace_id``/``span_id`` (outside a span, the execution's trace id:
everything done for an execution is in its trace; none when there is neither), and ``service``
(set for each service's tasks by the stack runners, :func:`set_service`). Two formats
(``--log-format``): ``text``, one line ``time service LEVEL logger: message [execution=… trace=…]``,
and ``json``, one JSON object per line (``time``, ``level``, ``service``, ``logger``, ``message``,
``execution_id``, ``trace_id``, ``span_id``, ``exception``: the traceback as one string).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from typing import Iterator

from . import tracing

FORMATS = ("text", "json")
_execution: contextvars.ContextVar[str | None] = contextvars.ContextVar("noetl_execution_id", default=None)
_service: contextvars.ContextVar[str | None] = contextvars.ContextVar("noetl_service", default=None)


def set_service(name: str) -> None:
    """Name the service of this task and of the tasks it starts from now on."""
    _service.set(name)


@contextlib.contextmanager
def bind(execution_id: str | None) -> Iterator[None]:
    """Records made inside carry ``execution_id`` (tasks started inside inherit it)."""
    token = _execution.set(execution_id)
    try:
        yield
    finally:
        _execution.reset(token)


def set_execution(execution_id: str | None) -> None:
    """Records of this task (and of the tasks it starts from now on) carry ``execution_id``."""
    _execution.set(execution_id)


def execution_id() -> str | None:
    return _execution.get()


class ContextFilter(logging.Filter):
    """Adds ``service``, ``execution_id``, ``trace_id``, ``span_id`` to every record it sees."""

    def __init__(self, service: str | None = None):
        super().__init__()
        self.default_service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = _service.get() or self.default_service or "noetl"
        record.execution_id = eid = _execution.get()
        record.trace_id, record.span_id = tracing.current_ids()
        if record.trace_id is None and eid:  # outside a span, work for an execution is in its trace
            record.trace_id = format(tracing.trace_id_of(eid), "032x")
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(service)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={v}" for k, v in (("execution", getattr(record, "execution_id", None)),
                                        ("trace", getattr(record, "trace_id", None))) if v]
        if not ids:
            return line
        head, sep, rest = line.partition("\n")  # after the message, before a traceback
        return f"{head} [{' '.join(ids)}]{sep}{rest}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": _iso(record.created), "level": record.levelname,
               "service": getattr(record, "service", None), "logger": record.name, "message": record.getMessage()}
        for key in ("execution_id", "trace_id", "span_id"):
            value = getattr(record, key, None)
            if value:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, default=str, ensure_ascii=False)


def _iso(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def configure(service: str | None = None, fmt: str | None = None, level: str | None = None, stream=None) -> None:
    """Log to ``stream`` (stderr) in ``fmt`` (``NOETL_LOG_FORMAT``, default text) at ``level``
    (``NOETL_LOG_LEVEL``, default INFO); replaces the root logger's handlers."""
    fmt = (fmt or os.environ.get("NOETL_LOG_FORMAT") or "text").lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter(service))
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level or os.environ.get("NOETL_LOG_LEVEL", "INFO"))
