"""Quantized checkpoints through the engine: tiny random models written by the reference
quantizers of tests/quant_writers.py in each format (AWQ GEMM, GPTQ in its variants, GGUF
Q4_0 / Q4_1 / Q8_0) give the same greedy tokens as the same models with the weights
dequantized. On the CPU a float32 model dequantizes at load and a bfloat16 one keeps the
weights quantized (kernels/cpu.py dequantizes each GEMM's weight on the fly): both compute
bit for bit what the dequantized model computes, so the tokens, and the logits, are equal.
"""
from __future__ import annotations

import json

import pytest
import torch

from pagedq.engine import LLMEngine, SamplingParams
from pagedq.engine.config import EngineConfig
from pagedq.engine.loader import resolve_model
from pagedq.engine.model_runner import ModelRunner
from pagedq.engine.quant.detect import detect
from pagedq.engine.scoring import next_token_logprobs
from tests import quant_writers as qw
from tests.model_fixtures import _tiny_config, tiny_tokenizer

PROMPTS = [[5, 77, 200, 31, 9], [300, 2, 2, 2, 150, 64, 99, 500], [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def tiny_wide(arch: str, folder, seed: int = 0, **over):
    """A tiny random checkpoint with 128 inputs per projection (group 128 fits)."""
    import transformers
    cfg = _tiny_config(arch)
    for k, v in {"hidden_size": 128, "intermediate_size": 256, **over}.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    getattr(transformers, arch)(cfg).float().eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def greedy(folder, **kw) -> list[list[int]]:
    engine = LLMEngine(str(folder), device="cpu", num_kv_blocks=64, max_model_len=128, **kw)
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def logits(folder, **kw) -> torch.Tensor:
    runner = ModelRunner(str(folder), EngineConfig(device="cpu", num_kv_blocks=8,
                                                   max_model_len=128, **kw))
    return next_token_logprobs(runner, PROMPTS[1] + PROMPTS[0], chunk=4), runner


def check_equal(quant, dense, dtype: str, summary: str) -> None:
    got, runner = logits(quant, dtype=dtype)
    want, _ = logits(dense, dtype=dtype, quantization="none")
    assert torch.equal(got, want), (got - want).abs().max()
    assert summary in runner.quant_summary, runner.quant_summary
    held = "dequantized at load" if dtype == "float32" else "kept quantized"
    assert held in runner.quant_summary, runner.quant_summary
    assert greedy(quant, dtype=dtype) == greedy(dense, dtype=dtype, quantization="none")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = tiny_wide(arch, tmp_path_factory.mktemp(arch))
        return made[arch]
    return get


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_awq_gemm_checkpoint(wide, tmp_path, arch):
    qw.write_awq(wide(arch), tmp_path / "awq", tmp_path / "dense", group=64)
    for dtype in ("bfloat16", "float32"):
        check_equal(tmp_path / "awq", tmp_path / "dense", dtype, "awq int4 g64")


GPTQ = [  # bits, group, sym, desc_act, v2, quantize_config.json
    (4, 128, True, False, False, False),
    (4, 128, False, True, False, False),
    (8, 64, True, True, True, True),
    (4, -1, False, False, False, False),
]


@pytest.mark.parametrize("bits,group,sym,act,v2,cfg_file", GPTQ)
def test_gptq_checkpoint(wide, tmp_path, bits, group, sym, act, v2, cfg_file):
    qw.write_gptq(wide("Qwen3ForCausalLM" if act else "LlamaForCausalLM"), tmp_path / "q",
                  tmp_path / "dense", bits=bits, group=group, sym=sym, desc_act=act, v2=v2,
                  config_file=cfg_file)
    label = f"int{bits} g{group}" if group > 0 else f"int{bits} per-channel"
    for dtype in ("bfloat16", "float32") if act else ("bfloat16",):
        check_equal(tmp_path / "q", tmp_path / "dense", dtype, f"gptq {label}")
    if act:  # act-order layers of several groups hold their row order; of one group (128
        # inputs in groups of 128) the order changes nothing, and is dropped
        runner = logits(tmp_path / "q", dtype="bfloat16")[1]
        mlp, attn = runner.model.model.layers[0].mlp, runner.model.model.layers[0].self_attn
        assert mlp.down_proj.perm is not None and mlp.down_proj.perm.shape == (256,)
        assert (attn.qkv_proj.perm is None) == (group == 128)


def test_gptq_act_order_with_another_order_per_projection_is_refused(wide, tmp_path):
    qw.write_gptq(wide("LlamaForCausalLM"), tmp_path / "q", tmp_path / "d", group=32,
                  desc_act=True)
    from safetensors.torch import load_file, save_file
    f = tmp_path / "q" / "model.safetensors"
    state = load_file(str(f))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()  # still an act-order g_idx, another one
    save_file(state, str(f))
    with pytest.raises(ValueError, match="self_attn.*another act-order row order than the"):
        greedy(tmp_path / "q", dtype="bfloat16")


GGUF = [  # arch, linear type, embedding type, per-tensor types
    ("LlamaForCausalLM", "Q4_0", "Q8_0", None),  # tied; llama.cpp's q/k permutation
    ("Qwen3ForCausalLM", "Q4_1", "F16", None),  # q/k norms, tied, dense embedding
    ("Qwen2ForCausalLM", "Q8_0", "Q4_1", {"blk.0.attn_v.weight": "Q4_0"}),  # biases,
    # an untied output, and a q/k/v of two types: that projection stays dense
]


@pytest.mark.parametrize("arch,linear,embedding,types", GGUF, ids=[g[1] for g in GGUF])
def test_gguf_file(tmp_path, arch, linear, embedding, types):
    import transformers
    cfg = _tiny_config(arch)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}  # as GGUF holds it
    if arch == "Qwen3ForCausalLM":  # transformers reads no head_dim from a qwen3 GGUF: its
        cfg.head_dim = 128  # default, as real Qwen3 files have
    torch.manual_seed(1)
    getattr(transformers, arch)(cfg).float().eval().save_pretrained(tmp_path / "src")
    tiny_tokenizer().save_pretrained(tmp_path / "src")
    path = qw.write_gguf(tmp_path / "src", tmp_path / f"tiny-{linear}.gguf", linear, embedding,
                         types)
    # the reference: the same file dequantized to float by transformers (quantization none)
    for dtype in ("bfloat16", "float32"):
        got, runner = logits(path, dtype=dtype)
        want, plain = logits(path, dtype=dtype, quantization="none")
        assert plain.quant_summary == "GGUF dequantized to float by transformers " \
            "(quantization none)"
        assert torch.equal(got, want), (dtype, (got - want).abs().max())
        assert runner.quant_summary.startswith("gguf ") and linear in runner.quant_summary
    runner = logits(path, dtype="bfloat16")[1]
    embed = runner.model.model.embed_tokens
    if embedding in ("Q8_0", "Q4_1"):  # a quantized table: rows as F.embedding lays them
        assert type(embed).__name__ == "QuantEmbedding"
        assert embed(torch.tensor([3, 1, 4, 1])).is_contiguous()
    layers = runner.model.model.layers
    kinds = {type(layers[0].self_attn.qkv_proj).__name__, type(layers[1].mlp.down_proj).__name__}
    assert kinds == ({"ColumnParallelLinear", "QuantLinear"} if types else {"QuantLinear"})
    assert greedy(path, dtype="bfloat16") == greedy(path, dtype="bfloat16", quantization="none")


@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["bitsandbytes", "awq"]),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, ["fp8"]),
    ({"quant_method": "exl2", "bits": 4.0}, ["exl2"]),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, ["'gemv'"]),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ["bits 3"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     ["'marlin'"]),
])
def test_unsupported_methods_are_one_clear_error(tiny_model_dir, tmp_path, qc, words):
    folder = tmp_path / "m"
    folder.mkdir()
    for f in tiny_model_dir("LlamaForCausalLM").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ValueError) as e:
        detect(resolve_model(folder))
    assert all(w in str(e.value) for w in words), e.value
    assert "\n" not in str(e.value)


