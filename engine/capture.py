"""The one stream this process captures every CUDA graph on, per device: the decode graphs
(engine/cuda_graphs.py) and the piecewise ones (engine/piecewise.py).

torch keeps a cuBLAS workspace (32 MiB on an H200) per (cuBLAS handle, stream) until the
process ends, made at the first matmul on that pair. A fresh stream per capture left one
more workspace behind every engine (issue 29: 0.05-0.07 GiB per engine, never freed, gc or
not). With one stream per device there is one per device and thread, however many engines
come and go. Each capture first runs a matmul on the stream, outside the capture, so that
workspace comes from the ordinary pool, never from a graph's private pool (which it would
then keep from being freed whole).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device, dtype: torch.dtype) -> torch.cuda.Stream:
    """The capture stream of ``device``, its cuBLAS / cuBLASLt workspaces made for this
    thread (``dtype``: the model's)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(torch.device("cuda", index))
    x = torch.ones(16, 16, dtype=dtype, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        F.linear(x, x)  # cuBLAS
        F.linear(x, x, x[0])  # a bias epilogue: cuBLASLt
    stream.synchronize()  # before x is freed on the current stream
    return stream
