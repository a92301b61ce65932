"""LLMEngine end to end on the CPU: greedy identity with transformers under every
scheduling path (staggered arrival, chunked prefill, prefix hits, preemption), seeded
sampling across preemption, n > 1, abort, stops, bad input."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from pagedq.engine import LLMEngine, SamplingParams
from tests.model_fixtures import hf_choices, load_hf

G = dict(temperature=0.0, ignore_eos=True)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with transformers (full recompute, no cache): the truth."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def run(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
        check=None) -> dict[str, list[int]]:
    """Step the engine, adding requests at the given step numbers; returns token ids."""
    got: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for rid, ids, p in arrivals.get(step, []):
            engine.add_request(rid, ids, p)
            got[rid] = []
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        if check:
            check(engine)
        step += 1
    return got


def integrity(engine: LLMEngine) -> None:
    seqs = engine.scheduler.running + engine.scheduler.waiting
    engine.block_manager.check_integrity(seqs)


@pytest.fixture(scope="module")
def smol_engine():
    return LLMEngine("smollm2", device="cpu", dtype="float32", num_kv_blocks=128,
                     max_model_len=1024, block_size=16)


def test_smollm2_greedy_equals_hf_alone_and_staggered(smol_engine, smollm2_hf):
    eng = smol_engine
    tok = eng.tokenizer
    prompts = ["The capital of France is", "def fibonacci(n):",
               "A list of fruits: apple, banana,", "In 1969, the first humans"]
    ids = [tok.encode(p) for p in prompts]
    lens = [12, 20, 7, 16]
    ref = []
    for k in range(len(prompts)):  # alone: each token is transformers' greedy choice
        got = run(eng, {0: [(f"a{k}", ids[k], SamplingParams(max_tokens=lens[k], **G))]})
        assert len(got[f"a{k}"]) == lens[k]
        assert got[f"a{k}"] == hf_choices(smollm2_hf, ids[k], got[f"a{k}"])
        ref.append(got[f"a{k}"])
    # staggered: requests join and leave the running batch at different steps
    arrivals = {0: [("s0", ids[0], SamplingParams(max_tokens=lens[0], **G))],
                3: [("s1", ids[1], SamplingParams(max_tokens=lens[1], **G))],
                4: [("s2", ids[2], SamplingParams(max_tokens=lens[2], **G))],
                9: [("s3", ids[3], SamplingParams(max_tokens=lens[3], **G))]}
    got = run(eng, arrivals, integrity)
    assert [got[f"s{k}"] for k in range(4)] == ref


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "MistralForCausalLM", "LlamaForCausalLM"])
def test_tiny_greedy_equals_hf_under_chunking_prefix_hits_and_preemption(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    hf = load_hf(folder)
    rng = random.Random(1)
    shared = rng.choices(range(300), k=40)
    prompts = [shared + rng.choices(range(300), k=n) for n in (5, 13, 29, 2, 60)]
    lens = [30, 25, 20, 35, 15]
    ref = [hf_greedy(hf, p, n) for p, n in zip(prompts, lens, strict=True)]
    # small token budget: prompts are chunked; tiny cache: requests are preempted
    eng = LLMEngine(str(folder), device="cpu", dtype="float32", block_size=8,
                    num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)
    arrivals = {0: [(f"r{k}", p, SamplingParams(max_tokens=n, **G))
                    for k, (p, n) in enumerate(zip(prompts[:3], lens[:3], strict=True))],
                5: [(f"r{k}", p, SamplingParams(max_tokens=n, **G))
                    for k, (p, n) in enumerate(zip(prompts[3:], lens[3:], strict=True), 3)]}
    got = run(eng, arrivals, integrity)
    assert [got[f"r{k}"] for k in range(5)] == ref
    assert eng.scheduler.num_preemptions_total > 0, "the tiny cache had to force preemption"
    assert eng.block_manager.num_free_blocks == 16
    # the shared 40-token prefix (5 full blocks) is served from the cache the second time
    again = run(eng, {0: [("again", prompts[1], SamplingParams(max_tokens=3, **G))]})
    assert again["again"] == ref[1][:3]


def test_held_arrivals_change_no_output(tiny_model_dir):
    """Requests held back while the batch decodes (prefill_wait_steps) join later and
    generate exactly what they would have; on the CPU (no CUDA graphs) the default is 0."""
    folder = str(tiny_model_dir("Qwen3ForCausalLM"))
    rng = random.Random(5)
    p = SamplingParams(max_tokens=12, **G)
    arrivals = {step: [(f"r{step}", rng.choices(range(300), k=9), p)] for step in (0, 2, 3, 9)}
    cfg = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    auto = LLMEngine(folder, **cfg)
    assert auto.config.prefill_wait_steps == 0
    held = LLMEngine(folder, prefill_wait_steps=4, **cfg)
    waits = []
    got = run(held, arrivals, lambda e: waits.append(e.scheduler.num_waiting))
    assert got == run(auto, arrivals)
    assert max(waits) >= 2, "the arrivals at steps 2 and 3 were not held together"


def test_seeded_sampling_reproducible_across_runs_and_preemption(tiny_model_dir):
    folder = str(tiny_model_dir("Qwen3ForCausalLM"))
    prompts = [random.Random(k).choices(range(300), k=30) for k in range(4)]
    params = [SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=100 + k,
                             ignore_eos=True) for k in range(4)]

    def sample(**cfg) -> tuple[list[list[int]], int]:
        eng = LLMEngine(folder, device="cpu", dtype="float32", block_size=8, **cfg)
        got = run(eng, {0: [(f"q{k}", p, sp) for k, (p, sp)
                            in enumerate(zip(prompts, params, strict=True))]})
        return [got[f"q{k}"] for k in range(4)], eng.scheduler.num_preemptions_total

    roomy, p0 = sample(num_kv_blocks=64)
    again, _ = sample(num_kv_blocks=64)
    tight, p1 = sample(num_kv_blocks=18, max_num_batched_tokens=16, max_num_seqs=4)
    assert p0 == 0 and p1 > 0
    assert roomy == again == tight
    assert len({tuple(x) for x in roomy}) == 4


def test_n_samples_share_prompt_blocks_and_differ(tiny_model_dir):
    eng = LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), device="cpu", dtype="float32",
                    block_size=8, num_kv_blocks=64)
    prompt = list(range(1, 34))  # 33 tokens: 4 full blocks shared
    eng.add_request("multi", prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0,
                                                    seed=5, ignore_eos=True))
    eng.step()
    tables = [s.block_table for s in eng.scheduler.running]
    assert len(tables) == 3 and tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert eng.abort_request("multi")
    out = eng.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert len(out.samples) == 3 and len({tuple(s.token_ids) for s in out.samples}) > 1


def test_request_ids_of_samples_are_taken_until_the_request_ends(tiny_model_dir):
    eng = LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), device="cpu", dtype="float32",
                    block_size=8, num_kv_blocks=64)
    two = SamplingParams(n=2, max_tokens=3, **G)
    eng.add_request("a", [1, 2, 3], two)
    eng.add_request("b#0", [1, 2, 3], SamplingParams(max_tokens=3, **G))
    for rid, params in (("a", None), ("a#1", None), ("b", two)):  # taken: "a", "a#1", "b#0"
        with pytest.raises(ValueError, match="already exists"):
            eng.add_request(rid, [4, 5], params)
    eng.add_request("b", [1, 2], SamplingParams(max_tokens=3, **G))  # "b" itself is free
    assert eng.abort_request("a") and not eng.abort_request("a")
    eng.add_request("a", [6], two)  # free again once aborted
    while eng.has_unfinished():
        eng.step()
    assert eng._samples == {}  # finished samples leave no bookkeeping behind
    eng.add_request("a", [7], two)


def test_abort_frees_blocks_at_once(tiny_model_dir):
    eng = LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), device="cpu", dtype="float32",
                    block_size=8, num_kv_blocks=32)
    eng.add_request("x", list(range(50)), SamplingParams(max_tokens=50, **G))
    eng.step()
    assert eng.block_manager.num_free_blocks < 32
    assert eng.abort_request("x") and not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == 32
    assert eng.abort_request("x") is False


def test_stop_strings_and_finish_reasons(smol_engine):
    eng = smol_engine
    p = SamplingParams(max_tokens=30, temperature=0.0, stop=[" Paris"])
    out = eng.generate(["The capital of France is"], p, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and "Paris" not in out.text
    out = eng.generate(["The capital of France is"], SamplingParams(max_tokens=3, **G),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_bad_input_is_a_clear_error(smol_engine):
    eng = smol_engine
    with pytest.raises(ValueError, match="context"):
        eng.add_request("long", list(range(2000)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("oov", [10**9], SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="block_size"):
        LLMEngine("smollm2", block_size=3)
    with pytest.raises(ValueError, match="KV cache"):  # max_model_len vs memory
        LLMEngine("smollm2", device="cpu", num_kv_blocks=8, max_model_len=1024)
    assert not eng.has_unfinished()


def test_running_tokens_stay_out_of_the_collectors_scan(tiny_model_dir):
    """A full garbage collection visits every element of every list the running batch holds:
    a busy worker's token ids (hundreds of thousands) made each one a pause of tens of ms.
    The engine keeps them where the collector does not look (engine/sequence.py)."""
    def scanned() -> int:  # elements of the lists the collector tracks
        gc.collect()
        return sum(len(o) for o in gc.get_objects() if type(o) is list)

    eng = LLMEngine(str(tiny_model_dir("Qwen3ForCausalLM")), device="cpu", dtype="float32",
                    block_size=16, num_kv_blocks=1024, max_num_seqs=32,
                    max_num_batched_tokens=8192)
    rng = random.Random(7)
    prompts = [rng.choices(range(300), k=200) for _ in range(32)]  # 6,400 tokens
    before = scanned() - sum(map(len, prompts))  # the caller's lists, dropped below
    for k, p in enumerate(prompts):
        eng.add_request(f"r{k}", p, SamplingParams(max_tokens=20, **G))
    del prompts, p
    for _ in range(3):
        eng.step()
    grown = scanned() - before
    assert len(eng.scheduler.running) == 32
    # block tables and hashes (32 x 13 + 32 x 12 entries) and a little bookkeeping (~1,250
    # elements); lists of token ids would add 2 x 6,400 (~14,100 with the lists before)
    assert grown < 3000, grown
