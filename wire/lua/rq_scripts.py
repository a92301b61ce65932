"""rq's own Lua (its scheduler's locks, unique and rate-limited enqueues), as a second
function library of pagedq's, ``pagedq_rq`` (Redis >= 7).

The bulk-batch control plane runs rq (batch/), and rq runs a few Lua scripts of its own
through redis-py's ``register_script`` (EVALSHA, and SCRIPT LOAD after NOSCRIPT). The
batch and gateway users may not run EVAL, EVALSHA or SCRIPT (docs/security.md): with them a
client runs any Lua. So each of rq's scripts of the installed rq (its module constants named
``*_SCRIPT``) becomes a function ``pagedq_rq_<digest of its text>`` of this library, loaded
with pagedq's own library (by a worker at start, or ``pagedq functions load``), and the
control plane's rq connection runs it by FCALL instead (batch/rq_redis.py). Every process
of a deployment must run the same rq version: a script text that is not in the loaded
library is not found (the error says so). Without rq installed the library is empty: None.
"""
from __future__ import annotations

import functools
import hashlib
import importlib

LIBRARY_NAME = "pagedq_rq"
VERSION_FUNCTION = "pagedq_rq_version"
_MODULES = ("rq.scripts", "rq.scheduler", "rq.rate_limit", "rq.queue", "rq.registry")


def function_name(text: str | bytes) -> str:
    """The function that runs rq's script ``text``."""
    raw = text if isinstance(text, bytes) else text.encode()
    return f"pagedq_rq_{hashlib.sha1(raw).hexdigest()[:16]}"


@functools.cache
def texts() -> dict[str, str]:
    """function name -> script text, for every Lua script constant of the installed rq."""
    out: dict[str, str] = {}
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr, value in vars(module).items():
            if attr.endswith("_SCRIPT") and isinstance(value, str | bytes):
                text = value.decode() if isinstance(value, bytes) else value
                out[function_name(text)] = text
    return dict(sorted(out.items()))


@functools.cache
def library() -> str | None:
    """The library's text (FUNCTION LOAD [REPLACE] it), None without rq."""
    if not texts():
        return None
    parts = [f"#!lua name={LIBRARY_NAME}",
             "-- rq's Lua scripts as functions, made by pagedq.wire.lua.rq_scripts.library()"]
    for i, (name, text) in enumerate(texts().items()):
        parts.append(f"local function f{i}(KEYS, ARGV)\n{text}\nend")
        parts.append(f"redis.register_function{{function_name = '{name}', callback = f{i}}}")
    body = "\n".join(parts)
    v = hashlib.sha1(body.encode()).hexdigest()[:16]
    return (f"{body}\nredis.register_function{{function_name = '{VERSION_FUNCTION}', "
            f"callback = function() return '{v}' end, flags = {{'no-writes'}}}}\n")


def version() -> str | None:
    lib = library()
    return None if lib is None else lib.rsplit("return '", 1)[1].split("'", 1)[0]
