"""API keys -> tenants. Keys come from a file (`key tenant` per line) or an environment
variable (`key:tenant,key:tenant`) named in the config; with none configured the server
runs in local single-tenant mode (logged once). Keys are never logged."""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

from dlite_ray.serve.errors import Unauthenticated

log = logging.getLogger(__name__)
LOCAL_TENANT = "local"


class KeyRing:
    def __init__(self, keys: dict[str, str]):
        self._keys = keys
        if not keys:
            log.warning("no API keys configured: local single-tenant mode, every caller is tenant %r", LOCAL_TENANT)

    @classmethod
    def load(cls, keys_file: str | None, keys_env: str | None) -> KeyRing:
        keys: dict[str, str] = {}
        if keys_file:
            for line in Path(keys_file).read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and not line.startswith("#"):
                    keys[parts[0]] = parts[1]
        if keys_env and os.environ.get(keys_env):
            for pair in os.environ[keys_env].split(","):
                key, _, tenant = pair.partition(":")
                if key and tenant:
                    keys[key.strip()] = tenant.strip()
        return cls(keys)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an `authorization: Bearer <key>` header (HTTP or gRPC metadata)."""
        if not self._keys:
            return LOCAL_TENANT
        if not authorization or not authorization.startswith("Bearer "):
            raise Unauthenticated("missing 'authorization: Bearer <key>'")
        given = authorization[len("Bearer "):].strip()
        for key, tenant in self._keys.items():
            if hmac.compare_digest(key, given):
                return tenant
        raise Unauthenticated("unknown API key")
