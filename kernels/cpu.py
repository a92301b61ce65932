"""CPU implementations of the kernel ops, vectorised over the batch: the contracts (and,
up to float rounding, the results) of kernels/reference.py, whose twins loop over
sequences. engine/layers/ops.py sends CPU tensors here; tests/test_kernels_cpu.py checks
each against its twin.

Attention: per group of sequences, their keys are gathered into a padded [n, L] context
(masked past each sequence's length, causal within) and attended in one call. GQA without
copies: the G = Hq / Hkv query heads of a KV head are laid out as G query rows of that
head. A step whose rows all decode is one group, attended with two batched matmuls;
otherwise decode rows form one group and prefill rows another, or one group each when
padding them to one shape would more than double the work, each a
scaled_dot_product_attention call.

Per step, the layers of a model call each op with the same metadata tensors; what is
derived from them alone (gather indices, masks, rotary cos/sin, valid slots) is computed
once and reused while the same tensor objects come back. Invariant relied on: metadata
tensors are not modified in place between two calls that share them (the engine builds
new ones every step; a non-inference tensor's in-place change is also caught by its
``_version``; inference tensors have none).
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedq.kernels import kv_quant, quant_layout, reference
from pagedq.kernels.cpu_sampling import (  # noqa: F401  (ops of this module)
    apply_token_bitmask,
    gumbel_argmax,
)


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


class _Derived(threading.local):
    """Per thread, per name: the last value derived from a tuple of tensors (and ``extra``
    plain values). It holds the tensors, so their identities stay theirs."""

    def __init__(self) -> None:
        self.slots: dict[str, tuple[tuple, tuple, object]] = {}

    def get(self, name: str, tensors: tuple, extra: tuple, build):
        hit = self.slots.get(name)
        versions = tuple(_version(t) for t in tensors)
        if hit is not None and hit[1] == versions + extra and len(hit[0]) == len(tensors) \
                and all(a is b for a, b in zip(hit[0], tensors, strict=True)):
            return hit[2]
        value = build()
        self.slots[name] = (tensors, versions + extra, value)
        return value


_derived = _Derived()


@dataclass(slots=True)
class _Group:
    """Sequences attended together, padded to maxq queries and L keys each."""

    n: int
    maxq: int
    L: int
    slots: torch.Tensor  # [n * L] int64 cache slot of each key; padding: the row's slot 0
    mask: torch.Tensor  # float32 [n, 1, maxq * G or 1, L]: 0 attend, -inf not
    q_rows: torch.Tensor | None  # [n * maxq] token index of each padded query (None: all, in order)
    valid: torch.Tensor | None  # [tokens] rows of the padded output that are real (None: all)
    out_rows: torch.Tensor | None  # [tokens] where they go in the output (None: all, in order)
    # decode groups (maxq 1): rows of the cache seen as [slots * Hkv, D] in (row, KV head,
    # key) order, and the mask as [n * Hkv, G, L], for the batched matmuls of _attend_decode
    head_rows: torch.Tensor | None = None
    head_mask: torch.Tensor | None = None


def _neg_mask(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


def _key_slots(tables: torch.Tensor, lengths: torch.Tensor, L: int, bs: int) -> torch.Tensor:
    """[n * L] slots of keys 0..L-1 of each row; keys past a row's length read its key 0,
    a written slot (so a stale or unwritten slot, even NaN, is never read: masked-out
    keys are finite and their softmax weight is exactly 0)."""
    pos = torch.arange(L)
    slot = tables.index_select(1, pos // bs).long() * bs + pos % bs
    return torch.where(pos < lengths.view(-1, 1), slot, slot[:, :1]).reshape(-1)


def _decode_group(block_tables: torch.Tensor, seq_lens: torch.Tensor, bs: int, hkv: int,
                  G: int) -> _Group:
    n, L = block_tables.shape[0], int(seq_lens.max())
    allowed = torch.arange(L) < seq_lens.view(n, 1)
    mask = _neg_mask(allowed).view(n, 1, 1, L)
    slots = _key_slots(block_tables, seq_lens, L, bs)
    head_rows = (slots.view(n, 1, L) * hkv + torch.arange(hkv).view(1, hkv, 1)).reshape(-1)
    head_mask = mask.expand(n, hkv, G, L).reshape(n * hkv, G, L)
    return _Group(n, 1, L, slots, mask, None, None, None, head_rows, head_mask)


def _group(rows: list[int], cu: list[int], lens: list[int], block_tables: torch.Tensor,
           bs: int, G: int) -> _Group:
    n = len(rows)
    ql = [cu[b + 1] - cu[b] for b in rows]
    rl = [lens[b] for b in rows]
    maxq, L = max(ql), max(rl)
    q_rows, valid, out_rows = [], [], []
    for i, b in enumerate(rows):
        q_rows += [cu[b] + min(j, ql[i] - 1) for j in range(maxq)]
        valid += range(i * maxq, i * maxq + ql[i])
        out_rows += range(cu[b], cu[b + 1])
    qlen, length = torch.tensor(ql).view(n, 1, 1), torch.tensor(rl).view(n, 1, 1)
    slots = _key_slots(block_tables.index_select(0, torch.tensor(rows)), length, L, bs)
    qpos = length - qlen + torch.arange(maxq).view(1, maxq, 1)  # [n, maxq, 1]
    kpos = torch.arange(L).view(1, 1, L)
    allowed = (kpos <= qpos) & (kpos < length)  # padded queries: any real key (no NaN)
    mask = _neg_mask(allowed).repeat_interleave(G, dim=1).unsqueeze(1)
    return _Group(n, maxq, L, slots, mask, torch.tensor(q_rows), torch.tensor(valid),
                  torch.tensor(out_rows))


def _plan(block_tables, seq_lens, cu_seqlens_q, bs: int, hkv: int, G: int) -> list[_Group]:
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    B = len(lens)
    if B == 0:
        return []
    if cu[-1] == B and all(cu[b + 1] - cu[b] == 1 for b in range(B)):
        return [_decode_group(block_tables, seq_lens, bs, hkv, G)]
    dec = [b for b in range(B) if cu[b + 1] - cu[b] == 1]
    pre = [b for b in range(B) if cu[b + 1] - cu[b] > 1]
    sets = [dec] if dec else []
    if pre:
        real = sum((cu[b + 1] - cu[b]) * lens[b] for b in pre)
        padded = len(pre) * max(cu[b + 1] - cu[b] for b in pre) * max(lens[b] for b in pre)
        sets += [pre] if padded <= 2 * real else [[b] for b in pre]
    groups = [_group(r, cu, lens, block_tables, bs, G) for r in sets]
    if len(groups) == 1 and len(sets[0]) == B:
        groups[0].out_rows = None  # every row, in order
    return groups


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache rows at slots: [len(slots), Hkv, D] (a transposed_view cache: by block, offset);
    of a scale cache [num_blocks, block_size, Hkv]: [len(slots), Hkv]."""
    nb, bs = cache.shape[:2]
    if cache.is_contiguous():
        return cache.view(nb * bs, *cache.shape[2:]).index_select(0, slots)
    return cache[slots // bs, slots % bs]


def _decode_rows(cache, scale, scale_cache, g: _Group, hkv: int, d: int) -> torch.Tensor:
    """A decode group's keys (or values) as float32 [n * Hkv, L, D] in (row, KV head) order,
    dequantized (kernels/kv_quant.py)."""
    n, L = g.n, g.L
    if cache.is_contiguous():
        x = cache.view(-1, d).index_select(0, g.head_rows).view(n, hkv, L, d).float()
        tok = None if scale_cache is None else \
            scale_cache.view(-1).index_select(0, g.head_rows).view(n, hkv, L, 1)
    else:
        x = _gather(cache, g.slots).view(n, L, hkv, d).transpose(1, 2).float()
        tok = None if scale_cache is None else \
            _gather(scale_cache, g.slots).view(n, L, hkv).transpose(1, 2).unsqueeze(-1)
    if tok is not None:
        x = x * tok
    elif isinstance(scale, torch.Tensor) or scale != 1.0:
        x = x * kv_quant.per_head(scale, hkv, x.device).view(1, hkv, 1, 1)
    return x.reshape(n * hkv, L, d)


def _attend_decode(q, k_cache, v_cache, g: _Group, scale: float, kq: dict) -> torch.Tensor:
    """A decode group's output [n, Hq, D] float32: per (row, KV head) a [G, D] x [D, L]
    product, masked softmax, [G, L] x [L, D] (batched matmuls: at one query per row they
    cost less than scaled_dot_product_attention's setup)."""
    n, (_, hq, d), hkv = g.n, q.shape, k_cache.shape[2]
    k = _decode_rows(k_cache, kq.get("k_scale", 1.0), kq.get("k_scale_cache"), g, hkv, d)
    v = _decode_rows(v_cache, kq.get("v_scale", 1.0), kq.get("v_scale_cache"), g, hkv, d)
    s = torch.baddbmm(g.head_mask, q.float().reshape(n * hkv, hq // hkv, d), k.transpose(1, 2),
                      alpha=scale)
    return torch.bmm(torch.softmax(s, dim=-1), v).view(n, hq, d)


def _attend(q, k_cache, v_cache, g: _Group, scale: float, kq: dict) -> torch.Tensor:
    """Output rows of group g: [its tokens, Hq, D] float32, in token order."""
    if g.head_rows is not None:  # every row of the step decodes, in order
        return _attend_decode(q, k_cache, v_cache, g, scale, kq)
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    G, n, mq = hq // hkv, g.n, g.maxq
    qg = q if g.q_rows is None else q.index_select(0, g.q_rows)
    qg = qg.float().view(n, mq, hkv, G, d).transpose(1, 2).reshape(n, hkv, mq * G, d)

    def real(cache, s, sc):
        tok = None if sc is None else _gather(sc, g.slots)
        x = kv_quant.dequantize(_gather(cache, g.slots), s, tok)
        return x.view(n, g.L, hkv, d).transpose(1, 2)
    k = real(k_cache, kq.get("k_scale", 1.0), kq.get("k_scale_cache"))
    v = real(v_cache, kq.get("v_scale", 1.0), kq.get("v_scale_cache"))
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
    o = o.view(n, hkv, mq, G, d).transpose(1, 2).reshape(n * mq, hq, d)
    return o if g.valid is None else o.index_select(0, g.valid)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, **kq) -> torch.Tensor:
    """reference.paged_attention (prefill, chunked prefill with a cached prefix, decode;
    ``kq``: its k_scale ... v_scale_cache)."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    G = q.shape[1] // hkv
    groups = _derived.get("attention", (block_tables, seq_lens, cu_seqlens_q), (bs, hkv, G),
                          lambda: _plan(block_tables, seq_lens, cu_seqlens_q, bs, hkv, G))
    if len(groups) == 1 and groups[0].out_rows is None:
        return _attend(q, k_cache, v_cache, groups[0], scale, kq).to(q.dtype)
    out = torch.empty_like(q)
    for g in groups:
        out.index_copy_(0, g.out_rows, _attend(q, k_cache, v_cache, g, scale, kq).to(q.dtype))
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, order: torch.Tensor | None = None,
                           **kq) -> torch.Tensor:
    """reference.paged_decode_attention: q [B, Hq, D], one query per sequence
    (``order`` ignored)."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    G = q.shape[1] // hkv
    g = _derived.get("decode", (block_tables, seq_lens), (bs, hkv, G),
                     lambda: _decode_group(block_tables, seq_lens, bs, hkv, G))
    return _attend_decode(q, k_cache, v_cache, g, scale, kq).to(q.dtype)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale=1.0,
                  v_scale=1.0, k_scale_cache: torch.Tensor | None = None,
                  v_scale_cache: torch.Tensor | None = None) -> None:
    """reference.store_kvcache, as one index_copy_ per cache (contiguous caches): the same
    kv_quant.quantize values."""
    scales = dict(k_scale=k_scale, v_scale=v_scale, k_scale_cache=k_scale_cache,
                  v_scale_cache=v_scale_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping, **scales)

    def valid():
        keep = slot_mapping >= 0
        return None if bool(keep.all()) else keep.nonzero().squeeze(1)
    keep = _derived.get("slots", (slot_mapping,), (), valid)
    slots = slot_mapping if keep is None else slot_mapping.index_select(0, keep)
    nb, bs, h, d = k_cache.shape
    for src, cache, s, sc in ((key, k_cache, k_scale, k_scale_cache),
                              (value, v_cache, v_scale, v_scale_cache)):
        src = src if keep is None else src.index_select(0, keep)
        src, tok = kv_quant.quantize(src, cache.dtype, s)
        dst = cache.view(nb * bs, h, d)
        if cache.element_size() == 1:  # no index_copy_ for float8: copy the bytes
            dst, src = dst.view(torch.uint8), src.view(torch.uint8)
        dst.index_copy_(0, slots, src)
        if tok is not None:
            sc.view(nb * bs, h).index_copy_(0, slots, tok)


