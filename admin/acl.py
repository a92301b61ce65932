"""Least-privilege Redis users for pagedq (Redis >= 7.0 ACL syntax): the roles, what each
may touch, and the ACL file (``pagedq acl``, admin/acl_cli.py; docs/security.md).

Where each part comes from, so that none can drift from the code it describes:
* key and channel patterns: wire/keys.py (``Keys`` of each tenant prefix, with ``*``
  for the variable parts);
* the commands the Lua scripts run: parsed from the scripts' text (wire/lua), per role
  from the scripts that role runs, as each script declares (``pagedq.wire.lua.SCRIPTS``):
  a script that starts using a new command gives its roles that command too;
* the commands the Python code sends itself: the lists below, next to the code they serve.

A tenant is one key prefix (``Settings.prefix``): every pattern of a tenant's users starts
with ``{prefix}:``, so a user of one tenant cannot name, read or write another tenant's
keys or channels. Prefixes use ``[A-Za-z0-9_.-]`` (wire/keys.py), none of which is a
glob character, and the closing ``}`` ends the prefix: ``{a}:*`` never matches ``{ab}:...``.
"""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from pagedq.wire import lua
from pagedq.wire.keys import Keys

ROLES = ("producer", "reader", "batch", "worker", "gateway", "scaler", "admin")
TENANT_ROLES = ("producer", "reader", "batch")  # one user per tenant; the others: one each

# Every role but admin. The connection handshake and keep-alive (AUTH, HELLO, PING, SELECT,
# CLIENT SETNAME/INFO, ...), without client-side caching: CLIENT TRACKING BCAST would tell
# a client the names of keys others write (job ids of the tenant). -@dangerous comes last
# in every user, so nothing below can grant KEYS, CONFIG, DEBUG, FLUSHALL, MONITOR, ...
CONNECTION = ("+@connection", "-client|tracking", "-client|caching")
# Running the scripts: FCALL (FCALL_RO for the read-only ones) of pagedq's function library
# (Redis >= 7, pagedq.wire.lua.library), never EVAL, EVALSHA or SCRIPT: with them a client
# runs any Lua it likes (a busy loop makes every other client wait: BUSY; the Lua heap is
# outside maxmemory). Every command a function runs is still checked against the caller's
# own rights (Redis runs it as the caller), so FCALL grants nothing the other rules do not.
SCRIPTING = ("fcall", "fcall_ro")
# The worker loads the library at start and when Redis lost it (worker/redis_faults.py).
LIBRARY_LOADING = ("function|load",)
# producer/reader.py: what status(), result(), stream() and subscribe() send (on a Redis
# Cluster SSUBSCRIBE). Only (S)SUBSCRIBE, never PSUBSCRIBE: a pattern subscription would
# receive every job's events.
READS = ("exists", "hgetall", "xread", "xrevrange", "subscribe", "unsubscribe", "ssubscribe",
         "sunsubscribe")
# worker/*.py outside the scripts: intake (XREADGROUP, XAUTOCLAIM, XPENDING, XINFO GROUPS,
# XGROUP CREATE, XACK + XDEL in MULTI, BLPOP of the wake lists, LLEN and EXISTS for
# --until-idle), release (XCLAIM), heartbeat (HSET, EXPIRE, ZADD, ZREMRANGEBYSCORE, SADD,
# ZREM, DEL), cancels (SMISMEMBER), sweep (SMEMBERS), metrics (XLEN, XPENDING, LLEN, and
# SMEMBERS + ZCOUNT of the models' serving sets), takeover replay (XRANGE).
WORKER_COMMANDS = ("xreadgroup", "xautoclaim", "xpending", "xinfo|groups", "xgroup|create",
                   "xack", "xdel", "xclaim", "xrange", "xlen", "hset", "expire", "zadd",
                   "zremrangebyscore", "zrem", "sadd", "smembers", "smismember", "del",
                   "blpop", "llen", "exists", "multi", "exec", "discard", "zcount")
# The batch control plane runs rq, whose commands change with its versions: data commands
# by category, minus what would list or wipe keys beyond its patterns (SCAN and RANDOMKEY
# ignore key patterns; FUNCTION FLUSH/LOAD change the server for everyone).
BATCH_RULES = ("+@read", "+@write", "+@transaction", "+subscribe", "+unsubscribe", "+publish",
               "+time", "-scan", "-randomkey", "-function")
RQ_PATTERN = "rq:*"  # rq's keys and its pub/sub channels (rq:pubsub:<worker>)

