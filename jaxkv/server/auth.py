"""API keys and tenants: who may call /v1/*, and whose prefix-cache namespace a request uses.

With keys configured (``jaxkv serve --api-key``), every /v1/* request carries
``Authorization: Bearer KEY``; each key is a tenant with its own prefix-cache namespace, so a
request only ever hits KV that the same tenant computed (``cached_tokens`` never reveals what
another tenant sent). The namespace is derived from a hash of the key, never the key itself,
combined with the request's own ``cache_salt``, which subdivides the tenant's namespace.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from fastapi.responses import JSONResponse

TENANT = "jaxkv.tenant"  # the ASGI scope key of a request's tenant


class AuthError(Exception):
    """A /v1/* request without a valid key (a 401)."""


def read_key_file(path: str) -> list[str]:
    """The keys of a file, one per line (blank lines skipped); ValueError if it holds none."""
    with open(path, encoding="utf-8") as f:
        keys = [line.strip() for line in f if line.strip()]
    if not keys:
        raise ValueError(f"--api-key-file {path}: no keys in it (one key per line)")
    return keys


def tenant_id(key: str) -> str:
    """A key's tenant: a short hash of it (a namespace that does not reveal the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Tenants:
    """The configured keys; without any, every request is let in under no tenant."""

    def __init__(self, keys: Iterable[str] = ()):
        keys = list(dict.fromkeys(keys))
        for key in keys:
            if not isinstance(key, str) or not key or key != key.strip() or " " in key:
                raise ValueError("an API key must be a non-empty string without spaces")
        self._keys = [(key.encode(), tenant_id(key)) for key in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of a request's ``Authorization`` header (None when no keys are
        configured); raises AuthError for a missing or unknown key."""
        if not self._keys:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("missing API key: send the header 'Authorization: Bearer KEY'")
        sent, found = key.strip().encode(), None
        for known, tenant in self._keys:  # every key compared: the time tells nothing
            if hmac.compare_digest(sent, known) and found is None:
                found = tenant
        if found is None:
            raise AuthError("invalid API key")
        return found


def cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The engine's cache salt: the tenant's namespace, subdivided by the request's salt.
    The tenant part has a fixed length, so no request salt can reach another tenant's."""
    if tenant is None:
        return salt
    return tenant if salt is None else f"{tenant}/{salt}"


TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")


class RequireKey:
    """ASGI middleware: /v1/* (and the ``more`` paths) needs a configured key, whose tenant it
    puts in the scope (``scope[TENANT]``); a 401 otherwise, before the body is read. A plain
    ASGI class rather than an http middleware, which would stand between a handler and its
    disconnect checks."""

    def __init__(self, app, tenants: Tenants, more: tuple[str, ...] = ()):
        self.app, self.tenants, self.more = app, tenants, more

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1/")
                                        or scope["path"] in self.more):
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            try:
                scope[TENANT] = self.tenants.tenant(header.decode("latin-1"))
            except AuthError as e:
                response = JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                                        content={"error": {"message": str(e),
                                                           "type": "AuthenticationError",
                                                           "param": None, "code": 401}})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
