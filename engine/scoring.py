"""Teacher-forced scoring of a token sequence through the paged KV cache (accuracy checks:
bench/fp8_accuracy.py, tests). The sequence is prefilled in chunks, so every chunk after
the first reads its prefix back from the cache, as decode does."""
from __future__ import annotations

import torch

from pagedq.engine.batch import ScheduledBatch
from pagedq.engine.sampling_params import SamplingParams
from pagedq.engine.sequence import Sequence


@torch.inference_mode()
def next_token_logprobs(runner, ids: list[int], chunk: int = 256) -> torch.Tensor:
    """float32 log-softmax [len(ids) - 1, vocab] on the CPU: row i is the distribution of
    ids[i + 1] given ids[:i + 1]. Uses KV blocks 0.. of the runner's cache (it must hold
    len(ids) tokens, and nothing else may be using those blocks)."""
    if len(ids) < 2:
        raise ValueError("need at least 2 token ids to score")
    if runner.tp.size > 1:  # it calls the model directly: the other ranks would not join
        raise ValueError("scoring runs on a single-rank runner (tensor_parallel_size 1)")
    blocks = -(-len(ids) // runner.block_size)
    if blocks > runner.num_kv_blocks or len(ids) > runner.max_model_len:
        raise ValueError(f"{len(ids)} tokens do not fit the runner ({runner.num_kv_blocks} "
                         f"blocks of {runner.block_size}, max_model_len {runner.max_model_len})")
    seq = Sequence("score", list(ids), SamplingParams())
    seq.block_table = list(range(blocks))
    out = []
    while seq.num_computed_tokens < len(ids):
        n = min(chunk, len(ids) - seq.num_computed_tokens)
        input_ids, positions, meta, _ = runner.prepare(ScheduledBatch(seqs=[seq],
                                                                      num_new_tokens=[n]))
        hidden = runner.model(input_ids, positions, meta)
        out.append(torch.log_softmax(runner.model.compute_logits(hidden).float(), -1).cpu())
        seq.num_computed_tokens += n
    return torch.cat(out)[:-1]
