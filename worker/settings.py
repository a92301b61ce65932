"""The worker process's own settings: the model it loads, how its engine runs, its id and
log level. The service settings it shares with clients (Redis, prefix, lanes, leases, ...)
are producer/settings.py's ``Settings``; worker/config.py layers both (flag > environment >
config file > default) and docs/configuration.md lists every one.

Each field is read from the environment as PAGEDQ_<NAME> (e.g. PAGEDQ_GPU_MEMORY_UTILIZATION).
The engine fields mirror engine/config.py's EngineConfig: same names, same defaults (a test
checks), so the engine stays free of pydantic; its own range checks (EngineConfig.validate)
run on top of the types checked here. No torch and no engine import: the CLI's parser and
`pagedq config` use this module.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# WorkerSettings fields that are EngineConfig fields, passed to LLMEngine as they are
# (seed: None becomes a random seed per process).
ENGINE_FIELDS = (
    "device", "dtype", "load_format", "quantization", "kv_cache_dtype", "max_model_len",
    "gpu_memory_utilization", "enforce_eager", "use_triton", "seed", "scheduling_policy",
    "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "async_scheduling",
    "block_size", "num_kv_blocks", "kv_cache_memory_gb", "enable_prefix_caching",
    "tensor_parallel_size", "prefill_wait_steps",
)


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    # ---- model (YAML section `model:`) ----
    model: str = "smollm2"  # bundled name, a local HF folder, or a .gguf file (YAML: path)
    served_name: str | None = None  # None: the model's name or folder/file stem
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    load_format: str = "auto"  # dummy: random weights from config.json alone
    quantization: str = "auto"  # auto (what the checkpoint is), awq, gptq, gguf or none
    kv_cache_dtype: str = "auto"  # auto = the model dtype; fp8 = float8_e4m3
    max_model_len: int | None = Field(None, ge=1)  # None: the model's context length
    gpu_memory_utilization: float = 0.90  # CUDA: share of device memory the engine may use
    enforce_eager: bool = False  # True: no CUDA graphs
    use_triton: bool | None = None  # None: Triton kernels on CUDA, reference path on CPU
    seed: int | None = None  # None: random per process, so workers never share noise
    # ranks sharing the model, one process (one GPU) each: cuda:N..N+size-1 (gloo on cpu)
    tensor_parallel_size: int = Field(1, ge=1)

    # ---- scheduler (YAML section `scheduler:`) ----
    scheduling_policy: str = "priority"  # or fcfs (YAML: policy)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None  # None: on for CUDA, off on the CPU
    # decode-only steps a new request may be held so arrivals are prefilled together;
    # None: 16 with CUDA graphs, else 0
    prefill_wait_steps: int | None = Field(None, ge=0)

    # ---- cache (YAML section `cache:`) ----
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory
    kv_cache_memory_gb: float = Field(1.0, gt=0)  # CPU: KV cache memory when num_kv_blocks unset
    enable_prefix_caching: bool = True

    # ---- the process (YAML section `service:`) ----
    worker_id: str | None = None  # None: <hostname>-<pid>
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE_RE.fullmatch(v):
            raise ValueError("not a device: give auto, cpu, cuda or cuda:N")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty model: give smollm2, a HF folder or a .gguf file")
        return v
