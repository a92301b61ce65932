"""What the scheduler hands the model runner for one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedq.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    """One engine step.

    For each ``seqs[i]`` the runner computes ``token_ids[c : c + num_new_tokens[i]]`` where
    ``c = seqs[i].num_computed_tokens`` (not yet advanced), writing their K/V at the slots
    given by ``seqs[i].block_table`` (already allocated to cover ``c + num_new_tokens[i]``).
    ``seqs[i]`` samples a token after this step iff ``c + num_new_tokens[i] == num_tokens``.
    Within one forward pass, every layer writes the K/V of ALL batch tokens before any
    attention reads: a sequence may read blocks another sequence fills in the same step
    (two prompts sharing a prefix scheduled together).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # rows (indices into the step's tokens) whose logits score prompt tokens, after the
    # sampling rows (engine/prompt_logprobs.py; set by the pipeline before the step runs)
    score_rows: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        s = self.seqs[i]
        return s.num_computed_tokens + self.num_new_tokens[i] == s.num_tokens

    @property
    def is_empty(self) -> bool:
        return not self.seqs