def test_requested_method_must_match_the_checkpoint(tiny_model_dir, tmp_path, wide):
    plain = resolve_model(tiny_model_dir("LlamaForCausalLM"))
    assert detect(plain, "auto") is None and detect(plain, "none") is None
    with pytest.raises(ValueError, match="no quantization config.*no awq checkpoint"):
        detect(plain, "awq")
    with pytest.raises(ValueError, match="is a folder, not a .gguf file"):
        detect(plain, "gguf")
    qw.write_awq(wide("LlamaForCausalLM"), tmp_path / "awq", tmp_path / "d", group=64)
    awq = resolve_model(tmp_path / "awq")
    assert detect(awq, "awq").method == "awq"
    with pytest.raises(ValueError, match="is a awq checkpoint.*not gptq"):
        detect(awq, "gptq")
    with pytest.raises(ValueError, match="cannot load unquantized; give --quantization auto"):
        detect(awq, "none")
    smol = resolve_model("smollm2")
    assert detect(smol, "none") is None
    assert detect(smol).summary() == "gguf Q4_1 x210, Q8_0 x1"
    with pytest.raises(ValueError, match="is a GGUF file, not a gptq checkpoint"):
        detect(smol, "gptq")


def test_gguf_of_types_not_kept_quantized_is_refused(tmp_path, tiny_model_dir):
    src = tiny_model_dir("LlamaForCausalLM")
    path = qw.write_gguf(src, tmp_path / "k.gguf", "Q4_0", "Q5_0",
                         {"blk.0.ffn_down.weight": "Q5_1", "blk.1.ffn_down.weight": "Q5_1"})
    with pytest.raises(ValueError, match=r"type Q5_1 \(2 tensors\).*--quantization none"):
        detect(resolve_model(path))
    # an embedding of another type is dequantized at load: the rest stays quantized
    ok = qw.write_gguf(src, tmp_path / "ok.gguf", "Q4_0", "Q5_0")
    assert detect(resolve_model(ok)).summary() == "gguf Q4_0"
    got, runner = logits(ok, dtype="bfloat16")
    assert type(runner.model.model.embed_tokens).__name__ == "VocabParallelEmbedding"
    assert torch.equal(got, logits(ok, dtype="bfloat16", quantization="none")[0])


