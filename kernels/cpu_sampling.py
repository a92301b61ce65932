"""CPU sampling: reference.apply_token_bitmask's contract (below), and
reference.gumbel_argmax's contract and, up to the rounding of log, its
results, without its cost on the CPU.

The twin draws noise for every row and every vocabulary entry in one pass: about twenty
full-size int64 and float32 temporaries (a SplitMix64 hash, then two logs), allocated anew
each call. At 256 rows of a 49,152-token vocabulary each temporary is 100 MB: the step
spends its time faulting in fresh pages and streaming memory (0.79 s a call on the 2-core
CPU machine, against 6 ms at 16 rows). Here:

  * greedy rows (temperature <= 0) take the argmax of their logits and draw no noise;
  * sampled rows are scored a vocabulary tile at a time, in buffers allocated once per
    call and small enough to stay in cache, each op in place; each tile keeps its maximum
    and the first index of it, and the row's token is the first index of the best tile's
    maximum: the twin's argmax (first index among equal maxima).

Every op is the twin's, in the twin's order and float32 precision, so a score differs from
the twin's only where torch's log rounds an element differently in its vectorised and
scalar loops (the twin is subject to the same: which elements take which loop depends on
the tensor's shape and the thread count).
"""
from __future__ import annotations

import sys

import torch

from pagedq.kernels import reference
from pagedq.kernels.reference import C1, C2, GAMMA, signed64

TILE = 1 << 17  # elements of a sampled tile: its int64 temporaries (1 MB each) stay cached
_steps: dict[tuple[int, torch.device], torch.Tensor] = {}


def _counter_steps(n: int, device: torch.device) -> torch.Tensor:
    """int64 [n]: i * GAMMA (mod 2**64) for i = 1..n, the stream's offsets (cached)."""
    key = (n, device)
    steps = _steps.get(key)
    if steps is None:
        steps = torch.arange(1, n + 1, device=device) * signed64(GAMMA)
        _steps[key] = steps
    return steps


def _lsr_into(z: torch.Tensor, s: int, out: torch.Tensor) -> torch.Tensor:
    """out = z logically shifted right by s (reference._lsr)."""
    torch.bitwise_right_shift(z, s, out=out)
    return out.bitwise_and_((1 << (64 - s)) - 1)


def _tile_scores(x: torch.Tensor, t: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor,
                 z: torch.Tensor, u: torch.Tensor, e: torch.Tensor, s: torch.Tensor) -> None:
    """s = x / t - log(E) for one tile: x [R, w] logits, t [R, 1] temperatures (> 0),
    keys [R, 1], steps [w] the tile's counter offsets; z, u int64 and e float32 scratch of
    x's shape (reference.splitmix_uniforms, exponentials, gumbel_scores)."""
    torch.add(keys, steps, out=z)
    for shift, mult in ((30, C1), (27, C2)):
        z.bitwise_xor_(_lsr_into(z, shift, u)).mul_(signed64(mult))
    z.bitwise_xor_(_lsr_into(z, 31, u))
    e.copy_(_lsr_into(z, 32, u)).add_(0.5).mul_(2.0**-32)  # w in (0, 1]
    s.copy_(e).neg_().add_(1.0).log_().neg_()  # E = -log(1 - w)
    small = e < 1e-3  # where 1 - w would round, E is the series in w (the twin's where)
    if small.any():
        w = e[small]
        s[small] = w * (1.0 + w * (0.5 + w * 0.33333334))
    s.log_()
    torch.div(x, t, out=e)
    s.neg_().add_(e)  # x / t - log(E), rounded once as the twin's subtraction


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """reference.gumbel_argmax (same signature and semantics)."""
    x = logits[:, :vocab_size]
    hot = temperature > 0
    rows = hot.nonzero().squeeze(1)
    if len(rows) == 0:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if len(rows) < x.shape[0]:
        out[~hot] = x[~hot].argmax(dim=-1)
    xs, ts, ks = x[rows], temperature[rows].float().unsqueeze(1), keys[rows].unsqueeze(1)
    R, V = xs.shape
    width = min(V, max(64, TILE // R // 64 * 64))
    steps = _counter_steps(V, x.device)
    z, u = (torch.empty(R * width, dtype=torch.int64, device=x.device) for _ in range(2))
    e, s = (torch.empty(R * width, dtype=torch.float32, device=x.device) for _ in range(2))
    best, first = [], []
    for c0 in range(0, V, width):
        w = min(width, V - c0)
        sc = s[:R * w].view(R, w)
        _tile_scores(xs[:, c0:c0 + w], ts, ks, steps[c0:c0 + w], z[:R * w].view(R, w),
                     u[:R * w].view(R, w), e[:R * w].view(R, w), sc)
        v, i = sc.max(dim=1)
        best.append(v)
        first.append(i + c0)
    tile = torch.stack(best, dim=1).argmax(dim=1, keepdim=True)  # the first best tile
    out[rows] = torch.stack(first, dim=1).gather(1, tile).squeeze(1)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                        vocab_size: int) -> None:
    """reference.apply_token_bitmask: numpy's unpackbits (one C pass) turns the inverted
    words into one byte per banned token (words are little-endian: byte k of word w holds
    bits 8k..8k+7), then only the masked rows are gathered, filled and written back."""
    if sys.byteorder != "little":
        reference.apply_token_bitmask(logits, bitmask, rows, vocab_size)
        return
    import numpy as np
    words = torch.bitwise_not(bitmask).contiguous().numpy().view(np.uint8)
    banned = torch.from_numpy(np.unpackbits(words, axis=1, bitorder="little")[:, :vocab_size])
    sub = logits.index_select(0, rows)[:, :vocab_size]
    logits[:, :vocab_size].index_copy_(0, rows, sub.masked_fill_(banned.view(torch.bool),
                                                                 float("-inf")))
