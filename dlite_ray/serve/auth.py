"""API keys -> tenants. Keys come from a file (`key tenant` per line) or an environment
variable (`key:tenant,key:tenant`) named in the config; with none configured the server
runs in local single-tenant mode (logged once). Keys are never logged.

Operational figures (/metrics, a full GetStats) need a key too: any key, or only the keys
of the tenants named in `ops_tenants`."""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

from dlite_ray.serve.errors import Forbidden, Unauthenticated

log = logging.getLogger(__name__)
LOCAL_TENANT = "local"


class KeyRing:
    def __init__(self, keys: dict[str, str], ops_tenants: list[str] | None = None):
        self._keys = keys
        self._ops_tenants = None if ops_tenants is None else frozenset(ops_tenants)
        if not keys:
            log.warning("no API keys configured: local single-tenant mode, every caller is tenant %r", LOCAL_TENANT)

    @classmethod
    def load(cls, keys_file: str | None, keys_env: str | None, ops_tenants: list[str] | None = None) -> KeyRing:
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
        return cls(keys, ops_tenants)

    @property
    def is_local(self) -> bool:
        """No keys configured: every caller is the local tenant, and may read everything."""
        return not self._keys

    @property
    def num_tenants(self) -> int:
        """Distinct tenants with keys (1 in local mode: everyone is the local tenant)."""
        return max(1, len(set(self._keys.values())))

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an `authorization: Bearer <key>` header (HTTP or gRPC metadata)."""
        if not self._keys:
            return LOCAL_TENANT
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():  # auth schemes are case-insensitive (RFC 9110)
            raise Unauthenticated("missing 'authorization: Bearer <key>'")
        given_bytes = given.strip().encode("utf-8", "surrogateescape")  # compare_digest refuses non-ASCII str
        for key, tenant in self._keys.items():
            if hmac.compare_digest(key.encode("utf-8"), given_bytes):
                return tenant
        raise Unauthenticated("unknown API key")

    def ops_tenant(self, authorization: str | None) -> str:
        """The tenant of a key that may read operational figures (/metrics, a full GetStats):
        Unauthenticated without a valid key, Forbidden for a tenant not in `ops_tenants`."""
        tenant = self.tenant(authorization)
        if self._keys and self._ops_tenants is not None and tenant not in self._ops_tenants:
            raise Forbidden("this API key may not read operational figures (ops_tenants)")
        return tenant
