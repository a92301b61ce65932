"""API keys: each maps to a tenant (a pagedq key prefix) and its rate limits.

A key is ``pq-`` + 43 random URL-safe characters, shown once when made. Only its SHA-256
(hex) is stored: in the Redis hash ``{P}:apikeys`` (P = the gateway's admin prefix,
PAGEDQ_PREFIX; field = the hash, value = the record as JSON), or in a JSON-lines file
(PAGEDQ_GATEWAY_KEYS_FILE; read at start). A key's *id* is the first 12 hex digits of its
hash: what ``key list`` shows, what ``key revoke`` takes and what the logs name. No key is
ever logged or stored in clear.

Rate limits are fixed one-minute windows counted in Redis, so every gateway process shares
them: ``{P}:ratelimit:<hash>:<minute>`` (a hash of ``r`` requests and ``t`` tokens, kept
two minutes). ADMIT (wire/lua/admit.lua) looks the key up and charges one request and the request's
estimated tokens (prompt characters / 4 + max_tokens x n) in one atomic step; a request
past either cap is refused with the seconds until the window ends. A single request above
``tpm`` is admitted into an empty window (otherwise it never could be). Once a job ends,
the gateway corrects the window's tokens by (actual usage - estimate) (SETTLE).
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedq.wire.keys import Keys, check_name

KEY_PREFIX = "pq-"
ID_LEN = 12  # hex digits of the hash that name a key

def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def apikeys_key(prefix: str) -> str:
    return Keys(prefix).apikeys


@dataclass(frozen=True, slots=True)
class KeyRecord:
    tenant: str  # the pagedq key prefix this key's requests use
    rpm: int = 0  # requests per minute, 0 = unlimited
    tpm: int = 0  # tokens per minute (estimated at admission, corrected at the end)
    name: str = ""
    created: float = 0.0

    def __post_init__(self) -> None:
        check_name("tenant", self.tenant)
        if not (isinstance(self.rpm, int) and isinstance(self.tpm, int)
                and self.rpm >= 0 and self.tpm >= 0):
            raise ValueError("rpm and tpm must be integers >= 0")
        if len(self.name) > 128:
            raise ValueError("a key's name is at most 128 characters")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_obj(cls, d: dict[str, Any]) -> KeyRecord:
        return cls(tenant=d["tenant"], rpm=int(d.get("rpm") or 0), tpm=int(d.get("tpm") or 0),
                   name=str(d.get("name") or ""), created=float(d.get("created") or 0))


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request let in: its tenant, the key's id (None without a key) and its window."""

    tenant: str
    key_id: str | None = None
    window: str | None = None


# ---- the file store

def load_file(path: str | Path) -> dict[str, KeyRecord]:
    """hash -> record of a keys file; ValueError (with the line) for a bad line."""
    out: dict[str, KeyRecord] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                d = json.loads(line)
                sha = d["sha256"]
                if not (isinstance(sha, str) and len(sha) == 64
                        and all(c in "0123456789abcdef" for c in sha)):
                    raise ValueError("sha256 must be 64 lowercase hex digits")
                out[sha] = KeyRecord.from_obj(d)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} line {n}: {e}") from None
    return out


def file_line(sha: str, rec: KeyRecord) -> str:
    return json.dumps({"sha256": sha, **asdict(rec)}, separators=(",", ":"))


# ---- admin operations (pagedq gateway key ...), on a sync redis client or a file

def add(rec: KeyRecord, *, r: Any = None, admin_prefix: str = "pagedq",
        keys_file: str | None = None) -> tuple[str, str]:
    """Make a key for ``rec``; returns (the key, its id). The key is not kept anywhere."""
    key = new_key()
    sha = hash_key(key)
    rec = KeyRecord(rec.tenant, rec.rpm, rec.tpm, rec.name, rec.created or time.time())
    if keys_file:
        with open(keys_file, "a", encoding="utf-8") as f:
            f.write(file_line(sha, rec) + "\n")
    else:
        r.hset(apikeys_key(admin_prefix), sha, rec.to_json())
    return key, sha[:ID_LEN]


def records(*, r: Any = None, admin_prefix: str = "pagedq",
            keys_file: str | None = None) -> dict[str, KeyRecord]:
    if keys_file:
        return load_file(keys_file) if Path(keys_file).exists() else {}
    return {sha: KeyRecord.from_obj(json.loads(v))
            for sha, v in r.hgetall(apikeys_key(admin_prefix)).items()}


def revoke(which: str, *, r: Any = None, admin_prefix: str = "pagedq",
           keys_file: str | None = None) -> list[str]:
    """Remove the keys whose id starts with ``which`` (at least 8 hex digits) or whose name
    is ``which``; returns their ids (empty: none matched)."""
    found = [sha for sha, rec in records(r=r, admin_prefix=admin_prefix,
                                         keys_file=keys_file).items()
             if rec.name == which or (len(which) >= 8 and sha.startswith(which))]
    if not found:
        return []
    if keys_file:
        kept = [ln for ln in Path(keys_file).read_text(encoding="utf-8").splitlines(True)
                if not any(f'"sha256":"{sha}"' in ln.replace(" ", "") for sha in found)]
        tmp = Path(keys_file + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(keys_file)
    else:
        r.hdel(apikeys_key(admin_prefix), *found)
    return [sha[:ID_LEN] for sha in found]
