"""oneDNN-packed float32 weights on the CPU (engine/layers/packed.py) against F.linear, and a
CPU runner's model packed end to end."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedq.engine.config import EngineConfig
from pagedq.engine.layers import packed as P
from pagedq.engine.model_runner import ModelRunner
from tests.model_fixtures import BlockPool, new_seq, schedule

pytest_plugins = ["tests.model_fixtures"]
needs_onednn = pytest.mark.skipif(not P.available(), reason="torch without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 32, 33, 100])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    x = torch.randn(rows, 96, generator=g)
    packed = P.pack(w)
    assert packed is not None
    # another summation order than F.linear's: equal up to float rounding
    torch.testing.assert_close(P.linear(x, w, b, packed), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_weights_are_packed():
    w = torch.randn(8, 16)
    assert P.pack(w.bfloat16()) is None
    assert P.pack(w.t()) is None  # not contiguous
    x = torch.randn(4, 16).bfloat16()
    assert torch.equal(P.linear(x, w.bfloat16(), None, None), F.linear(x, w.bfloat16()))


@needs_onednn
def test_cpu_runner_packs_every_linear_layer_and_the_logits_head(tiny_model_dir):
    runner = ModelRunner(str(tiny_model_dir("Qwen2ForCausalLM")),  # untied head, q/k/v bias
                         EngineConfig(device="cpu", dtype="float32", block_size=8,
                                      num_kv_blocks=32))
    model = runner.model
    layers = [m for m in model.modules() if hasattr(m, "packed")]
    assert model.lm_head in layers and model.model.embed_tokens not in layers
    assert len(layers) == 4 * len(model.model.layers) + 1
    assert all(m.packed is not None for m in layers)

    seq = new_seq(list(range(1, 21)))
    batch = schedule(BlockPool(32), 8, (seq, 20))
    logits = runner.execute(batch)
    for m in layers:
        m.packed = None
    torch.testing.assert_close(runner.execute(batch), logits, rtol=1e-5, atol=1e-5)
