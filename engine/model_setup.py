"""What the model runner (engine/model_runner.py) settles before it builds the model: the
device of a rank, the dtype's name, the EOS token ids; and the random weights of
load_format dummy."""
from __future__ import annotations

import torch

from pagedq.engine.quant import model as quant_model

# "half" and "float" are vLLM's names of float16 and float32 (wire/engine_config.py)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "half": torch.float16, "float": torch.float32}


def pick_device(name: str, tp_size: int = 1, rank: int = 0) -> torch.device:
    """The device of one rank: with tensor parallelism, rank r of ``cuda:N`` (or ``cuda``:
    N = 0) is cuda:N+r; every rank of ``cpu`` is the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if tp_size == 1 or dev.type != "cuda":
        return dev
    first, count = dev.index or 0, torch.cuda.device_count()
    if first + tp_size > count:
        raise ValueError(f"tensor_parallel_size {tp_size} on device {name!r} needs CUDA devices "
                         f"cuda:{first} to cuda:{first + tp_size - 1}; this machine has {count}")
    return torch.device("cuda", first + rank)


def eos_ids(hf_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for v in (getattr(hf_config, "eos_token_id", None),
              getattr(hf_config, "pagedq_generation_eos", None),
              getattr(tokenizer, "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list | tuple):
            ids.update(int(x) for x in v)
    return ids



@torch.no_grad()
def init_dummy(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights (norm weights 1): the same shapes and speed as a real checkpoint.
    (Tensor-parallel ranks seed by rank: a benchmark's shards need not form one model.)"""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    quant_model.init_dummy(model, gen)  # quantized layers: random codes and scales
