"""Offline engine throughput: workload 1 of docs/benchmarks.md (nano-vllm's bench).

random.seed(0); N sequences; prompt = randint(100, 1024) random ids in [0, 10000];
max_tokens = randint(100, 1024); temperature 0.6; ignore_eos; max_model_len 4096.
Random bf16 weights of a model shape (load_format 'dummy': nothing to download).
One warm-up call, then one timed call. Also reports KV waste: the share of allocated
KV slots (blocks of running sequences x block size) not holding a computed token,
sampled every 8th step.

  python bench/offline.py [--shape qwen3-0.6b|llama-3.2-1b|llama-3.1-8b|llama-3.1-70b|tiny]
                          [--num-seqs 256] [--tensor-parallel-size N]
                          [--enforce-eager] [--disable fused_add_rms_norm,qk_norm_rope_store]
                          [--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2|int8]
                          [--decode-variant swap8:st=3]
(--disable qk_norm_rope_store runs the unfused norm / rotary / store kernels instead: see
engine/layers/ops.py; list those too for their torch twins, with --enforce-eager.)
(bench/tp.py runs it at several --tensor-parallel-size values and compares.)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                       hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, tie_word_embeddings=True,
                       max_position_embeddings=40960),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                         hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rope_theta=500000.0, tie_word_embeddings=False,
                         max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    # 141 GB of bf16 weights: more than one H200 holds (--tensor-parallel-size 2)
    "llama-3.1-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                          vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=128, rope_theta=500000.0, tie_word_embeddings=False,
                          max_position_embeddings=131072,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}),
}
# A few-MB Qwen3 for CPU checks of the bench scripts themselves (--smoke): ids up to 10,000
# fit its vocabulary; its figures mean nothing.
SHAPES["tiny"] = dict(SHAPES["qwen3-0.6b"], vocab_size=10240, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
PHYSICAL_LIMIT = {"qwen3-0.6b": 35600.0}  # tok/s on the H200 (docs/benchmarks.md)


def kv_cache_dtypes() -> tuple[str, ...]:
    """kv_cache_dtype's values, as the engine declares them (wire/engine_config.py)."""
    from pagedq.wire.declared import declared
    from pagedq.wire.engine_config import EngineConfig
    return next(d.setting.choices for d in declared(EngineConfig) if d.name == "kv_cache_dtype")


def cache_kind(kv_cache_dtype: str) -> str:
    """The decode kernel's cache kind (kernels/decode_attention.py DEFAULTS) of a value."""
    import torch

    from pagedq.engine.kv_cache import kv_format
    from pagedq.kernels.kv_quant import kind
    return kind(kv_format(kv_cache_dtype, torch.bfloat16).dtype)


def workload(n: int):
    from pagedq.engine import SamplingParams
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
               for _ in range(n)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=random.randint(100, 1024)) for _ in range(n)]
    return prompts, params


