"""Triton kernels and their pure-torch reference twins.

Layouts shared by every kernel (checked by each wrapper):
  k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim], contiguous or (V of an
                     fp8 cache) a layout.transposed_view of such a tensor
  slot_mapping     : [num_tokens] int64, slot = block_id * block_size + offset; -1 = skip
  block_tables     : [num_seqs, max_blocks_per_seq] int32, unused entries -1
  seq_lens         : [num_seqs] int32, context length of each sequence INCLUDING this step
  cu_seqlens_q     : [num_seqs + 1] int32, query tokens of seq b are q[cu[b]:cu[b+1]];
                     they are the LAST (cu[b+1]-cu[b]) positions of its context (causal).
Imports nothing from engine. No __version__ here (docs/environment.md, "The `kernels` name
clash": Hugging Face's hub-kernels package has the same import name).
"""
if __name__ == "kernels":  # this folder imported by its bare name, from a checkout's root
    import sys as _sys

    from ._hub import hand_over as _hand_over

    del _sys.modules["kernels._hub"]  # ours: no trace of it under the hub package's name
    _hand_over()
