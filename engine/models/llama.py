"""The Llama family on our layers: Llama (SmolLM2), Mistral, Qwen2, Qwen3.

Differences are class attributes: Qwen2 has q/k/v bias (o without), Qwen3 RMS-normalises
each q/k head before rotary; Llama/Mistral/Qwen3 take biases from ``attention_bias``.
Merged projections: qkv_proj rows = [q (Hq*D) | k (Hkv*D) | v (Hkv*D)], gate_up_proj rows =
[gate (I) | up (I)]; load_weights maps HF names (q_proj, k_proj, ...) onto those row ranges.
Tokens are flattened over the batch: every activation is [T, ...] (no batch dimension).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_params

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
                 qk_norm: bool) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = _dims(cfg)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, o_bias)
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
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(-1, self.nh * self.hd))


class LlamaMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias)
        self.act = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, qkv_bias, o_bias, qk_norm)
        self.mlp = LlamaMLP(cfg)
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
                 qk_norm: bool) -> None:
        super().__init__()
        _, _, hd = _dims(cfg)
        theta, scaling = rope_params(cfg)
        rotary = RotaryEmbedding(hd, max_position, theta, scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, qkv_bias, o_bias, qk_norm)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config, max_position: int | None = None) -> None:
        super().__init__()
        cfg = self.config = hf_config
        max_position = max_position or cfg.max_position_embeddings
        qkv_bias, o_bias = self.attention_biases(cfg)
        self.model = LlamaModel(cfg, max_position, qkv_bias, o_bias, self.qk_norm)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
        self.num_kv_heads, self.head_dim = _dims(cfg)[1:]

    qk_norm = False

    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        b = bool(getattr(cfg, "attention_bias", False))
        return b, b

    @staticmethod
    def sliding_window(cfg) -> int | None:
        """Attention window of the checkpoint, if any (we attend to the full context, so the
        runner caps max_model_len at it)."""
        return None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden [T, H] (after the final norm)."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] in the model's dtype (a float32 copy of bf16
        logits would add no information, only a pass over [N, vocab])."""
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(hidden, w)

    def _shard(self, merged: str, shard: int) -> tuple[int, int]:
        """(row offset, rows) of one HF projection inside a merged parameter."""
        if merged == "gate_up_proj":
            i = self.config.intermediate_size
            return shard * i, i
        nh, nkv, hd = _dims(self.config)
        sizes = [nh * hd, nkv * hd, nkv * hd]
        return sum(sizes[:shard]), sizes[shard]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters (casting to their dtype/device).
        ValueError on an unknown name, a shape mismatch or a missing parameter."""
        params = dict(self.named_parameters())
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
            dst = param.data
            if target is not None:
                dst = dst.narrow(0, *self._shard(target, shard))
            if tuple(dst.shape) != tuple(w.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(w.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(w)
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
