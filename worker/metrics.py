"""Prometheus metrics, vLLM's names under the `pagedq:` prefix, plus queue metrics and the
GPU gauges (worker/gpu_metrics.py). One registry per Worker (several workers may live in
one test process). Served with /healthz and /readyz by worker/http_server.py; the names
are listed in docs/deployment.md and used by deploy/grafana/dashboards/pagedq.json."""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from pagedq.wire.schema import FinishReason, Status
from pagedq.worker import http_server
from pagedq.worker.gpu_metrics import GpuCollector
from pagedq.worker.health import Health

_LAT = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_TOKENS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))  # 1 .. 500,000
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5)
# the (status, finish reason) pairs a worker ends jobs with (worker/admission.py,
# service.py, job_table.py): each series exists from the start, at 0
OUTCOMES = ((Status.finished, FinishReason.stop), (Status.finished, FinishReason.length),
            (Status.finished, FinishReason.deadline), (Status.failed, FinishReason.error),
            (Status.cancelled, FinishReason.cancelled), (Status.expired, FinishReason.deadline))


def observe_many(hist: Histogram, amount: float, count: int) -> None:
    """Record ``count`` observations of ``amount``, as ``count`` ``observe()`` calls would,
    in one pass over the buckets: a step's tokens share a few gaps, and observing each
    token alone cost the engine thread ~1 us per running job per step. prometheus_client
    has no weighted observe; its value slots (``_sum``, ``_buckets``, ``_upper_bounds``,
    the last bucket +Inf) are what ``Histogram.observe`` itself updates."""
    if not hasattr(hist, "_upper_bounds"):  # another prometheus_client layout: the slow way
        for _ in range(count):
            hist.observe(amount)
        return
    hist._sum.inc(amount * count)
    for bound, bucket in zip(hist._upper_bounds, hist._buckets, strict=True):
        if amount <= bound:
            bucket.inc(count)
            return


class Metrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        # the process's CPU seconds, RSS, open fds and start time (a restart), and Python's
        # version: what the default registry has, which a registry of our own lacks
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        self._seen: dict[str, int] = {}  # engine totals already counted, by counter
        g = lambda n, d: Gauge(f"pagedq:{n}", d, registry=reg)
        # the queue gauges: one series per jobs queue (worker/liveness.py read_queue_metrics)
        queue_g = lambda n, d: Gauge(f"pagedq:{n}", d, ["prefix", "model", "lane"],
                                     registry=reg)
        c = lambda n, d: Counter(f"pagedq:{n}", d, registry=reg)
        self.running = g("num_requests_running", "Requests in the running batch")
        self.waiting = g("num_requests_waiting", "Requests admitted but waiting in the engine")
        self.kv_usage = g("kv_cache_usage_perc", "Share of KV-cache blocks in use (0-1)")
        self.stream_length = queue_g("stream_length", "Unfinished jobs of the lane: entries "
                                                      "of its jobs stream and its inbox")
        self.pending = queue_g("pending_count", "Entries delivered but not acknowledged")
        self.oldest_pending = queue_g("oldest_pending_age_seconds", "Idle time of the oldest pending entry")
        self.dlq_size = queue_g("dlq_size", "Entries in the dead-letter stream")
        self.model_workers = Gauge("pagedq:model_workers", "Live workers of each model ever "
                                   "served under the prefix (0: its jobs have no worker)",
                                   ["prefix", "model"], registry=reg)
        self.ttft = Histogram("pagedq:time_to_first_token_seconds", "Admission to first token",
                              ["lane"], buckets=_LAT, registry=reg)
        self.itl = Histogram("pagedq:inter_token_latency_seconds", "Between tokens of one job",
                             buckets=_ITL, registry=reg)
        self.e2e = Histogram("pagedq:e2e_request_latency_seconds", "Submission to final result",
                             buckets=_LAT, registry=reg)
        self.submit_ttft = Histogram("pagedq:submission_to_first_token_seconds",
                                     "Submission to first token: what the user waits "
                                     "(queue wait by Redis time, then admission to first "
                                     "token)", ["lane"], buckets=_LAT + (600, 1800, 3600),
                                     registry=reg)
        # vLLM's phases of a job: admission to first token; first to last token
        self.prefill_time = Histogram("pagedq:request_prefill_time_seconds",
                                      "Admission to first token of each job ended with one",
                                      buckets=_LAT, registry=reg)
        self.decode_time = Histogram("pagedq:request_decode_time_seconds",
                                     "First to last token of each job ended with one",
                                     buckets=_LAT, registry=reg)
        self.queue_wait = Histogram("pagedq:request_queue_time_seconds",
                                    "Submission to admission by a worker (queue wait)",
                                    ["lane"], buckets=_LAT + (600, 1800, 3600), registry=reg)
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed")
        # by tenant (key prefix) and model: what each tenant asks of each model
        self.request_prompt = Histogram("pagedq:request_prompt_tokens",
                                        "Prompt tokens of each job ended", ["prefix", "model"],
                                        buckets=_TOKENS, registry=reg)
        self.request_generation = Histogram("pagedq:request_generation_tokens",
                                            "Tokens generated for each job ended (all its "
                                            "choices)", ["prefix", "model"], buckets=_TOKENS,
                                            registry=reg)
        self.generation_tokens = c("generation_tokens", "Tokens generated")
        self.preemptions = c("num_preemptions", "Preemptions by recompute")
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the "
                                                        "prefix cache (each job's first "
                                                        "admission)")
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.reclaims = c("reclaims", "Entries reclaimed from dead or stale workers")
        self.redis_oom = c("redis_oom_errors", "Writes a full Redis refused (maxmemory), "
                                               "each retried")
        self.streams_recreated = c("streams_recreated", "Jobs streams or groups made again "
                                                        "after Redis lost its data")
        self.degraded = g("degraded", "1 while the worker is degraded (a full Redis refuses "
                                      "its writes), else 0")
        self.finished = Counter("pagedq:request_success",
                                "Jobs ended, by tenant (key prefix), model, status and "
                                "finish reason",
                                ["prefix", "model", "status", "finish_reason"], registry=reg)
        self.model = ""  # the model served (serving())
        self.gpu: GpuCollector | None = None
        self.server = None  # the HTTP server, once serve() ran

    def serving(self, model: str, prefixes: Iterable[str], lanes: Iterable[str]) -> None:
        """Create every series of the label sets the worker will serve, at 0, before the
        first job: a series born at its first event hides that event from ``rate()`` and
        ``increase()`` (the first failure, the first job of a lane)."""
        self.model, lanes, prefixes = model, tuple(lanes), tuple(prefixes)
        for lane in lanes:
            self.ttft.labels(lane)
            self.submit_ttft.labels(lane)
            self.queue_wait.labels(lane)
            for prefix in prefixes:
                for gauge in (self.stream_length, self.pending, self.oldest_pending,
                              self.dlq_size):
                    gauge.labels(prefix, model, lane)
        for prefix in prefixes:
            self.request_prompt.labels(prefix, model)
            self.request_generation.labels(prefix, model)
            for status, reason in OUTCOMES:
                self.finished.labels(prefix, model, status, reason)

    def ended(self, prefix: str, status: str, reason: str) -> None:
        """A job of tenant ``prefix`` ended (or was dead-lettered)."""
        self.finished.labels(prefix, self.model, status, reason).inc()

    def tokens_of(self, prefix: str, prompt: int, generated: int) -> None:
        """The tokens of a job ended: its prompt, and what was generated for it."""
        self.request_prompt.labels(prefix, self.model).observe(prompt)
        self.request_generation.labels(prefix, self.model).observe(generated)

    def watch_device(self, device) -> None:
        """Export the GPU gauges of ``device`` (a torch.device; families only on a CPU)."""
        self.gpu = GpuCollector(device)
        self.registry.register(self.gpu)

    def observe_engine(self, engine) -> None:
        """Gauges of the engine's state, and the scheduler's totals (preemptions, prefix
        cache queries and hits) since the last call."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_cache_usage)
        sched = engine.scheduler
        for name, counter in (("num_preemptions_total", self.preemptions),
                              ("prefix_cache_queries", self.prefix_queries),
                              ("prefix_cache_hits", self.prefix_hits)):
            total = getattr(sched, name)
            if total > self._seen.get(name, 0):
                counter.inc(total - self._seen.get(name, 0))
                self._seen[name] = total

    def serve(self, port: int, host: str = "127.0.0.1", health: Health | None = None) -> int:
        """Expose /metrics (and, given ``health``, /healthz and /readyz) on ``host``:``port``
        (port 0 = pick a free one); returns the port. The default host is loopback only;
        "0.0.0.0" listens on every interface."""
        self.server = http_server.serve(self.registry, health, port, host)
        return self.server.server_port
