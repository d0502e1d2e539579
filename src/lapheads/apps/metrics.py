"""What a server's batches did, as Prometheus metrics (``GET /metrics`` of ``lapheads serve``), named as vLLM's.

Design choices:

* **vLLM's names with lapheads' prefix**, so the dashboards and alerts users keep for vLLM read lapheads with a
  renamed prefix: ``lapheads:num_requests_running`` / ``_waiting`` (gauges), ``lapheads:prompt_tokens_total`` /
  ``generation_tokens_total`` / ``request_success_total{finished_reason}`` (counters),
  ``lapheads:time_to_first_token_seconds``, ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``,
  ``request_queue_time_seconds`` and ``iteration_tokens_total`` (histograms), each labelled ``model_name``.
* **One lapheads metric beyond vLLM's, for where the time goes**: ``lapheads:step_seconds{phase}``, a histogram
  of the worker's phases: ``decode`` (one forward for every live row), ``sample`` (each row's next token, the
  callbacks that turn tokens into text, the pieces handed to the readers: the per-token Python side) and
  ``prefill`` (a batch's first prompts, which the worker waits for), and ``prefill_joining`` (joiners' prompts, on
  the prefill thread beside the steps). ``benchmarks/serving.py`` reads it to split a served round's wall time.
* **prometheus_client, a registry per server**: two apps in one process (tests, notebooks) never share counts;
  :meth:`ServingMetrics.exposition` is the text format Prometheus scrapes. Its metrics are thread-safe, so the
  worker, the prefill thread and the HTTP side record without a lock of ours.
* **Times from one monotonic clock** (``time.perf_counter``), taken by the batcher where the event happens: a
  token is "generated" when it is sampled (or forced), before its text is flushed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["RequestClock", "ServingMetrics"]

# vLLM's latency buckets (vllm/v1/metrics/loggers.py), so the same queries read both; the inter-token ones gain
# four below vLLM's first (10 ms): a CPU step of a small model takes a few milliseconds
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# tokens per forward: vLLM's start 1, 8, 16; a CPU batch is a few rows
_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# a CPU step of a small model is ~1 ms: finer than vLLM's request-level buckets
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass
class RequestClock:
    """One request's times (``time.perf_counter`` seconds): submitted, started (its prefill began), its first and
    its last token so far."""

    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class ServingMetrics:
    """The Prometheus metrics of one server's batcher (module docstring).

    Args:
        model_name: the ``model_name`` label every metric carries (the served run's name, as ``/v1/models`` says).
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels, name = ["model_name"], model_name

        def make(kind, metric: str, doc: str, extra: tuple[str, ...] = (), **kwargs):
            return kind(f"lapheads:{metric}", doc, [*labels, *extra], registry=self.registry, **kwargs)

        self.running = make(Gauge, "num_requests_running", "Requests in the batch being decoded.").labels(name)
        self.waiting = make(Gauge, "num_requests_waiting", "Requests submitted and not yet started.").labels(name)
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens prefilled.").labels(name)
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated.").labels(name)
        self._success = make(Counter, "request_success", "Requests finished, by why.", ("finished_reason",))
        self._model_name = name
        self.time_to_first_token = make(Histogram, "time_to_first_token_seconds", "Submitted to first token.",
                                        buckets=_TTFT_BUCKETS).labels(name)  # fmt: skip
        self.inter_token_latency = make(Histogram, "inter_token_latency_seconds", "Between a request's tokens.",
                                        buckets=_ITL_BUCKETS).labels(name)  # fmt: skip
        self.e2e_latency = make(Histogram, "e2e_request_latency_seconds", "Submitted to finished.",
                                buckets=_REQUEST_BUCKETS).labels(name)  # fmt: skip
        self.queue_time = make(Histogram, "request_queue_time_seconds", "Submitted to its prefill's start.",
                               buckets=_REQUEST_BUCKETS).labels(name)  # fmt: skip
        self.iteration_tokens = make(Histogram, "iteration_tokens_total", "Tokens per forward (a step, a prefill).",
                                     buckets=_TOKENS_BUCKETS).labels(name)  # fmt: skip
        self._step = make(Histogram, "step_seconds", "Phases: decode, sample, prefill, prefill_joining.", ("phase",),
                          buckets=_STEP_BUCKETS)  # fmt: skip

    def step(self, phase: str, seconds: float) -> None:
        """One ``phase`` ("decode", "sample", "prefill" or "prefill_joining") took ``seconds``."""
        self._step.labels(self._model_name, phase).observe(seconds)

    def started(self, clock: RequestClock, prompt_tokens: int) -> None:
        """A request's prefill begins."""
        clock.started = time.perf_counter()
        self.queue_time.observe(clock.started - clock.submitted)
        self.prompt_tokens.inc(prompt_tokens)

    def token(self, clock: RequestClock) -> None:
        """A request generated a token now."""
        now = time.perf_counter()
        if clock.first_token is None:
            clock.first_token = now
            self.time_to_first_token.observe(now - clock.submitted)
        else:
            self.inter_token_latency.observe(now - clock.last_token)
        clock.last_token = now
        self.generation_tokens.inc()

    def finished(self, clock: RequestClock, reason: str) -> None:
        """A request ended, for ``reason`` ("stop", "length", or "abort" for a reader that left)."""
        self.e2e_latency.observe(time.perf_counter() - clock.submitted)
        self._success.labels(self._model_name, reason).inc()

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format (what ``GET /metrics`` returns)."""
        return generate_latest(self.registry)
