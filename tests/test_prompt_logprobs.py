"""Prompt logprobs in the engine (engine/prompt_logprobs.py) against transformers' own
log-softmax of the same prompt (CPU, float32): whole prefills, chunked prefills, a prompt
whose blocks sit in the prefix cache, preemption in the middle of a prompt, async
scheduling, n > 1, max_tokens 0, and requests without them in the same batch."""
from __future__ import annotations

import random

import pytest
import torch

from pagedq.engine import LLMEngine, SamplingParams
from pagedq.engine.scheduler import Scheduler
from tests.model_fixtures import load_hf

pytestmark = pytest.mark.timeout(300)
G = dict(temperature=0.0, ignore_eos=True)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is log P(. | ids[:p + 1]) (the truth)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)[:-1]


def check(entries, ids: list[int], ref: torch.Tensor, k: int, atol: float = 1e-4) -> None:
    """One entry per prompt token; the first has none; each is the token's log-probability,
    its rank and the k likeliest alternatives."""
    assert len(entries) == len(ids)
    first = entries[0]
    assert (first.token_id, first.logprob, first.rank, first.top) == (ids[0], None, None, [])
    for p, e in enumerate(entries[1:]):
        row, t = ref[p], ids[p + 1]
        assert e.token_id == t and abs(e.logprob - row[t].item()) < atol
        above = int((row > row[t] + atol).sum())  # tokens certainly likelier; near-ties may
        assert above < e.rank <= above + int(((row - row[t]).abs() <= atol).sum())  # go either way
        assert len(e.top) == k
        assert all(abs(v - w) < atol and abs(v - row[i].item()) < atol
                   for (i, v), w in zip(e.top, row.topk(k).values.tolist(), strict=True))


def drive(eng: LLMEngine, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Run to the end; per request id: (outputs' prompt_logprobs in order, tokens, reason)."""
    for rid, ids, p in reqs:
        eng.add_request(rid, ids, p)
    got: dict[str, dict] = {}
    while eng.has_unfinished():
        for o in eng.step():
            g = got.setdefault(o.request_id, {"plp": [], "ids": [], "reason": None})
            if o.prompt_logprobs is not None:
                g["plp"].append(o.prompt_logprobs)
            g["ids"] += o.new_token_ids
            g["reason"] = o.finish_reason
        eng.block_manager.check_integrity(eng.scheduler.running + eng.scheduler.waiting)
    return got


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    folder = tiny_model_dir("Qwen3ForCausalLM")
    return str(folder), load_hf(folder)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_prefix_cache_and_preemption_score_every_position_once(
        tiny, async_scheduling, monkeypatch):
    folder, hf = tiny
    cut = []  # requests preempted before their prompt was all scored
    preempt = Scheduler._preempt

    def spy(self, seq, batch):
        if seq.scores_prompt:
            cut.append(seq.request_id)
        return preempt(self, seq, batch)
    monkeypatch.setattr(Scheduler, "_preempt", spy)
    rng = random.Random(3)
    shared = rng.choices(range(300), k=40)
    prompts = [shared + rng.choices(range(300), k=n) for n in (7, 21, 3)]
    refs = [hf_logprobs(hf, p) for p in prompts]
    # a 16-token budget chunks every prompt; 14 blocks of 8 cannot hold three of them:
    # requests are preempted, some in the middle of their prompt
    eng = LLMEngine(folder, device="cpu", dtype="float32", block_size=8, num_kv_blocks=14,
                    max_num_batched_tokens=16, max_num_seqs=4,
                    async_scheduling=async_scheduling)
    reqs = [(f"r{k}", p, SamplingParams(max_tokens=6, prompt_logprobs=3, **G))
            for k, p in enumerate(prompts)]
    reqs.append(("plain", shared + [1, 2], SamplingParams(max_tokens=6, **G)))
    got = drive(eng, reqs)
    assert cut, "the tiny cache had to preempt a request in the middle of its prompt"
    for k, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        assert len(got[f"r{k}"]["plp"]) == 1, "handed out with the first output only"
        check(got[f"r{k}"]["plp"][0], p, ref, 3)
        assert len(got[f"r{k}"]["ids"]) == 6
    assert got["plain"]["plp"] == []  # not asked for: none computed, none handed out
    assert eng.pipeline.scoring == 0
    # the shared prefix's blocks are now cached: a request that scores its prompt does not
    # take them (it computes every position), one that does not still hits them
    eng.block_manager.check_integrity([])
    again = drive(eng, [("again", prompts[1], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                              **G))])
    check(again["again"]["plp"][0], prompts[1], refs[1], 0)


def test_max_tokens_0_scores_the_prompt_only_and_n_samples_each_get_it(tiny):
    folder, hf = tiny
    eng = LLMEngine(folder, device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    ids = random.Random(9).choices(range(300), k=19)
    ref = hf_logprobs(hf, ids)
    got = drive(eng, [("zero", ids, SamplingParams(max_tokens=0, prompt_logprobs=2, **G)),
                      ("n3", ids, SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=1,
                                                 prompt_logprobs=1))])
    assert got["zero"]["ids"] == [] and got["zero"]["reason"] == "length"
    check(got["zero"]["plp"][0], ids, ref, 2)
    for k in range(3):
        check(got[f"n3#{k}"]["plp"][0], ids, ref, 1)
    one = eng.generate([ids[:1]], SamplingParams(max_tokens=0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert one.token_ids == [] and [e.logprob for e in one.prompt_logprobs] == [None]
    with pytest.raises(ValueError, match="max_tokens: 0 generates nothing"):
        SamplingParams(max_tokens=0)


def test_smollm2_prompt_logprobs_equal_transformers(smollm2_hf):
    """The real SmolLM2, float32 on the CPU, chunked prefill: within 1e-3 of transformers."""
    eng = LLMEngine("smollm2", device="cpu", dtype="float32", num_kv_blocks=64,
                    max_model_len=512, max_num_batched_tokens=16, max_num_seqs=4)
    ids = eng.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of "
                     "France, and Berlin is the capital of")
    out = eng.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=5, **G),
                       use_tqdm=False)[0]
    check(out.prompt_logprobs, ids, hf_logprobs(smollm2_hf, ids), 5, atol=1e-3)
