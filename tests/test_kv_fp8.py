"""The fp8 KV cache (kv_cache_dtype="fp8") on the CPU reference path, on the real SmolLM2 and
real text: teacher-forced next-token distributions stay close to those of a float32 cache,
while really being quantised. bench/fp8_accuracy.py reports the full figures."""
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


def test_fp8_cache_close_to_float32_cache(smollm2_runner, ids):
    fp8 = ModelRunner("smollm2", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32,
                                              max_model_len=1024, kv_cache_dtype="fp8"))
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn
    truth = next_token_logprobs(smollm2_runner, ids, chunk=96)
    got = next_token_logprobs(fp8, ids, chunk=96)
    kl = (truth.exp() * (truth - got)).sum(-1)
    top1 = (truth.argmax(-1) == got.argmax(-1)).float().mean()
    assert kl.mean() > 1e-5, "the fp8 cache changed nothing: is it really quantising?"
    assert kl.mean() < 0.05 and top1 > 0.85, (float(kl.mean()), float(top1))
