"""Quantized checkpoints on CUDA (the Triton W4A16 / W8A16 GEMM, CUDA graphs) against the
CPU engine on the same checkpoint. float32: the kernel's exact fp32 dots, so greedy tokens
are equal; bfloat16: the bf16 tensor-core path, logits close. Skipped without CUDA
(bench/h200.sh quant runs it, with tests/test_quant_kernels.py on the GPU)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedq.engine import LLMEngine
from pagedq.engine.config import EngineConfig
from pagedq.engine.model_runner import ModelRunner
from pagedq.engine.scoring import next_token_logprobs
from tests import quant_writers as qw
from tests.test_quant_models import GGUF, GREEDY, PROMPTS, greedy, tiny_wide

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def checkpoints(tmp_path) -> dict:
    src = tiny_wide("LlamaForCausalLM", tmp_path / "src")
    qw.write_awq(src, tmp_path / "awq", tmp_path / "d1", group=64)
    qw.write_gptq(src, tmp_path / "gptq", tmp_path / "d2", group=32, sym=False, desc_act=True)
    qw.write_gptq(src, tmp_path / "gptq8", tmp_path / "d3", bits=8, group=128)
    made = {"awq": tmp_path / "awq", "gptq": tmp_path / "gptq", "gptq8": tmp_path / "gptq8"}
    if importlib.util.find_spec("gguf") is not None:  # (not in every GPU image)
        arch, linear, embedding, _ = GGUF[0]
        gsrc = tiny_wide(arch, tmp_path / "gsrc", rope_parameters={"rope_type": "default",
                                                                    "rope_theta": 10000.0})
        made["gguf"] = qw.write_gguf(gsrc, tmp_path / "t.gguf", linear, embedding)
    return made


def test_cuda_quantized_engine_equals_the_cpu_one(tmp_path):
    for name, path in checkpoints(tmp_path).items():
        cpu = greedy(path, dtype="float32")
        engine = LLMEngine(str(path), device="cuda", num_kv_blocks=64, max_model_len=128,
                           dtype="float32")
        assert engine.runner.graphs and "kept quantized" in engine.runner.quant_summary
        got = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == cpu, name


def test_cuda_bf16_logits_close_to_the_dequantized_model(tmp_path):
    for name, path in checkpoints(tmp_path).items():
        ids = list(range(3, 40))
        lp = {}
        for dev in ("cuda", "cpu"):
            runner = ModelRunner(str(path), EngineConfig(device=dev, dtype="bfloat16" if dev
                                                         == "cuda" else "float32",
                                                         num_kv_blocks=8, max_model_len=128,
                                                         enforce_eager=True))
            lp[dev] = next_token_logprobs(runner, ids, chunk=8)
        kl = (lp["cpu"].exp() * (lp["cpu"] - lp["cuda"])).sum(-1).mean().item()
        assert kl < 1e-2, (name, kl)  # bf16 rounding alone: ~1e-3 (SmolLM2); a wrong layout: ~1
