"""Every Lua script of the wire protocol, one ``.lua`` file each, and their one loader.

``source(name)`` is the exact text to EVAL or SCRIPT LOAD: ``common.lua`` (the rules every
script shares: event ids, the final event, leaving the queue, the terminal statuses)
followed by ``<name>.lua``. The terminal set is generated from ``pagedq.wire.schema.TERMINAL``,
so the scripts never restate it. Producers in other languages load the same text
(docs/protocol.md); each file's header gives its KEYS, ARGV and reply.

Key names come from KEYS, built by wire/keys.py, except where a script discovers job
ids or models inside Redis (expire_unserved, served, queue_snapshot) or reads a job's
model (cancel): there it appends them to the key base it is given in ARGV. Those keys
share the base's hash tag, so they are in the declared keys' Redis Cluster slot.

Producer scripts: submit, cancel, served, queue_snapshot. Worker scripts: start, publish,
finish, reject, refresh, expire_unserved. The gateway's: admit and settle, which need no
prelude (``plain``).

On a Redis Cluster the scripts run as ``sharded(source(name))``: the pub/sub mirror goes
out with SPUBLISH (sharded pub/sub, Redis 7), which reaches the subscribers of the
channel's shard only. PUBLISH there is sent to every node over the cluster bus, a cost
that grows with the node count and took most of a 3-master cluster's scale-out. A
channel shares its job's hash tag, so it is in the slot of the keys its script declares.
"""
from __future__ import annotations

import functools
import hashlib
from importlib import resources

from pagedq.wire.schema import TERMINAL

NAMES = ("submit", "cancel", "served", "queue_snapshot",
         "start", "publish", "finish", "reject", "refresh", "expire_unserved")
_TERMINAL_LINE = "local TERMINAL = {} --@terminal"


def _read(filename: str) -> str:
    return resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")


PLAIN = ("admit", "settle")


@functools.cache
def plain(name: str) -> str:
    """The text of a script that runs without the common prelude."""
    if name not in PLAIN:
        raise ValueError(f"unknown script {name!r}; one of {', '.join(PLAIN)}")
    return _read(f"{name}.lua")


@functools.cache
def source(name: str) -> str:
    """The full text of script ``name`` (common prelude + the script)."""
    if name not in NAMES:
        raise ValueError(f"unknown script {name!r}; one of {', '.join(NAMES)}")
    common = _read("common.lua")
    if _TERMINAL_LINE not in common:
        raise RuntimeError("common.lua lost its TERMINAL line")
    table = "{" + ", ".join(f"{s.value} = true" for s in sorted(TERMINAL)) + "}"
    common = common.replace(_TERMINAL_LINE, f"local TERMINAL = {table}")
    return common + "\n" + _read(f"{name}.lua")


_PUBLISH, _SPUBLISH = "redis.call('PUBLISH', ", "redis.call('SPUBLISH', "


def sharded(text: str) -> str:
    """A script's text for a Redis Cluster: its PUBLISH calls made SPUBLISH."""
    return text.replace(_PUBLISH, _SPUBLISH)


def sha(name: str) -> str:
    """SHA1 of ``source(name)``: the id for EVALSHA."""
    return hashlib.sha1(source(name).encode()).hexdigest()
