"""event-recorder: writes every event to Postgres, keeps the catalog, answers the read queries."""
from .service import DURABLE, RecorderService

__all__ = ["DURABLE", "RecorderService"]
