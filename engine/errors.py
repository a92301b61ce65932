"""The engine's own error types that callers catch (no torch: ``pagedq.EngineClosed`` is
importable without it)."""
from __future__ import annotations


class EngineClosed(RuntimeError):
    """A call on an LLMEngine after ``close()`` (or after the ``with`` block that built it);
    ``call`` names the method."""

    def __init__(self, call: str) -> None:
        super().__init__(f"LLMEngine.{call}(): the engine is closed (close() released its "
                         f"model and KV cache); build a new LLMEngine")
        self.call = call

    def __reduce__(self):
        return type(self), (self.call,)
