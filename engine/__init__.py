"""The inference engine. Never imports redis (a test asserts it).

``from pagedq.engine import LLMEngine, SamplingParams, EngineClosed, GuidedSpec`` is the
public API; it imports torch lazily so that ``import pagedq.engine.sampling_params``
stays light (``GuidedSpec`` and ``validate_guided`` import no torch either).
"""
from pagedq.engine.errors import EngineClosed
from pagedq.engine.sampling_params import SamplingParams
from pagedq.wire.guided import GuidedSpec, validate_guided

__all__ = ["EngineClosed", "GuidedSpec", "LLMEngine", "SamplingParams", "validate_guided"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from pagedq.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
