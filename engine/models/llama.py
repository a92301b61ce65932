"""The Llama family on our layers: Llama (SmolLM2), Mistral, Qwen2, Qwen3.

Differences are class attributes: Qwen2 has q/k/v bias (o without), Qwen3 RMS-normalises
each q/k head before rotary; Llama/Mistral/Qwen3 take biases from ``attention_bias``.
Merged projections: qkv_proj rows = [q (Hq*D) | k (Hkv*D) | v (Hkv*D)], gate_up_proj rows =
[gate (I) | up (I)]; load_weights maps HF names (q_proj, k_proj, ...) onto those row ranges.
Tokens are flattened over the batch: every activation is [T, ...] (no batch dimension).
Tensor parallelism (engine/parallel.py): built with a ``TensorParallel``, each layer holds
its rank's heads / columns / vocab rows (Hq, Hkv, I above are then this rank's), and
load_weights copies only those slices of each checkpoint tensor.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedq.engine.layers.activation import SiluAndMul
from pagedq.engine.layers.attention import Attention, AttentionMetadata
from pagedq.engine.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    ShapeError,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from pagedq.engine.layers.norm import RMSNorm
from pagedq.engine.layers.quant_linear import QuantEmbedding, quantized_layers
from pagedq.engine.layers.rotary import RotaryEmbedding, rope_params
from pagedq.engine.loader import materialize
from pagedq.engine.parallel import SINGLE, TensorParallel, check_heads, head_slice, split

# HF projection name -> (our merged parameter, shard index)
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _dims(cfg) -> tuple[int, int, int]:
    nh = cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nh
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    return nh, nkv, hd


class LlamaAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        nh, nkv, hd = _dims(cfg)
        hs = head_slice(nh, nkv, tp.size, tp.rank)
        self.nh, self.nkv, self.hd = hs.q_count, hs.kv_count, hd  # this rank's heads
        kv = (nkv * hd, hs.kv_start * hd, hs.kv_count * hd)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [(nh * hd, hs.q_start * hd, hs.q_count * hd), kv, kv], qkv_bias)
        self.o_proj = RowParallelLinear(nh * hd, cfg.hidden_size, o_bias, tp,
                                        hs.q_start * hd, hs.q_count * hd)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary  # shared by all layers (one cos/sin cache)
        self.attn = Attention(self.nh, self.nkv, self.hd, self.hd ** -0.5)

    def forward(self, positions: torch.Tensor, h: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.nh * self.hd, self.nkv * self.hd,
                                          self.nkv * self.hd], dim=-1)
        q, k, v = q.view(-1, self.nh, self.hd), k.view(-1, self.nkv, self.hd), \
            v.view(-1, self.nkv, self.hd)
        qw = kw = None
        eps = 0.0
        if self.q_norm is not None:  # Qwen3: q/k head norms fused into the same kernel
            qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        o = self.attn(q, k, v, positions, self.rotary.cos_sin_cache(q.device), meta, qw, kw,
                      eps)
        return self.o_proj(o.reshape(-1, self.nh * self.hd))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = cfg.intermediate_size
        i0, n = split(inter, tp.size, tp.rank)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [(inter, i0, n)] * 2, bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp, i0, n)
        self.act = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, qkv_bias, o_bias, qk_norm, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, h, residual, meta):
        """Residual stream kept apart: returns (mlp output, residual before adding it)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, max_position: int, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        _, _, hd = _dims(cfg)
        theta, scaling = rope_params(cfg)
        rotary = RotaryEmbedding(hd, max_position, theta, scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, qkv_bias, o_bias, qk_norm, tp)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config, max_position: int | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        cfg = self.config = hf_config
        self.check_tensor_parallel(cfg, tp.size)
        self.tp = tp
        max_position = max_position or cfg.max_position_embeddings
        qkv_bias, o_bias = self.attention_biases(cfg)
        self.model = LlamaModel(cfg, max_position, qkv_bias, o_bias, self.qk_norm, tp)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.logits_head().packed = None  # packable (engine/layers/packed.py) as a linear layer
        nh, nkv, self.head_dim = _dims(cfg)
        self.num_kv_heads = head_slice(nh, nkv, tp.size, tp.rank).kv_count  # this rank's

    qk_norm = False
    stacked = STACKED  # HF projections -> merged layers (engine/quant/model.py reads it)

    @staticmethod
    def check_tensor_parallel(cfg, size: int) -> None:
        """ValueError unless ``size`` ranks can share the model's heads, MLP and vocab."""
        if size == 1:
            return
        nh, nkv, _ = _dims(cfg)
        check_heads(nh, nkv, size)
        for what, n in (("MLP width (intermediate_size)", cfg.intermediate_size),
                        ("vocabulary", cfg.vocab_size)):
            if n < size:
                raise ValueError(f"tensor_parallel_size {size} is more than the model's {what} "
                                 f"of {n}")

    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        b = bool(getattr(cfg, "attention_bias", False))
        return b, b

    @staticmethod
    def sliding_window(cfg) -> int | None:
        """Attention window of the checkpoint, if any (we attend to the full context, so the
        runner caps max_model_len at it)."""
        return None

    def logits_head(self) -> VocabParallelEmbedding:
        """The module whose weight computes the logits (the embedding when tied)."""
        return self.model.embed_tokens if self.tied else self.lm_head

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden [T, H] (after the final norm)."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> logits [N, vocab] in the model's dtype (a float32 copy of bf16
        logits would add no information, only a pass over [N, vocab]). Tensor-parallel:
        rank 0 gets [N, vocab rounded up to a multiple of the ranks] (columns past the vocab
        are padding), the other ranks None."""
        head = self.logits_head()
        if isinstance(head, QuantEmbedding):  # weights kept quantized (one rank)
            return head.logits(hidden)
        return vocab_parallel_logits(hidden, head.weight, self.tp, head.packed)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (or loader.LazyTensors) into our parameters, each layer
        taking its rank's slice (casting to their dtype/device). ValueError on an unknown
        name, a shape mismatch or a missing parameter. A quantized layer
        (engine/layers/quant_linear.py) loads its weight, a QuantTensor, under the same
        name as a plain one."""
        params = {**dict(self.named_parameters()), **quantized_layers(self)}
        modules = dict(self.named_modules())
        expected = {(n, s) for n in params for s in range(
            3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1)}
        loaded: set[tuple[str, int]] = set()
        for name, w in weights:
            if name.endswith("rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight"):
                continue
            parts = name.split(".")
            target, shard = STACKED.get(parts[-2], (None, 0)) if len(parts) > 1 else (None, 0)
            if target is not None:
                pname = ".".join(parts[:-2] + [target, parts[-1]])
            else:
                pname = name
            param = params.get(pname)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            owner, _, leaf = pname.rpartition(".")
            module = modules[owner]
            try:
                if hasattr(module, "load_shard"):
                    module.load_shard(leaf, w, shard)
                elif tuple(w.shape) != tuple(param.shape):
                    raise ShapeError(f"has shape {tuple(w.shape)}, expected {tuple(param.shape)}")
                else:  # replicated (norms)
                    param.data.copy_(materialize(w))
            except ShapeError as e:
                raise ValueError(f"checkpoint tensor {name!r} {e}") from None
            loaded.add((pname, shard))
        missing = sorted({n for n, _ in expected - loaded})
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:4]}")


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window(cfg) -> int | None:
        return getattr(cfg, "sliding_window", None)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        return True, False

    @staticmethod
    def sliding_window(cfg) -> int | None:
        return getattr(cfg, "sliding_window", None) if getattr(
            cfg, "use_sliding_window", False) else None


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    sliding_window = Qwen2ForCausalLM.__dict__["sliding_window"]  # the staticmethod
