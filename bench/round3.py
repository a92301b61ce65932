"""Decode attention at workload 1's batch sizes, every kernel variant; then workload 1 end to
end with the best variants, and the shared-prefix A/B: issue 28's GPU work in one process.

  PYTHONUNBUFFERED=1 python bench/round3.py [--out DIR] [--variants SPEC,...] [--e2e auto|none|SPEC]
                                            [--prefix] [--smoke]

1. Kernels. At B = 32, 64, 128, 180, 256, random contexts in workload 1's range at that
   batch size (docs/benchmarks.md, "Decode attention": 32 x 1,200-2,000, 64 x 800-2,000,
   128 x 600-2,000, 180 x 400-1,900, 256 x 100-1,100 tokens), Qwen3-0.6B's heads (16/8,
   head_dim 128, block 16), block tables 256 wide and the batch padded as the engine's
   graphs pad it (padding rows: length 1 over block 0), rows longest first. A variant
   (kernels/decode_attention.py parse_variant: "name[:knob=value,...]") of the 16-bit kind
   runs on a bf16 cache, of the fp8 kind on its e4m3 copy with V transposed (the engine's
   layouts). Each is first checked against the reference twin on 8 rows (max relative error
   per row; over 2e-2 it is marked BAD and never picked), then timed: one CUDA graph of calls
   over rotating input sets (together at least 4x the L2), median of its replays, per call.
   The table: us, TB/s of KV read (real tokens only) and the ratio to the bf16 default
   ("16bit=tile") of the same batch; "weighted": the sum over B of us times workload 1's steps
   in that batch bucket (docs/benchmarks.md's per-batch table), and its ratio.
2. --e2e auto (default): bench/offline.py --num-seqs 256 in subprocesses: bf16 with the
   default variant; bf16 with the best 16-bit one, if it is not the default and its weighted
   time is 2% lower; fp8 with the best fp8 one (lowest weighted time among those that passed
   the check). --e2e SPEC: fp8 with that variant; --e2e none: no runs. Prints tok/s and the
   fp8 / bf16 ratio (bf16: the default's run).
3. --prefix: bench/shared_prefix.py --ab on this tree, then on each old tree under .whl/trees
   (bench/old_trees.sh puts them there): the shared-prefix drop's A/B (its docstring).

Writes DIR/round3.json (DIR: --out, else $OUT, else bench/results). --smoke: the whole script
on the CPU (Triton interpreter, tiny shapes, the tiny model, wall-clock timing): a check of
the script, its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pagedq.kernels import reference as R  # noqa: E402
from pagedq.kernels.decode_attention import decode_launch, longest_first, parse_variant  # noqa: E402
from pagedq.kernels.layout import transposed_view  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
HQ, HKV, D, BS, WIDTH = (4, 2, 32, 16, 4) if SMOKE else (16, 8, 128, 16, 256)
# batch -> (context range, workload 1's steps in that bucket: docs/benchmarks.md)
BATCHES = {2: ((5, 40), 1), 3: ((20, 60), 1)} if SMOKE else {
    32: ((1200, 2000), 278), 64: ((800, 2000), 138), 128: ((600, 2000), 249),
    180: ((400, 1900), 88), 256: ((100, 1100), 280)}
# and the decode steps of bench/shared_prefix.py: every row's first SHARED blocks are the
# same blocks (read through L2), then its own (suffix and output so far); not weighted
SHARED = dict(B=3, blocks=2, extra=(1, 20)) if SMOKE else dict(B=256, blocks=128,
                                                                extra=(33, 160))
BASE = "16bit=tile"
VARIANTS = ("16bit=tile", "16bit=tile:st=3", "16bit=swap", "fp8=tile", "fp8=tile:bn=32",
            "fp8=swap8", "fp8=swap8:st=2", "fp8=swap8:bn=128", "fp8=swap8:sm=8",
            "fp8=swap8:w=8")
SMOKE_VARIANTS = ("16bit=tile", "16bit=swap", "fp8=tile", "fp8=swap8", "fp8=swap8:bn=32")
MIN_SET_BYTES = 200 << 20  # fp8 KV bytes per graph pass: 4x the H200's L2 (smoke: 2 sets)
BAD = 2e-2


def graph_sizes(n_max: int = 256) -> list[int]:
    """The decode batch sizes the engine captures (ModelRunner.capture_cudagraphs)."""
    return sorted({min(n_max, x) for x in [1, 2, 4, 8] + list(range(16, n_max + 16, 16))})


class Batch:
    """Input sets for one batch size: a bf16 cache and its fp8 copy (V transposed), each set
    its own scrambled blocks; contexts drawn once (the same in every set)."""

    def __init__(self, B: int, lo: int, hi: int, seed: int, shared: int = 0):
        rng = random.Random(seed)
        self.B, self.padded = B, min(b for b in graph_sizes() if b >= B) if not SMOKE else B
        self.lens_real = [shared * BS + rng.randint(lo, hi) for _ in range(B)]
        own = [-(-n // BS) - shared for n in self.lens_real]
        blocks = shared + sum(own)
        tokens = sum(self.lens_real)  # as read: a shared block once per row
        self.kv_bytes = {"16bit": tokens * HKV * D * 2 * 2, "fp8": tokens * HKV * D * 2}
        self.n_sets = min(2 if SMOKE else 16,
                          max(1, -(-MIN_SET_BYTES // (blocks * BS * HKV * D * 2))))
        nb = blocks * self.n_sets + 1  # block 0: the padding rows'
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.kc = torch.randn(nb, BS, HKV, D, device=DEV, generator=gen).to(torch.bfloat16)
        self.vc = torch.randn(nb, BS, HKV, D, device=DEV, generator=gen).to(torch.bfloat16)
        self.kc8 = self.kc.to(torch.float8_e4m3fn)
        self.vc8 = transposed_view(torch.empty(self.vc.shape, dtype=torch.float8_e4m3fn,
                                               device=DEV))
        self.vc8.copy_(self.vc)
        perm = (torch.randperm(nb - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
        lens = self.lens_real + [1] * (self.padded - B)
        self.lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        self.order = longest_first(self.lens)
        self.q = torch.randn(self.padded, HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
        self.tables, i = [], 0
        for _ in range(self.n_sets):
            bt = torch.zeros(self.padded, WIDTH, dtype=torch.int32)
            bt[:B, :shared] = torch.tensor(perm[i:i + shared], dtype=torch.int32)
            i += shared
            for b, k in enumerate(own):
                bt[b, shared:shared + k] = torch.tensor(perm[i:i + k], dtype=torch.int32)
                i += k
            self.tables.append(bt.to(DEV))

    def caches(self, kind: str):
        return (self.kc8, self.vc8) if kind == "fp8" else (self.kc, self.vc)

    def call(self, kind: str, knobs: dict, s: int):
        kc, vc = self.caches(kind)
        return decode_launch(self.q, kc, vc, self.tables[s], self.lens, D ** -0.5,
                             order=self.order, **knobs)

    def check(self, kind: str, knobs: dict) -> float:
        """Max relative error per row against the twin, on 8 real rows of set 0 (the twin
        gets their blocks upcast to float32: no fp8 indexing needed)."""
        rows = sorted({0, self.B - 1, *random.Random(1).sample(range(self.B), min(6, self.B))})
        out = self.call(kind, knobs, 0)[rows].double()
        if not torch.isfinite(out).all():
            return float("inf")
        kc, vc = self.caches(kind)
        bt = self.tables[0][rows]
        used = bt[bt > 0].unique()  # every checked row holds >= 1 block, none is block 0
        small = torch.zeros_like(bt)
        small[bt > 0] = torch.searchsorted(used, bt[bt > 0]).int()
        up = [c.view(torch.uint8)[used.long()].view(c.dtype).float() for c in (kc, vc)]
        idx = torch.tensor(rows, device=DEV)
        ref = R.paged_decode_attention(self.q[idx].float(), up[0], up[1], small,
                                       self.lens[idx], D ** -0.5).double()
        return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def time_us(fns) -> float:
    """Median microseconds per call of the callables in ``fns`` (one per input set)."""
    if SMOKE:  # (the interpreter: one pass, after the check's compile-free run)
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) / len(fns) * 1e6
    inner = max(1, 24 // len(fns))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(15):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) * 1e3 / (inner * len(fns)))
    graph.reset()
    return statistics.median(ts)


def split_spec(spec: str) -> tuple[str, str]:
    kind, eq, variant = spec.partition("=")
    if not eq or kind not in ("16bit", "fp8"):
        raise ValueError(f"--variants: {spec!r} is not KIND=VARIANT (KIND 16bit or fp8)")
    parse_variant(variant)
    return kind, variant


def kernels(specs: list[str], out: dict) -> dict:
    rows = out["kernels"] = {}
    batches = {B: Batch(B, lo, hi, seed=B) for B, ((lo, hi), _) in BATCHES.items()}
    batches["shared"] = Batch(SHARED["B"], *SHARED["extra"], seed=7, shared=SHARED["blocks"])
    for B, b in batches.items():
        print(f"B {B} (padded {b.padded}): {min(b.lens_real)}-{max(b.lens_real)} tokens, "
              f"{b.n_sets} input sets", flush=True)
    for spec in specs:
        kind, variant = split_spec(spec)
        knobs = dict(parse_variant(variant))
        row = rows[spec] = {}
        t0 = time.perf_counter()
        for B, b in batches.items():
            try:
                err = b.check(kind, knobs)
                us = time_us([lambda s=s, b=b, kind=kind, knobs=knobs: b.call(kind, knobs, s)
                              for s in range(b.n_sets)])
                row[B] = dict(us=us, TBps=b.kv_bytes[kind] / us / 1e6, relerr=err)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                row[B] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        print(f"  {spec}: {time.perf_counter() - t0:.1f} s", flush=True)
    for row in rows.values():
        cells = list(row.items())  # (batch, result) only, so far
        for B, r in cells:
            base = rows[BASE].get(B, {})
            if "us" in r and "us" in base:
                r["ratio"] = r["us"] / base["us"]
        row["ok"] = all("us" in r for _, r in cells)
        if row["ok"]:
            row["weighted_us"] = sum(row[B]["us"] * w for B, (_, w) in BATCHES.items())
            row["max_relerr"] = max(r["relerr"] for _, r in cells)
            row["ok"] = row["max_relerr"] < BAD
    for row in rows.values():
        if "weighted_us" in row and "weighted_us" in rows[BASE]:
            row["weighted_ratio"] = row["weighted_us"] / rows[BASE]["weighted_us"]
    print_table(rows)
    return rows


def print_table(rows: dict) -> None:
    heads = "".join(f" | B={B:<3} us   TB/s  /bf16" for B in BATCHES) + \
        " | shared us TB/s* /bf16"
    print(f"\n{'variant':22s}{heads} | weighted /bf16 | relerr")
    for spec, row in rows.items():
        cells = ""
        for B in [*BATCHES, "shared"]:
            r = row.get(B, {})
            cells += (f" | {r['us']:7.1f} {r['TBps']:5.2f} {r.get('ratio', 0):5.2f}" if "us" in r
                      else f" | {'error':>19s}")
        tail = (f" | {row['weighted_us'] / 1e3:6.1f}ms {row.get('weighted_ratio', 0):5.2f}"
                f" | {row['max_relerr']:.1e}{'' if row['ok'] else ' BAD'}"
                if "weighted_us" in row else " | (failed)")
        print(f"{spec:22s}{cells}{tail}")
    print(f"  shared: B={SHARED['B']}, every row's first {SHARED['blocks']} blocks the same "
          f"(bench/shared_prefix.py's decode steps); *TB/s of KV as read (a shared block once "
          f"per row), from L2 mostly; not in the weighted sum")
    for spec, row in rows.items():
        for B in [*BATCHES, "shared"]:
            if "error" in row.get(B, {}):
                print(f"  {spec} B={B}: {row[B]['error']}")


def best(rows: dict, kind: str) -> str | None:
    ok = [(r["weighted_us"], s) for s, r in rows.items() if s.startswith(kind + "=") and r["ok"]]
    return min(ok)[1] if ok else None


def offline(out_dir: str, kind: str, variant: str | None) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "offline.py"), "--num-seqs",
           "8" if SMOKE else "256", "--out", out_dir]
    if SMOKE:
        cmd += ["--smoke", "--shape", "tiny", "--device", "cpu"]
    if kind == "fp8":
        cmd += ["--kv-cache-dtype", "fp8"]
    if variant:
        cmd += ["--decode-variant", variant]
    print("$", " ".join(cmd[1:]), flush=True)
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        print(p.stdout[-1500:], p.stderr[-3000:], sep="\n")
        return {"kind": kind, "variant": variant, "error": f"exit {p.returncode}"}
    res = json.loads(lines[-1])
    res.update(kind=kind, variant=variant, process_s=time.perf_counter() - t)
    print(f"  {kind} {variant or 'default'}: {res['throughput_tok_s']:,.0f} tok/s "
          f"({res['ms_per_step']:.2f} ms/step, host waited {res['host_wait_s']:.2f} s, "
          f"triton compiles in timed run {res['triton_compiles_in_timed_run']}; "
          f"process {res['process_s']:.0f} s)", flush=True)
    return res


def e2e(mode: str, rows: dict, out_dir: str, out: dict) -> None:
    runs = out["e2e"] = []
    runs.append(offline(out_dir, "16bit", None))
    b16 = best(rows, "16bit") if rows else None
    if b16 and b16 != BASE and rows[b16]["weighted_us"] < 0.98 * rows[BASE]["weighted_us"]:
        runs.append(offline(out_dir, "16bit", b16.partition("=")[2]))
    spec = best(rows, "fp8") if mode == "auto" else "fp8=" + mode
    if spec is None:
        print("no fp8 variant passed its check: no fp8 run")
        return
    runs.append(offline(out_dir, "fp8", spec.partition("=")[2]))
    base = runs[0].get("throughput_tok_s")
    for r in runs[1:]:
        if base and "throughput_tok_s" in r:
            r["ratio_to_bf16_default"] = r["throughput_tok_s"] / base
            print(f"  {r['kind']} {r['variant']}: {r['ratio_to_bf16_default']:.3f}x the bf16 "
                  f"default's {base:,.0f} tok/s")


def prefix(out_dir: str, out: dict) -> None:
    trees = [ROOT]
    old = os.path.join(ROOT, ".whl", "trees")
    if os.path.isdir(old):
        trees += [os.path.join(old, t) for t in sorted(os.listdir(old))]
    runs = out["prefix"] = []
    for tree in trees:
        cmd = [sys.executable, os.path.join(HERE, "shared_prefix.py"), "--tree", tree]
        cmd += ["--ab"] if tree == ROOT else ["--on-only"]
        cmd += ["--smoke"] if SMOKE else []
        print("$", " ".join(cmd[1:]), flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                runs.append(json.loads(line))
            else:
                print(" ", line, flush=True)
        if p.returncode:
            print(p.stderr[-3000:])
            runs.append({"tree": tree, "error": f"exit {p.returncode}"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"),
                    help="folder for round3.json (default: $OUT, else bench/results)")
    ap.add_argument("--variants", default="",
                    help="KIND=VARIANT items separated by spaces, KIND 16bit or fp8 "
                         "(default: the built-in list; 16bit=tile always runs)")
    ap.add_argument("--e2e", default="auto", help="auto | none | an fp8 VARIANT (default auto)")
    ap.add_argument("--prefix", action="store_true", help="run the shared-prefix A/B too")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script")
    args = ap.parse_args()
    specs = args.variants.split() or list(SMOKE_VARIANTS if SMOKE else VARIANTS)
    if BASE not in specs:
        specs.insert(0, BASE)
    try:
        for s in specs:
            split_spec(s)
        if args.e2e not in ("auto", "none"):
            parse_variant(args.e2e)
    except ValueError as e:
        ap.error(str(e))
    if not SMOKE and not torch.cuda.is_available():
        print("bench/round3.py needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "round3.json")
    t0 = time.perf_counter()
    out: dict = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(),
                 "torch": torch.__version__}
    rows = {} if args.no_kernels else kernels(specs, out)
    if not SMOKE:  # the caches go back to the device: the engines below size theirs by it
        gc.collect()
        torch.cuda.empty_cache()
    print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    if args.e2e != "none":
        e2e(args.e2e, rows, args.out, out)
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    if args.prefix:
        prefix(args.out, out)
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
