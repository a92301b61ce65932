"""Admission of a request: its API key -> tenant, and its rate limits (gateway/apikeys.py
has the store and the scripts). One Redis round trip per request; none with auth off."""
from __future__ import annotations

import json
import logging

from pagedq.wire.keys import Keys

from .apikeys import (
    ADMIT_LUA,
    ID_LEN,
    SETTLE_LUA,
    Admitted,
    KeyRecord,
    apikeys_key,
    hash_key,
    load_file,
)
from .errors import APIError

log = logging.getLogger("pagedq.gateway")


def bearer(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (None: no usable header)."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class Auth:
    """``mode``: auto (keys required once the store holds one), on, off. ``keys_file``:
    the store is that file (read once, here) instead of the Redis hash."""

    def __init__(self, r, admin_prefix: str, mode: str, keys_file: str = "") -> None:
        self.mode, self.default_tenant = mode, admin_prefix
        self.base = Keys(admin_prefix).base
        self.hash_key = apikeys_key(admin_prefix)
        self.file: dict[str, KeyRecord] | None = load_file(keys_file) if keys_file else None
        self._admit = r.register_script(ADMIT_LUA)
        self._settle = r.register_script(SETTLE_LUA)

    async def admit(self, authorization: str | None, est_tokens: int) -> Admitted:
        """The tenant of the request, its est_tokens charged; APIError 401 or 429."""
        if self.mode == "off":
            return Admitted(self.default_tenant)
        key = bearer(authorization)
        sha = hash_key(key) if key else ""
        given = ""
        if self.file is not None:
            if not self.file and self.mode == "auto":
                return Admitted(self.default_tenant)
            rec = self.file.get(sha)
            if rec is None:
                raise _unauthorized(key)
            given = rec.to_json()
        reply = await self._admit(keys=[self.hash_key],
                                  args=[sha, max(0, est_tokens), self.mode, self.base, given])
        kind = reply[0]
        if kind == "open":
            return Admitted(self.default_tenant)
        if kind == "unknown":
            raise _unauthorized(key)
        if kind == "limited":
            what, retry, cap = reply[1], int(reply[2]), reply[3]
            log.info("rate_limited key_id=%s limit=%s", sha[:ID_LEN], what)
            raise APIError(429, f"rate limit reached: {cap} {what} per minute for this key; "
                           f"retry in {retry} s", "rate_limit_exceeded", retry_after=retry)
        rec = KeyRecord.from_obj(json.loads(reply[1]))
        return Admitted(rec.tenant, sha[:ID_LEN], reply[2])

    async def settle(self, adm: Admitted, tokens: int) -> None:
        """Correct the request's window by ``tokens`` (actual usage - estimate)."""
        if adm.window and tokens:
            await self._settle(keys=[adm.window], args=[tokens])


def _unauthorized(key: str | None) -> APIError:
    if key is None:
        return APIError(401, "no API key: send the header 'Authorization: Bearer <key>'",
                        "missing_api_key")
    return APIError(401, "incorrect API key provided", "invalid_api_key")
