"""The model runner's CUDA graphs (CUDA, Triton kernels, not enforce_eager): one whole-model
graph per padded decode batch size, replayed by a decode-only step, and, with one rank, the
piecewise graphs of the steps that prefill (engine/piecewise.py).

Invariants:
  * ``CudaGraphs`` holds the model, never the runner (engine/model_runner.py: nothing the
    runner owns refers back to it);
  * ``graphs`` is one dict for the object's lifetime, cleared, never replaced: the tensor-
    parallel rank group's hook before it leaves the process group holds it
    (``reset_graphs``);
  * the decode graphs share one memory pool and the static buffers ``static``; padding rows
    write no KV (slot -1) and read block 0 over seq_len 1, their output dropped.
"""
from __future__ import annotations

import torch

from pagedq.engine.capture import capture_stream
from pagedq.engine.layers import ops
from pagedq.engine.layers.attention import AttentionMetadata
from pagedq.engine.piecewise import PiecewiseGraphs
from pagedq.engine.progress import stage


def model_step(model, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
    """The model on one step; a decode-only step first orders its rows for the decode
    kernel, on the device (so a captured graph orders each replay's rows)."""
    if meta.is_decode_only:
        meta.decode_order = ops.decode_order(meta.seq_lens)
    return model(input_ids, positions, meta)


def reset_graphs(graphs: dict[int, torch.cuda.CUDAGraph]) -> None:
    """Destroy the decode graphs in ``graphs`` (their pool is freed with the last)."""
    for graph in graphs.values():
        graph.reset()
    graphs.clear()


class CudaGraphs:
    """The captured graphs of one runner's model on ``device``: empty until ``capture``."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # padded decode batch size -> graph
        self.static: dict[str, torch.Tensor] = {}  # the decode graphs' inputs and output
        self.piecewise: PiecewiseGraphs | None = None  # steps that prefill (one rank only)
        self.graph_bytes = 0  # device memory the CUDA graphs hold (pools, static buffers)
        self.max_num_seqs = 0  # the largest decode batch a graph runs (set by capture)

    def capture(self, model, hf_config, config, max_model_len: int, tp_size: int,
                announce: bool = True) -> int:
        """Capture the decode graphs and, with one rank, the piecewise ones; return the
        device memory they took."""
        torch.cuda.empty_cache()  # the static buffers must not come from cached blocks
        before = torch.cuda.memory_reserved(self.device)
        if announce:
            stage("capturing CUDA graphs")
        self.capture_decode(model, hf_config.hidden_size, config.max_num_seqs,
                            -(-max_model_len // config.block_size), tp_size)
        # (ranks would have to capture their collectives in lockstep: not built)
        if tp_size == 1 and not ops.ablated("piecewise_graphs"):
            if announce:
                stage("capturing piecewise CUDA graphs for steps that prefill")
            self.piecewise = PiecewiseGraphs(model, self.device, self.dtype,
                                             hf_config.hidden_size,
                                             config.max_num_batched_tokens)
            self.piecewise.capture(capture_stream(self.device, self.dtype))
        return torch.cuda.memory_reserved(self.device) - before

    @torch.inference_mode()
    def capture_decode(self, model, hidden_size: int, n_max: int, width: int,
                       tp_size: int) -> None:
        """One CUDA graph per padded decode batch size (1, 2, 4, 8, 16, 32, ... up to
        ``n_max``: max_num_seqs), sharing one memory pool and one set of static input
        buffers (``width``: block-table columns). Needs the Triton kernels (the reference
        twins sync with the host). Padding rows: slot -1 (no KV write), seq_len 1 over
        block 0 (valid memory; their output is dropped)."""
        self.max_num_seqs = n_max
        sizes = sorted({min(n_max, x) for x in [1, 2, 4, 8] + list(range(16, n_max + 16, 16))})
        dev, i64, i32 = self.device, torch.int64, torch.int32
        st = self.static = {
            "ids": torch.zeros(n_max, dtype=i64, device=dev),
            "pos": torch.zeros(n_max, dtype=i64, device=dev),
            "slots": torch.full((n_max,), -1, dtype=i64, device=dev),
            "tables": torch.zeros(n_max, width, dtype=i32, device=dev),
            "lens": torch.ones(n_max, dtype=i32, device=dev),
            "cu": torch.arange(n_max + 1, dtype=i32, device=dev),
            "out": torch.zeros(n_max, hidden_size, dtype=self.dtype, device=dev),
        }
        pool = None
        # tensor-parallel: the all-reduces are captured too (every rank captures the same
        # sizes in the same order, in lockstep); thread-local capture lets the NCCL
        # watchdog thread query its events meanwhile
        mode = "thread_local" if tp_size > 1 else "global"
        stream = capture_stream(dev, self.dtype)
        for n in reversed(sizes):  # largest first: smaller graphs reuse its pool
            meta = AttentionMetadata(st["slots"][:n], st["tables"][:n], st["lens"][:n],
                                     st["cu"][:n + 1], 1, True, st["pos"][:n])
            model_step(model, st["ids"][:n], st["pos"][:n], meta)  # compile/warm the kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                st["out"][:n] = model_step(model, st["ids"][:n], st["pos"][:n], meta)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(dev)

    def fits_decode(self, n: int, meta: AttentionMetadata) -> bool:
        """Whether a step of ``n`` rows replays a decode graph (``replay_decode``)."""
        return bool(meta.is_decode_only and self.graphs and n <= self.max_num_seqs)

    def replay_decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, H] of a decode-only step that ``fits_decode`` (a view of a
        static buffer: valid until the next step)."""
        n = input_ids.shape[0]
        padded = min(b for b in self.graphs if b >= n)
        st, w = self.static, meta.block_tables.shape[1]
        st["ids"][:n].copy_(input_ids)
        st["pos"][:n].copy_(positions)
        st["slots"][:n].copy_(meta.slot_mapping)
        st["slots"][n:padded].fill_(-1)
        st["lens"][:n].copy_(meta.seq_lens)
        st["lens"][n:padded].fill_(1)
        st["tables"][:n, :w].copy_(meta.block_tables)
        st["tables"][n:padded, 0].fill_(0)
        self.graphs[padded].replay()
        return st["out"][:n]

    def release(self) -> None:
        """Destroy every graph and drop the static buffers (a later ``capture`` may run)."""
        reset_graphs(self.graphs)
        self.static = {}
        if self.piecewise is not None:
            self.piecewise.reset()
        self.piecewise = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
