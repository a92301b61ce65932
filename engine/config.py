"""Engine configuration: every engine default, validated with clear errors."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # default: the model's context length
    num_kv_blocks: int | None = None  # default: sized from memory
    kv_cache_memory_gb: float = 1.0  # CPU: memory given to the KV cache when num_kv_blocks unset
    gpu_memory_utilization: float = 0.90  # CUDA: share of total device memory the engine may use
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available else cpu
    kv_cache_dtype: str = "auto"  # auto = model dtype; "fp8" = float8_e4m3fn, unit scale
    enforce_eager: bool = False  # disable CUDA graphs
    use_triton: bool | None = None  # None: Triton kernels on CUDA (CPU tensors: kernels/cpu.py)
    seed: int = 0  # seed of the generator for requests without their own seed
    # "dummy": random weights from config.json alone (benchmarks: no checkpoint needed)
    load_format: str = "auto"
    # how the checkpoint's weights are held (engine/quant/): "auto" = what the checkpoint
    # is (config.json quantization_config, quantize_config.json, a .gguf file's types);
    # "awq" / "gptq" / "gguf" = that, or an error if the checkpoint is not; "none" = plain
    # weights (a .gguf file dequantized to float by transformers at load)
    quantization: str = "auto"
    # schedule and launch step N+1 before step N's tokens reach the host (engine/pipeline.py).
    # None: on for CUDA; off on the CPU, where a step computes as it is launched, so the
    # pipeline overlaps nothing and would only hold every token back one step
    async_scheduling: bool | None = None
    # "priority": waiting requests by (priority, arrival); a waiting request may preempt a
    # running one of lower priority for a seat or KV blocks. "fcfs": arrival order only.
    scheduling_policy: str = "priority"
    # while the running batch only decodes, a waiting request is held at most this many
    # steps (less when the queue would fill the batch, or it outranks a running request),
    # so arrivals are prefilled together: a step that prefills costs ~1.5 decode steps in
    # piecewise CUDA graphs (engine/piecewise.py), ~4 run eagerly (docs/benchmarks.md,
    # bench/mixed_steps.py). None: 4 where piecewise graphs were captured, 16 where only the
    # decode graphs were (tensor-parallel), else 0 (off: every step admits)
    prefill_wait_steps: int | None = None
    # ranks sharing the model (Megatron-style tensor parallelism, engine/distributed.py):
    # one process per rank (per GPU: cuda:N..N+size-1), all-reduce over NCCL (gloo on the
    # CPU). 1: the single-device path, no process started
    tensor_parallel_size: int = 1

    def validate(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128 (got {self.block_size})")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not self.enable_chunked_prefill and self.max_model_len and \
                self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        if self.prefill_wait_steps is not None and (
                not isinstance(self.prefill_wait_steps, int) or self.prefill_wait_steps < 0):
            raise ValueError(f"prefill_wait_steps must be an integer >= 0 "
                             f"(got {self.prefill_wait_steps!r})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError("kv_cache_dtype must be 'auto' or 'fp8'")
        if self.quantization not in ("auto", "awq", "gptq", "gguf", "none"):
            raise ValueError(f"quantization must be auto, awq, gptq, gguf or none "
                             f"(got {self.quantization!r})")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be 'auto' or 'dummy'")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1 "
                             f"(got {self.tensor_parallel_size!r})")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("dtype must be auto, float32, bfloat16 or float16")