# gateway/*.py outside the scripts and the clients it drives: the uploaded files' records
# (HSET + ZADD in MULTI, HGETALL, ZREVRANGE, DEL + ZREM), a batch's OpenAI fields (HSET,
# HMGET), a stored response (HSET, HGETALL of its job's record), the models served and the
# 404/503 probe of a model (SMEMBERS of the models, ZRANGEBYSCORE of their serving sets:
# the batch rules' @read), logprobs and resumed streams (XRANGE on a job's events). Its own
# scripts (admit, settle) are parsed.
GATEWAY_COMMANDS = ("xrange", "exists", "hset", "hmget", "hgetall", "zadd", "zrevrange",
                    "zrem", "del", "multi", "exec", "discard")

# An autoscaler reading the queues' depth (KEDA's Redis Streams scaler: XLEN for the stream
# length, XINFO GROUPS for the group's lag, XPENDING for its pending entries; its Redis
# Lists scaler: LLEN of a lane's inbox, the jobs no worker has moved into the stream yet;
# deploy/k8s): read-only on the jobs streams and inboxes, and none of these returns an
# entry's body (the prompts).
SCALER_COMMANDS = ("xlen", "xinfo|groups", "xpending", "llen")

_CALL_RE = re.compile(r"""redis\.p?call\s*[(,]\s*'([A-Za-z]+)'(?:\s*,\s*'([A-Za-z]+)')?""")
_CONTAINERS = {"xgroup", "xinfo", "script", "client", "object", "memory", "config", "function"}
_ACCESS = {"RW": "~", "R": "%R~", "W": "%W~"}


def script_commands(text: str) -> set[str]:
    """The commands a Lua script's text runs (``redis.call('X', ...)``, ``redis.pcall``,
    ``pcall(redis.call, 'X', ...)``), as ACL names (``xgroup|create`` for a subcommand)."""
    out = set()
    for cmd, sub in _CALL_RE.findall(text):
        cmd = cmd.lower()
        out.add(f"{cmd}|{sub.lower()}" if cmd in _CONTAINERS and sub else cmd)
    return out


@functools.cache
def commands_of_scripts(names: tuple[str, ...]) -> tuple[str, ...]:
    found: set[str] = set()
    for name in names:  # as on a single Redis, and as on a cluster (SPUBLISH)
        text = lua.source(name)
        found |= script_commands(text) | script_commands(lua.sharded(text))
    return tuple(sorted(found))


def role_script_commands(role: str) -> tuple[str, ...]:
    """The commands of every script ``role`` runs (wire/lua's SCRIPTS declare who runs
    what)."""
    return commands_of_scripts(tuple(n for n, s in lua.SCRIPTS.items() if role in s.roles))


@dataclass(frozen=True, slots=True)
class KeyRule:
    """A key pattern of a tenant: the access each role has to it in its root rules (R
    read, W write, RW both: Redis 7's %R~, %W~, ~; "" none), and the roles whose scripts
    name it in KEYS (``scripted``: see ``script_selector``)."""

    pattern: str
    access: dict[str, str]
    scripted: frozenset[str] = frozenset()


_PB = frozenset({"producer", "batch"})


def tenant_key_rules(k: Keys) -> list[KeyRule]:
    """The keys of one tenant for the roles limited key by key (the worker gets the whole
    prefix). Comments say what needs the access."""
    a = "*"
    return [
        # SUBMIT appends a job to its lane's inbox, but nobody except workers may read the
        # inboxes (every producer's prompts are there) or take from them: no root access,
        # only the script selector's RPUSH. The jobs streams are the workers' alone.
        KeyRule(k.inbox(a, a), {"producer": "", "batch": ""}, _PB),
        KeyRule(k.wake(a), {"producer": "RW", "batch": "RW"}, _PB),  # SUBMIT rings it
        KeyRule(k.vocab, {"producer": "R", "batch": "R"}),  # the gateway's token id check
        # SUBMIT/CANCEL write the record, clients read it
        KeyRule(k.job(a), {"producer": "RW", "batch": "RW", "reader": "R"}, _PB),
        # SUBMIT clears, CANCEL writes the final event; clients read the events
        KeyRule(k.out(a), {"producer": "RW", "batch": "RW", "reader": "R"}, _PB),
        # CANCEL adds a running job's id (and removes a queued one's): never read
        KeyRule(k.cancel, {"producer": "W", "batch": "W"}, _PB),
        KeyRule(k.queued_tokens(a, a), {"producer": "RW", "batch": "RW"}, _PB),  # caps
        KeyRule(k.queued_jobs(a, a), {"producer": "RW", "batch": "RW"}, _PB),
        KeyRule(k.serving(a), {"producer": "R", "batch": "R"}, _PB),  # require_worker
        KeyRule(k.models, {"producer": "RW", "batch": "RW"}, _PB),  # SUBMIT adds, SERVED reads
        # CANCEL of a job of a bulk batch counts it on the batch's record (common.lua);
        # SUBMIT of such a job names them (the batch control plane's)
        KeyRule(k.batch(a), {"producer": "RW", "batch": "RW"}, frozenset({"batch"})),
        KeyRule(k.batch_done(a), {"producer": "W", "batch": "RW"}, frozenset({"batch"})),
        KeyRule(k.batches, {"batch": "RW"}),
    ]


