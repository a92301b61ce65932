"""The GPU gauges (worker/gpu_metrics.py) on a real CUDA device, read through the worker's
HTTP server as Prometheus reads them, from its own thread, while the device is busy."""
from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import torch

from pagedq.worker.health import SERVING, Health
from pagedq.worker.metrics import Metrics

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def samples(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines() if line.startswith("pagedq:gpu_")}


def test_gpu_gauges_while_the_device_computes():
    dev = torch.device("cuda")
    m = Metrics()
    m.watch_device(dev)
    health = Health(60.0)
    health.set_phase(SERVING)
    health.beat()
    port = m.serve(0, health=health)
    block = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # 256 MiB alive
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    stop = threading.Event()

    def busy() -> None:  # another thread keeps kernels running, as the engine would
        while not stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    t = threading.Thread(target=busy)
    t.start()
    try:
        time.sleep(1.0)  # NVML's utilisation is over its last sample period
        reads = [samples(port) for _ in range(5) if not time.sleep(0.3)]
    finally:
        stop.set()
        t.join()
    label = f'{{device="cuda:{torch.cuda.current_device()}"}}'
    s = reads[-1]
    alloc = s[f"pagedq:gpu_memory_allocated_bytes{label}"]
    reserved = s[f"pagedq:gpu_memory_reserved_bytes{label}"]
    used = s[f"pagedq:gpu_memory_used_bytes{label}"]
    total = s[f"pagedq:gpu_memory_total_bytes{label}"]
    assert block.numel() <= alloc <= reserved <= used < total
    assert total == torch.cuda.get_device_properties(dev).total_memory
    print({k.split("{")[0]: v for k, v in s.items()}, "utilization error:",
          m.gpu.utilization_error)
    try:
        import pynvml  # noqa: F401 - nvidia-ml-py, in the GPU image
    except ImportError:
        assert f"pagedq:gpu_utilization_perc{label}" not in s  # declared, no sample
    else:
        util = [r[f"pagedq:gpu_utilization_perc{label}"] for r in reads]
        assert all(0.0 <= u <= 1.0 for u in util) and max(util) > 0.5, util
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        assert r.status == 200
