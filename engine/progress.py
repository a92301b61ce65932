"""Stages of building an engine, told to whoever asked (the worker prints them, the demo
shows them): reading the model files, dequantizing a GGUF file, loading the weights,
sizing the KV cache, capturing CUDA graphs. Building an engine takes seconds to minutes;
without this it is silent.

The listener is context-local (a ContextVar), so the engine's constructors keep their
signatures and a thread that did not ask hears nothing. A listener must not raise.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

Listener = Callable[[str], None]

_listener: ContextVar[Listener | None] = ContextVar("pagedq_engine_progress", default=None)


def stage(text: str) -> None:
    """Announce the stage that starts now (a short phrase: "loading weights to cpu")."""
    fn = _listener.get()
    if fn is not None:
        fn(text)


@contextlib.contextmanager
def reporting(listener: Listener) -> Iterator[None]:
    """Within the block, ``stage(text)`` calls ``listener(text)``."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)
