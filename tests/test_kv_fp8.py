"""The 8-bit KV caches (kv_cache_dtype fp8, fp8_e5m2, int8) on the CPU path, on the real
SmolLM2 and real text: teacher-forced next-token distributions stay close to those of a
float32 cache, while really being quantised. bench/fp8_accuracy.py reports the full
figures (and the engine's greedy outputs)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedq.engine.config import EngineConfig
from pagedq.engine.model_runner import ModelRunner
from pagedq.engine.scoring import next_token_logprobs

TEXT = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def ids(smollm2_runner):
    return smollm2_runner.tokenizer.encode(TEXT)[:400]


def test_scoring_through_the_paged_cache_equals_transformers(smollm2_runner, smollm2_hf, ids):
    ours = next_token_logprobs(smollm2_runner, ids, chunk=96)  # 5 chunks: cached prefixes
    with torch.no_grad():
        ref = torch.log_softmax(smollm2_hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)


# kv_cache_dtype: (cache dtype, bounds on mean KL and top-1 agreement with a float32 cache)
# (measured on these 400 tokens: fp8 0.0096 / 94.7%, fp8_e5m2 0.031 / 90.2%, int8 0.0010 / 99.2%)
CACHES = {"fp8": (torch.float8_e4m3fn, 0.05, 0.85), "fp8_e5m2": (torch.float8_e5m2, 0.1, 0.8),
          "int8": (torch.int8, 0.005, 0.95)}


@pytest.mark.parametrize("kv", CACHES)
def test_8bit_cache_close_to_float32_cache(smollm2_runner, ids, kv):
    dtype, max_kl, min_top1 = CACHES[kv]
    r8 = ModelRunner("smollm2", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32,
                                             max_model_len=1024, kv_cache_dtype=kv))
    assert r8.kv_cache.dtype == dtype
    truth = next_token_logprobs(smollm2_runner, ids, chunk=96)
    got = next_token_logprobs(r8, ids, chunk=96)
    kl = (truth.exp() * (truth - got)).sum(-1)
    top1 = (truth.argmax(-1) == got.argmax(-1)).float().mean()
    assert kl.mean() > 1e-6, f"the {kv} cache changed nothing: is it really quantising?"
    assert kl.mean() < max_kl and top1 > min_top1, (float(kl.mean()), float(top1))
