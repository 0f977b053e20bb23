"""event-recorder: writes every event to Postgres, keeps the catalog, answers the read queries."""
from .service import (
    DURABLE,
    Q_CATALOG_GET,
    Q_CATALOG_LIST,
    Q_CATALOG_REGISTER,
    Q_EXECUTION_EVENTS,
    Q_EXECUTION_GET,
    Q_EXECUTION_LIST,
    Q_RECORDER_PING,
    RecorderService,
)

__all__ = [
    "DURABLE", "Q_CATALOG_GET", "Q_CATALOG_LIST", "Q_CATALOG_REGISTER", "Q_EXECUTION_EVENTS",
    "Q_EXECUTION_GET", "Q_EXECUTION_LIST", "Q_RECORDER_PING", "RecorderService",
]
