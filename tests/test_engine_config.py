"""One EngineConfig, validated once (wire/engine_config.py ``__post_init__``): a bad value
fails where the config is constructed, with one line naming the setting; LLMEngine and
ModelRunner take a constructed config as it is, the very object (nothing rebuilt from its
fields, so nothing validated again), and the worker hands the engine the object its
configuration check built. Also: the runner's parts (engine/cuda_graphs.py,
engine/kv_sizing.py) keep no reference back to the runner."""
from __future__ import annotations

import gc
import re

import pytest

from pagedq.cli import build_parser
from pagedq.engine.config import EngineConfig
from pagedq.engine.kv_sizing import warmup_lens
from pagedq.engine.llm_engine import LLMEngine
from pagedq.worker.cli import build_engine, check_config

CPU = dict(device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64,
           max_num_seqs=4, max_num_batched_tokens=64)


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1 (got 0)"),
    (dict(block_size=12), "block_size"),
    (dict(device="tpu"), "device"),
    (dict(max_num_seqs=100, max_num_batched_tokens=50),
     "max_num_batched_tokens must be >= max_num_seqs"),
])
def test_a_bad_value_fails_at_construction_naming_the_setting(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        EngineConfig(**kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=re.escape(words)):  # and so in LLMEngine's keywords
        LLMEngine("smollm2", **kwargs)


def test_engine_and_runner_use_the_config_object_passed_in(tiny_model_dir):
    cfg = EngineConfig(**CPU)
    with LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), config=cfg) as eng:
        assert eng.config is cfg and eng.runner.config is cfg
        assert eng.scheduler.config is cfg
    with pytest.raises(TypeError, match="not both"):
        LLMEngine("smollm2", config=cfg, device="cpu")


def test_the_worker_hands_the_engine_the_config_its_check_built(tiny_model_dir):
    folder = str(tiny_model_dir("LlamaForCausalLM"))
    args = build_parser().parse_args(["worker", "--model", folder, "--device", "cpu",
                                      "--num-kv-blocks", "16", "--max-num-seqs", "4"])
    cfg = check_config(args)
    assert isinstance(cfg.engine, EngineConfig) and cfg.engine.num_kv_blocks == 16
    with build_engine(cfg) as eng:
        assert eng.config is cfg.engine and eng.runner.config is cfg.engine


def test_the_runners_parts_do_not_refer_back_to_it(tiny_model_dir):
    with LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), **CPU) as eng:
        runner = eng.runner
        seen, todo = {id(runner.cuda_graphs)}, [runner.cuda_graphs]
        while todo:  # everything reachable from the graphs' owner
            for o in gc.get_referents(todo.pop()):
                assert o is not runner, "CudaGraphs reaches the runner"
                if id(o) not in seen and not isinstance(o, type):
                    seen.add(id(o))
                    todo.append(o)


def test_warmup_step_fills_the_token_budget_within_the_model_length():
    assert warmup_lens(2048, 4096, 64) == [2048]
    assert warmup_lens(2048, 512, 64) == [512] * 4
    assert warmup_lens(1000, 300, 64) == [300, 300, 300, 100]
    assert warmup_lens(1000, 300, 2) == [300, 300]
