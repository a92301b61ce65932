"""Admission of a request: its API key -> tenant, and its rate limits (gateway/apikeys.py
has the store and the scripts). One Redis round trip per request; none with auth off."""
from __future__ import annotations

import json
import logging

from pagedq.wire import script
from pagedq.wire.gateway_scripts import Admit, Settle
from pagedq.wire.keys import Keys

from .apikeys import (
    ID_LEN,
    Admitted,
    KeyRecord,
    apikeys_key,
    hash_key,
    load_file,
)
from .errors import APIError
from .metrics import GatewayMetrics

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

    def __init__(self, r, admin_prefix: str, mode: str, keys_file: str = "",
                 metrics: GatewayMetrics | None = None) -> None:
        self.mode, self.default_tenant = mode, admin_prefix
        self.metrics = metrics
        self.base = Keys(admin_prefix).base
        self.hash_key = apikeys_key(admin_prefix)
        self.file: dict[str, KeyRecord] | None = load_file(keys_file) if keys_file else None
        self.r = r

    async def admit(self, authorization: str | None, est_tokens: int) -> Admitted:
        """The tenant of the request, its est_tokens charged; APIError 401 or 429."""
        try:
            adm = await self._admit(authorization, est_tokens)
        except APIError as e:
            if self.metrics:
                self.metrics.rejected("rate_limited" if e.status == 429 else e.code)
            raise
        if self.metrics:
            self.metrics.admitted(adm.tenant)
        return adm

    async def _admit(self, authorization: str | None, est_tokens: int) -> Admitted:
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
        v = await script.run_async(self.r, Admit(self.hash_key, sha, est_tokens, self.mode,
                                                  self.base, given))
        if v.kind == "open":
            return Admitted(self.default_tenant)
        if v.kind == "unknown":
            raise _unauthorized(key)
        if v.kind == "limited":
            log.info("rate_limited key_id=%s limit=%s", sha[:ID_LEN], v.what)
            raise APIError(429, f"rate limit reached: {v.cap} {v.what} per minute for this key; "
                           f"retry in {v.retry_s} s", "rate_limit_exceeded",
                           retry_after=v.retry_s)
        rec = KeyRecord.from_obj(json.loads(v.record))
        return Admitted(rec.tenant, sha[:ID_LEN], v.window)

    async def settle(self, adm: Admitted, tokens: int) -> None:
        """Correct the request's window by ``tokens`` (actual usage - estimate)."""
        if adm.window and tokens:
            await script.run_async(self.r, Settle(adm.window, tokens))


def _unauthorized(key: str | None) -> APIError:
    if key is None:
        return APIError(401, "no API key: send the header 'Authorization: Bearer <key>'",
                        "missing_api_key")
    return APIError(401, "incorrect API key provided", "invalid_api_key")
