"""The inference engine. Never imports redis (a test asserts it).

``from pagedq.engine import LLMEngine, SamplingParams, EngineClosed`` is the public API; it
imports torch lazily so that ``import pagedq.engine.sampling_params`` stays light.
"""
from pagedq.engine.errors import EngineClosed
from pagedq.engine.sampling_params import SamplingParams

__all__ = ["EngineClosed", "LLMEngine", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from pagedq.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
