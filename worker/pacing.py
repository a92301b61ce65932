"""Step pacing: short engine steps on slow devices, a watchdog sized from real steps.

A worker refreshes its leases and heartbeat between engine steps. On a slow device (a
CPU) one step of a long prefill can take longer than a lease, so the pacer lowers the
engine's per-step token budget until a step takes about ``max_step_s``: a long prompt is
prefilled in more, shorter chunks. On a GPU steps are milliseconds and the budget stays
at max_num_batched_tokens.

The cost per token is a decaying maximum over recent steps: it rises at once after a slow
step (the next chunk is smaller straight away) and falls back slowly, since the cost of a
prefill token grows with the context already computed.
"""
from __future__ import annotations

DECAY = 0.95  # per step: how fast the remembered cost per token falls back


class StepPacer:
    def __init__(self, engine, max_step_s: float, watchdog_floor_s: float) -> None:
        self.engine = engine
        self.max_step_s = max_step_s
        self.watchdog_floor_s = watchdog_floor_s
        self.cost_per_token: float | None = None  # seconds
        self.step_s = 0.0  # decaying maximum of step seconds
        cfg = engine.config
        self._max_budget = cfg.max_num_batched_tokens
        self._min_budget = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        # without chunked prefill a prompt must fit one step: the budget cannot shrink
        self._enabled = max_step_s > 0 and cfg.enable_chunked_prefill

    def after_step(self, seconds: float, tokens: int) -> None:
        self.step_s = max(seconds, self.step_s * DECAY)
        if tokens <= 0 or not self._enabled:
            return
        cost = seconds / tokens
        prev = self.cost_per_token
        self.cost_per_token = cost if prev is None else max(cost, prev * DECAY)
        budget = int(self.max_step_s / self.cost_per_token)
        self.engine.set_step_budget(max(self._min_budget, min(self._max_budget, budget)))

    def prefill_estimate_s(self, tokens: int) -> float | None:
        """Rough seconds to prefill ``tokens`` here (None until a step was measured)."""
        return None if self.cost_per_token is None else tokens * self.cost_per_token

    def watchdog_limit_s(self) -> float:
        """A step this long is wedged: the configured floor, or 20x the slow steps seen."""
        return max(self.watchdog_floor_s, 20.0 * self.step_s)