def gateway_home_patterns(home: Keys) -> list[str]:
    """The gateway's own prefix (its ``--prefix``): the API keys read only (``pagedq
    gateway key add/revoke`` run as admin), the rate windows read and written (ADMIT,
    SETTLE)."""
    return [f"%R~{home.apikeys}", f"~{home.ratelimit('*', '*')}"]


def key_patterns(role: str, tenants: list[Keys], home: Keys | None = None) -> list[str]:
    """The root ``~``/``%R~``/``%W~`` rules of ``role`` over ``tenants`` (``home``: the
    gateway's own prefix)."""
    if role == "admin":
        return ["~*"]
    if role == "worker":
        return [f"~{k.base}:*" for k in tenants]
    if role == "scaler":
        return [f"%R~{p}" for k in tenants for p in (k.jobs("*", "*"), k.inbox("*", "*"))]
    if role == "gateway":  # the batch role's (it serves /v1/batches), the uploads' records
        rules = key_patterns("batch", tenants)
        rules += [f"~{p}" for k in tenants for p in (k.file("*"), k.files)]
        return rules + (gateway_home_patterns(home) if home else [])
    rules = [f"{_ACCESS[r.access[role]]}{r.pattern}" for k in tenants
             for r in tenant_key_rules(k) if r.access.get(role)]
    if role == "batch":
        rules.append(f"~{RQ_PATTERN}")
    return rules


# What the script selector allows besides running scripts: the commands the scripts run on
# keys that only the selector covers (SUBMIT's RPUSH on a lane's inbox: it cannot remove a
# job, trim the queue or read it, as XADD ... MAXLEN 0 or MINID on a jobs stream could).
SELECTOR_COMMANDS = ("rpush",)


def script_selector(role: str, tenants: list[Keys], home: Keys | None = None) -> list[str]:
    """Redis checks the KEYS of FCALL for read AND write access, and then each command a
    function runs on its own. A Redis 7 selector (a command is allowed when the root rules
    or one selector allow it with all its keys) gives the function calls every key their
    KEYS name, with no other command than running functions and SELECTOR_COMMANDS; so a key
    can be a function's KEYS while the root rules keep it write-only or out of reach (the
    inboxes: no LRANGE, no LPOP, no LTRIM, no DEL). The gateway runs the batch role's
    functions, and ADMIT on its read-only API keys hash (a selector of its own: no RPUSH)."""
    run = [f"+{c}" for c in SCRIPTING]
    if role == "gateway":
        own = ["(" + " ".join([f"~{home.apikeys}", *run]) + ")"] if home else []
        return script_selector("batch", tenants) + own
    keys = [f"~{r.pattern}" for k in tenants for r in tenant_key_rules(k)
            if role in r.scripted]
    if not keys:
        return []
    return ["(" + " ".join([*keys, *run, *(f"+{c}" for c in SELECTOR_COMMANDS)]) + ")"]


def channel_patterns(role: str, tenants: list[Keys]) -> list[str]:
    if role == "admin":
        return ["&*"]
    if role == "scaler":
        return []
    chans = [f"&{k.chan('*')}" for k in tenants]
    return chans + ([f"&{RQ_PATTERN}"] if role in ("batch", "gateway") else [])


def command_rules(role: str) -> list[str]:
    """The command rules of ``role``, ending with -@dangerous (but admin: +@all)."""
    if role == "admin":
        return ["+@all"]
    if role == "reader":
        cmds: tuple[str, ...] = READS
    elif role in ("producer", "batch"):
        cmds = (*SCRIPTING, *READS, *role_script_commands(role))
    elif role == "worker":
        cmds = (*SCRIPTING, *LIBRARY_LOADING, *WORKER_COMMANDS, *role_script_commands(role))
    elif role == "gateway":
        cmds = (*SCRIPTING, *READS, *GATEWAY_COMMANDS, *role_script_commands(role))
    elif role == "scaler":
        cmds = SCALER_COMMANDS
    else:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    rules = ["-@all", *CONNECTION, *(f"+{c}" for c in dict.fromkeys(cmds))]
    batch = role in ("batch", "gateway")  # the gateway enqueues batches' rq jobs
    return rules + (list(BATCH_RULES) if batch else []) + ["-@dangerous"]


