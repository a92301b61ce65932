"""Per-request sampling parameters, ``SamplingParams`` (validated on construction). They are
declared once in wire/sampling.py, where the wire's job requests take the same fields with
the same ranges."""
from pagedq.wire.sampling import SamplingParams, sample_seed

__all__ = ["SamplingParams", "sample_seed"]
