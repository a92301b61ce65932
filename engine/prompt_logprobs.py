"""Log-probabilities of a prompt's own tokens (``SamplingParams.prompt_logprobs``), computed
during its prefill: what OpenAI's ``echo`` with ``logprobs`` returns, and what
loglikelihood evaluations (lm-eval) read.

The logits of position p are the distribution of token p + 1, so a request of P prompt
tokens scores positions 0 .. P - 2 (its first token has no entry). In a step that computes
positions [c, end) of such a request, the positions [max(c, done), min(end, P - 1)) are
scored, ``done`` being how many it has already (``seq.prompt_lps``):

* ``plan`` (the pipeline, before the step runs) lists them and puts their rows (indices
  into the step's tokens) in ``batch.score_rows``; the input builder appends those rows
  after the sampling rows, so the runner's one ``compute_logits`` gives both, on every
  tensor-parallel rank alike (engine/inputs.py);
* ``score`` turns the tail rows of the step's logits into entries (the token's raw
  log-probability, its rank, the k likeliest alternatives: the sampler's ``TokenLogprobs``)
  appended to ``seq.prompt_lps``, and hands back the sampling rows.

Chunked prefill scores chunk by chunk. A request preempted and recomputed scores no
position twice (``done``). Positions must be computed to be scored, so a request whose
prompt is not all scored takes nothing from the prefix cache (``Sequence.scores_prompt``,
engine/block_manager.py): its blocks are computed again, as vLLM does for such requests;
once scored, a recompute may hit the cache as any request. The engine hands them out
(``entries``) with the request's first output (engine/llm_engine.py).

Cost: a scored row's logits (vocab floats) live for the step, and ``score`` reads them back
to the host (the step is synchronous): a long prompt asking for them costs about
vocab x chunk x 4 bytes of activation memory per step.
"""
from __future__ import annotations

import torch

from pagedq.engine.batch import ScheduledBatch
from pagedq.engine.sampler import TokenLogprobs
from pagedq.engine.sequence import Sequence

# rows scored at once: bounds score's float32 copy of the logits (rows x vocab)
SCORE_SLICE = 256

Plan = list[tuple[Sequence, int, int]]  # (sequence, first position, end position) to score


def entries(seq: Sequence) -> list[TokenLogprobs]:
    """The request's prompt logprobs as handed out: one entry per prompt token, the first
    one's ``logprob`` and ``rank`` None (nothing precedes it) and no alternatives."""
    return [TokenLogprobs(seq.prompt_token_ids[0], None, None, []), *(seq.prompt_lps or ())]


def plan(batch: ScheduledBatch) -> Plan:
    """The prompt positions this step scores, in batch order; sets ``batch.score_rows``
    (their rows among the step's tokens). Call before the step runs (computed counts not
    yet advanced)."""
    out: Plan = []
    rows = batch.score_rows
    rows.clear()
    t = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if seq.params.prompt_logprobs is not None:
            c, done = seq.num_computed_tokens, len(seq.prompt_lps or ())
            if c > done and done < seq.num_prompt_tokens - 1:  # the prefix cache's rule
                raise RuntimeError(f"{seq.request_id}: prompt positions [{done}, {c}) were "
                                   "computed without being scored")
            lo, hi = max(c, done), min(c + n, seq.num_prompt_tokens - 1)
            if hi > lo:
                out.append((seq, lo, hi))
                rows.extend(range(t + lo - c, t + hi - c))
        t += n
    return out


@torch.inference_mode()
def score(scored: Plan, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Score ``scored``'s positions from the last rows of ``logits`` (one per position, in
    order: ``plan``'s rows); returns the rows before them (the sampling rows)."""
    total = sum(hi - lo for _, lo, hi in scored)
    first = logits.shape[0] - total
    targets: list[int] = []
    ks: list[int] = []
    owners: list[Sequence] = []
    for seq, lo, hi in scored:
        targets.extend(seq.token_ids[lo + 1:hi + 1])
        ks.extend([seq.params.prompt_logprobs] * (hi - lo))
        owners.extend([seq] * (hi - lo))
        if seq.prompt_lps is None:
            seq.prompt_lps = []
    kmax = min(max(ks), vocab_size)
    dev = logits.device
    for a in range(0, total, SCORE_SLICE):
        b = min(total, a + SCORE_SLICE)
        lp = torch.log_softmax(logits[first + a:first + b, :vocab_size].float(), dim=-1)
        tgt = torch.tensor(targets[a:b], dtype=torch.long, device=dev).unsqueeze(1)
        chosen = lp.gather(1, tgt)
        ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
        values = chosen.squeeze(1).tolist()
        top_v: list[list[float]] = [[] for _ in range(b - a)]
        top_i: list[list[int]] = [[] for _ in range(b - a)]
        if kmax:
            tv, ti = lp.topk(kmax, dim=-1)
            top_v, top_i = tv.tolist(), ti.tolist()
        for j in range(b - a):
            k = ks[a + j]
            owners[a + j].prompt_lps.append(TokenLogprobs(
                targets[a + j], values[j], ranks[j],
                list(zip(top_i[j][:k], top_v[j][:k], strict=True))))
    return logits[:first]
