"""gateway: the HTTP API (FastAPI), talking to the rest of the system only over NATS."""
from .app import GatewayService, create_app

__all__ = ["GatewayService", "create_app"]
