"""What a job arriving mid-generation costs the running batch: engine steps with and
without new prompts mixed into a full decode batch (LLMEngine directly, no Redis).

A batch of --running sequences is prefilled and decoding; then, for each --every k, one
new request (--prompt tokens) is added before every k-th step for --steps steps (k = 0: none
added, decode only). Reported per k: wall ms per step, output tok/s, how many steps began
with a prompt pending (waiting, held back, or not yet computed). A decode-only step replays
one CUDA graph; a step that holds a prefill replays the piecewise graphs (engine/
piecewise.py) or, with --disable piecewise_graphs, runs the eager model: its cost shows
here. Then cProfile's view of --profile-steps mixed steps: the Python functions (Triton's
launcher, torch ops, ours) by own time, i.e. where the host time of such a step goes
(cProfile slows each call, so read shares, not absolute times).

  python bench/mixed_steps.py [--shape qwen3-0.6b] [--running 192] [--prompt 512]
                              [--every 0 1 4 16] [--steps 120] [--enforce-eager]
                              [--prefill-wait-steps N] [--disable piecewise_graphs] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offline import SHAPES, model_folder, set_ablations  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    ap.add_argument("--running", type=int, default=192, help="sequences decoding")
    ap.add_argument("--prompt", type=int, default=512, help="tokens of each new prompt")
    ap.add_argument("--every", type=int, nargs="+", default=[0, 1, 4, 16],
                    help="add one request before every k-th step (0: none)")
    ap.add_argument("--steps", type=int, default=120, help="timed steps per k")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--prefill-wait-steps", type=int, default=None,
                    help="EngineConfig.prefill_wait_steps (default: the engine's)")
    ap.add_argument("--disable", default="",
                    help="ablations, as bench/offline.py's (piecewise_graphs: steps that "
                         "prefill run the eager model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_ablations(ap, args.disable)
    import cProfile
    import io
    import pstats

    import torch

    from pagedq.engine import LLMEngine, SamplingParams
    engine = LLMEngine(model_folder(args.shape), load_format="dummy", max_model_len=4096,
                       max_num_seqs=256, max_num_batched_tokens=16384, device=args.device,
                       enforce_eager=args.enforce_eager,
                       prefill_wait_steps=args.prefill_wait_steps)
    print(f"engine ready in {engine.runner.load_time_s:.1f} s; prefill_wait_steps="
          f"{engine.config.prefill_wait_steps}; piecewise graphs: "
          f"{engine.runner.piecewise.sizes if engine.runner.piecewise else None}", flush=True)
    rng = random.Random(0)
    long = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=3000)
    n = 0

    def add() -> None:
        nonlocal n
        engine.add_request(f"m{n}", [rng.randint(0, 10000) for _ in range(args.prompt)], long)
        n += 1

    for _ in range(args.running):
        add()
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(10):  # decode only: graphs warm
        engine.step()

    def prompt_pending() -> bool:
        """A prompt not (known to be) computed yet: waiting, held, or mid-prefill. With async
        scheduling the computed counts trail the launched step, so this over-counts the
        steps that really prefilled by a step or two per prompt."""
        return any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
                   ) or bool(engine.scheduler.waiting)

    rows = []
    for k in args.every:
        tokens = pending = 0
        t0 = time.perf_counter()
        for i in range(args.steps):
            if k and i % k == 0:
                add()
            pending += prompt_pending()
            tokens += len(engine.step())
        dt = time.perf_counter() - t0
        for s in list(engine.scheduler.running)[args.running:]:  # back to --running
            engine.abort_request(s.request_id)
        for _ in range(3):
            engine.step()
        rows.append(dict(every=k, ms_per_step=dt / args.steps * 1e3, tok_s=tokens / dt,
                         steps_begun_with_prompt_pending=pending, steps=args.steps))
        print(f"add one every {k or '-':>3} steps: {rows[-1]['ms_per_step']:7.2f} ms/step "
              f"{rows[-1]['tok_s']:9.0f} tok/s  ({pending}/{args.steps} steps began with a "
              f"prompt pending)", flush=True)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profile_steps):
        add()
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
    table = buf.getvalue()
    print(f"host view of {args.profile_steps} steps, each with one new {args.prompt}-token "
          f"prompt:\n{table}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"mixed-steps-{args.shape}.json")
        with open(path, "w") as f:
            json.dump(dict(vars(args), rows=rows, profile=table), f, indent=1)
        print(f"wrote {path}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
