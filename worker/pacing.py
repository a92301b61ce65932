"""Step pacing: short engine steps on slow devices, a watchdog sized from real steps.

A worker refreshes its leases and heartbeat between engine steps (and, during a long
step, from its watchdog). On a slow device (a CPU) one step of a long prefill can take
many seconds, so the pacer lowers the engine's per-step token budget as soon as a step
takes longer than ``max_step_s``, to what fits in that time at the cost per token just
seen: a long prompt is then prefilled in more, shorter chunks. The budget doubles back
after each step that used all of it in under half that time, so a GPU (steps of
milliseconds) runs at max_num_batched_tokens after a slow first step (compilation) within
a few steps.

The cost per token used for prefill estimates is a moving average over recent steps; a
job is only refused on it once a few steps were measured.
"""
from __future__ import annotations

ALPHA = 0.2  # weight of the newest step in the moving average of the cost per token
DECAY = 0.95  # per step: how fast the remembered slowest step falls back
MIN_STEPS_FOR_ESTIMATE = 8


class StepPacer:
    def __init__(self, engine, max_step_s: float, watchdog_floor_s: float) -> None:
        self.engine = engine
        self.max_step_s = max_step_s
        self.watchdog_floor_s = watchdog_floor_s
        self.cost_per_token: float | None = None  # seconds, moving average
        self.step_s = 0.0  # decaying maximum of step seconds
        self.steps = 0
        cfg = engine.config
        self._max_budget = cfg.max_num_batched_tokens
        self._min_budget = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.budget = self._max_budget
        # without chunked prefill a prompt must fit one step: the budget cannot shrink
        self._enabled = max_step_s > 0 and cfg.enable_chunked_prefill

    def after_step(self, seconds: float, tokens: int) -> None:
        self.step_s = max(seconds, self.step_s * DECAY)
        if tokens <= 0:
            return
        self.steps += 1
        cost = seconds / tokens
        prev = self.cost_per_token
        self.cost_per_token = cost if prev is None else prev + ALPHA * (cost - prev)
        if not self._enabled:
            return
        if seconds > self.max_step_s:
            budget = int(self.max_step_s / cost)
        elif tokens >= self.budget and seconds < self.max_step_s / 2:
            budget = self.budget * 2
        else:
            return
        budget = max(self._min_budget, min(self._max_budget, budget))
        if budget != self.budget:
            self.budget = self.engine.set_step_budget(budget)

    def prefill_estimate_s(self, tokens: int) -> float | None:
        """Rough seconds to prefill ``tokens`` here (None until enough steps were seen)."""
        if self.cost_per_token is None or self.steps < MIN_STEPS_FOR_ESTIMATE:
            return None
        return tokens * self.cost_per_token

    def watchdog_limit_s(self) -> float:
        """A step this long is wedged: the configured floor, or 20x the slow steps seen."""
        return max(self.watchdog_floor_s, 20.0 * self.step_s)
