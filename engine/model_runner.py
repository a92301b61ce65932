"""The model runner owns everything on the device: weights, the paged KV cache, input
preparation and the forward pass of one ScheduledBatch.

KV cache: one tensor [2 (k, v), num_layers, num_blocks, block_size, num_kv_heads, head_dim]
of the kv_cache_dtype's storage, with its scales (engine/kv_cache.py, engine/kv_scales.py);
each attention layer holds views of its k and v slices. Slot of token position p of a
sequence = block_table[p // block_size] * block_size + p % block_size.

Tensor parallelism (EngineConfig.tensor_parallel_size > 1, engine/distributed.py): one
ModelRunner per rank process, each holding its shard of the weights and of the KV cache
(its KV heads; the same number of blocks everywhere, so the driver's block manager speaks
for all). The driver's runner (rank 0) spawns the others; ``__init__`` runs in lockstep on
every rank. Each step the driver packs the inputs and sends them to the ranks
(``execute``), every rank runs ``_forward`` on them, and only the driver gets logits.
With one rank nothing is spawned and no collective runs: the single-device code path.

KV cache sizing (num_kv_blocks unset): engine/kv_sizing.py.

CUDA graphs (CUDA, Triton kernels, not enforce_eager; engine/cuda_graphs.py, which holds the
model, not the runner): a decode-only step replays one whole-model graph per padded batch
size; with one rank, a step that prefills (up to 8,192 tokens) replays the model in pieces
between eager attention calls (engine/piecewise.py).

``close()`` releases all of it at once (engine/llm_engine.py: the engine's lifetime). Nothing
the runner owns refers back to it (the rank group's hook before it leaves the process group
holds the graphs, not the runner), so a runner dropped without close() is freed, device
memory and all, by reference counting; tensor-parallel ranks are stopped by its finalizer.
"""
from __future__ import annotations

import contextlib
import functools
import time
import weakref

import torch

