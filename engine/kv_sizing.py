"""How many KV blocks a runner's cache gets (EngineConfig.num_kv_blocks unset): on the CPU
kv_cache_memory_gb of them; on CUDA what is left of the device's memory after the weights,
a full step's activations and the CUDA graphs (engine/kv_cache.py: a block's bytes, the
allocation and the layers' views).

``profile_num_blocks`` takes the runner for the duration of the call and keeps nothing of
it (engine/model_runner.py: nothing the runner owns refers back to it).
"""
from __future__ import annotations

import math

import torch

from pagedq.engine import kv_cache
from pagedq.engine.batch import ScheduledBatch
from pagedq.engine.progress import stage
from pagedq.engine.sampling_params import SamplingParams
from pagedq.engine.sequence import Sequence


def warmup_lens(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int
                ) -> list[int]:
    """The prompt lengths of the warm-up step: a full token budget in sequences of at most
    max_model_len tokens, at most max_num_seqs of them."""
    chunk = min(max_model_len, max_num_batched_tokens)
    lens = [chunk] * (max_num_batched_tokens // chunk)
    if max_num_batched_tokens % chunk:
        lens.append(max_num_batched_tokens % chunk)
    return lens[:max_num_seqs]


def profile_num_blocks(runner) -> int:
    """CPU: kv_cache_memory_gb. CUDA: run one warm-up step of max_num_batched_tokens with a
    just-large-enough temporary cache, then give the KV cache what is left of
    total * gpu_memory_utilization after other processes, the CUDA context, the weights
    and the warm-up's peak activations."""
    per_block = runner.block_bytes()
    if runner.device.type != "cuda":
        return max(1, int(runner.config.kv_cache_memory_gb * 2**30) // per_block)
    cfg, bs, device = runner.config, runner.block_size, runner.device
    lens = warmup_lens(cfg.max_num_batched_tokens, runner.max_model_len, cfg.max_num_seqs)
    tmp_blocks = sum(math.ceil(n / bs) for n in lens)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner._allocate_kv_cache(tmp_blocks)
    batch, next_block = ScheduledBatch(), 0
    for i, n in enumerate(lens):
        seq = Sequence(f"warmup-{i}", [0] * n, SamplingParams())
        seq.block_table = list(range(next_block, next_block + math.ceil(n / bs)))
        next_block += len(seq.block_table)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
    with torch.inference_mode():  # every rank runs it (no step is sent to the ranks)
        runner._forward(runner.inputs.pack(batch), None)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - tmp_blocks * per_block
    free, total = torch.cuda.mem_get_info(device)
    not_ours = total - free - torch.cuda.memory_reserved(device)
    graphs = 0
    if runner._uses_graphs() and runner.tp.size == 1:
        # the graphs' pools do not depend on the cache's size: captured once over this
        # small cache to be measured, then again over the real one (they bake in its
        # addresses). Tensor-parallel ranks' graphs (decode only, no piecewise) stay
        # outside the budget: their capture must run in lockstep (not built twice).
        stage("capturing the CUDA graphs once to measure their memory")
        graphs = runner._capture_graphs(announce=False)
        runner.release_graphs()
    budget = total * cfg.gpu_memory_utilization - not_ours - peak - graphs
    runner.kv_cache = runner.kv_scale_cache = None
    kv_cache.release(runner.model.attention_layers())
    torch.cuda.empty_cache()  # (the graphs' pools too, once released)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB after "
            f"weights and a {cfg.max_num_batched_tokens}-token warm-up): raise "
            f"gpu_memory_utilization or lower max_num_batched_tokens")
    return blocks
