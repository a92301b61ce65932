"""Pure functions of the sampler (engine/sampler.py): the keys of the counter-based noise
stream (the stream itself is kernels/reference.py's exponentials), penalties, top-k / top-p
and min-p masks. None modifies its inputs in place."""
from __future__ import annotations

import torch

from pagedq.kernels.reference import C1, C2, GAMMA, signed64

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as vLLM)
_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * C1) & _MASK64
    z = ((z ^ (z >> 27)) * C2) & _MASK64
    return z ^ (z >> 31)


def row_seed(seed: int, index: int) -> int:
    """Key (63 bits) of the noise for output index ``index`` of a request seeded with ``seed``
    (the key of kernels/reference.py's exponentials stream)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1


def stream_keys(base: int, rows: int, stride: int) -> list[int]:
    """Signed int64 keys base + r * stride * GAMMA (mod 2**64), r < rows: each row reads the
    next ``stride`` outputs of ONE SplitMix64 stream, so rows never share noise."""
    step = stride * GAMMA
    return [signed64((base + r * step) & _MASK64) for r in range(rows)]


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of ``logits`` [R, V].

    ``seen`` bool [R, V]: token occurs in prompt or output (repetition penalty: positive
    logits divided, negative multiplied). ``counts`` [R, V]: occurrences in the output only
    (logit -= frequency * count + presence * (count > 0)). Penalty vectors are [R].
    """
    rep = repetition.unsqueeze(1)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, scaled, logits)
    return out - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(out.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    k_bound: int | None = None,
) -> torch.Tensor:
    """Mask to -inf what top_k [R] (int, V = off) and top_p [R] (> 1 = off) remove.

    Both keep a prefix of the descending order, expressed as a logit threshold, so tokens
    tied with the last kept one are kept too (independent of sort tie-breaking). top_p keeps
    a token iff the probability mass strictly before it (after top_k) is < p. ``k_bound``
    (a Python int >= every top_k) lets top_k rows sort only their k_bound largest logits.
    """
    V = logits.shape[1]
    if top_k is not None and k_bound is not None and k_bound < V:
        srt = logits.topk(k_bound, dim=-1).values
    else:
        srt = logits.sort(dim=-1, descending=True).values
    neg_inf = float("-inf")
    if top_k is not None:
        kth = srt.gather(1, (top_k - 1).clamp(0, srt.shape[1] - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, neg_inf)
        srt = srt.masked_fill(srt < kth, neg_inf)
    if top_p is not None:
        probs = srt.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        n_keep = (before < top_p.unsqueeze(1)).sum(dim=1).clamp_min(1)
        cutoff = srt.gather(1, (n_keep - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < cutoff, neg_inf)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Remove tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    thresh = logits.amax(dim=1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < thresh, float("-inf"))
