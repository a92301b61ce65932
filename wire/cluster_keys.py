"""Keys of the commands whose keys move, found locally for redis-py's cluster clients.

redis-py routes a cluster command by its keys. For commands flagged ``movablekeys`` it
asks a server with ``COMMAND GETKEYS`` before the call, and always the same server (the
client's default node). Ours are on the token path: every reader's XREAD, every worker's
XREADGROUP, and in a cluster pipeline every script call (EVALSHA: redis-py 8's pipeline
looks up each command's keys this way). In bench/redis_cost.py that was 0.6 extra round
trips per token event, all to one master, which ran at 0.99 busy while the other two ran
at 0.61.

``install(r)`` makes ``r`` find those keys itself; every other command goes to redis-py's
own lookup, unchanged. An argument list not of a shape listed here also goes there, so a
shape missed here costs at most the round trip it would have cost anyway.
"""
from __future__ import annotations

from typing import Any

from redis._parsers.commands import AsyncCommandsParser, CommandsParser

_SCRIPTS = ("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO")


def _word(arg: Any) -> str:
    if isinstance(arg, bytes | bytearray | memoryview):
        return bytes(arg).decode("latin-1").upper()
    return str(arg).upper()


def _stream_keys(args: tuple[Any, ...]) -> list[Any] | None:
    i = 1
    if _word(args[0]) == "XREADGROUP":
        if len(args) < 4 or _word(args[1]) != "GROUP":
            return None
        i = 4  # past GROUP <group> <consumer>: either may be spelled STREAMS
    while i < len(args):
        word = _word(args[i])
        if word == "STREAMS":
            rest = args[i + 1:]
            if not rest or len(rest) % 2:
                return None
            return list(rest[:len(rest) // 2])
        if word in ("COUNT", "BLOCK"):
            i += 2
        elif word == "NOACK":
            i += 1
        else:
            return None
    return None


def _script_keys(args: tuple[Any, ...]) -> list[Any] | None:
    try:
        n = int(args[2])
    except (IndexError, ValueError, TypeError):
        return None
    if n <= 0 or len(args) < 3 + n:
        return None  # no keys: redis-py picks a node itself
    return list(args[3:3 + n])


def moving_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of ``XREAD [COUNT n] [BLOCK ms] STREAMS k.. id..``, ``XREADGROUP GROUP g c
    [COUNT n] [BLOCK ms] [NOACK] STREAMS k.. id..`` and ``EVAL[SHA][_RO] / FCALL[_RO] x
    numkeys k.. arg..`` (``args[0]`` the command name); None for any other command or
    shape."""
    if len(args) < 2:
        return None
    name = _word(args[0])
    if name in ("XREAD", "XREADGROUP"):
        return _stream_keys(args)
    if name in _SCRIPTS:
        return _script_keys(args)
    return None


class _SyncParser(CommandsParser):
    def get_keys(self, redis_conn, *args):
        keys = moving_keys(args)
        return keys if keys is not None else super().get_keys(redis_conn, *args)


class _AsyncParser(AsyncCommandsParser):
    __slots__ = ()

    async def get_keys(self, *args: Any):
        keys = moving_keys(args)
        return keys if keys is not None else await super().get_keys(*args)


def install(r: Any) -> Any:
    """Give cluster client ``r`` (sync or asyncio) the local lookup; returns ``r``. The
    parser object and its state stay: only its class changes, to a subclass that adds no
    state."""
    parser = r.commands_parser
    if isinstance(parser, AsyncCommandsParser):
        parser.__class__ = _AsyncParser
    elif isinstance(parser, CommandsParser):
        parser.__class__ = _SyncParser
    return r