def with_partitions(rules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """``rules`` (key or channel patterns, or a selector ``(...)``), each one that names a
    tenant's partition 0 ``{p}`` followed by the same for its other partitions, ``{p:p*}``
    (wire/keys.py): ``:`` is not in the prefix alphabet, so ``{p:p*`` matches no other
    tenant's keys (``{a:p*}`` never matches ``{ab}``, ``{ab:p1}`` or ``{a.p1}``)."""
    out: list[str] = []
    for rule in rules:
        if rule.startswith("(") and rule.endswith(")"):
            out.append("(" + " ".join(with_partitions(rule[1:-1].split(), prefixes)) + ")")
            continue
        out.append(rule)
        out += [rule.replace("{" + p + "}", "{" + p + ":p*}") for p in prefixes
                if "{" + p + "}" in rule]
    return out


@dataclass(frozen=True, slots=True)
class User:
    name: str
    role: str
    tenants: tuple[str, ...]  # prefixes; every prefix for admin
    home: str | None = None  # the gateway's own prefix (API keys, rate windows)
    partitioned: bool = False  # PAGEDQ_PARTITIONS > 1: every partition of each tenant

    def rules(self, password_sha256: str) -> str:
        """The user's ACL file line. ``resetkeys``/``resetchannels`` first, so the line
        states every right the user has, whatever the server's defaults."""
        ks = [Keys(p) for p in self.tenants]
        home = Keys(self.home) if self.home else None
        keys = [*key_patterns(self.role, ks, home), *channel_patterns(self.role, ks)]
        selector = script_selector(self.role, ks, home)
        if self.partitioned:
            keys, selector = (with_partitions(keys, self.tenants),
                              with_partitions(selector, self.tenants))
        parts = ["user", self.name, "on", f"#{password_sha256}", "resetkeys", "resetchannels",
                 *keys, *command_rules(self.role), *selector]
        return " ".join(parts)


def users(tenants: list[str], worker_prefixes: list[str] | None = None,
          roles: tuple[str, ...] = ROLES, gateway_prefixes: list[str] | None = None,
          gateway_home: str | None = None, partitions: int = 1) -> list[User]:
    """One producer, reader and batch user per tenant (``<role>-<prefix>``), one ``worker``
    user serving ``worker_prefixes`` (default: every tenant), one ``gateway`` serving
    ``gateway_prefixes`` (default: every tenant) with its API keys under ``gateway_home``
    (its --prefix; default: the first tenant), one ``scaler`` reading the depth of the
    worker's queues (an autoscaler: KEDA), one ``admin``. ``partitions`` > 1: the
    patterns cover every partition of each tenant (``with_partitions``)."""
    gateway_home = gateway_home or tenants[0]
    for p in [*tenants, *(worker_prefixes or []), *(gateway_prefixes or []), gateway_home]:
        Keys(p)  # ValueError on a prefix outside the key alphabet
    if len(set(tenants)) != len(tenants):
        raise ValueError(f"a tenant is named twice: {','.join(tenants)}")
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ValueError(f"unknown role {bad[0]!r}: use {', '.join(ROLES)}")
    many = partitions > 1
    out = [User(f"{role}-{p}", role, (p,), partitioned=many) for role in TENANT_ROLES
           if role in roles for p in tenants]
    if "worker" in roles:
        out.append(User("worker", "worker", tuple(worker_prefixes or tenants), partitioned=many))
    if "gateway" in roles:
        out.append(User("gateway", "gateway", tuple(gateway_prefixes or tenants), gateway_home,
                        partitioned=many))
    if "scaler" in roles:  # the worker's queues
        out.append(User("scaler", "scaler", tuple(worker_prefixes or tenants), partitioned=many))
    if "admin" in roles:
        out.append(User("admin", "admin", tuple(tenants)))
    return out


def password_hash(password: str) -> str:
    """What the ACL file stores instead of the password (``#<sha256 hex>``)."""
    return hashlib.sha256(password.encode()).hexdigest()


# the default user takes every connection that has not authenticated: it must not be able
# to do anything (off: AUTH is required; "ping": anyone may PING, for health checks)
DEFAULT_USER = {"off": "user default off resetpass resetkeys resetchannels -@all",
                "ping": "user default on nopass resetkeys resetchannels -@all +ping"}


def acl_file(passwords: dict[str, str], user_list: list[User], default_user: str = "off") -> str:
    """The ACL file's text: the default user, then one line per user. Redis's ACL file
    has no comments; docs/security.md explains each line."""
    lines = [DEFAULT_USER[default_user]]
    lines += [u.rules(password_hash(passwords[u.name])) for u in user_list]
    return "\n".join(lines) + "\n"
