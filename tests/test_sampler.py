"""Sampler: greedy, masks (exact supports), penalties, min_tokens, logit_bias, grammar masks,
seeds, logprobs, statistics."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedq.engine.guided import GuidedMask
from pagedq.engine.sampler import (
    Sampler,
    TokenLogprobs,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    row_seed,
)
from pagedq.engine.sampling_params import SamplingParams
from pagedq.engine.sequence import Sequence
from pagedq.kernels.reference import exponentials, splitmix_uniforms

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]  # token i has probability PROBS[i] at temperature 1


def seq(prompt=(0, 1), out=(), resumed=0, **kw) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**kw), token_ids=list(prompt) + list(out))
    s.num_resumed_output = resumed
    return s


def prob_logits(rows: int, device="cpu", probs=PROBS) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(rows, 1).to(device)


def support(sampler, configs: list[dict], draws: int, device="cpu") -> list[set[int]]:
    """One batch with ``draws`` rows per config (configs interleaved); sampled set per config."""
    seqs = [seq(**configs[j % len(configs)]) for j in range(draws * len(configs))]
    ids = sampler(prob_logits(len(seqs), device), seqs).token_ids
    return [set(ids[j :: len(configs)]) for j in range(len(configs))]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_argmax_and_input_untouched(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g).to(device)
    before = logits.clone()
    out = Sampler(100, {2})(logits, [seq(temperature=0.0) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16
    # equal maxima: the first, as argmax (a wide row, as a vocabulary)
    ties = torch.zeros(3, 49152, device=device)
    ties[:, [7, 300, 49151]] = 1.0
    ties[1, 5] = 1.0
    assert Sampler(49152, {2})(ties, [seq(temperature=0.0)] * 3).token_ids == [7, 5, 7]
    # a non-fast-path batch (penalties, min_tokens, sampling) must not modify its input either
    mixed = [seq(temperature=0.0, repetition_penalty=1.5, min_tokens=3) for _ in range(8)]
    mixed += [seq(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1) for _ in range(8)]
    Sampler(100, {2})(logits, mixed)
    assert torch.equal(logits, before)


def test_vocab_padding_columns_never_sampled_and_shape_errors():
    logits = torch.zeros(3, 10)
    logits[:, 8:] = 100.0  # lm_head padding beyond vocab_size=8
    s = Sampler(8, set())
    assert all(t < 8 for t in s(logits, [seq(temperature=0.0), seq(), seq(seed=1)]).token_ids)
    with pytest.raises(ValueError):
        s(torch.zeros(2, 10), [seq()])
    with pytest.raises(ValueError):
        s(torch.zeros(1, 7), [seq()])


@pytest.mark.parametrize("device", DEVICES)
def test_exact_supports_of_masks_in_one_mixed_batch(device):
    configs = [
        dict(temperature=1.0),  # everything
        dict(temperature=1.0, top_k=3),  # {0,1,2}
        dict(temperature=1.0, top_p=0.6),  # mass before: 0, .40, .65 -> {0,1}
        dict(temperature=1.0, top_p=0.7),  # .65 < .7 -> {0,1,2}
        dict(temperature=1.0, min_p=0.3),  # prob >= .12 -> {0,1,2}
        # T=2: probs ~ .277 .219 .170 .139 .107 .088 -> mass before: 0 .277 .496 .666
        dict(temperature=2.0, top_p=0.6),  # {0,1,2}
        # top_k=4 renormalises to .444 .278 .167 .111; top_p .75 -> {0,1,2}; min_p .5 -> {0,1}
        dict(temperature=1.0, top_k=4, top_p=0.75),
        dict(temperature=1.0, top_k=4, top_p=0.75, min_p=0.5),
        dict(temperature=1.0, top_k=1),  # {0}
        dict(temperature=0.0, top_k=3),  # greedy ignores the rest
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),  # all off
    ]
    expected = [
        {0, 1, 2, 3, 4, 5}, {0, 1, 2}, {0, 1}, {0, 1, 2}, {0, 1, 2}, {0, 1, 2},
        {0, 1, 2}, {0, 1}, {0}, {0}, {0, 1, 2, 3, 4, 5},
    ]
    assert support(Sampler(6, set()), configs, draws=600, device=device) == expected


def test_mask_functions_directly():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    # ties with the k-th logit are kept, whatever the sort order
    assert torch.isinf(apply_top_k_top_p(x, torch.tensor([3]), None)).tolist() == [
        [False, True, False, False, True]
    ]
    off = apply_top_k_top_p(x, torch.tensor([5]), torch.tensor([2.0]))
    assert torch.equal(off, x)
    y = torch.tensor([[0.0, math.log(0.5), math.log(0.2)]])
    assert torch.isinf(apply_min_p(y, torch.tensor([0.3]))).tolist() == [[False, False, True]]
    assert torch.equal(apply_min_p(y, torch.tensor([0.0])), y)


def test_top_k_bound_path_equals_full_sort():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 300, generator=g)
    k = torch.tensor([1, 2, 5, 10, 17, 40, 40, 3])
    p = torch.tensor([0.5, 0.9, 2.0, 0.3, 0.99, 2.0, 0.7, 0.1])
    for top_p in (None, p):
        full = apply_top_k_top_p(x, k, top_p)
        assert torch.equal(apply_top_k_top_p(x, k, top_p, k_bound=40), full)
        assert (~torch.isinf(full)).sum(1).le(k).all()
    # a batch where every sampled row has top_k takes the topk path inside the sampler
    assert support(Sampler(6, set()), [dict(top_k=2, top_p=0.9), dict(top_k=3)], 400) == [
        {0, 1}, {0, 1, 2},
    ]


def test_penalty_formulas_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    seen = torch.tensor([[True, True, False, False, True]])  # 0: prompt only; 1: output x2
    counts = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0]])
    out = apply_penalties(
        logits, seen, counts, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    # 2/2; -1*2 - .25*2 - .5; untouched; untouched; 0 stays 0 under repetition, -.25 - .5
    assert out.tolist() == [[1.0, -3.0, 0.5, 3.0, -0.75]]


def test_sampler_builds_penalty_inputs_like_a_reference_loop():
    rnd = random.Random(0)
    V = 30
    seqs = []
    for _ in range(6):
        prompt = [rnd.randrange(V) for _ in range(rnd.randrange(1, 12))]
        out = [rnd.randrange(V) for _ in range(rnd.randrange(0, 12))] + [V + 3]  # id past vocab
        seqs.append(seq(prompt, out, resumed=2, repetition_penalty=rnd.choice([1.0, 1.3, 0.8]),
                        presence_penalty=rnd.uniform(-2, 2), frequency_penalty=rnd.uniform(-2, 2)))
    seqs.append(seqs[0])  # the same sequence twice in one batch
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(V, set())
    for _step in range(2):  # the second step reuses the cached prompt ids
        got = sampler._penalised(logits.clone(), seqs, list(range(7)))
        for r, s in enumerate(seqs):
            p = s.params
            for t in range(V):
                x = logits[r, t].item()
                if t in s.token_ids:
                    x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
                c = s.output_token_ids.count(t)
                x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
                assert got[r, t].item() == pytest.approx(x, abs=1e-5)
        for s in seqs[:6]:
            s.append_token(rnd.randrange(V))


def test_penalties_flip_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 1.0]]).repeat(3, 1)
    seqs = [
        seq(prompt=[0], repetition_penalty=1.1, temperature=0.0),  # 3/1.1 < 2.9 -> 1
        seq(prompt=[2], out=[0, 0], frequency_penalty=0.1, temperature=0.0),  # 2.8 -> 1
        seq(prompt=[2], out=[1], presence_penalty=2.0, temperature=0.0),  # unaffected -> 0
    ]
    assert Sampler(3, set())(logits, seqs).token_ids == [1, 1, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masks_eos_and_stop_ids_until_reached(device):
    probs = [0.05, 0.05, 0.1, 0.3, 0.5]  # 4 = EOS, 3 = a stop token id
    sampler = Sampler(5, {4})
    kw = dict(min_tokens=2, stop_token_ids=[3])
    for temp in (0.0, 1.0):
        masked = [seq(out=[0] * n, temperature=temp, **kw) for n in (0, 1) for _ in range(300)]
        ids = sampler(prob_logits(len(masked), device, probs), masked).token_ids
        assert set(ids) == ({2} if temp == 0 else {0, 1, 2})
        free = [seq(out=[0, 0], temperature=temp, **kw) for _ in range(300)]
        ids = sampler(prob_logits(300, device, probs), free).token_ids
        assert set(ids) == ({4} if temp == 0 else {0, 1, 2, 3, 4})
        # under ignore_eos EOS stops nothing, so min_tokens only masks the stop ids (as vLLM)
        no_eos = [seq(out=[0], temperature=temp, ignore_eos=True, **kw) for _ in range(300)]
        ids = sampler(prob_logits(300, device, probs), no_eos).token_ids
        assert set(ids) == ({4} if temp == 0 else {0, 1, 2, 4})


def bitmask(allowed: list[set[int]], V: int) -> torch.Tensor:
    """int32 [G, ceil(V / 32)]: bit t of row g set iff t in allowed[g] (llguidance's layout)."""
    words = [[0] * (-(-V // 32)) for _ in allowed]
    for g, toks in enumerate(allowed):
        for t in toks:
            words[g][t // 32] |= 1 << (t % 32)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words],
                        dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_grammar_masks_and_bias_leave_other_rows_bit_identical(device):
    """Guided rows sample only tokens their mask allows (greedy: the best of them; sampled:
    every allowed one, nothing else); greedy and seeded rows beside them, and beside
    logit_bias rows, get exactly the tokens of a batch without those rows."""
    V = 300
    g = torch.Generator().manual_seed(5)
    plain = [dict(temperature=0.0), dict(temperature=0.8, seed=3), dict(temperature=1.2, seed=4,
             top_k=50), dict(temperature=0.0, min_p=0.1), dict(temperature=0.7, seed=8, top_p=0.9)]
    allowed = [{3, 77, 299}, {0, 1, 2, 200}]
    for step in range(20):
        logits = (torch.randn(len(plain) + 3, V, generator=g) * 3).to(device)
        alone = Sampler(V, set())(logits[:len(plain)], [seq(**c) for c in plain]).token_ids
        batch = [seq(**c) for c in plain] + [seq(temperature=0.0), seq(temperature=1.0),
                                             seq(temperature=0.0, logit_bias={9: 100.0})]
        mask = GuidedMask([len(plain), len(plain) + 1], bitmask(allowed, V))
        out = Sampler(V, set(), default_seed=step)(logits, batch, mask).token_ids
        assert out[:len(plain)] == alone
        assert out[-3] == max(allowed[0], key=lambda t: logits[-3, t].item())
        assert out[-2] in allowed[1] and out[-1] == 9
    hot = [seq(temperature=1.0) for _ in range(400)]
    flat = torch.zeros(400, V, device=device)
    mask = GuidedMask(list(range(400)), bitmask([allowed[1]] * 400, V))
    assert set(Sampler(V, set())(flat, hot, mask).token_ids) == allowed[1]


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_adds_to_the_logits_and_logprobs_stay_raw(device):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3, device=device)
    seqs = [seq(temperature=0.0, logprobs=1), seq(temperature=0.0, logit_bias={3: 3.5}),
            seq(temperature=0.0, logit_bias={0: -1.5, 2: 2.9}, logprobs=0)]
    out = Sampler(4, set())(logits, seqs)
    assert out.token_ids == [0, 3, 2]
    raw = torch.log_softmax(logits[0].cpu(), -1)
    assert out.logprobs[0].logprob == pytest.approx(raw[0].item())
    assert out.logprobs[2].logprob == pytest.approx(raw[2].item())  # the model's, unbiased
    assert out.logprobs[2].rank == 3


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_token_depends_only_on_seed_index_and_logits(device):
    V = 200
    g = torch.Generator().manual_seed(3)
    row = torch.randn(V, generator=g).to(device)
    for index in range(5):
        mine = dict(seed=1234, temperature=0.9, top_p=0.95, out=[7] * index)
        alone = Sampler(V, set())(row[None], [seq(**mine)]).token_ids[0]
        others = [seq(), seq(seed=9), seq(temperature=0.0), seq(top_k=3, seed=1)]
        batch = others[:3] + [seq(**mine)] + others[3:]
        logits = torch.randn(5, V, generator=g).to(device)
        logits[3] = row
        in_batch = Sampler(V, set(), default_seed=77)(logits, batch).token_ids[3]
        # crash resume: output tokens carried over count the same as generated ones
        resumed = seq(resumed=index, **mine)
        again = Sampler(V, set())(row[None], [resumed]).token_ids[0]
        assert alone == in_batch == again
    s = Sampler(V, set())
    preempted = seq(seed=5, out=[1, 2])
    assert s(row[None], [preempted]).token_ids == s(row[None], [preempted]).token_ids


def test_different_seeds_and_indices_differ():
    V = 1000
    flat = torch.zeros(1, V)
    by_seed = {Sampler(V, set())(flat, [seq(seed=k)]).token_ids[0] for k in range(20)}
    by_index = {Sampler(V, set())(flat, [seq(seed=1, out=[0] * i)]).token_ids[0] for i in range(20)}
    assert len(by_seed) >= 15 and len(by_index) >= 15
    assert len({row_seed(s, i) for s in range(50) for i in range(50)}) == 2500


def test_noise_is_the_splitmix64_stream():
    M = (1 << 64) - 1
    keys = [0, 1, row_seed(42, 7), (1 << 63) - 1]
    u = splitmix_uniforms(torch.tensor(keys), 5)
    for r, key in enumerate(keys):
        state = key
        for i in range(5):
            state = (state + 0x9E3779B97F4A7C15) & M
            z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & M
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
            z ^= z >> 31
            want = (torch.tensor(float(z >> 32), dtype=torch.float32) + 0.5) * 2.0**-32
            assert u[r, i].item() == want.item()
    assert 0 < u.min() and u.max() <= 1
    # Exp(1): mean 1, P(E < 1e-3) ~ 1e-3 (the series branch), no inf / nan
    e = exponentials(torch.tensor([row_seed(7, i) for i in range(64)]), 20000)
    assert torch.isfinite(e).all() and (e > 0).all()
    assert abs(e.mean().item() - 1) < 0.01 and abs((e < 1e-3).float().mean().item() - 1e-3) < 3e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_tokens_identical_on_cpu_and_cuda():
    keys = torch.tensor([row_seed(s, i) for s in range(8) for i in range(8)])
    assert torch.equal(splitmix_uniforms(keys, 4096), splitmix_uniforms(keys.cuda(), 4096).cpu())
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    for extra in ({}, {"top_p": 0.9}):  # fused kernel path, then the masked path
        seqs = [seq(seed=s, out=[0] * i, **extra) for s in range(8) for i in range(8)]
        cpu = Sampler(4096, set())(logits, seqs).token_ids
        assert Sampler(4096, set())(logits.cuda(), seqs).token_ids == cpu


def test_unseeded_rows_reproducible_from_default_seed():
    logits = torch.zeros(32, 500)
    a = Sampler(500, set(), default_seed=3)
    b = Sampler(500, set(), default_seed=3)
    for _ in range(3):
        seqs = [seq() for _ in range(32)]
        assert a(logits, seqs).token_ids == b(logits, seqs).token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_rank(device):
    V = 50
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5)).to(device)
    seqs = [
        seq(logprobs=5, temperature=1.0, repetition_penalty=1.7, prompt=list(range(20))),
        seq(logprobs=0, temperature=0.0),
        seq(),
        seq(logprobs=20, top_k=10, seed=3),
    ]
    out = Sampler(V, set())(logits, seqs)
    ref = torch.log_softmax(logits.cpu().double(), -1)
    assert out.logprobs[2] is None
    for r in (0, 1, 3):
        lp = out.logprobs[r]
        assert isinstance(lp, TokenLogprobs) and lp.token_id == out.token_ids[r]
        assert lp.logprob == pytest.approx(ref[r, lp.token_id].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[r] > ref[r, lp.token_id] + 1e-9).sum())
        k = seqs[r].params.logprobs
        vals, idx = ref[r].topk(k)
        assert [t for t, _ in lp.top] == idx.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-5)
    assert out.logprobs[1].rank == 1 and out.logprobs[1].top == []


def _chi2(ids: list[int], probs: list[float]) -> float:
    n = len(ids)
    return sum((ids.count(t) - n * p) ** 2 / (n * p) for t, p in enumerate(probs))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_softmax_distribution(temperature):
    # deterministic (fixed seeds); df = 5, chi2 critical value at p = 1e-4 is ~25.7
    w = [p ** (1 / temperature) for p in PROBS]
    expected = [x / sum(w) for x in w]
    n = 12000
    unseeded = [seq(temperature=temperature) for _ in range(n)]
    ids = Sampler(6, set(), default_seed=11)(prob_logits(n), unseeded).token_ids
    assert _chi2(ids, expected) < 25.7
    seeded = [seq(temperature=temperature, seed=k) for k in range(3000)]
    ids = Sampler(6, set())(prob_logits(3000), seeded).token_ids
    assert _chi2(ids, expected) < 25.7
