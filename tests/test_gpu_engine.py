"""The engine on CUDA (Triton kernels, CUDA graphs) against the CPU reference path, greedy,
for a fixed random model; its memory budget; engine after engine giving the device memory
back. Skipped without CUDA."""
from __future__ import annotations

import gc
import json
import random
import weakref

import pytest
import torch

from pagedq.engine import LLMEngine, SamplingParams
from pagedq.engine.llm_engine import PREFILL_WAIT_STEPS
from tests.test_engine import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_cuda_engine_greedy_equals_cpu_reference(arch, tiny_model_dir):
    folder = str(tiny_model_dir(arch))
    rng = random.Random(3)
    prompts = [rng.choices(range(400), k=n) for n in (7, 33, 64, 120, 5)]
    g = dict(temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{k}", p, SamplingParams(max_tokens=24, **g))
                    for k, p in enumerate(prompts[:3])],
                4: [(f"r{k}", p, SamplingParams(max_tokens=30, **g))
                    for k, p in enumerate(prompts[3:], 3)]}
    cfg = dict(dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64,
               max_num_seqs=8)
    ref = run(LLMEngine(folder, device="cpu", **cfg), arrivals)
    eager = run(LLMEngine(folder, device="cuda", enforce_eager=True, **cfg), arrivals)
    graphs_engine = LLMEngine(folder, device="cuda", **cfg)
    assert graphs_engine.runner.graphs, "CUDA graphs were not captured"
    assert graphs_engine.runner.piecewise.sizes == [64]  # steps that prefill: in pieces
    assert graphs_engine.runner.graph_bytes > 0  # the start line reports the pools
    # the step-4 arrivals are held while the batch decodes (prefill_wait_steps' default)
    assert graphs_engine.config.prefill_wait_steps == PREFILL_WAIT_STEPS > 0
    graphs = run(graphs_engine, arrivals)
    assert eager == ref
    assert graphs == ref


def test_cuda_guided_rows_async_equal_cpu_reference(tiny_model_dir):
    """Guided rows on CUDA with async scheduling (masks built from the step in flight's
    tokens, pinned, applied by the Triton mask kernel) give the CPU engine's greedy tokens,
    beside unguided rows, through CUDA graphs."""
    from pagedq.wire.guided import GuidedSpec
    folder = str(tiny_model_dir("Qwen3ForCausalLM"))
    rng = random.Random(5)
    prompts = [rng.choices(range(250), k=n) for n in (9, 40, 3, 70)]
    schema = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99999},
                             "b": {"type": "array", "items": {"enum": ["x", "yz"]}}}}
    specs = [GuidedSpec.of("json_schema", schema), None, GuidedSpec("regex", "[a-f]{2,9}-[0-9]{3}"),
             GuidedSpec.of("choice", ["left", "right"])]
    arrivals = {0: [(f"g{k}", p, SamplingParams(max_tokens=32, temperature=0.0, guided=s))
                    for k, (p, s) in enumerate(zip(prompts[:2], specs[:2], strict=True))],
                3: [(f"g{k}", p, SamplingParams(max_tokens=32, temperature=0.0, guided=s))
                    for k, (p, s) in enumerate(zip(prompts[2:], specs[2:], strict=True), 2)]}
    cfg = dict(dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64,
               max_num_seqs=8)
    ref = run(LLMEngine(folder, device="cpu", **cfg), arrivals)
    eng = LLMEngine(folder, device="cuda", **cfg)
    assert eng.pipeline.allow_async and eng.runner.graphs
    assert run(eng, arrivals) == ref
    assert eng.guided.cache.compiles == 3 and not eng.guided


