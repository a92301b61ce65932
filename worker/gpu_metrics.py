"""GPU gauges, read when Prometheus scrapes (never from the engine loop).

  pagedq:gpu_memory_allocated_bytes  torch.cuda.memory_allocated: tensors alive now
  pagedq:gpu_memory_reserved_bytes   torch.cuda.memory_reserved: held by torch's caching
                                     allocator (the KV cache is allocated once, up front)
  pagedq:gpu_memory_used_bytes       total - free from torch.cuda.mem_get_info: the whole
                                     device, other processes and CUDA graphs included
  pagedq:gpu_memory_total_bytes      the device's memory
  pagedq:gpu_utilization_perc        torch.cuda.utilization() / 100 (0-1): share of the last
                                     NVML sample period with a kernel running. Needs NVML
                                     (the nvidia-ml-py package, in the GPU image); without it
                                     the family is declared but has no sample.

Each family carries a ``device`` label (cuda:N). Every family is declared on every worker,
so a scrape lists the names; a CPU worker exports no sample of them. The reads are
device-level queries (no stream synchronisation), safe from the HTTP thread.
"""
from __future__ import annotations

from collections.abc import Iterator

import structlog
from prometheus_client.core import GaugeMetricFamily

log = structlog.get_logger("pagedq.metrics")

FAMILIES = {
    "gpu_memory_allocated_bytes": "GPU memory in live tensors (torch.cuda.memory_allocated)",
    "gpu_memory_reserved_bytes": "GPU memory held by torch's caching allocator",
    "gpu_memory_used_bytes": "GPU memory in use on the device, all processes (total - free)",
    "gpu_memory_total_bytes": "GPU memory of the device",
    "gpu_utilization_perc": "Share of time a kernel ran on the GPU, 0-1 (NVML; absent "
                            "without nvidia-ml-py)",
}


class GpuCollector:
    """A prometheus_client collector of one torch device (``None`` or a CPU: no samples)."""

    def __init__(self, device=None) -> None:
        self.device = device if device is not None and device.type == "cuda" else None
        self.utilization_error: str | None = None
        self._label: list[str] = []
        if self.device is not None:
            import torch

            # resolved here, on the engine's thread: a bare "cuda" is its current device
            index = self.device.index
            self._label = [f"cuda:{torch.cuda.current_device() if index is None else index}"]
            self.device = torch.device(self._label[0])
            self.utilization_error = self._probe_utilization()

    def _probe_utilization(self) -> str | None:
        import torch

        try:
            torch.cuda.utilization(self.device)
            return None
        except Exception as e:  # noqa: BLE001 - no NVML (pynvml) or no permission: no gauge
            log.info("gpu_utilization_unavailable", error=f"{type(e).__name__}: {e}")
            return f"{type(e).__name__}: {e}"

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(f"pagedq:{n}", d, labels=["device"])
                for n, d in FAMILIES.items()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fams = {n: GaugeMetricFamily(f"pagedq:{n}", d, labels=["device"])
                for n, d in FAMILIES.items()}
        if self.device is not None:
            try:
                self._read(fams)
            except Exception as e:  # noqa: BLE001 - a metrics read must never fail a scrape
                log.warning("gpu_metrics_failed", error=f"{type(e).__name__}: {e}")
        yield from fams.values()

    def _read(self, fams: dict[str, GaugeMetricFamily]) -> None:
        import torch

        dev, label = self.device, self._label
        free, total = torch.cuda.mem_get_info(dev)
        fams["gpu_memory_allocated_bytes"].add_metric(label, torch.cuda.memory_allocated(dev))
        fams["gpu_memory_reserved_bytes"].add_metric(label, torch.cuda.memory_reserved(dev))
        fams["gpu_memory_used_bytes"].add_metric(label, total - free)
        fams["gpu_memory_total_bytes"].add_metric(label, total)
        if self.utilization_error is None:
            fams["gpu_utilization_perc"].add_metric(label, torch.cuda.utilization(dev) / 100.0)
