"""An engine that lets go (engine/llm_engine.py, "Lifetime"): close() and ``with`` release
the model and the KV cache at once, and so does dropping the last reference without
close(), by reference counting alone (the collector switched off proves it); engine after
engine holds memory flat; a closed engine answers every call with EngineClosed; close()
from another thread, or from a signal handler inside a step, lets the step end first."""
from __future__ import annotations

import gc
import os
import signal
import threading
import weakref

import pytest
import torch

from pagedq.engine import EngineClosed, LLMEngine, SamplingParams

MiB = 2**20
KV_BYTES = 64 * MiB  # large enough that one engine's KV cache left behind shows in the RSS
G = dict(temperature=0.0, ignore_eos=True)


def live_tensors() -> int:
    tensor = torch.Tensor  # by type(): isinstance() would read proxies' __class__
    return sum(issubclass(type(o), tensor) for o in gc.get_objects())


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def engine_garbage() -> list[str]:
    """What a collection would find of the engine (its objects, tensors): nothing, when no
    cycle runs through it. The found objects are kept out of the heap (DEBUG_SAVEALL)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage
                 if issubclass(type(o), torch.Tensor) or type(o).__module__.startswith("pagedq.")]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    return found


@pytest.fixture
def tiny(tiny_model_dir):
    return str(tiny_model_dir("LlamaForCausalLM"))


def build(tiny: str, **cfg) -> LLMEngine:
    kw = dict(device="cpu", dtype="float32", block_size=16, kv_cache_memory_gb=KV_BYTES / 2**30)
    return LLMEngine(tiny, **{**kw, **cfg})


def work(eng: LLMEngine) -> None:
    """Requests of every sampler path: greedy, seeded, penalised with logprobs, n=2."""
    params = [SamplingParams(max_tokens=8, **G),
              SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=8, repetition_penalty=1.3, logprobs=2, **G),
              SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=2, ignore_eos=True)]
    outs = eng.generate([[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8, 8, 8, 4]


def test_engine_after_engine_closed_or_dropped_frees_everything_without_gc(tiny):
    """Eight engines in a row, every other one closed, the others only dropped (``del``),
    with the collector off: right away the KV cache, every weight and the engine itself are
    gone, nothing of them waits for a collection, the live tensors are as many as before,
    and the resident memory does not grow by a KV cache."""
    work(build(tiny))  # process-wide caches (kernels/cpu.py) made once, before measuring
    gc.collect()
    gc.disable()
    try:
        base_tensors, base_rss = live_tensors(), rss()
        for k in range(8):
            eng = build(tiny)
            work(eng)
            assert eng.runner.kv_cache_bytes >= KV_BYTES - MiB
            refs = {"engine": weakref.ref(eng), "runner": weakref.ref(eng.runner),
                    "KV cache": weakref.ref(eng.runner.kv_cache)}
            refs.update((f"weight {name}", weakref.ref(p))
                        for name, p in eng.runner.model.named_parameters())
            if k % 2 == 0:
                eng.close()  # releases while the engine is still referenced
                alive = [name for name, ref in refs.items() if ref() is not None]
                assert alive == ["engine", "runner"], f"engine {k}: kept after close: {alive}"
            del eng
            alive = [name for name, ref in refs.items() if ref() is not None]
            assert not alive, f"engine {k}: still alive after del: {alive}"
            assert live_tensors() == base_tensors, f"engine {k}"
            assert engine_garbage() == [], f"engine {k}"
            grown = rss() - base_rss
            assert grown < KV_BYTES // 2, f"engine {k}: resident memory grew {grown / MiB:.0f} MiB"
    finally:
        gc.enable()


def test_with_closes_and_every_call_on_a_closed_engine_names_itself(tiny):
    with build(tiny, kv_cache_memory_gb=0.01) as eng:
        work(eng)
        kv = weakref.ref(eng.runner.kv_cache)
        assert not eng.closed
    assert eng.closed and kv() is None
    eng.close()  # twice: nothing happens
    p = SamplingParams(max_tokens=2)
    calls = {"step": lambda: eng.step(),
             "generate": lambda: eng.generate([[1, 2]], p, use_tqdm=False),
             "add_request": lambda: eng.add_request("x", [1, 2], p),
             "abort_request": lambda: eng.abort_request("x"),
             "encode": lambda: eng.encode([1, 2]),
             "has_unfinished": lambda: eng.has_unfinished(),
             "can_admit": lambda: eng.can_admit(),
             "num_running": lambda: eng.num_running,
             "num_waiting": lambda: eng.num_waiting,
             "kv_cache_usage": lambda: eng.kv_cache_usage,
             "device_wait_s": lambda: eng.device_wait_s,
             "set_step_budget": lambda: eng.set_step_budget(4),
             "set_failure_handler": lambda: eng.set_failure_handler(print)}
    for name, call in calls.items():
        with pytest.raises(EngineClosed, match=rf"^LLMEngine\.{name}\(\): the engine is "
                                               r"closed .*build a new LLMEngine$") as info:
            call()
        assert info.value.call == name
    assert isinstance(info.value, RuntimeError)


def test_close_from_another_thread_lets_the_running_step_end_then_raises_there(tiny):
    """The engine thread steps (or generates) without pause; close() comes from another
    thread at some point of a step. That step ends whole (a step on a released runner
    would fail with some other error), then the engine thread gets EngineClosed."""
    for k in range(6):
        eng = build(tiny, kv_cache_memory_gb=0.01)
        kv = weakref.ref(eng.runner.kv_cache)
        steps: list[int] = []
        errors: list[BaseException] = []
        started = threading.Event()
        use_generate = k % 2 == 1

        def engine_thread(eng=eng, steps=steps, errors=errors, started=started,
                          use_generate=use_generate) -> None:
            try:
                if use_generate:  # ~240 steps: the close() comes long before its end
                    started.set()
                    eng.generate([list(range(1, 20))] * 4,
                                 SamplingParams(max_tokens=10_000, **G), use_tqdm=False)
                    steps.append(-1)  # (a machine so loaded that it ended first)
                for i in range(10**9):
                    eng.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=50, **G))
                    steps.append(len(eng.step()))
                    started.set()
            except BaseException as e:  # noqa: BLE001 - the test reads it
                errors.append(e)
                started.set()

        t = threading.Thread(target=engine_thread, daemon=True)
        t.start()
        assert started.wait(120)
        threading.Event().wait(0.003 * k)  # land at different points of a step
        eng.close()
        t.join(120)
        assert not t.is_alive(), "the engine thread hangs after close()"
        assert len(errors) == 1 and type(errors[0]) is EngineClosed, errors
        in_generate = use_generate and -1 not in steps
        assert errors[0].call in ({"generate"} if in_generate else {"add_request", "step"})
        assert kv() is None, "close() returned before the engine was released"
        del eng


def test_close_in_a_signal_handler_during_a_step_releases_after_it(tiny):
    """A handler (say, of SIGALRM or SIGINT) that calls close() runs on the thread that is
    stepping, between two bytecodes of the step: the step finishes, then the engine is
    released, and the next step raises EngineClosed."""
    inside = 0
    for k in range(5):
        eng = build(tiny, kv_cache_memory_gb=0.01)
        kv = weakref.ref(eng.runner.kv_cache)
        eng.add_request("long", list(range(1, 40)), SamplingParams(max_tokens=10_000, **G))
        seen: list[bool] = []

        def handler(signum, frame, eng=eng, seen=seen) -> None:
            seen.append(eng._calls > 0)  # white box: was a step under way?
            eng.close()

        old = signal.signal(signal.SIGALRM, handler)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.02 + 0.007 * k)
            with pytest.raises(EngineClosed, match=r"LLMEngine\.step\(\)"):
                while True:
                    eng.step()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert seen and kv() is None
        inside += seen[0]
        del eng
    assert inside >= 1, "no signal landed inside a step: the deferred release went untested"


def test_a_failed_constructor_holds_no_tensor_even_while_its_exception_lives(tiny):
    """The runner (weights, KV cache) is built before the context check fails: the error,
    with its traceback, kept by the caller (a notebook keeps the last one) holds none of it."""
    work(build(tiny, kv_cache_memory_gb=0.01))
    gc.collect()
    gc.disable()
    try:
        base = live_tensors()
        with pytest.raises(ValueError, match="max_model_len 256 needs 256 tokens") as info:
            build(tiny, num_kv_blocks=2, max_model_len=256)
        assert info.value.__traceback__ is not None
        assert live_tensors() == base
    finally:
        gc.enable()


def lifetime_in_a_fresh_process(device: str, model: str, engines: int, **config) -> list:
    """tests/engine_lifetime_child.py's lines (one per engine, then the garbage found)."""
    import json
    import subprocess
    import sys

    from tests.worker_proc import ROOT

    res = subprocess.run([sys.executable, "-m", "tests.engine_lifetime_child", device, model,
                          str(engines), json.dumps(config)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(
                                 os.pathsep) if p])})
    assert res.returncode == 0, res.stdout + res.stderr
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_the_first_engine_of_a_process_goes_by_del_alone_with_the_collector_off(tiny):
    """In a process whose collector is off from its first line, the first engine (which
    meets every first-use cost: imports, caches, compiled kernels on a GPU) and the next
    ones go the moment ``del`` drops them, and nothing of pagedq waits for a collection.
    (The GPU run of the same child: tests/test_gpu_engine.py.)"""
    lines = lifetime_in_a_fresh_process("cpu", tiny, 3, dtype="float32", block_size=16,
                                        kv_cache_memory_gb=KV_BYTES / 2**30)
    assert [x["alive"] for x in lines[:-1]] == [[], [], []], lines
    assert lines[-1] == {"garbage": []}, lines