def test_device_memory_stays_within_gpu_memory_utilization(tmp_path):
    """The KV cache's budget leaves room for the CUDA graphs' pools (decode and piecewise)
    and a full step's activations: after steps of every kind, the device memory in use
    stays under gpu_memory_utilization of the total."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
               hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
               rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16",
               tie_word_embeddings=False, eos_token_id=0, bos_token_id=0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    util = (total - free) / total + 0.15  # what others hold now, and 15% (~21 GiB) more
    engine = LLMEngine(str(tmp_path), device="cuda", load_format="dummy", max_model_len=4096,
                       max_num_batched_tokens=12288, max_num_seqs=64,
                       gpu_memory_utilization=util)
    assert engine.runner.piecewise.sizes[-1] == 8192 and engine.runner.graph_bytes > 2**28
    rng = random.Random(0)
    once = SamplingParams(max_tokens=8, ignore_eos=True)
    # an 11,192-token step (eager: above the piecewise sizes), then decode steps (graphs)
    engine.generate([rng.choices(range(32000), k=n) for n in (4000, 4000, 3192)], once,
                    use_tqdm=False)
    # an 8,096-token step (the largest piecewise size)
    engine.generate([rng.choices(range(32000), k=n) for n in (4000, 3096, 700, 300)], once,
                    use_tqdm=False)
    torch.cuda.synchronize()
    used = total - torch.cuda.mem_get_info()[0]
    slack = 2**27  # allocator rounding: segments are carved in 2 MiB pieces
    assert used <= util * total + slack, (
        f"{(used - util * total) / 2**20:.0f} MiB over; graphs "
        f"{engine.runner.graph_bytes / 2**20:.0f} MiB, KV {engine.runner.num_kv_blocks} blocks")


MiB = 2**20


def dummy_llama(folder, **dims) -> str:
    """A folder holding only the config.json of a Llama shape (load_format="dummy": random
    weights)."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
               max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
               torch_dtype="bfloat16", tie_word_embeddings=False, eos_token_id=0,
               bos_token_id=0, **dims)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.mark.parametrize("release", ["close", "del"])
def test_engine_after_engine_gives_the_device_memory_back(release, tmp_path):
    """Eight engines built, used and released in a row, by close() or by ``del`` alone with
    the collector off: after each, torch.cuda.memory_allocated() is back within 16 MiB of
    where it started, the KV cache and the weights are gone, and the next engine gets the
    same KV cache. Each sizes its KV cache from free memory (a warm-up step and a capture
    of the graphs to measure them, then the real capture): decode and piecewise graphs.
    One engine first, before the start is read: what a process keeps once for all engines
    (cuBLAS workspaces of the default and capture streams, engine/capture.py)."""
    folder = dummy_llama(tmp_path, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    cfg = dict(device="cuda", load_format="dummy", max_model_len=2048, max_num_seqs=32,
               max_num_batched_tokens=1024,
               gpu_memory_utilization=(total - free) / total + 0.05)  # ~7 GiB of an H200
    rng = random.Random(0)
    prompts = [rng.choices(range(32000), k=n) for n in (700, 300, 90, 33, 5)]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True)

    def use(eng: LLMEngine) -> list:
        assert eng.runner.graphs and eng.runner.piecewise is not None
        outs = eng.generate(prompts, params, use_tqdm=False)  # piecewise, then decode graphs
        assert [len(o.token_ids) for o in outs] == [24] * len(prompts)
        return [weakref.ref(eng.runner.kv_cache)] + [
            weakref.ref(p) for p in eng.runner.model.parameters()]

    before = torch.cuda.memory_allocated()
    with LLMEngine(folder, **cfg) as first:
        refs = use(first)
        blocks, per_block = first.runner.num_kv_blocks, first.runner.block_bytes()
    assert all(r() is None for r in refs), "close() kept the KV cache or weights"
    start = torch.cuda.memory_allocated()
    lines = [f"kept for the process by the first engine: {(start - before) / MiB:.1f} MiB; "
             f"KV cache {blocks} blocks"]
    gc.disable()
    try:
        for k in range(8):
            eng = LLMEngine(folder, **cfg)
            held = torch.cuda.memory_allocated() - start
            got = eng.runner.num_kv_blocks
            refs = use(eng)
            if release == "close":
                eng.close()
            del eng
            after = torch.cuda.memory_allocated() - start
            lines.append(f"engine {k}: {held / MiB:.0f} MiB while built, {after / MiB:+.1f} "
                         f"MiB after {release}; KV cache {got} blocks")
            assert all(r() is None for r in refs), "\n".join(lines)
            assert abs(after) <= 16 * MiB, "\n".join(lines)
            # none held back: each engine gets the KV cache of the first one built after the
            # process's own keep (the warm-up engine's, less what the process keeps)
            if k == 0:
                loop_blocks = got
                kept = max(0, start - before)
                assert got >= blocks - (kept + 16 * MiB) // per_block, "\n".join(lines)
            assert got >= loop_blocks - 16 * MiB // per_block, "\n".join(lines)
    finally:
        gc.enable()
    print("\n".join(lines))


