"""The inference engine. Never imports redis (a test asserts it).

``from engine import LLMEngine, SamplingParams`` is the public API; it imports torch
lazily so that ``import pagedq.engine.sampling_params`` stays light.
"""
from pagedq.engine.sampling_params import SamplingParams

__all__ = ["LLMEngine", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from pagedq.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
