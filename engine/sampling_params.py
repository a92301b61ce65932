"""Per-request sampling parameters (validated on construction)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedq.engine.guided_spec import GuidedSpec

LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's range)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token
    n: int = 1
    # guided decoding: the output must match this spec (engine/guided_spec.py); it is
    # compiled at add_request (a spec that cannot compile is a ValueError there)
    guided: GuidedSpec | None = None
    # token id -> added to its logit before sampling (after penalties, before the
    # min_tokens and guided masks); ids are checked against the vocabulary at add_request
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1 (off) or >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.n >= 1, "n must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (self.seed is None or self.seed >= 0, "seed must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            raise ValueError("guided must be a GuidedSpec (engine/guided_spec.py)")
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a dict of token id -> bias")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0 (got {tok!r})")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be numbers in "
                                 f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] (got {bias!r} "
                                 f"for token {tok})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
