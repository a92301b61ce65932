"""Prefill attention (docs/benchmarks.md, definition 7): the Triton varlen kernel over the
paged cache (kernels/prefill_attention.py) against torch SDPA's flash backend, causal, on
the same batch of prompts; then the time to first token of one 4,096-token prompt through
the engine. CUDA, bf16, Qwen3-0.6B's attention (16 query / 8 KV heads, head_dim 128).

  python bench/prefill.py [--out DIR] [--ttft-runs 10] [--skip-ttft] [--dry-run]

Batches: "workload1": 64 prompts of random.Random(0).randint(100, 1024) tokens;
"16x4k": 16 prompts of 4,096 tokens. Each is a whole-prompt prefill (no cached prefix).
- triton: paged_attention() over a paged cache (block 16, blocks scrambled).
- sdpa_varlen: aten._flash_attention_forward on the packed batch with cu_seqlens: the
  kernel SDPA's flash backend runs (torch's own nested-tensor path calls it so; SDPA
  itself takes no varlen batch with is_causal), GQA native.
- sdpa_loop: F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) under the
  flash backend, one call per prompt (what the public API gives for varlen).
TFLOP/s count the causal work only: 4 * Hq * D * L(L+1)/2 per prompt (QK^T and PV).
Times: triton.testing.do_bench medians (L2 flushed between calls).

TTFT: LLM engine, Qwen3-0.6B shape, random weights, max_model_len 8192, step budget
--max-num-batched-tokens (16384: one step holds the prompt); generate() of one prompt with
max_tokens=1, wall clock. Every prompt is new random ids (no prefix-cache hit); three
warm-up prompts first; median and min of --ttft-runs.

--dry-run: the same code paths on the CPU, tiny sizes, the Triton kernel under the
interpreter (TRITON_INTERPRET=1), the reference twin in place of flash, the tiny shape in
the engine; its numbers mean nothing. JSON: DIR/prefill-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a script: the checkout's root leads sys.path, bench/ after it
    sys.path[0] = ROOT
    sys.path.append(os.path.join(ROOT, "bench"))
from pagedq.kernels import reference  # noqa: E402
from pagedq.kernels.prefill_attention import paged_attention  # noqa: E402

BS = 16
if DRY:
    HQ, HKV, D, DT, DEV, SHAPE, TTFT_LEN = 4, 2, 32, torch.float32, "cpu", "tiny", 256
else:
    HQ, HKV, D, DT, DEV, SHAPE, TTFT_LEN = 16, 8, 128, torch.bfloat16, "cuda", "qwen3-0.6b", 4096


def batches() -> dict[str, list[int]]:
    rnd = random.Random(0)
    if DRY:
        return {"workload1": [rnd.randint(10, 70) for _ in range(3)], "2x128": [128] * 2}
    return {"workload1": [rnd.randint(100, 1024) for _ in range(64)], "16x4k": [4096] * 16}


def bench(fn) -> float:
    """Median milliseconds."""
    if DRY:
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)[1]
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


class Batch:
    """Packed q/k/v [T, H, D] of prompts of ``lens``, and the same K/V in a paged cache."""

    def __init__(self, lens: list[int]) -> None:
        g = torch.Generator(device=DEV).manual_seed(0)
        T = sum(lens)
        self.lens = lens
        self.q, self.k, self.v = (torch.randn(T, h, D, device=DEV, dtype=DT, generator=g)
                                  for h in (HQ, HKV, HKV))
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        self.cu = torch.tensor(cu, device=DEV, dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, device=DEV, dtype=torch.int32)
        nblocks = [-(-n // BS) for n in lens]
        perm = torch.randperm(sum(nblocks), device=DEV, generator=g)
        self.bt = torch.full((len(lens), max(nblocks)), -1, device=DEV, dtype=torch.int32)
        self.kc = torch.zeros(sum(nblocks), BS, HKV, D, device=DEV, dtype=DT)
        self.vc = torch.zeros_like(self.kc)
        first = 0
        for b, (n, nb) in enumerate(zip(lens, nblocks, strict=True)):
            blocks = perm[first:first + nb]
            first += nb
            self.bt[b, :nb] = blocks.to(torch.int32)
            slots = (blocks[:, None] * BS + torch.arange(BS, device=DEV)).flatten()[:n]
            self.kc.view(-1, HKV, D)[slots] = self.k[cu[b]:cu[b + 1]]
            self.vc.view(-1, HKV, D)[slots] = self.v[cu[b]:cu[b + 1]]
        self.scale = D ** -0.5
        self.varlen_gqa = "native"

    def flops(self) -> float:
        return sum(4 * HQ * D * n * (n + 1) / 2 for n in self.lens)

    def triton(self):
        return lambda: paged_attention(self.q, self.kc, self.vc, self.bt, self.seq_lens,
                                       self.cu, self.scale)

    def sdpa_varlen(self):
        """Flash varlen on the packed batch; None where it cannot run (the CPU)."""
        if DEV != "cuda":
            return None
        m, k, v = max(self.lens), self.k, self.v

        def f():
            return torch.ops.aten._flash_attention_forward(
                self.q, k, v, self.cu, self.cu, m, m, 0.0, True, False, scale=self.scale)[0]
        try:
            f()
        except RuntimeError as e:  # a build without native GQA: K/V heads repeated, untimed
            print(f"flash varlen refused GQA ({str(e).splitlines()[0]}); K/V heads repeated")
            self.varlen_gqa = "repeated"
            k, v = (x.repeat_interleave(HQ // HKV, dim=1) for x in (self.k, self.v))
            f()
        return f

    def sdpa_loop(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [SDPBackend.FLASH_ATTENTION] if DEV == "cuda" else [SDPBackend.MATH]
        cu = self.cu.tolist()
        views = [tuple(x[cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0)
                       for x in (self.q, self.k, self.v)) for b in range(len(self.lens))]

        def f():
            with sdpa_kernel(backends):
                return [F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                       scale=self.scale) for q, k, v in views]
        return f

    def reference(self) -> torch.Tensor:
        return reference.paged_attention(self.q, self.kc, self.vc, self.bt, self.seq_lens,
                                         self.cu, self.scale)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kernel_rows() -> list[dict]:
    rows = []
    for name, lens in batches().items():
        b = Batch(lens)
        tri = b.triton()
        out = tri()
        loop = b.sdpa_loop()
        ref = torch.cat([o.squeeze(0).transpose(0, 1) for o in loop()])
        r = dict(batch=name, prompts=len(lens), tokens=sum(lens), max_len=max(lens),
                 gflop=b.flops() / 1e9, triton_rel_err_vs_sdpa=rel_err(out, ref))
        if DRY:  # the interpreter's kernel against the pure-torch twin as well
            r["triton_rel_err_vs_twin"] = rel_err(out, b.reference())
        for key, fn in (("triton", tri), ("sdpa_varlen", b.sdpa_varlen()), ("sdpa_loop", loop)):
            if fn is None:
                r[f"{key}_ms"] = None
                continue
            ms = bench(fn)
            r[f"{key}_ms"], r[f"{key}_tflops"] = ms, b.flops() / ms / 1e9
        r["sdpa_varlen_gqa"] = b.varlen_gqa if r["sdpa_varlen_ms"] else None
        base = r["sdpa_varlen_ms"] or r["sdpa_loop_ms"]
        r["sdpa_over_triton_time"] = base / r["triton_ms"]  # > 1: the Triton kernel is faster
        rows.append(r)
        print(row_line(r), flush=True)
        del b
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


def row_line(r: dict) -> str:
    def t(key):
        return f"{r[key + '_ms']:9.3f} ms {r[key + '_tflops']:6.1f}" if r.get(key + "_ms") \
            else f"{'-':>20}"
    return (f"{r['batch']:<10} {r['prompts']:>3} x <= {r['max_len']:<5} triton {t('triton')} | "
            f"sdpa varlen {t('sdpa_varlen')} | sdpa loop {t('sdpa_loop')} | "
            f"sdpa/triton time {r['sdpa_over_triton_time']:.2f} | relerr "
            f"{r['triton_rel_err_vs_sdpa']:.1e}")


def ttft(runs: int, budget: int) -> dict:
    """Wall time of generate([one new TTFT_LEN-token prompt], max_tokens=1)."""
    from offline import model_folder

    from pagedq.engine import LLMEngine, SamplingParams
    with LLMEngine(model_folder(SHAPE), load_format="dummy", max_model_len=2 * TTFT_LEN,
                   max_num_seqs=256, max_num_batched_tokens=budget,
                   device="cpu" if DRY else "auto") as engine:
        rnd = random.Random(1)
        sp = SamplingParams(max_tokens=1, temperature=0.6, ignore_eos=True)
        ts = []
        for i in range(3 + runs):  # fresh ids each time: never a prefix-cache hit
            prompt = [rnd.randint(0, 10000) for _ in range(TTFT_LEN)]
            t = time.perf_counter()
            out = engine.generate([prompt], sp, use_tqdm=False)
            dt = time.perf_counter() - t
            assert len(out[0].token_ids) == 1, out[0]
            if i >= 3:
                ts.append(dt * 1e3)
    return dict(prompt_tokens=TTFT_LEN, max_num_batched_tokens=budget, runs=runs,
                ttft_ms_median=statistics.median(ts), ttft_ms_min=min(ts), ttft_ms_max=max(ts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"),
                    help="folder for the JSON (default: bench/results)")
    ap.add_argument("--ttft-runs", type=int, default=10,
                    help="timed TTFT prompts after 3 warm-up ones (default: %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="the engine's step budget for the TTFT (default: %(default)s)")
    ap.add_argument("--skip-ttft", action="store_true", help="kernels only (default: off)")
    ap.add_argument("--dry-run", action="store_true", help="CPU check of this script (see doc)")
    args = ap.parse_args()
    if not DRY and not torch.cuda.is_available():
        print("bench/prefill.py needs CUDA (or --dry-run)", file=sys.stderr)
        return 2
    if args.ttft_runs < 1:
        print("--ttft-runs must be >= 1", file=sys.stderr)
        return 2
    import triton
    name = "cpu (dry run)" if DRY else torch.cuda.get_device_name()
    print(f"device {name}; torch {torch.__version__}, triton {triton.__version__}; "
          f"Hq/Hkv {HQ}/{HKV}, head_dim {D}, {DT}", flush=True)
    res = dict(device=name, torch=torch.__version__, triton=triton.__version__, hq=HQ, hkv=HKV,
               head_dim=D, dtype=str(DT), block_size=BS, kernels=kernel_rows())
    if not args.skip_ttft:
        res["ttft"] = t = ttft(args.ttft_runs, args.max_num_batched_tokens)
        print(f"TTFT, one {t['prompt_tokens']}-token prompt, {SHAPE}, step budget "
              f"{t['max_num_batched_tokens']}: median {t['ttft_ms_median']:.1f} ms, min "
              f"{t['ttft_ms_min']:.1f}, max {t['ttft_ms_max']:.1f} ({t['runs']} runs)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"prefill-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")
    bad = [r["batch"] for r in res["kernels"] if r["triton_rel_err_vs_sdpa"] > 2e-2]
    if bad:
        print(f"the Triton kernel disagrees with SDPA on {bad} (rel err > 2e-2)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
