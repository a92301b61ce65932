"""Per-request sampling parameters, ``SamplingParams`` (validated on construction). They are
declared once in wire/sampling.py, where the wire's job requests take the same fields with
the same ranges."""
from pagedq.wire.sampling import SamplingParams, fan_out, sample_seed, split_sample_id

__all__ = ["SamplingParams", "fan_out", "sample_seed", "split_sample_id"]