def test_dummy_weights_take_the_configs_format(tmp_path, tiny_model_dir):
    """load_format dummy + a quantization_config: random int4 layers (the benchmark's)."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    cfg = json.loads((tiny_model_dir("LlamaForCausalLM") / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                  "sym": True, "desc_act": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    runner = ModelRunner(str(folder), EngineConfig(device="cpu", dtype="bfloat16",
                                                   load_format="dummy", num_kv_blocks=8))
    assert runner.quant_summary == "gptq int4 g32 (sym, act-order), kept quantized"
    lp = next_token_logprobs(runner, [1, 2, 3, 4, 5], chunk=2)
    assert torch.isfinite(lp).all()


def test_pagedq_gguf_reader_gives_transformers_float_values_bit_for_bit():
    """SmolLM2 (Q4_1 projections, a Q8_0 embedding, llama.cpp's q/k row order): every tensor
    pagedq reads from the file, dense from the blocks and through the quantized layout,
    equals the float32 weight transformers dequantizes (its cache: what a float32 CPU
    model and tensor-parallel ranks load)."""
    from pagedq.engine.loader import hf_folder, iter_safetensors, load_model_files
    from pagedq.engine.quant import gguf

    source = resolve_model("smollm2")
    want = dict(iter_safetensors(hf_folder(source)))
    cfg = load_model_files(source, tokenizer=False, quant=detect(source))[0]
    seen = 0
    for name, w in gguf.iter_weights(source.path, cfg):
        if hasattr(w, "quantized"):
            assert torch.equal(w.dense(), want[name]), name
            if seen % 20 == 0:  # the quantized layout's values too (every 20th: time)
                assert torch.equal(w.quantized().dense(), want[name]), name
        else:
            assert torch.equal(w.float(), want[name]), name
        seen += 1
    assert seen == len(want) == 272  # every tensor of the file, none left out