def model_folder(shape: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"pagedq-{shape}-")
    cfg = dict(SHAPES[shape], rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16",
               eos_token_id=0, bos_token_id=0)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def triton_variants() -> int:
    """Number of Triton kernel variants compiled (or loaded from the disk cache) so far in
    this process. A compile inside the timed call costs seconds; the bench reports it."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith(("kernels.", "pagedq.kernels.")) or mod is None:
            continue
        for obj in vars(mod).values():
            for entry in getattr(obj, "device_caches", {}).values():
                n += len(entry[0])  # (kernel_cache, ...) in triton 3.x
    return n


def set_ablations(ap: argparse.ArgumentParser, names: str) -> None:
    """--disable: export the names for engine/layers/ops.py (which reads them at import, so
    before the engine is imported); a name that switches nothing off is an error (a typo
    would measure nothing)."""
    if not names:
        return
    os.environ["PAGEDQ_DISABLE_KERNELS"] = names
    from pagedq.engine.layers.ops import ABLATIONS, unknown_ablations
    if bad := unknown_ablations(names):
        ap.error(f"--disable: unknown {', '.join(bad)} (known: {', '.join(sorted(ABLATIONS))})")


def run(engine, prompts, params) -> dict:
    """generate() by hand so KV waste can be sampled between steps."""
    for k, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"b{k}", p, sp)
    out_tokens = steps = 0
    alloc = held = 0
    peak_waste = 0.0
    bs = engine.config.block_size
    t0 = time.perf_counter()
    wait0 = engine.device_wait_s
    while engine.has_unfinished():
        out_tokens += len(engine.step())
        steps += 1
        if steps % 8 == 0:
            run_seqs = engine.scheduler.running
            a = sum(len(s.block_table) for s in run_seqs) * bs
            h = sum(s.num_computed_tokens for s in run_seqs)
            alloc, held = alloc + a, held + h
            if a:
                peak_waste = max(peak_waste, 1 - h / a)
    dt = time.perf_counter() - t0
    return dict(seconds=dt, output_tokens=out_tokens, steps=steps, ms_per_step=dt / steps * 1e3,
                host_wait_s=engine.device_wait_s - wait0,
                throughput_tok_s=out_tokens / dt,
                kv_waste_mean=(1 - held / alloc) if alloc else 0.0, kv_waste_peak=peak_waste)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=kv_cache_dtypes())
    ap.add_argument("--no-async", action="store_true", help="synchronous scheduling")
    ap.add_argument("--disable", default="",
                    help="kernels to replace by their torch twins; decode_order: decode "
                         "rows launched in batch order, not longest first; piecewise_graphs: "
                         "steps that prefill run the eager model")
    ap.add_argument("--decode-variant", default="",
                    help="the decode attention variant for this run's cache kind, as "
                         "kernels/decode_attention.py parse_variant reads it (e.g. "
                         "swap8:st=3); default: that module's DEFAULTS")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks sharing the model: one process per GPU, cuda:0..N-1")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    ap.add_argument("--smoke", action="store_true", help="clip prompts/outputs to 16 tokens")
    args = ap.parse_args()
    set_ablations(ap, args.disable)
    if args.decode_variant:  # before the engine: its CUDA graphs capture the kernel they see
        from pagedq.kernels import decode_attention
        try:
            decode_attention.use_variant(cache_kind(args.kv_cache_dtype), args.decode_variant)
        except ValueError as e:
            ap.error(f"--decode-variant: {e}")
    import torch

    from pagedq.engine import LLMEngine, SamplingParams
    t = time.perf_counter()
    with LLMEngine(model_folder(args.shape), load_format="dummy", max_model_len=4096,
                   max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   enforce_eager=args.enforce_eager, device=args.device,
                   async_scheduling=not args.no_async, kv_cache_dtype=args.kv_cache_dtype,
                   tensor_parallel_size=args.tensor_parallel_size,
                   gpu_memory_utilization=args.gpu_memory_utilization) as engine:
        load_s = time.perf_counter() - t
        prompts, params = workload(args.num_seqs)
        if args.smoke:  # a quick check of the script itself, e.g. on the CPU
            prompts = [p[:16] for p in prompts]
            for sp in params:
                sp.max_tokens = 16
        # warm-up: prompts of the workload's lengths (chunked prefill shapes and decode batch
        # sizes JIT-compile here, not in the timed call), outputs clipped to 8 tokens
        warm = [[(7 * i + j) % 10000 for j in range(len(p))] for i, p in enumerate(prompts[:32])]
        engine.generate(warm, SamplingParams(max_tokens=8, temperature=0.6, ignore_eos=True),
                        use_tqdm=False)
        compiled = triton_variants()
        res = run(engine, prompts, params)
        res["triton_compiles_in_timed_run"] = triton_variants() - compiled
        res.update(shape=args.shape, num_seqs=args.num_seqs, enforce_eager=args.enforce_eager,
                   async_scheduling=not args.no_async, kv_cache_dtype=args.kv_cache_dtype,
                   disabled=args.disable, decode_variant=args.decode_variant or None,
                   prompt_tokens=sum(map(len, prompts)),
                   expected_output_tokens=sum(p.max_tokens for p in params),
                   num_kv_blocks=engine.runner.num_kv_blocks, load_s=load_s,
                   tensor_parallel_size=args.tensor_parallel_size,
                   cuda_graphs=len(engine.runner.graphs),
                   kv_cache_gib=engine.runner.kv_cache_bytes / 2**30,
                   kv_cache=engine.runner.kv_label,
                   graph_gib=engine.runner.graph_bytes / 2**30,
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if args.shape in PHYSICAL_LIMIT and res["device"] != "cpu":
        res["fraction_of_limit"] = res["throughput_tok_s"] / PHYSICAL_LIMIT[args.shape]
    print(json.dumps(res))
    print(f"{args.shape:13s} seqs={args.num_seqs:4d} kv={args.kv_cache_dtype:8s} eager={args.enforce_eager!s:5s} "
          f"disabled={args.disable or '-':30s} {res['throughput_tok_s']:9.0f} tok/s "
          f"({res['output_tokens']} tok in {res['seconds']:.2f} s, {res['steps']} steps, "
          f"{res['ms_per_step']:.2f} ms/step, host waited {res['host_wait_s']:.2f} s) "
          f"kv_waste mean={res['kv_waste_mean']:.2%} peak={res['kv_waste_peak']:.2%} "
          f"triton compiles in timed run={res['triton_compiles_in_timed_run']} "
          f"KV {res['kv_cache_gib']:.2f} GiB, CUDA graphs {res['graph_gib']:.2f} GiB")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = f"{args.shape}-{args.num_seqs}{'-eager' if args.enforce_eager else ''}" + \
              (f"-tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else "") + \
              ("-sync" if args.no_async else "") + \
              (f"-{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "") + \
              (f"-no-{args.disable.replace(',', '+')}" if args.disable else "") + \
              (f"-dv-{args.decode_variant.translate(str.maketrans(':,=', '-+_'))}"
               if args.decode_variant else "")
        with open(os.path.join(args.out, f"offline-{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
    assert res["output_tokens"] == res["expected_output_tokens"], "lost tokens"
    return 0


if __name__ == "__main__":
    sys.exit(main())
