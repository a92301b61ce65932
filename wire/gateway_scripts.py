"""The gateway's scripts (wire/lua/admit.lua, settle.lua: KEYS, ARGV and replies in each
file's header) as calls, for gateway/auth.py: an API key's admission against its rate
windows, and the window's correction once the request's job ended (gateway/apikeys.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .script import ScriptCall


@dataclass(frozen=True, slots=True)
class AdmitVerdict:
    """ADMIT's verdict: ``kind`` open (no key needed: auto and none exists) | unknown |
    limited (``what`` requests|tokens, ``retry_s``, ``cap``) | ok (``record`` JSON, the
    rate ``window`` key it was charged to)."""

    kind: str
    record: str = ""
    window: str = ""
    what: str = ""
    retry_s: int = 0
    cap: str = ""


@dataclass(frozen=True, slots=True)
class Admit(ScriptCall):
    """Look the key (its SHA-256 ``key_hash``) up in ``apikeys`` (or take ``record``, the
    key's JSON when the store is a file) and charge its window one request and
    ``est_tokens``. ``base``: the key base '{P}' the window key is built on."""

    SCRIPT = "admit"
    apikeys: str
    key_hash: str
    est_tokens: int
    mode: str
    base: str
    record: str = ""

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return [self.apikeys], [self.key_hash, max(0, self.est_tokens), self.mode, self.base,
                                self.record]

    def parse(self, reply: Any) -> AdmitVerdict:
        kind = reply[0]
        if kind == "limited":
            return AdmitVerdict(kind, what=reply[1], retry_s=int(reply[2]), cap=reply[3])
        if kind == "ok":
            return AdmitVerdict(kind, record=reply[1], window=reply[2])
        return AdmitVerdict(kind)


@dataclass(frozen=True, slots=True)
class Settle(ScriptCall):
    """Add ``tokens`` (negative: give back) to the rate ``window`` ADMIT charged."""

    SCRIPT = "settle"
    window: str
    tokens: int

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return [self.window], [self.tokens]
