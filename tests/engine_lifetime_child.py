"""A fresh process whose collector is off from its first line: engine after engine, the
first of the process included, built, used and dropped by ``del`` alone (no close()).
Prints one JSON line per engine: which of the engine, its runner, model and KV cache are
still alive, the device memory allocated beyond the start (CUDA), and at the end what a
collection would have found of pagedq (objects kept alive only by a reference cycle).

    python -m tests.engine_lifetime_child DEVICE MODEL_DIR ENGINES [ENGINE_CONFIG_JSON]

Run by tests/test_engine_close.py (cpu) and tests/test_gpu_engine.py (cuda)."""
import gc

gc.disable()  # before anything is imported: the first engine sees first-use work too

import json  # noqa: E402
import sys  # noqa: E402
import weakref  # noqa: E402


def kept_by(ref: weakref.ref) -> dict:
    """What keeps ``ref``'s object alive: the reference cycle a collection finds (its
    objects' types, the frames and functions in it), or, if none, the referrer chain up
    from the object (a global keeps it). Collects: the cycle is freed afterwards."""
    from collections import Counter

    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    gc.set_debug(0)
    garbage, gc.garbage[:] = list(gc.garbage), []
    names = Counter(type(o).__module__ + "." + type(o).__qualname__ for o in garbage)
    where = sorted({f"{o.f_code.co_filename}:{o.f_lineno} {o.f_code.co_name}"
                    for o in garbage if type(o).__name__ == "frame"}
                   | {f"function {o.__module__}.{o.__qualname__}" for o in garbage
                      if type(o).__name__ == "function"})
    out = {"cycle_types": names.most_common(25), "cycle_code": where[:40]}
    obj = ref()
    del garbage
    gc.collect()
    if ref() is not None and obj is not None:  # no cycle: a chain of referrers
        chain, seen = [], {id(obj)}
        for _ in range(8):
            refs = [r for r in gc.get_referrers(obj) if id(r) not in seen
                    and type(r).__name__ != "frame" and r is not chain]
            if not refs:
                break
            obj = refs[0]
            del refs  # (it would be the next object's first referrer)
            seen.add(id(obj))
            keys = ([k for k, v in obj.items() if v is not None][:6]
                    if isinstance(obj, dict) else [])
            chain.append(f"{type(obj).__module__}.{type(obj).__qualname__} {keys}")
        out["chain"] = chain
    del obj
    return out


def main() -> None:
    device, model, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    import torch

    from pagedq.engine import LLMEngine, SamplingParams

    cuda = device.startswith("cuda")
    start = torch.cuda.memory_allocated() if cuda else 0
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=8, repetition_penalty=1.3, logprobs=2,
                             temperature=0.0, ignore_eos=True),
              SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=2, ignore_eos=True)]
    for k in range(count):
        eng = LLMEngine(model, device=device, **config)
        outs = eng.generate([[1, 2, 3, 4] * 40, [5, 6], [7, 8, 9], [10]], params,
                            use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [8, 8, 8, 4]
        refs = {"engine": weakref.ref(eng), "runner": weakref.ref(eng.runner),
                "model": weakref.ref(eng.runner.model),
                "KV cache": weakref.ref(eng.runner.kv_cache)}
        del eng, outs
        alive = [name for name, ref in refs.items() if ref() is not None]
        grown = (torch.cuda.memory_allocated() - start) if cuda else 0
        line = {"engine": k, "alive": alive, "grown_bytes": grown}
        if alive:  # what keeps it (then freed, so that the next engine has its memory)
            line["kept_by"] = kept_by(refs[alive[-1]])
        print(json.dumps(line), flush=True)
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    kept = sorted({type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage
                   if type(o).__module__.startswith("pagedq.")
                   or (type(o).__name__ == "frame"
                       and o.f_globals.get("__name__", "").startswith("pagedq."))
                   or issubclass(type(o), torch.Tensor)})
    print(json.dumps({"garbage": kept}), flush=True)


if __name__ == "__main__":
    main()
