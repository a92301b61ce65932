"""Reference quantizers for tests: a float checkpoint's projections quantized (round to
nearest, per group of input rows) and packed exactly as AutoAWQ (GEMM), AutoGPTQ /
GPTQModel and llama.cpp (GGUF, written with the gguf package) lay them out, next to the
same model with those weights dequantized (a plain float32 folder).

Written from the formats' definitions (each field's position spelled out, as the
quantizers' own packers place it), importing nothing from pagedq.engine.quant or
pagedq.kernels, so that loading these files checks the engine's readers against an
independent writer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# projections that read the same input: quantized with one act-order permutation (as GPTQ
# does: one Hessian per input)
SAME_INPUT = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              ("mlp.gate_proj", "mlp.up_proj"), ("self_attn.o_proj",), ("mlp.down_proj",))
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _int32(v: torch.Tensor) -> torch.Tensor:
    """int64 words < 2**32 -> int32 with the same bits."""
    return (((v + 2**31) % 2**32) - 2**31).to(torch.int32)


def rtn(w: torch.Tensor, groups: torch.Tensor, n_groups: int, bits: int, sym: bool):
    """w [N, K] float32, groups [K] (the group of each input column) -> (codes [N, K],
    zeros [N, G] int64, scales [N, G] float16)."""
    maxq = (1 << bits) - 1
    n = w.shape[0]
    scales = torch.empty(n, n_groups, dtype=torch.float16)
    zeros = torch.empty(n, n_groups, dtype=torch.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-6).half()
        scales[:, g] = s
        zeros[:, g] = (1 << (bits - 1)) if sym else torch.round(-lo / s.float()).clamp(0, maxq)
    s = scales.float()[:, groups]
    codes = torch.clamp(torch.round(w / s) + zeros[:, groups], 0, maxq).to(torch.int64)
    return codes, zeros, scales


def dequantized(codes, zeros, scales, groups) -> torch.Tensor:
    return (codes - zeros[:, groups]).float() * scales.float()[:, groups]


def pack_awq(ints: torch.Tensor) -> torch.Tensor:
    """[R, N] ints -> [R, N / 8] int32: nibble i of word j = column 8j + AWQ_ORDER[i]."""
    r, n = ints.shape
    nibbles = ints.to(torch.int64).view(r, n // 8, 8)[..., list(AWQ_ORDER)]  # [.., i]
    return _int32((nibbles << (4 * torch.arange(8))).sum(-1))


def pack_gptq_rows(ints: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] ints -> [K / P, N] int32, row P*j + i in bits i*b.. of word j."""
    p = 32 // bits
    k, n = ints.shape
    fields = ints.to(torch.int64).view(k // p, p, n)  # [j, i, n] = row P*j + i
    return _int32((fields << (bits * torch.arange(p)).view(1, p, 1)).sum(1))


def pack_gptq_columns(ints: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, N] ints -> [R, N / P] int32, column P*j + i in bits i*b.. of word j."""
    return pack_gptq_rows(ints.t().contiguous(), bits).t().contiguous()


def _copy_folder(src: Path, out: Path, quant_config: dict | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(cfg))
    return cfg


def _projections(state: dict) -> list[str]:
    return sorted({k.removesuffix(".weight") for k in state
                   if k.endswith(".weight") and any(f".{p}." in k + "." for p in PROJ)})


def write_awq(src: Path, out: Path, dense_out: Path, group: int = 32) -> None:
    """AutoAWQ GEMM checkpoint of ``src``'s projections (4-bit, zero points) in ``out``;
    the same weights dequantized, float32, in ``dense_out``."""
    state = load_file(str(next(src.glob("*.safetensors"))))
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
          "version": "gemm", "modules_to_not_convert": None}
    _copy_folder(src, out, qc)
    _copy_folder(src, dense_out, None)
    q_state, d_state = dict(state), dict(state)
    for stem in _projections(state):
        w = q_state.pop(stem + ".weight").float()
        k = w.shape[1]
        groups = torch.arange(k) // group
        codes, zeros, scales = rtn(w, groups, k // group, 4, sym=False)
        q_state[stem + ".qweight"] = pack_awq(codes.t().contiguous())  # [K, N / 8]
        q_state[stem + ".qzeros"] = pack_awq(zeros.t().contiguous())  # [K / G, N / 8]
        q_state[stem + ".scales"] = scales.t().contiguous()  # [K / G, N]
        d_state[stem + ".weight"] = dequantized(codes, zeros, scales, groups)
    save_file(q_state, str(out / "model.safetensors"))
    save_file(d_state, str(dense_out / "model.safetensors"))


def write_gptq(src: Path, out: Path, dense_out: Path, *, bits: int = 4, group: int = 128,
               sym: bool = True, desc_act: bool = False, v2: bool = False, seed: int = 0,
               config_file: bool = False) -> None:
    """An AutoGPTQ / GPTQModel checkpoint (format gptq: zeros stored minus one; gptq_v2:
    as they are) in ``out``, its dequantized twin in ``dense_out``. ``desc_act``: each
    input's columns quantized in a random order (g_idx[perm[i]] = i // group), shared by
    the projections of one input. ``config_file``: quantize_config.json instead of
    config.json's quantization_config."""
    state = load_file(str(next(src.glob("*.safetensors"))))
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
          "sym": sym, "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
          "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    _copy_folder(src, out, None if config_file else qc)
    if config_file:
        (out / "quantize_config.json").write_text(json.dumps(qc))
    _copy_folder(src, dense_out, None)
    q_state, d_state = dict(state), dict(state)
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for stem in _projections(state):
        w = q_state.pop(stem + ".weight").float()
        n, k = w.shape
        size = k if group == -1 else group  # -1: one group of all inputs
        n_groups = -(-k // size)
        g_idx = torch.arange(k) // size
        if desc_act:
            layer, part = stem.rsplit(".", 2)[0], ".".join(stem.rsplit(".", 2)[1:])
            share = next(i for i, ps in enumerate(SAME_INPUT) if part in ps)
            if (layer, share) not in perms:
                perms[(layer, share)] = torch.randperm(k, generator=gen)
            perm = perms[(layer, share)]
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // size
        codes, zeros, scales = rtn(w, g_idx, n_groups, bits, sym)
        stored = zeros if v2 else zeros - 1
        q_state[stem + ".qweight"] = pack_gptq_rows(codes.t().contiguous(), bits)
        q_state[stem + ".qzeros"] = pack_gptq_columns(
            (stored & ((1 << bits) - 1)).t().contiguous(), bits)
        q_state[stem + ".scales"] = scales.t().contiguous()
        q_state[stem + ".g_idx"] = g_idx.to(torch.int32)
        d_state[stem + ".weight"] = dequantized(codes, zeros, scales, g_idx)
    save_file(q_state, str(out / "model.safetensors"))
    save_file(d_state, str(dense_out / "model.safetensors"))


# ---- GGUF (llama.cpp) -------------------------------------------------------------------

def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row order for llama: [h, 2, d/2] -> [h, d/2, 2]."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.N.<part...>.<leaf>
    return f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(src: Path, path: Path, linear: str = "Q4_0", embedding: str = "Q8_0",
               types: dict[str, str] | None = None) -> Path:
    """A GGUF file of ``src`` (a tiny HF folder with the byte-level tokenizer of
    tests/model_fixtures.py): projections of type ``linear``, the token embedding (and an
    untied output) of type ``embedding``, norms F32; ``types`` overrides by GGUF name.
    llama checkpoints get llama.cpp's q/k row permutation, as its converter writes them."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    cfg = json.loads((src / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3"}[cfg["architectures"][0]]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    alphabet = sorted(ByteLevel.alphabet(), key=ord)
    tokens = alphabet + ["<|endoftext|>", "<|pad|>"]
    tokens += [f"<|unused{i}|>" for i in range(cfg["vocab_size"] - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL]
                      * (len(tokens) - 256))
    w.add_token_scores([0.0] * len(tokens))  # (no merges: transformers derives none from them)
    w.add_bos_token_id(256)
    w.add_eos_token_id(256)
    w.add_pad_token_id(257)
    state = load_file(str(next(src.glob("*.safetensors"))))
    for name, t in state.items():
        data = t.float().numpy()
        gname = _gguf_name(name)
        if arch == "llama" and ".self_attn.q_proj." in name:
            data = _llama_cpp_permute(data, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            data = _llama_cpp_permute(data, kv)
        kind = (types or {}).get(gname)
        if kind is None:
            kind = "F32" if data.ndim == 1 else embedding if gname in (
                "token_embd.weight", "output.weight") else linear
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(gname, data.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(gname, data.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