def _float32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in ts)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin's float32 arithmetic in the same order (equal bit for bit), in place on the
    temporaries: F.rms_norm on the CPU adds two copies of x."""
    r = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return torch.mul(x, r).mul_(weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _float32(x, weight):  # the twin computes in float32 and rounds once
        return reference.rms_norm(x, weight, eps)
    return _rms(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not _float32(x, residual, weight):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    s = x + residual
    return _rms(s, weight, eps), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        return reference.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _heads_side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, Hq + Hkv, D] over q's and k's memory when k's heads follow q's in every row (both
    views of one qkv projection, as the models make them); else None."""
    T, hq, d = q.shape
    width = hq + k.shape[1]
    if k.shape[0] != T or k.shape[2] != d or q.stride() != k.stride() or q.stride()[1:] != (d, 1) \
            or q.stride(0) < width * d or k.data_ptr() != q.data_ptr() + hq * d * q.element_size() \
            or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr():
        return None
    return q.as_strided((T, width, d), q.stride())


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.apply_rotary, equal bit for bit: x * [cos | cos] + [x2 | x1] * [-sin | sin]
    (the twin's products and sums), with the cos/sin rows looked up once per step and q and
    k rotated in one pass when they lie side by side."""
    if not _float32(q, k):
        return reference.apply_rotary(q, k, positions, cos_sin_cache)

    def lookup():
        cs = cos_sin_cache.index_select(0, positions.long())
        half = cs.shape[-1] // 2
        cos, sin = cs[:, :half], cs[:, half:]
        return torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([-sin, sin], -1).unsqueeze(1)
    cos, sin = _derived.get("rotary", (positions, cos_sin_cache), (), lookup)
    half = cos.shape[-1] // 2

    def rot(x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, cos).add_(x.roll(half, -1).mul_(sin))

    both = _heads_side_by_side(q, k)
    if both is None:
        return rot(q), rot(k)
    out = rot(both)
    return out[:, :q.shape[1]], out[:, q.shape[1]:]


def qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       q_weight, k_weight, eps, **scales):
    """reference.qk_norm_rope_store as the same composition of this module's ops (each equal
    to its twin, so the whole is too)."""
    return reference.rope_store_with(sys.modules[__name__], q, k, v, positions, cos_sin_cache,
                                     k_cache, v_cache, slot_mapping, q_weight, k_weight, eps,
                                     **scales)




def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None, bits: int, group_size: int, zero_point: int,
                 bias: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None) -> torch.Tensor:
    """The twin's contract, dequantized on the fly: W in x's dtype, then F.linear, so a
    CPU model with quantized weights computes exactly what the same model with those
    weights dequantized to its dtype computes: the same rounding of W, the same GEMM on the
    same [N, K] layout, and act-order rows put back in the checkpoint's order (not x's
    columns permuted), so the same summation order too."""
    w = quant_layout.dequantize(qweight, scales, offsets, bits, group_size, zero_point)
    if perm is not None:
        w = w.index_select(0, torch.argsort(perm.long()))
    return F.linear(x, w.t().to(x.dtype).contiguous(),
                    None if bias is None else bias.to(x.dtype))
