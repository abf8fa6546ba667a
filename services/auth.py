"""API key → tenant, decided from a request's headers (HTTP ``Authorization: Bearer``, gRPC ``api_key``) before its
body is read. No keys configured: every request is tenant ``default``."""

from __future__ import annotations

from common.config import ServerConfig
from common.errors import AuthenticationError


class ApiKeys:
    def __init__(self, server: ServerConfig) -> None:
        self.keys = server.load_api_keys()

    def tenant(self, api_key: str | None) -> str:
        if not self.keys:
            return "default"
        if not api_key or api_key not in self.keys:
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer <key>)")
        return self.keys[api_key]
