"""The KV cache per kv_cache_dtype (engine/kv_cache.py) and an fp8 e4m3 cache's scales
(engine/kv_scales.py) through ModelRunner and LLMEngine on the CPU, on tiny random
checkpoints: scales read from a checkpoint under vLLM's names, or fitted to the first
prefill; a model whose K and V pass e4m3's 448 keeps its accuracy with fitted scales and
loses it without; what a block costs; the device check."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedq.engine import kv_cache, kv_scales
from pagedq.engine.config import EngineConfig
from pagedq.engine.model_runner import ModelRunner
from pagedq.engine.scoring import next_token_logprobs

IDS = [(7 * i + 3) % 250 for i in range(120)]


def runner(folder, kv="auto", **kw) -> ModelRunner:
    return ModelRunner(str(folder), EngineConfig(device="cpu", dtype="float32", num_kv_blocks=16,
                                                 max_model_len=256, kv_cache_dtype=kv, **kw))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def scaled_model(src: Path, dst: Path, f: float) -> Path:
    """The same function with K and V f times larger: k_proj and v_proj times f, q_proj
    and o_proj divided by f (the rotary is linear; attention's output goes through o)."""
    copy_model(src, dst)
    path = dst / "model.safetensors"
    w = load_file(path)
    for name in w:
        for proj, mul in (("k_proj", f), ("v_proj", f), ("q_proj", 1 / f), ("o_proj", 1 / f)):
            if f".self_attn.{proj}.weight" in name:
                w[name] = w[name] * mul
    save_file(w, path, metadata={"format": "pt"})
    return dst


def kl(truth, lp) -> float:
    return float((truth.exp() * (truth - lp)).sum(-1).mean())


@pytest.fixture(scope="module")
def big_kv(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with K and V 400 times larger: past e4m3's 448."""
    return scaled_model(tiny_model_dir("LlamaForCausalLM"),
                        tmp_path_factory.mktemp("big") / "m", 400.0)


def test_scales_are_fitted_to_the_first_prefill(big_kv):
    """max(1, max|x| / 224) per layer and KV head, over what the first prefill stores; then
    the fp8 cache stays close to a float32 cache, where unit scales saturate and do not."""
    ref = runner(big_kv)
    truth = next_token_logprobs(ref, IDS, chunk=len(IDS))  # one prefill: the cache is its K/V
    fp8 = runner(big_kv, "fp8")
    assert fp8.kv_fit and "fitted to the first prefill" in fp8.kv_label
    got = next_token_logprobs(fp8, IDS, chunk=40)  # the first chunk fits them
    slots = torch.arange(len(IDS))[:40]
    for i, attn in enumerate(fp8.model.attention_layers()):
        assert not attn.fit_scales
        for j, name in enumerate(("k_scale", "v_scale")):
            stored = ref.kv_cache[j, i].flatten(0, 1)[slots]  # [40, Hkv, D]
            want = torch.clamp(stored.abs().amax(dim=(0, 2)) / kv_scales.FIT_TARGET, min=1.0)
            # (layer 0's K/V are the same; later layers' follow fp8 attention of the former)
            rtol = 0 if i == 0 else 0.05
            torch.testing.assert_close(attn.kv_quant[name], want, rtol=rtol, atol=0)
            assert (want > 1).all()  # this model needs them
    unit = runner(big_kv, "fp8")
    for attn in unit.model.attention_layers():
        attn.fit_scales = False
    saturated = next_token_logprobs(unit, IDS, chunk=40)
    assert all((a.kv_quant["k_scale"] == 1).all() for a in unit.model.attention_layers())
    assert kl(truth, got) < 0.02 and kl(truth, saturated) > 10 * kl(truth, got), \
        (kl(truth, got), kl(truth, saturated))


def test_a_model_within_range_keeps_unit_scales(tiny_model_dir):
    fp8 = runner(tiny_model_dir("LlamaForCausalLM"), "fp8")
    next_token_logprobs(fp8, IDS, chunk=64)
    for attn in fp8.model.attention_layers():
        assert (attn.kv_quant["k_scale"] == 1).all() and (attn.kv_quant["v_scale"] == 1).all()


def add_scales(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, folder / "kv_scales.safetensors", metadata={"format": "pt"})


def test_scales_from_the_checkpoint(tiny_model_dir, tmp_path):
    """vLLM's names (self_attn.k_scale; ModelOpt's v_proj.output_scale, per KV head; the
    older kv_scale for both) are taken out of the weights; other caches ignore them."""
    folder = copy_model(tiny_model_dir("LlamaForCausalLM"), tmp_path / "m")
    add_scales(folder, {"model.layers.0.self_attn.k_scale": torch.tensor(2.0),
                        "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([0.5, 3.0]),
                        "model.layers.1.self_attn.kv_scale": torch.tensor([1.5])})
    fp8 = runner(folder, "fp8")
    assert not fp8.kv_fit and fp8.kv_label == "float8_e4m3fn, scales of the checkpoint"
    layers = fp8.model.attention_layers()
    assert layers[0].kv_quant["k_scale"].tolist() == [2.0, 2.0]
    assert layers[0].kv_quant["v_scale"].tolist() == [0.5, 3.0]
    assert layers[1].kv_quant["k_scale"].tolist() == layers[1].kv_quant["v_scale"].tolist() \
        == [1.5, 1.5]
    truth = next_token_logprobs(runner(folder), IDS, chunk=50)
    assert kl(truth, next_token_logprobs(fp8, IDS, chunk=50)) < 0.02
    assert layers[0].kv_quant["k_scale"].tolist() == [2.0, 2.0]  # not fitted over
    for kv in ("int8", "fp8_e5m2", "auto"):
        assert "scale" not in runner(folder, kv).model.attention_layers()[0].kv_quant


def test_checkpoint_scales_must_cover_every_layer(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir("LlamaForCausalLM"), tmp_path / "m")
    add_scales(folder, {"model.layers.0.self_attn.k_scale": torch.tensor(2.0),
                        "model.layers.0.self_attn.v_scale": torch.tensor(2.0)})
    with pytest.raises(ValueError, match="none for layer 1's K"):
        runner(folder, "fp8")
    add_scales(folder, {f"model.layers.{i}.self_attn.kv_scale": torch.tensor([1.0, 2.0, 3.0])
                        for i in range(2)})
    with pytest.raises(ValueError, match=r"one value or one per KV head \(2\)"):
        runner(folder, "fp8")


def test_a_kv_cache_only_quantization_config_loads_plain_weights(tiny_model_dir, tmp_path):
    """compressed-tensors with a kv_cache_scheme and no config_groups: the weights are
    plain, the scales the cache's; another quantization asked for is refused."""
    folder = copy_model(tiny_model_dir("LlamaForCausalLM"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                  "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                      "strategy": "tensor"}}
    (folder / "config.json").write_text(json.dumps(cfg))
    add_scales(folder, {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.5)
                        for i in range(2) for kv in "kv"})
    fp8 = runner(folder, "fp8")
    assert fp8.quant is None and fp8.model.attention_layers()[1].kv_quant["v_scale"][0] == 0.5
    with pytest.raises(ValueError, match="quantizes only its KV cache"):
        runner(folder, "fp8", quantization="gptq")


def test_block_bytes_count_int8_scales(tiny_model_dir):
    """2 layers, 2 KV heads, head_dim 16, blocks of 16: per token and head, K and V, float32
    16 x 4 bytes, 8-bit 16 bytes, int8 16 + a 4-byte scale."""
    per = {"auto": 64, "fp8": 16, "fp8_e5m2": 16, "int8": 20}
    for kv, b in per.items():
        r = runner(tiny_model_dir("LlamaForCausalLM"), kv)
        assert r.block_bytes() == 2 * 2 * 16 * 2 * b, kv
        if kv == "int8":
            assert r.kv_scale_cache.shape == (2, 2, 16, 16, 2)
            assert r.kv_label == "int8, scale per token and head"


def test_a_gpu_without_e4m3_gets_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    dev = torch.device("cuda", 0)
    with pytest.raises(ValueError) as e:
        kv_cache.check_device(kv_cache.kv_format("fp8", torch.bfloat16), dev)
    assert str(e.value) == ("kv_cache_dtype fp8_e4m3 (float8_e4m3fn) needs a GPU of compute "
                            "capability 8.9 or more; cuda:0 (NVIDIA A100) is 8.0: use "
                            "fp8_e5m2 or int8")
    for ok in ("fp8_e5m2", "int8", "auto"):
        kv_cache.check_device(kv_cache.kv_format(ok, torch.bfloat16), dev)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    kv_cache.check_device(kv_cache.kv_format("fp8", torch.bfloat16), dev)


def test_the_worker_names_the_setting_in_that_line():
    from pagedq.cli import build_parser
    from pagedq.worker.config import resolve

    cfg = resolve(build_parser().parse_args(["worker", "--kv-cache-dtype", "fp8"]))
    line = cfg.explain("kv_cache_dtype fp8_e4m3 (float8_e4m3fn) needs a GPU of compute "
                       "capability 8.9 or more; cuda:0 (X) is 8.0: use fp8_e5m2 or int8")
    assert line.startswith("--kv-cache-dtype fp8_e4m3 (float8_e4m3fn) needs a GPU")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "int8"])
def test_engine_generates_with_each_8bit_cache(tiny_model_dir, kv):
    """LLMEngine end to end (its accuracy: tests/test_kv_fp8.py, on SmolLM2; a random tiny
    model's flat distributions make greedy tokens part ways at once): an fp8 e4m3 cache
    fits its scales in the first step and never again."""
    from pagedq.engine import LLMEngine, SamplingParams

    folder = tiny_model_dir("LlamaForCausalLM")
    prompts = [IDS[:40], IDS[10:90], IDS[5:20]]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for cache in ("auto", kv):
        with LLMEngine(str(folder), device="cpu", dtype="float32", kv_cache_dtype=cache,
                       num_kv_blocks=32, max_model_len=256) as llm:
            outs[cache] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            assert not llm.runner.kv_fit
            assert not any(a.fit_scales for a in llm.runner.model.attention_layers())
    assert [len(t) for t in outs[kv]] == [24] * 3


def test_checkpoint_scales_per_head_go_to_each_rank_its_heads(tiny_model_dir, tmp_path):
    """A tensor-parallel rank takes its KV heads' scales (engine/parallel.py head_slice),
    also where ranks share a KV head (4 ranks, 2 KV heads)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    folder = tiny_model_dir("LlamaForCausalLM")
    hf = AutoConfig.from_pretrained(folder)  # 4 heads, 2 KV heads, 2 layers
    cs = kv_scales.CheckpointScales()
    names = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([1.0 + i, 10.0 + i])
             for i in range(2) for kv in "kv"}
    assert list(cs.take(list(names.items()) + [("x.weight", torch.ones(1))])) == \
        [("x.weight", torch.ones(1))]
    for size, rank, head in ((1, 0, [0, 1]), (2, 0, [0]), (2, 1, [1]), (4, 1, [0]),
                             (4, 2, [1])):
        t = cs.tensor(hf, SimpleNamespace(size=size, rank=rank), 2, torch.device("cpu"))
        per_layer = ([1.0, 10.0], [2.0, 11.0])  # K's (= V's) per head, layers 0 and 1
        want = torch.tensor([[[s[h] for h in head]] * 2 for s in per_layer])
        assert torch.equal(t, want), (size, rank)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_tensor_parallel_engine_with_an_8bit_cache(tiny_model_dir, kv):
    """Two gloo ranks, each with its own KV heads' cache and scales (fitted on each rank
    to its heads), serve a greedy batch to the end."""
    from pagedq.engine import LLMEngine, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), device="cpu", dtype="float32",
                   kv_cache_dtype=kv, num_kv_blocks=32, max_model_len=256,
                   tensor_parallel_size=2) as llm:
        outs = llm.generate([IDS[:30], IDS[40:50]], sp, use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [8, 8]
        assert llm.runner.model.num_kv_heads == 1 and not llm.runner.kv_fit
