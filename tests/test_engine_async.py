"""Async scheduling (engine/pipeline.py) on the CPU: the same outputs as the synchronous
engine under every scheduling path, no placeholder visible between steps, aborts and
stops never publish the speculative extra token."""
from __future__ import annotations

import random

import pytest

from pagedq.engine import LLMEngine, SamplingParams
from pagedq.engine.pipeline import PLACEHOLDER


def make(folder, async_scheduling: bool, **cfg) -> LLMEngine:
    kw = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    kw.update(cfg)
    return LLMEngine(str(folder), async_scheduling=async_scheduling, **kw)


def no_placeholders(eng: LLMEngine) -> None:
    seqs = eng.scheduler.running + eng.scheduler.waiting
    for s in seqs:
        assert s.num_pending_tokens == 0 and PLACEHOLDER not in s.token_ids
    eng.block_manager.check_integrity(seqs)


def drive(eng: LLMEngine, arrivals: dict[int, list], aborts: dict[int, list[str]] | None = None):
    """Step to completion; per request: (token ids, text, finish reason, #outputs)."""
    got: dict[str, dict] = {}
    step = 0
    aborts = aborts or {}
    while eng.has_unfinished() or any(k >= step for k in list(arrivals) + list(aborts)):
        for rid, ids, p in arrivals.get(step, []):
            eng.add_request(rid, ids, p)
            for k in range(p.n):
                got[rid if p.n == 1 else f"{rid}#{k}"] = dict(ids=[], text="", reason=None, n=0)
        for rid in aborts.get(step, []):
            eng.abort_request(rid)
        for o in eng.step():
            g = got[o.request_id]
            assert g["reason"] is None, f"{o.request_id}: output after it finished"
            g["ids"] += o.new_token_ids
            g["text"] += o.delta
            g["reason"] = o.finish_reason if o.finished else None
            g["n"] += 1
            assert o.num_output_tokens == len(g["ids"])
        no_placeholders(eng)
        step += 1
    return got


def both(folder, arrivals, aborts=None, **cfg):
    sync = drive(make(folder, False, **cfg), arrivals, aborts)
    eng = make(folder, True, **cfg)
    return sync, drive(eng, arrivals, aborts), eng


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = rng.choices(range(300), k=20)
    return [shared + rng.choices(range(300), k=rng.randint(1, 40)) for _ in range(n)]


@pytest.mark.parametrize("cfg", [
    dict(),  # roomy
    dict(num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=4),  # chunks, preemption
])
def test_async_equals_sync_greedy_seeded_stops_n(tiny_model_dir, cfg):
    folder = tiny_model_dir("Qwen3ForCausalLM")
    ps = prompts(6)
    free = drive(make(folder, True), {0: [("f", ps[2], SamplingParams(max_tokens=30,
                                                                     temperature=0.0))]})
    text = free["f"]["text"]
    assert len(text) >= 5
    stop = text[3:5]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(max_tokens=30, temperature=0.0, stop=["\x00\x00", stop]),
        SamplingParams(max_tokens=18, temperature=1.0, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=22, temperature=0.7, top_k=20, seed=11, min_tokens=5),
        SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True),
    ]
    arrivals = {0: [(f"r{k}", ps[k], params[k]) for k in range(3)],
                3: [(f"r{k}", ps[k], params[k]) for k in range(3, 6)]}
    sync, asyn, eng = both(folder, arrivals, **cfg)
    assert asyn == sync
    assert asyn["r2"]["reason"] == "stop" and asyn["r2"]["text"] == text[:text.index(stop)]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    if cfg:
        assert eng.scheduler.num_preemptions_total > 0


def test_stop_token_drops_the_speculative_token(tiny_model_dir):
    folder = tiny_model_dir("LlamaForCausalLM")
    p = prompts(1, seed=2)[0]
    free = drive(make(folder, True), {0: [("x", p, SamplingParams(max_tokens=12,
                                                                temperature=0.0,
                                                                ignore_eos=True))]})
    ids = free["x"]["ids"]
    stop_at = next(i for i in range(3, 12) if ids[i] not in ids[:i])
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids[stop_at]])
    sync, asyn, eng = both(folder, {0: [("x", p, params)]})
    assert asyn == sync
    assert asyn["x"]["ids"] == ids[:stop_at + 1] and asyn["x"]["reason"] == "stop"
    assert asyn["x"]["n"] == stop_at + 1  # one output per token, none for the extra one
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_abort_while_a_step_is_in_flight(tiny_model_dir):
    folder = tiny_model_dir("Qwen3ForCausalLM")
    eng = make(folder, True)
    ps = prompts(2, seed=3)
    g = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eng.add_request("a", ps[0], g)
    eng.add_request("b", ps[1], g)
    seen = {"a": 0, "b": 0}
    for _ in range(5):
        for o in eng.step():
            seen[o.request_id] += len(o.new_token_ids)
    assert eng.pipeline.inflight is not None and seen["a"] == 4  # 5 steps launched, 4 collected
    used = eng.block_manager.num_blocks - eng.block_manager.num_free_blocks
    assert eng.abort_request("a")
    assert eng.block_manager.num_blocks - eng.block_manager.num_free_blocks < used  # at once
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == "b"
            seen["b"] += len(o.new_token_ids)
    assert seen == {"a": 4, "b": 30}
    eng.step()  # a leftover in-flight step with nothing live is harmless
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_penalties_and_logprobs_fall_back_to_sync_steps(tiny_model_dir):
    folder = tiny_model_dir("MistralForCausalLM")
    ps = prompts(3, seed=4)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(max_tokens=10, temperature=0.8, seed=1, logprobs=2,
                             ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)]
    arrivals = {0: [(f"p{k}", ps[k], params[k]) for k in range(3)]}
    sync, asyn, _ = both(folder, arrivals)
    assert asyn == sync


def test_decode_blocks_enter_the_prefix_cache_as_in_sync_mode(tiny_model_dir):
    """A block completed by a placeholder token is registered once the token is known."""
    folder = tiny_model_dir("Qwen3ForCausalLM")
    ps = prompts(3, seed=5)
    g = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"c{k}", ps[k], g) for k in range(3)]}
    caches = []
    for mode in (False, True):
        eng = make(folder, mode)
        drive(eng, arrivals)
        caches.append(set(eng.block_manager.cached))
    assert caches[0] == caches[1] and len(caches[0]) > 6