def test_cuda_prompt_logprobs_equal_cpu_reference(tiny_model_dir):
    """Prompt logprobs on CUDA (Triton kernels, piecewise CUDA graphs for the steps that
    prefill, async scheduling) beside plain requests: chunked, one of them scoring the
    prompt of a plain request beside it (whose blocks enter the prefix cache), one with
    max_tokens 0; equal to the CPU engine's (float32), the tokens generated alike."""
    from tests.test_prompt_logprobs import drive
    folder = str(tiny_model_dir("Qwen3ForCausalLM"))
    rng = random.Random(8)
    shared = rng.choices(range(400), k=48)
    prompts = [shared + rng.choices(range(400), k=n) for n in (9, 70, 2)]
    g = dict(temperature=0.0, ignore_eos=True)
    reqs = [("warm", prompts[0], SamplingParams(max_tokens=6, **g)),
            ("a", prompts[0], SamplingParams(max_tokens=6, prompt_logprobs=4, **g)),
            ("b", prompts[1], SamplingParams(max_tokens=0, prompt_logprobs=1, **g)),
            ("c", prompts[2], SamplingParams(max_tokens=12, **g))]
    cfg = dict(dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64,
               max_num_seqs=8)
    ref = drive(LLMEngine(folder, device="cpu", **cfg), reqs)
    eng = LLMEngine(folder, device="cuda", **cfg)
    assert eng.pipeline.allow_async and eng.runner.piecewise is not None
    got = drive(eng, reqs)
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in ref.items()}
    for rid in ("a", "b"):
        (want,), (have,) = ref[rid]["plp"], got[rid]["plp"]
        assert [e.token_id for e in have] == [e.token_id for e in want]
        assert all(abs(x.logprob - y.logprob) < 1e-3 and [t for t, _ in x.top] == [
            t for t, _ in y.top] for x, y in zip(want[1:], have[1:], strict=True))
    assert got["b"]["ids"] == [] and eng.pipeline.scoring == 0


def test_the_first_engine_of_a_process_gives_the_device_memory_back_by_del_alone(tmp_path):
    """Issue 37: in a process whose collector is off from its first line, the first engine
    released by ``del`` alone (no close()) kept its memory (83 GiB on an H200). Here four
    engines, the first included, are built, used (piecewise and decode graphs, every
    sampler path) and dropped by ``del``: after each, nothing of it is alive and
    torch.cuda.memory_allocated() is within 0.1 GiB of the process's start (what the
    process keeps once, its cuBLAS workspaces, included); no reference cycle holds
    anything of pagedq (tests/engine_lifetime_child.py)."""
    from tests.test_engine_close import lifetime_in_a_fresh_process

    folder = dummy_llama(tmp_path, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8)
    free, total = torch.cuda.mem_get_info()
    lines = lifetime_in_a_fresh_process(
        "cuda", folder, 4, load_format="dummy", max_model_len=2048, max_num_seqs=32,
        max_num_batched_tokens=1024, gpu_memory_utilization=(total - free) / total + 0.05)
    print("\n".join(map(str, lines)))
    for line in lines[:-1]:
        assert line["alive"] == [], lines
        assert abs(line["grown_bytes"]) <= 2**30 // 10, lines
    assert lines[-1] == {"garbage": []}, lines
