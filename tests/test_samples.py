"""One fan-out for a request's n samples (wire/sampling.py ``fan_out``: sample k of seed s
draws from (s + k) mod 2**63, its id "id#k"), taken by the offline engine and by the
worker's choices: the same request gives the same samples offline and through a real worker, up to
the largest seed."""
from __future__ import annotations

from pagedq.engine import LLMEngine, SamplingParams
from pagedq.wire.sampling import fan_out, sample_seed, split_sample_id
from pagedq.wire.schema import JobRequest
from tests.worker_proc import TINY_KV_CACHE_GB

TOP = 2**63 - 1  # the largest seed a request may carry
SAMPLE = dict(temperature=1.0, max_tokens=12, ignore_eos=True)


def test_the_seed_rule_wraps_below_two_to_the_63():
    assert [sample_seed(TOP, k) for k in range(3)] == [TOP, 0, 1]
    assert sample_seed(5, 2) == 7
    req = JobRequest(prompt=[1, 2, 3], model="m", seed=TOP, n=2, **SAMPLE)
    samples = fan_out("j", SamplingParams.of_request(req))
    assert [(rid, p.seed, p.n) for rid, p in samples] == [("j#0", TOP, 1), ("j#1", 0, 1)]
    assert [split_sample_id(rid) for rid, _ in samples] == [("j", 0), ("j", 1)]
    one = SamplingParams(seed=3)
    assert fan_out("j", one) == [("j", one)] and split_sample_id("j") == ("j", 0)


def test_offline_n_samples_equal_the_same_job_through_a_worker(svc, tiny_dir):
    prompt = [5, 17, 33, 250, 4, 9]
    with LLMEngine(tiny_dir, device="cpu", max_num_seqs=16,
                   kv_cache_memory_gb=float(TINY_KV_CACHE_GB)) as eng:
        out = eng.generate([prompt], SamplingParams(n=2, seed=TOP, **SAMPLE),
                           use_tqdm=False)[0]
    texts = [s.text for s in out.samples]
    assert len(texts) == 2 and texts[0] != texts[1]  # two streams, not one twice
    svc.worker()
    c = svc.client()
    rec = c.result(c.submit(prompt, n=2, seed=TOP, **SAMPLE), timeout=120)
    assert rec.status == "finished", rec
    assert [ch.text for ch in sorted(rec.choices, key=lambda ch: ch.index)] == texts
