"""CPU throughput against transformers (docs/benchmarks.md, definition 4): the bundled SmolLM2
in float32, 16 chat prompts, 64 new tokens each with EOS ignored, greedy (--temperature:
both sides sample instead, no top-k / top-p).

  python bench/cpu.py [--rounds 3] [--batch 16] [--max-new-tokens 64] [--temperature 0]
                      [--json FILE]

Both sides run in this one process on the same prompt token ids, in alternating rounds
(transformers, then pagedq, per round), after one short warm-up of each:
  * transformers: ``generate()`` with static batching: the prompts padded on the left to
    one [batch, longest] tensor, greedy, ``max_new_tokens``, no EOS (the generation
    config's eos_token_id emptied: no row stops or turns to padding, none is masked);
  * pagedq: LLMEngine.generate (continuous batching over the paged KV cache),
    temperature 0, ignore_eos, the same max_tokens; prefix caching off unless
    --prefix-caching (the rounds repeat the same prompts: with it on, every round after
    the warm-up would skip most of its prefill).
Throughput = new tokens / wall seconds of the call (prefill included). The ratio is
pagedq / transformers of the same round; the summary is the median over rounds, and the
best round of each side with their ratio (other processes only ever slow a call down, so
on a shared machine the best of each is the steadier estimate of the uncontended ratio). Greedy
agreement: how many sequences are equal token for token (float32 both sides; a tie in
the argmax broken differently by padding or kernel order shows up here, so it is
printed, not asserted).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pagedq.demo import PROMPTS as DEMO_PROMPTS  # noqa: E402

PROMPTS = [  # the demo's 8, then 8 more
    *DEMO_PROMPTS,
    "Describe a cat to someone who has never seen one.",
    "What should I pack for a weekend in the mountains?",
    "Summarise the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
    "List five fruits that are red.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "Write a short thank-you note to a teacher.",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """Token ids of the first n prompts (cycled) through the chat template."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


class HFStatic:
    """transformers generate() over one left-padded batch."""

    def __init__(self, folder, tokenizer, temperature: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from pagedq.engine.loader import quiet_transformers
        with quiet_transformers():
            self.model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=torch.float32).eval()
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        cfg = copy.deepcopy(self.model.generation_config)
        # no stopping and nothing masked, EOS is an ordinary token (None would be filled
        # in from the model's own generation config by generate())
        cfg.eos_token_id = []
        cfg.pad_token_id = self.pad
        for k in ("temperature", "top_p", "top_k"):
            setattr(cfg, k, None)
        cfg.do_sample = temperature > 0
        if cfg.do_sample:
            cfg.temperature = temperature
        self.gen_config = cfg

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        import torch
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        self.gen_config.max_new_tokens = new_tokens
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask,
                                      generation_config=self.gen_config)
        return out[:, width:].tolist()


class Paged:
    """pagedq's LLMEngine, EOS ignored."""

    def __init__(self, args) -> None:
        from pagedq.engine import LLMEngine
        self.temperature = args.temperature
        self.engine = LLMEngine("smollm2", device="cpu", dtype="float32",
                                enable_prefix_caching=args.prefix_caching,
                                max_num_seqs=args.max_num_seqs,
                                kv_cache_memory_gb=args.kv_cache_memory_gb,
                                max_model_len=args.max_model_len)

    def __enter__(self) -> Paged:
        return self

    def __exit__(self, *exc) -> None:
        self.engine.close()

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from pagedq.engine import SamplingParams
        sp = SamplingParams(temperature=self.temperature, max_tokens=new_tokens,
                            ignore_eos=True)
        outs = self.engine.generate(prompts, sp, use_tqdm=False)
        return [o.token_ids for o in outs]


def timed(fn, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    toks = fn(prompts, new_tokens)
    dt = time.perf_counter() - t0
    n = sum(map(len, toks))
    if n != len(prompts) * new_tokens:
        raise RuntimeError(f"expected {len(prompts) * new_tokens} new tokens, got {n}")
    return n / dt, toks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed rounds")
    ap.add_argument("--batch", type=int, default=16,
                    help="prompts (the static batch of transformers)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch intra-op threads (the default is os.cpu_count())")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="pagedq's seats")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.25,
                    help="pagedq's KV cache size")
    ap.add_argument("--max-model-len", type=int, default=2048, help="pagedq's context length")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="let pagedq reuse the prompts' KV blocks cached by the warm-up and "
                         "earlier rounds (off: every round prefills every prompt, as "
                         "transformers does)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (the definition); above 0: both sides sample")
    ap.add_argument("--json", default=None, help="write the rounds, medians and bests to this file")
    args = ap.parse_args(argv)
    if min(args.rounds, args.batch, args.max_new_tokens, args.threads) < 1:
        ap.error("--rounds, --batch, --max-new-tokens and --threads must be >= 1")
    if not 0 <= args.temperature <= 100:
        ap.error("--temperature must be between 0 and 100")

    import torch
    torch.set_num_threads(args.threads)
    with Paged(args) as paged:
        return compare(args, paged)


def compare(args, paged: Paged) -> int:
    """The rounds: transformers, then pagedq, on the same prompts; prints and --json."""
    import torch

    from pagedq.engine.loader import hf_folder
    prompts = chat_prompts(paged.engine.tokenizer, args.batch)
    hf = HFStatic(hf_folder(paged.engine.runner.source), paged.engine.tokenizer,
                  args.temperature)
    print(f"SmolLM2-135M float32, CPU, {args.threads} threads, torch {torch.__version__}; "
          f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.max_new_tokens} new tokens each, "
          f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}", flush=True)
    hf.run(prompts, 4)  # warm-up: first calls allocate and pick kernels
    paged.run(prompts, 4)

    rounds = []
    for r in range(args.rounds):
        hf_tps, hf_toks = timed(hf.run, prompts, args.max_new_tokens)
        pq_tps, pq_toks = timed(paged.run, prompts, args.max_new_tokens)
        same = sum(a == b for a, b in zip(hf_toks, pq_toks, strict=True))
        rounds.append({"transformers_tok_s": hf_tps, "pagedq_tok_s": pq_tps,
                       "ratio": pq_tps / hf_tps,
                       "greedy_equal": None if args.temperature else same})
        agree = f"greedy equal {same}/{len(prompts)}" if not args.temperature else "sampled"
        print(f"round {r + 1}: transformers {hf_tps:7.1f} tok/s  pagedq {pq_tps:7.1f} tok/s  "
              f"ratio {pq_tps / hf_tps:.2f}  {agree}", flush=True)
    med = {k: statistics.median(x[k] for x in rounds)
           for k in ("transformers_tok_s", "pagedq_tok_s", "ratio")}
    print(f"median: transformers {med['transformers_tok_s']:.1f} tok/s  pagedq "
          f"{med['pagedq_tok_s']:.1f} tok/s  ratio {med['ratio']:.2f} "
          f"(min {min(x['ratio'] for x in rounds):.2f}, max {max(x['ratio'] for x in rounds):.2f})")
    best = {k: max(x[k] for x in rounds) for k in ("transformers_tok_s", "pagedq_tok_s")}
    best["ratio"] = best["pagedq_tok_s"] / best["transformers_tok_s"]
    print(f"best: transformers {best['transformers_tok_s']:.1f} tok/s  pagedq "
          f"{best['pagedq_tok_s']:.1f} tok/s  ratio {best['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rounds": rounds,
                       "median": med, "best": best}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
