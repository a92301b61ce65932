"""The engine's configuration, every setting declared once (wire/declared.py): its type,
default, help, allowed values and YAML section. The engine runs with it (engine/config.py
re-exports it); the worker turns the same fields into its flags, PAGEDQ_<NAME> variables,
config file keys, `pagedq config` and docs/configuration.md. It lives outside the engine
package so that `pagedq`'s command line reads it without importing the engine
(tests/test_architecture.py). Standard library only: no pydantic, no redis, no torch.

A new engine setting is one field here (and the code that uses it), like ``quantization``
below; then ``python -m pagedq.worker.config_doc`` rewrites docs/configuration.md's tables.
"""
from __future__ import annotations

from dataclasses import dataclass

from .declared import check, setting

DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


@dataclass(slots=True)
class EngineConfig:
    # ---- model (YAML section `model:`) ----
    device: str = setting(
        "auto", "model", "the device", pattern=DEVICE_PATTERN,
        pattern_help="auto, cpu, cuda or cuda:N", default_help="cuda if available, else cpu")
    dtype: str = setting(
        "auto", "model", "the weights' and activations' dtype; `half` is `float16` and "
        "`float` is `float32` (vLLM's names)",
        choices=("auto", "float32", "bfloat16", "float16", "half", "float"),
        default_help="bfloat16 on CUDA, float32 on the CPU")
    load_format: str = setting(
        "auto", "model", "`dummy`: random weights from config.json alone (benchmarks: no "
        "checkpoint needed)", choices=("auto", "dummy"), flag_choices=True)
    # how the checkpoint's weights are held (engine/quant/): "auto" = what the checkpoint is
    # (config.json quantization_config, quantize_config.json, a .gguf file's types); "awq" /
    # "gptq" / "gguf" = that, or an error if the checkpoint is not; "none" = plain weights
    # (a .gguf file dequantized to float by transformers at load)
    quantization: str = setting(
        "auto", "model", "how the weights are held: AWQ, GPTQ and GGUF Q4_0/Q4_1/Q8_0 "
        "checkpoints stay quantized on the GPU (dequantized at load on the CPU in float32 and "
        "with tensor parallelism); `none`: plain weights (a `.gguf` file dequantized to "
        "float); another method is a configuration error",
        choices=("auto", "awq", "gptq", "gguf", "none"), flag_choices=True,
        default_help="as the checkpoint is quantized")
    # the storage of each (engine/kv_cache.py) and its contract (kernels/kv_quant.py)
    kv_cache_dtype: str = setting(
        "auto", "model", "the KV cache's values: 8-bit ones hold twice the tokens of a 16-bit "
        "cache per GiB (accuracy: docs/benchmarks.md). `fp8` (`fp8_e4m3`): float8_e4m3, a "
        "scale per layer and KV head from the checkpoint (vLLM's `k_scale` / `v_scale` "
        "names), else fitted to the first prefill (docs/design.md); a CUDA device needs "
        "compute capability 8.9. `fp8_e5m2`: float8_e5m2, unit scales. `int8`: int8 "
        "codes and a float32 scale per token and KV head stored beside them (4 bytes per "
        "head_dim codes)",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"), flag_choices=True,
        default_help="the model dtype")
    max_model_len: int | None = setting(
        None, "model", "longest sequence, prompt + output; a longer prompt fails with the "
        "model-length error", low=1, metavar="N",
        default_help="the model's context length, lowered to what the KV cache holds")
    gpu_memory_utilization: float = setting(
        0.90, "model", "CUDA: share of the device's memory the engine may use: weights, a full "
        "step's activations and the CUDA graphs first, the KV cache gets the rest",
        low=0, low_open=True, high=1, metavar="F")
    enforce_eager: bool = setting(False, "model", "no CUDA graphs")
    # None: Triton kernels on CUDA (CPU tensors run kernels/cpu.py)
    use_triton: bool | None = setting(
        None, "model", "Triton kernels; CPU tensors always run the CPU path (`kernels/cpu.py`)",
        default_help="on for CUDA")
    # the engine's generator seed for requests without their own; a worker draws a random
    # one per process (None), so workers never share a noise stream
    seed: int | None = setting(
        0, "model", "noise seed of jobs without their own seed", low=0,
        worker_default=None, default_help="random per process, so workers never share a "
        "noise stream")
    # ranks sharing the model (Megatron-style tensor parallelism, engine/distributed.py):
    # one process per rank, all-reduce over NCCL (gloo on the CPU). 1: no process started
    tensor_parallel_size: int = setting(
        1, "model", "ranks sharing the model (tensor parallelism): one process and one GPU "
        "each, `cuda:N` to `cuda:N+size-1` on device `cuda:N` (gloo on `cpu`); the worker "
        "process is rank 0 and the only one that talks to Redis (docs/tensor_parallel.md)",
        low=1, metavar="N")

    # ---- scheduler (YAML section `scheduler:`) ----
    # "priority": waiting requests by (priority, arrival); a waiting request may preempt a
    # running one of lower priority for a seat or KV blocks. "fcfs": arrival order only.
    scheduling_policy: str = setting(
        "priority", "scheduler", "`priority`: higher lanes and priorities first, and they may "
        "preempt lower ones; `fcfs`: arrival order", key="policy",
        choices=("priority", "fcfs"), flag_choices=True)
    max_num_seqs: int = setting(
        64, "scheduler", "sequences in one engine step: the worker's seats", low=1, metavar="N")
    max_num_batched_tokens: int = setting(
        2048, "scheduler", "token budget of one engine step (prefill chunks + decodes), >= "
        "max_num_seqs", low=1, metavar="N")
    enable_chunked_prefill: bool = setting(
        True, "scheduler", "split long prompts over several steps; off: "
        "max_num_batched_tokens must be >= max_model_len")
    # schedule and launch step N+1 before step N's tokens reach the host (engine/pipeline.py).
    # Off on the CPU, where a step computes as it is launched: the pipeline would overlap
    # nothing and only hold every token back one step
    async_scheduling: bool | None = setting(
        None, "scheduler", "schedule step N+1 before step N's tokens reach the host",
        default_help="on for CUDA, off on the CPU")
    # while the running batch only decodes, a waiting request is held at most this many
    # steps so arrivals are prefilled together (engine/piecewise.py, bench/mixed_steps.py)
    prefill_wait_steps: int | None = setting(
        None, "scheduler", "while the running jobs only decode, a new job may wait this many "
        "steps so that arrivals are prefilled together (sooner when they would fill every "
        "seat, or outrank a running job); a step that prefills costs about 1.5 decode steps "
        "in piecewise CUDA graphs, about 4 run eagerly (docs/benchmarks.md)", low=0,
        metavar="N", default_help="4 where piecewise CUDA graphs are captured (one GPU), 16 "
        "where only the decode graphs are (tensor-parallel), else 0 (every step admits)")

    # ---- cache (YAML section `cache:`) ----
    block_size: int = setting(
        16, "cache", "tokens per KV block", choices=(8, 16, 32, 64, 128), metavar="N")
    num_kv_blocks: int | None = setting(
        None, "cache", "KV-cache blocks", low=1, metavar="N", default_help="sized from memory")
    kv_cache_memory_gb: float = setting(
        1.0, "cache", "CPU: memory of the KV cache when num_kv_blocks is not set", low=0,
        low_open=True, metavar="GB")
    enable_prefix_caching: bool = setting(
        True, "cache", "share the KV blocks of common prompt prefixes")

    def __post_init__(self) -> None:
        # the one validation: an EngineConfig that exists is valid (LLMEngine and
        # ModelRunner take it as it is; a field set afterwards is the setter's to check)
        self.validate()

    def validate(self) -> None:
        """ValueError, one line naming the setting, unless every value is allowed: each
        setting's own declaration, then the rules between settings (run by construction)."""
        check(self)
        if not self.enable_chunked_prefill and self.max_model_len and \
                self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= "
                             "max_model_len")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode "
                             "token each)")
