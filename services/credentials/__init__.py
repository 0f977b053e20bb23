"""credentials: the credential store (D24) and the workers' resolutions of it."""
from .service import CredentialsService

__all__ = ["CredentialsService"]