from pagedq.engine import kv_cache, kv_scales, kv_sizing
from pagedq.engine.batch import ScheduledBatch
from pagedq.engine.config import EngineConfig
from pagedq.engine.cuda_graphs import CudaGraphs, model_step, reset_graphs
from pagedq.engine.inputs import InputBuilder, Packed
from pagedq.engine.layers import ops
from pagedq.engine.layers.attention import AttentionMetadata
from pagedq.engine.layers.packed import pack_model
from pagedq.engine.loader import load_model_files, resolve_model
from pagedq.engine.model_setup import DTYPES, eos_ids, init_dummy, pick_device
from pagedq.engine.models import get_model_class
from pagedq.engine.parallel import SINGLE
from pagedq.engine.piecewise import PiecewiseGraphs
from pagedq.engine.progress import stage
from pagedq.engine.quant import model as quant_model
from pagedq.engine.quant.detect import detect as detect_quantization
from pagedq.engine.quant.weights import feed
from pagedq.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model_name_or_path: str, config: EngineConfig, *, rank: int = 0,
                 link=None) -> None:
        """``rank``/``link``: set only in a tensor-parallel rank process (rank > 0, its
        distributed.DriverLink); the driver (rank 0) spawns those processes itself.
        ``config``: used as it is (validated when it was constructed)."""
        t0 = time.perf_counter()
        self.config = config
        tp_size = config.tensor_parallel_size
        self.rank = rank
        self.device = pick_device(config.device, tp_size, rank)
        self.dtype = (DTYPES[config.dtype] if config.dtype != "auto" else
                      torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.kv_format = kv_cache.kv_format(config.kv_cache_dtype, self.dtype)
        kv_cache.check_device(self.kv_format, self.device)
        self.kv_cache_dtype = self.kv_format.dtype
        self.kv_scales = kv_scales.CheckpointScales()  # filled while the weights load
        self.kv_scale_cache = None  # int8's scale caches (engine/kv_cache.py)
        self.kv_fit = False  # fp8 e4m3 scales to fit: the next step that prefills is eager

        self.source = resolve_model(model_name_or_path, config.load_format != "dummy")
        self.quant = detect_quantization(self.source, config.quantization,
                                         config.load_format == "dummy")
        # Quantized weights are dequantized at load (engine/quant/weights.py feed) by a
        # float32 CPU model, which multiplies oneDNN-packed float32 weights (engine/layers/
        # packed.py: far faster there than dequantizing every step), and by tensor-parallel
        # ranks (a quantized layer holds one rank's whole weight). A GGUF file is then read
        # from transformers' float32 cache of it (engine/loader.py): the values pagedq's
        # reader gives, bit for bit (tests/test_quant_models.py), and fast to start.
        self.dequantize_why = "float32 CPU" if self.device.type == "cpu" and \
            self.dtype == torch.float32 else "tensor-parallel" if tp_size > 1 else None
        files_quant = self.quant
        if self.quant is not None and self.quant.method == "gguf" and self.dequantize_why:
            files_quant = None
        # how the weights are held, for the ready line (None: a plain checkpoint)
        self.quant_summary: str | None = "GGUF dequantized to float by transformers " \
            "(quantization none)" if self.quant is None and self.source.kind == "gguf" \
            else None
        stage("reading the model's config and tokenizer")
        # tensor-parallel: lazy tensors, so each rank reads only its slices; only the
        # driver detokenizes
        hf_config, weights, self.tokenizer = load_model_files(
            self.source, lazy=tp_size > 1, tokenizer=rank == 0, quant=files_quant)
        self.hf_config = hf_config
        model_cls = get_model_class(hf_config)
        model_cls.check_tensor_parallel(hf_config, tp_size)  # before any process starts
        self.max_model_len = self._max_model_len(model_cls)
        self.vocab_size = int(hf_config.vocab_size)
        self.eos_token_ids = eos_ids(hf_config, self.tokenizer)

        self.ranks = None  # the driver's distributed.RankGroup when tensor-parallel
        self.tp = SINGLE
        self.cuda_graphs = CudaGraphs(self.device, self.dtype)  # empty until captured
        self.model = self.kv_cache = self.inputs = None  # set by _build; None once closed
        self._closed = False
        if tp_size == 1:
            try:
                self._build(model_cls, weights)
            except BaseException:
                with contextlib.suppress(Exception):  # the error to report is the first
                    self.close()  # what was built goes now, not with the traceback
                raise
        else:
            from pagedq.engine.rank_group import RankGroup
            if rank == 0:
                stage(f"starting {tp_size - 1} tensor-parallel rank process(es)")
                link = self.ranks = RankGroup(type(self), model_name_or_path, config,
                                              self.device)
                # NCCL cannot leave a group while a graph captured its collectives
                self.ranks.before_leave = functools.partial(reset_graphs, self.graphs)
                weakref.finalize(self, self.ranks.close)  # a runner dropped unclosed
            self._link = link
            try:
                self.tp = link.init_group(self.device)
                self._build(model_cls, weights)
            except BaseException as e:
                if self.ranks is None:  # a rank: rank_main reports it to the driver
                    raise
                # a ValueError is the driver's own (a bad checkpoint, too little memory...)
                failure = (self.ranks.failure_behind(e) if isinstance(e, Exception)
                           and not isinstance(e, ValueError) else None)
                with contextlib.suppress(Exception):  # the error to report is this one
                    self.close()
                if failure is None:
                    raise
                raise failure from e
        self.load_time_s = time.perf_counter() - t0

    def _build(self, model_cls, weights) -> None:
        """This rank's shard of the weights, the KV cache and the CUDA graphs (in lockstep
        on every rank when tensor-parallel: each step with collectives is reached by all)."""
        config, tp = self.config, self.tp
        with torch.device("meta"):  # no random init: parameters are filled by load_weights
            model = model_cls(self.hf_config, max_position=self.max_model_len, tp=tp)
        model = model.to(self.dtype)
        why = self.dequantize_why
        kept = set()  # the checkpoint weights kept quantized
        if self.quant is not None:
            if why is None:
                kept = quant_model.quantize(model, self.quant)
            self.quant_summary = self.quant.summary() + (
                f", dequantized at load ({why})" if why else
                ", kept quantized" if kept else ": no layer kept quantized")
        model = model.to_empty(device=self.device)  # (quantized buffers keep their dtypes)
        stage(f"loading weights to {self.device} {str(self.dtype).removeprefix('torch.')}"
              + (f" ({self.quant.summary()}, dequantized: {why})" if self.quant and why
                 else ""))
        if config.load_format == "dummy":
            init_dummy(model, seed=tp.rank)
        else:
            model.load_weights(self.kv_scales.take(feed(weights, kept)))
            quant_model.finish_load(model)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            pack_model(model)  # MKL-packed copies for the GEMMs of a decode step
        self.model = model.eval()
        if tp.size > 1:
            self._link.barrier("loaded")  # no collective waits on a slow loader

        use_triton = config.use_triton
        if use_triton is None:
            use_triton = self.device.type == "cuda" and ops.triton_available()
        ops.set_use_triton(use_triton)

        self.inputs = InputBuilder(self.device, config, self.max_model_len)
        if config.num_kv_blocks is None and self.device.type == "cuda":
            stage("measuring free GPU memory for the KV cache (one warm-up step)")
        blocks = config.num_kv_blocks or kv_sizing.profile_num_blocks(self)
        if tp.size > 1 and not config.num_kv_blocks:  # every rank holds the same blocks
            t = torch.tensor([blocks], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=tp.group)
            blocks = int(t.item())
        self.num_kv_blocks = blocks
        stage(f"allocating the KV cache ({self.num_kv_blocks} blocks)")
        self._allocate_kv_cache(self.num_kv_blocks)
        if self._uses_graphs():
            self.cuda_graphs.graph_bytes = self._capture_graphs()
        if tp.size > 1:
            self._link.barrier("ready")

    def _uses_graphs(self) -> bool:
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and ops.use_triton())

    def _capture_graphs(self, announce: bool = True) -> int:
        """Capture the decode graphs and, with one rank, the piecewise ones; return the
        device memory they took."""
        return self.cuda_graphs.capture(self.model, self.hf_config, self.config,
                                        self.max_model_len, self.tp.size, announce)

    # the graphs, as tests and benches read them (engine/cuda_graphs.py)
    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """Padded decode batch size -> its captured graph (empty: none)."""
        return self.cuda_graphs.graphs

    @property
    def piecewise(self) -> PiecewiseGraphs | None:
        """The piecewise graphs of steps that prefill (one rank only), or None."""
        return self.cuda_graphs.piecewise

    @piecewise.setter
    def piecewise(self, value: PiecewiseGraphs | None) -> None:
        self.cuda_graphs.piecewise = value

    @property
    def graph_bytes(self) -> int:
        """Device memory the CUDA graphs hold (pools, static buffers)."""
        return self.cuda_graphs.graph_bytes

    @property
    def block_size(self) -> int:
        """Tokens per KV block: the config's (the block manager is built from it too)."""
        return self.config.block_size

    # ---- setup -------------------------------------------------------------------------
    def _max_model_len(self, model_cls) -> int:
        hf = self.hf_config
        limit = getattr(hf, "max_position_embeddings", None)
        window = model_cls.sliding_window(hf)
        if window:  # we attend to the full context: stay within the trained window
            limit = min(limit, window) if limit else window
        asked = self.config.max_model_len
        if asked is None:
            if limit is None:
                raise ValueError("the model config has no max_position_embeddings: "
                                 "set EngineConfig.max_model_len")
            return int(limit)
        if limit is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's context length {limit}")
        return int(asked)

    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers, K and V (int8's scales included)."""
        m = self.model
        return kv_cache.block_bytes(self.kv_format, len(m.attention_layers()), self.block_size,
                                    m.num_kv_heads, m.head_dim)

    @property
    def kv_label(self) -> str:
        """The KV cache's dtype and scales in words (engine/kv_cache.py label)."""
        return kv_cache.label(self.kv_format, self.kv_fit)

    @property
    def kv_cache_bytes(self) -> int:
        """Device memory of the KV cache (num_kv_blocks blocks)."""
        return self.num_kv_blocks * self.block_bytes()

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = self.kv_scale_cache = None
        self.kv_cache, self.kv_scale_cache, self.kv_fit = kv_cache.allocate(
            self.kv_format, self.model, num_blocks, self.block_size, self.device,
            self.kv_scales, self.hf_config, self.tp)

    # ---- one step ----------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, pending: dict[Sequence, int] | None = None,
                prev_tokens: torch.Tensor | None = None):
        """(input_ids [T], positions [T], AttentionMetadata, sample_rows [N]) for a batch;
        see engine/inputs.py (``pending``: placeholder tokens taken from ``prev_tokens``)."""
        return self.inputs.build(batch, pending, prev_tokens)

    def capture_cudagraphs(self) -> None:
        """The decode graphs alone (engine/cuda_graphs.py CudaGraphs.capture_decode)."""
        self.cuda_graphs.capture_decode(self.model, self.hf_config.hidden_size,
                                        self.config.max_num_seqs,
                                        -(-self.max_model_len // self.block_size), self.tp.size)

    def _model_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        return model_step(self.model, input_ids, positions, meta)

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, H]: a captured CUDA graph for decode-only batches that fit one,
        the piecewise graphs for other steps that fit them, else the eager model."""
        n = input_ids.shape[0]
        if self.kv_fit and not meta.is_decode_only:  # its layers fit their fp8 scales
            self.kv_fit = False
            return self._model_step(input_ids, positions, meta)
        cg = self.cuda_graphs
        if not cg.fits_decode(n, meta):
            pw = cg.piecewise
            if pw is not None and not meta.is_decode_only and n <= pw.max_tokens:
                return pw.run(input_ids, positions, meta)
            return self._model_step(input_ids, positions, meta)
        return cg.replay_decode(input_ids, positions, meta)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, pending: dict[Sequence, int] | None = None,
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [num_sampling_seqs, vocab] in the model's dtype, for the seqs where
        batch.samples(i), in batch order. Does not advance num_computed_tokens (the engine does). Never
        waits for the device: the logits are computed asynchronously on CUDA.
        Tensor-parallel: the step runs on every rank; the logits' columns are the vocab
        rounded up to a multiple of the ranks (padding past vocab_size), and a rank that
        died makes this raise distributed.TensorParallelError."""
        if batch.is_empty:
            return torch.empty(0, self.vocab_size, dtype=self.dtype, device=self.device)
        packed = self.inputs.pack(batch, pending)
        ranks = self.ranks
        if ranks is None:
            return self._forward(packed, prev_tokens)
        ranks.send(("step", packed))
        try:
            return self._forward(packed, prev_tokens)
        except Exception as e:  # a collective with a dead peer: say which rank died
            if (failure := ranks.failure_behind(e)) is None:
                raise
            raise failure from e

    @torch.inference_mode()
    def run_packed(self, packed: Packed) -> None:
        """A non-driver rank's part of a step the driver sent (distributed.serve)."""
        self._forward(packed, None)

    def _forward(self, packed: Packed, prev_tokens: torch.Tensor | None):
        input_ids, positions, meta, sample_rows = self.inputs.unpack(packed, prev_tokens)
        if packed.P and self.tp.size > 1:  # placeholders: the driver's ids from the device
            self.tp.broadcast(input_ids)
        hidden = self._run_model(input_ids, positions, meta)
        return self.model.compute_logits(hidden[sample_rows])

    def check_healthy(self) -> None:
        """Raise the tensor-parallel group's failure, if a rank died (a step collected
        after that may hold garbage). Nothing to check with one rank."""
        if self.ranks is not None:
            self.ranks.check()

    @property
    def tensor_parallel_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (none with one rank)."""
        return self.ranks.pids if self.ranks is not None else []

    def set_failure_handler(self, callback) -> None:
        """``callback(TensorParallelError)`` is called when a rank process dies, even while
        the engine is idle (from a monitor thread, or the stepping one). No-op with one
        rank."""
        if self.ranks is not None:
            self.ranks.on_failure = callback

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs. NCCL keeps a communicator alive while a captured graph
        refers to it, so its destroy (and even its abort) waits forever: every rank releases
        its graphs before it leaves the process group."""
        self.cuda_graphs.release()

    def close(self) -> None:
        """Release the device: stop the tensor-parallel ranks (each rank, the driver
        included, destroys its graphs before it leaves the group), destroy the CUDA graphs,
        drop the KV cache, the weights and the input buffers, and (CUDA) hand the freed
        memory back to the driver. Idempotent; the runner runs no step afterwards."""
        if self._closed:
            return
        self._closed = True
        if self.ranks is not None:
            self.ranks.close()
        try:
            self.release_graphs()
        finally:
            if self.model is not None:  # a caller may still hold the model: not its cache
                kv_cache.release(self.model.attention_layers())
            self.model = self.kv_cache = self.kv_scale_cache = self.inputs = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
