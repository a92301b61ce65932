"""Every server-side script of pagedq, one ``.lua`` file each, declared here, and their one
loader.

``source(name)`` is the exact text to EVAL or SCRIPT LOAD: the script's prelude followed
by ``<name>.lua``. The job scripts' prelude is ``common.lua`` (the rules they share: event
ids, the final event, leaving the queue, the terminal statuses); its terminal set is
generated from ``pagedq.wire.schema.TERMINAL``, so the scripts never restate it. The batch
record's scripts have ``now.lua`` (Redis's clock); the gateway's need none. Producers in
other languages load the same text (docs/protocol.md); each file's header gives its KEYS,
ARGV and reply. The calls of each script (its arguments as a dataclass, its reply parsed)
are in pagedq.wire.scripts, worker_scripts, batch_scripts and gateway_scripts; they run
through pagedq.wire.script.

``SCRIPTS`` declares, for each, the roles whose Redis users run it: the ACL file gives a
role the commands of its scripts (pagedq/admin/acl.py parses them from the text), so a
script that starts using a new command gives its role that command too.

Key names come from KEYS, built by wire/keys.py, except where a script discovers job ids
or models inside Redis (expire_unserved, served, queue_snapshot), reads a job's model
(cancel) or names a rate window (admit): there it appends them to the key base it is given
in ARGV. Those keys share the base's hash tag, so they are in the declared keys' Redis
Cluster slot.

On a Redis Cluster the scripts run as ``sharded(source(name))``: the pub/sub mirror goes
out with SPUBLISH (sharded pub/sub, Redis 7), which reaches the subscribers of the
channel's shard only. PUBLISH there is sent to every node over the cluster bus, a cost
that grows with the node count and took most of a 3-master cluster's scale-out. A
channel shares its job's hash tag, so it is in the slot of the keys its script declares.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources

from ..schema import TERMINAL

_CLIENTS = frozenset({"producer", "batch", "gateway"})  # the roles that submit and cancel
_BATCH = frozenset({"batch", "gateway"})  # the batch control plane (the gateway: /v1/batches)


@dataclass(frozen=True, slots=True)
class Script:
    """A script's declaration: its file ``<name>.lua``, the prelude put in front of it
    (None: none), the ACL roles whose users run it."""

    name: str
    roles: frozenset[str]
    prelude: str | None = "common"


SCRIPTS: dict[str, Script] = {s.name: s for s in (
    Script("submit", _CLIENTS),
    Script("cancel", _CLIENTS),
    Script("served", _CLIENTS),
    Script("queue_snapshot", frozenset()),  # invariants.py's check: tests and admins
    Script("start", frozenset({"worker"})),
    Script("publish", frozenset({"worker"})),
    Script("finish", frozenset({"worker"})),
    Script("reject", frozenset({"worker"})),
    Script("refresh", frozenset({"worker"})),
    Script("expire_unserved", frozenset({"worker"})),
    Script("batch_create", _BATCH, "now"),
    Script("batch_lease", _BATCH, "now"),
    Script("batch_release", _BATCH, None),
    Script("batch_commit", _BATCH, None),
    Script("batch_transition", _BATCH, "now"),
    Script("batch_clock", _BATCH, "now"),
    Script("batch_rearm", _BATCH, "now"),
    Script("admit", frozenset({"gateway"}), None),
    Script("settle", frozenset({"gateway"}), None),
)}
NAMES = tuple(SCRIPTS)
_TERMINAL_LINE = "local TERMINAL = {} --@terminal"


def _read(filename: str) -> str:
    return resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")


def _prelude(name: str) -> str:
    text = _read(f"{name}.lua")
    if name == "common":
        if _TERMINAL_LINE not in text:
            raise RuntimeError("common.lua lost its TERMINAL line")
        table = "{" + ", ".join(f"{s.value} = true" for s in sorted(TERMINAL)) + "}"
        text = text.replace(_TERMINAL_LINE, f"local TERMINAL = {table}")
    return text


@functools.cache
def source(name: str) -> str:
    """The full text of script ``name`` (its prelude + the script)."""
    script = SCRIPTS.get(name)
    if script is None:
        raise ValueError(f"unknown script {name!r}; one of {', '.join(NAMES)}")
    own = _read(f"{name}.lua")
    return own if script.prelude is None else _prelude(script.prelude) + "\n" + own


_PUBLISH, _SPUBLISH = "redis.call('PUBLISH', ", "redis.call('SPUBLISH', "


def sharded(text: str) -> str:
    """A script's text for a Redis Cluster: its PUBLISH calls made SPUBLISH."""
    return text.replace(_PUBLISH, _SPUBLISH)


@functools.cache
def text(name: str, cluster: bool = False) -> str:
    """What runs: ``source(name)``, sharded on a cluster."""
    return sharded(source(name)) if cluster else source(name)


@functools.cache
def sha(name: str, cluster: bool = False) -> str:
    """SHA1 of ``text(name, cluster)``: the id for EVALSHA."""
    return hashlib.sha1(text(name, cluster).encode()).hexdigest()
