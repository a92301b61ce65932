"""Kernel dispatch: one module-level switch picks the Triton kernels or the reference twins.

Triton kernels run only when the switch is on AND the tensor is on CUDA; CPU tensors run
kernels/cpu.py (batched torch ops, tested against the twins); everything else (CUDA with
the switch off) runs kernels/reference.py. An op named in PAGEDQ_DISABLE_KERNELS runs its
twin on every device. Triton modules are imported lazily on first use, so the CPU path
never imports triton. The switch is process-wide: the model
runner sets it once from EngineConfig.use_triton.
Signatures are those of kernels/reference.py (the Triton wrappers share them).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from pagedq.kernels import cpu, reference

# op name -> Triton module under kernels/
TRITON_MODULES = {
    "store_kvcache": "pagedq.kernels.store_kvcache",
    "paged_decode_attention": "pagedq.kernels.decode_attention",
    "paged_attention": "pagedq.kernels.prefill_attention",
    "rms_norm": "pagedq.kernels.norm",
    "fused_add_rms_norm": "pagedq.kernels.norm",
    "apply_rotary": "pagedq.kernels.rotary",
    "qk_norm_rope_store": "pagedq.kernels.rope_store",
    "gumbel_argmax": "pagedq.kernels.sampling",
    "apply_token_bitmask": "pagedq.kernels.sampling",
    "silu_and_mul": "pagedq.kernels.activation",
    "quant_matmul": "pagedq.kernels.quant_matmul",
}

_use_triton = False
_triton_ops: dict[str, object] = {}
# Ablations (bench/offline.py --disable): ops listed here run their torch twin even on CUDA;
# "decode_order" launches decode rows in batch order (decode_order below);
# "piecewise_graphs": steps that prefill run the eager model (engine/piecewise.py).
ABLATIONS = frozenset(TRITON_MODULES) | {"decode_order", "piecewise_graphs"}


def _names(value: str) -> set[str]:
    """The names in a comma-separated PAGEDQ_DISABLE_KERNELS value."""
    return {x.strip() for x in value.split(",") if x.strip()}


_disabled = _names(os.environ.get("PAGEDQ_DISABLE_KERNELS", ""))


def unknown_ablations(names: str) -> list[str]:
    """The names in a comma-separated PAGEDQ_DISABLE_KERNELS value that switch nothing off."""
    return sorted(_names(names) - ABLATIONS)


def ablated(name: str) -> bool:
    """True when PAGEDQ_DISABLE_KERNELS names ``name`` (one of ABLATIONS)."""
    return name in _disabled


def set_use_triton(flag: bool) -> None:
    global _use_triton
    _use_triton = bool(flag)


def use_triton() -> bool:
    return _use_triton


def triton_available() -> bool:
    """True when triton and every Triton kernel module can be found (nothing imported)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return all(importlib.util.find_spec(m) is not None for m in set(TRITON_MODULES.values()))


def _op(name: str, x: torch.Tensor):
    if not (_use_triton and x.is_cuda) or ablated(name):
        if x.device.type == "cpu" and not ablated(name):
            return getattr(cpu, name)
        return getattr(reference, name)
    fn = _triton_ops.get(name)
    if fn is None:
        fn = getattr(importlib.import_module(TRITON_MODULES[name]), name)
        _triton_ops[name] = fn
    return fn


# ``kq`` below: an 8-bit cache's scales, k_scale / v_scale / k_scale_cache / v_scale_cache
# (kernels/kv_quant.py); none for a 16-bit cache.
def store_kvcache(key, value, k_cache, v_cache, slot_mapping, **kq) -> None:
    _op("store_kvcache", key)(key, value, k_cache, v_cache, slot_mapping, **kq)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, **kq):
    return _op("paged_attention", q)(q, k_cache, v_cache, block_tables, seq_lens,
                                     cu_seqlens_q, scale, **kq)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, order=None,
                           **kq):
    return _op("paged_decode_attention", q)(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                            order, **kq)


def decode_order(seq_lens):
    """The launch order of a decode batch's rows for paged_decode_attention: longest
    context first where the Triton kernel runs (kernels/decode_attention.py), else None
    (row order; also when "decode_order" is disabled: its ablation)."""
    module = _op("paged_decode_attention", seq_lens).__module__
    if module != TRITON_MODULES["paged_decode_attention"] or ablated("decode_order"):
        return None
    return sys.modules[module].longest_first(seq_lens)


def rms_norm(x, weight, eps):
    return _op("rms_norm", x)(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return _op("fused_add_rms_norm", x)(x, residual, weight, eps)


def apply_rotary(q, k, positions, cos_sin_cache):
    return _op("apply_rotary", q)(q, k, positions, cos_sin_cache)


def qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       q_weight, k_weight, eps, **kq):
    """Per-head q/k RMSNorm (weights None: none), rotary, K/V store; returns rotated (q, k).
    Disabled (ablation), it runs the ops it fuses, each dispatched as usual: the unfused
    Triton kernels on CUDA unless they are disabled too (all four: the twins; the twin's
    store is not CUDA-graph capturable: bench with --enforce-eager then)."""
    if ablated("qk_norm_rope_store"):
        return reference.rope_store_with(sys.modules[__name__], q, k, v, positions,
                                         cos_sin_cache, k_cache, v_cache, slot_mapping,
                                         q_weight, k_weight, eps, **kq)
    return _op("qk_norm_rope_store", q)(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                        slot_mapping, q_weight, k_weight, eps, **kq)


def gumbel_argmax(logits, temperature, keys, vocab_size):
    return _op("gumbel_argmax", logits)(logits, temperature, keys, vocab_size)


def apply_token_bitmask(logits, bitmask, rows, vocab_size):
    _op("apply_token_bitmask", logits)(logits, bitmask, rows, vocab_size)


def silu_and_mul(x):
    return _op("silu_and_mul", x)(x)


def quant_matmul(x, qweight, scales, offsets, bits, group_size, zero_point, bias=None,
                 perm=None):
    """x [M, K] @ a quantized W [K, N] (kernels/quant_layout.py) -> [M, N] in x's dtype."""
    return _op("quant_matmul", x)(x, qweight, scales, offsets, bits, group_size, zero_point,
                                  bias, perm)
