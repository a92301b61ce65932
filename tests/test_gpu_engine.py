"""The engine on CUDA (Triton kernels, CUDA graphs) against the CPU reference path, greedy,
for a fixed random model. Skipped without CUDA."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.llm_engine import PREFILL_WAIT_STEPS
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
    # the step-4 arrivals are held while the batch decodes (prefill_wait_steps' default)
    assert graphs_engine.config.prefill_wait_steps == PREFILL_WAIT_STEPS > 0
    graphs = run(graphs_engine, arrivals)
    assert eager == ref
    assert graphs == ref
