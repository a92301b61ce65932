"""Pure-torch twins of every kernel: the contract of each. Tests compare the Triton kernels
and the CPU path (kernels/cpu.py, which the CPU engine runs) against them. Written for
clarity, not speed (loops over sequences)."""
from __future__ import annotations

import sys

import torch

from pagedq.kernels import kv_quant, quant_layout


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale=1.0,
                  v_scale=1.0, k_scale_cache: torch.Tensor | None = None,
                  v_scale_cache: torch.Tensor | None = None) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slot -1 is skipped.
    8-bit caches store kv_quant.quantize's values (fp8: divided by k_scale / v_scale; int8:
    codes, their scales into the scale caches). Indexes (block, offset), so a
    transposed_view cache (kernels/layout.py) works too."""
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blk, off = slots // bs, slots % bs
    for x, cache, scale, sc in ((key, k_cache, k_scale, k_scale_cache),
                                (value, v_cache, v_scale, v_scale_cache)):
        codes, s = kv_quant.quantize(x[keep], cache.dtype, scale)
        if cache.element_size() == 1:  # (no index_put for float8 on every device)
            cache, codes = cache.view(torch.uint8), codes.view(torch.uint8)
        cache[blk, off] = codes
        if s is not None:
            sc[blk, off] = s


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from the paged cache: [length, Hkv, D]
    (or, of a scale cache [num_blocks, block_size, Hkv], [length, Hkv])."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    return cache[blocks].flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *, k_scale=1.0, v_scale=1.0,
                    k_scale_cache: torch.Tensor | None = None,
                    v_scale_cache: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's paged context.

    Query j (0-based) of sequence b sits at position seq_lens[b] - qlen_b + j and attends
    to keys 0..that position. Covers prefill, chunked prefill with a cached prefix, and
    decode (qlen 1). GQA: query head h reads KV head h // (Hq // Hkv). 8-bit caches are
    read as kv_quant.dequantize's float32 values (k_scale ... v_scale_cache: its doc).
    """
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    group = hq // hkv
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()

    def real(cache, s, sc, b, length):
        tok = None if sc is None else gather_kv(sc, block_tables[b], length)
        x = kv_quant.dequantize(gather_kv(cache, block_tables[b], length), s, tok)
        return x.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
    for b, length in enumerate(lens):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        qb = q[s:e].float().transpose(0, 1)  # [Hq, qlen, D]
        k = real(k_cache, k_scale, k_scale_cache, b, length)
        v = real(v_cache, v_scale, v_scale_cache, b, length)
        scores = (qb @ k.transpose(1, 2)) * scale  # [Hq, qlen, L]
        qpos = torch.arange(length - (e - s), length, device=q.device).unsqueeze(1)
        kpos = torch.arange(length, device=q.device).unsqueeze(0)
        scores.masked_fill_(kpos > qpos, float("-inf"))
        out[s:e] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, order: torch.Tensor | None = None,
                           **scales) -> torch.Tensor:
    """Decode: q [B, Hq, D], one query per sequence at its last position. ``order``
    (the Triton kernel's launch order of the rows) changes no result: ignored here.
    ``scales``: paged_attention's k_scale ... v_scale_cache."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu, scale, **scales)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(s, weight, eps), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I], in fp32, rounded once."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def rotary_cos_sin(head_dim: int, max_position: int, base: float,
                   scaling: dict | None = None) -> torch.Tensor:
    """cos_sin_cache [max_position, head_dim]: first half cos, second half sin (float32).
    ``scaling``: a Llama-3 style rope_scaling dict (rope_type 'llama3') or None."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        import math
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    t = torch.arange(max_position, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX/HF-Llama rotary (rotate_half) on q [T, Hq, D] and k [T, Hkv, D]."""
    cs = cos_sin_cache[positions.long()]  # [T, D]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, :half].unsqueeze(1), cs[:, half:].unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rot(q), rot(k)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float,
                       **scales) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head rms_norm of q and k (Qwen3; weights None: none), apply_rotary, then
    store_kvcache of the rotated k and v (``scales``: its k_scale ... v_scale_cache).
    Returns the rotated (q, k); the fused kernel (kernels/rope_store.py) rotates q and k
    in place, this twin returns new tensors: callers use the result."""
    return rope_store_with(sys.modules[__name__], q, k, v, positions, cos_sin_cache, k_cache,
                           v_cache, slot_mapping, q_weight, k_weight, eps, **scales)


def rope_store_with(ops, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                    q_weight, k_weight, eps, **scales):
    """qk_norm_rope_store composed of ``ops``' rms_norm, apply_rotary and store_kvcache (this
    module's, kernels/cpu.py's, or engine/layers/ops.py's dispatchers for the ablation)."""
    if q_weight is not None:
        q, k = ops.rms_norm(q, q_weight, eps), ops.rms_norm(k, k_weight, eps)
    q, k = ops.apply_rotary(q, k, positions, cos_sin_cache)
    ops.store_kvcache(k, v, k_cache, v_cache, slot_mapping, **scales)
    return q, k


# SplitMix64 (Steele, Lea, Flood 2014): output i of the stream started at key k is
# mix(k + i * GAMMA). Counter-based: any element can be computed on its own, on any device.
GAMMA, C1, C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def signed64(c: int) -> int:
    """The int64 with the bits of the uint64 ``c``."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [R, n] in (0, 1]: the top 32 bits of outputs 1..n of the stream of each int64
    key, as (bits + 0.5) * 2**-32 rounded to float32 (plain int64 torch ops; multiplication
    wraps mod 2**64, so CPU and CUDA agree bit for bit)."""
    z = keys.unsqueeze(1) + torch.arange(1, n + 1, device=keys.device) * signed64(GAMMA)
    z = (z ^ _lsr(z, 30)) * signed64(C1)
    z = (z ^ _lsr(z, 27)) * signed64(C2)
    z = z ^ _lsr(z, 31)
    return (_lsr(z, 32).float() + 0.5) * 2.0**-32


def exponentials(keys: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [R, n] Exp(1) noise E = -log(1 - w), w = splitmix_uniforms. w is the small
    side, so E keeps its precision near 0, where the winner of an exponential race lives
    (a series below 1e-3: 1 - w would round)."""
    w = splitmix_uniforms(keys, n)
    return torch.where(w < 1e-3, w * (1.0 + w * (0.5 + w * 0.33333334)), -torch.log(1.0 - w))


def gumbel_scores(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """float32 [R, vocab_size]: logits / T - log(E[v]) with E the row's
    ``exponentials(keys[r])``; for rows with T == 0, the logits themselves."""
    x = logits[:, :vocab_size].float()
    t = temperature.unsqueeze(1)
    noisy = x / torch.where(t > 0, t, 1.0) - torch.log(exponentials(keys, vocab_size))
    return torch.where(t > 0, noisy, x)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """int64 [R]: per row, argmax of ``gumbel_scores`` (a sample of softmax(logits / T);
    rows with T == 0: greedy). logits [R, >= vocab_size] any float dtype, read only;
    temperature [R] float32; keys [R] int64."""
    return gumbel_scores(logits, temperature, keys, vocab_size).argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                        vocab_size: int) -> None:
    """In place: ``logits[rows[g], t] = -inf`` for every token t < vocab_size that row g
    of ``bitmask`` does not allow. Bit t of a row is bit t % 32 of its word t // 32 (the
    grammar library's layout); bits past vocab_size are ignored, columns past it untouched.
    logits float [R, >= vocab_size]; bitmask int32 [G, ceil(vocab_size / 32)]; rows int64
    [G], distinct."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    sub = logits[rows, :vocab_size]
    logits[rows, :vocab_size] = sub.masked_fill(~allowed, float("-inf"))


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None, bits: int, group_size: int, zero_point: int,
                 bias: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x[:, perm] @ W (+ bias) in x's dtype, W [K, N] the float32 weight of the
    quantized layout (kernels/quant_layout.py), product and sum in float32."""
    w = quant_layout.dequantize(qweight, scales, offsets, bits, group_size, zero_point)
    xf = (x if perm is None else x[:, perm.long()]).float()
    y = xf @ w
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
