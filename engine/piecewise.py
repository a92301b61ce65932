"""Piecewise CUDA graphs for the steps that prefill (vLLM's scheme, without torch.compile).

A decode-only step replays one whole-model CUDA graph (engine/cuda_graphs.py). A
step that prefills cannot: its attention's grid and loop bounds follow the step's query
lengths, not only its token count. Run eagerly, such a step costs the host about 17 ms of
launches for Qwen3-0.6B's 28 layers whatever its size (bench/mixed_steps.py), several
decode steps' device time. So the model is captured in pieces cut at each attention: piece
0 runs from the embedding to layer 0's stored K/V and rotated q, piece i from layer i-1's
attention output to layer i's rotated q, the last one to the final norm; each layer's
attention runs eagerly between two pieces (Attention.attend). A step of T tokens replays
the pieces captured for the smallest size >= T: the padding rows write no KV (slot -1),
and their outputs are never read.

Invariants:
  * every piece of every size shares one memory pool, and the tensors that pass from one
    piece to the next (the residual stream) live in it, unowned once capture ended: a step
    replays all pieces of ONE size in order, on one stream, with nothing else from that
    pool in between (the engine runs one step at a time; decode graphs use their own pool);
  * q and the attention output cross between pieces through two static buffers shared by
    every layer and size: piece i+1 reads attention output i before attention i+1 writes it.
  * inputs past T keep earlier steps' values (valid ids and positions), except slots: -1.
"""
from __future__ import annotations

import bisect

import torch

from pagedq.engine.layers.attention import Attention, AttentionMetadata

# captured token counts (those above the runner's limit dropped, the limit itself added).
# Larger steps run eagerly: their device time hides the eager launches (H200, Qwen3-0.6B:
# ~17 ms of launches; workload 1's 16,384-token steps take ~43 ms), and a larger size
# would only add pool memory.
SIZES = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def piece_sizes(max_tokens: int) -> list[int]:
    """The sizes captured for steps of at most ``max_tokens`` tokens."""
    top = min(max_tokens, SIZES[-1])
    return [s for s in SIZES if s < top] + [top]


class PiecewiseGraphs:
    """Captures ``model`` in pieces at every size of ``piece_sizes(max_tokens)`` and runs a
    step of at most ``max_tokens`` tokens through them (``run``)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 hidden_size: int, max_tokens: int) -> None:
        self.model = model
        self.layers: list[Attention] = model.attention_layers()
        self.sizes = piece_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        n, a = self.max_tokens, self.layers[0]
        i64 = torch.int64
        self.ids = torch.zeros(n, dtype=i64, device=device)
        self.pos = torch.zeros(n, dtype=i64, device=device)
        self.slots = torch.full((n,), -1, dtype=i64, device=device)
        self.q = torch.zeros(n, a.num_heads, a.head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros_like(self.q)
        self.out = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.device = device

    def _meta(self, n: int, split) -> AttentionMetadata:
        """A capture's metadata: only the store's slots and positions are read; the
        attention's own fields are the replayed step's (``run``)."""
        empty = torch.zeros(0, dtype=torch.int32, device=self.device)
        return AttentionMetadata(self.slots[:n], empty.view(0, 0), empty, empty, n, False,
                                 self.pos[:n], split=split)

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream) -> None:
        """Capture every size on ``stream`` (engine/capture.py: the process's one capture
        stream, not a fresh one per engine)."""
        for n in reversed(self.sizes):  # largest first, as the decode graphs
            self.pieces[n] = self._capture(n, stream)
        torch.cuda.synchronize(self.device)

    def _capture(self, n: int, stream: torch.cuda.Stream) -> list[torch.cuda.CUDAGraph]:
        """The pieces of size n: one graph per attention layer, cut where it begins, and
        the last one, after it."""
        q, out = self.q[:n], self.attn_out[:n]
        # compile / warm every kernel at this size outside a capture
        self.model(self.ids[:n], self.pos[:n], self._meta(n, lambda attn, rotated: out))
        torch.cuda.synchronize(self.device)
        graphs = [torch.cuda.CUDAGraph()]

        def split(attn: Attention, rotated: torch.Tensor) -> torch.Tensor:
            q.copy_(rotated)
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self.pool)
            return out

        with torch.cuda.stream(stream):
            graphs[0].capture_begin(pool=self.pool)
            self.out[:n].copy_(self.model(self.ids[:n], self.pos[:n], self._meta(n, split)))
            graphs[-1].capture_end()
        return graphs

    def reset(self) -> None:
        """Destroy the graphs (their pool is freed with the last)."""
        for graphs in self.pieces.values():
            for graph in graphs:
                graph.reset()
        self.pieces.clear()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, H] of a step of T <= max_tokens tokens (a view of a static
        buffer: valid until the next step)."""
        T = input_ids.shape[0]
        n = self.sizes[bisect.bisect_left(self.sizes, T)]
        self.ids[:T].copy_(input_ids)
        self.pos[:T].copy_(positions)
        self.slots[:T].copy_(meta.slot_mapping)
        self.slots[T:n].fill_(-1)
        graphs = self.pieces[n]
        q, out = self.q[:T], self.attn_out[:T]
        for graph, attn in zip(graphs[:-1], self.layers, strict=True):
            graph.replay()
            out.copy_(attn.attend(q, meta))
        graphs[-1].replay()
        return self.out[:T]
