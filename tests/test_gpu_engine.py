"""The engine on CUDA (Triton kernels, CUDA graphs) against the CPU reference path, greedy,
for a fixed random model. Skipped without CUDA."""
from __future__ import annotations

import gc
import json
import random

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
