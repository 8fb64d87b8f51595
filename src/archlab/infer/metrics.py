"""The server's counters, gauges and latency histograms, and their Prometheus text exposition
(format 0.0.4), for ``GET /metrics``.

Written by hand rather than with ``prometheus_client``: the server needs three metric kinds and
their text form, a few dozen lines, where the package would be one more dependency of ``serve``.
Updates come from two threads (the engine thread counts tokens and latencies, the event loop
counts requests), so every metric takes one lock; a scrape reads under the same lock and never
sees a histogram whose count disagrees with its buckets.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Callable

# Seconds. Time to first token includes the wait for a slot, so its buckets reach a minute;
# per-token latency is one decode step (milliseconds on a GPU, tens of them on a CPU).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# How a request ended: a completion's finish reasons (cancelled: its client went away), then the
# refusals (unauthorized and too_large count requests to any route).
OUTCOMES = ("stop", "length", "timeout", "cancelled", "error",
            "invalid", "unauthorized", "too_large", "queue_full")


def number(value: float) -> str:
    """A sample value as the text format writes it (integers without a fraction, +Inf, NaN)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() and abs(value) < 2 ** 53 else repr(float(value))


def label_text(labels: dict[str, str]) -> str:
    """``{name="value",...}`` with the format's escapes (backslash, double quote, newline)."""
    if not labels:
        return ""

    def escape(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(str(v))}"' for k, v in labels.items()) + "}"


class Metric:
    """One metric family: its HELP and TYPE lines, then the samples its kind writes."""

    def __init__(self, name: str, help_text: str, kind: str):
        self.name, self.help, self.kind = name, help_text, kind
        self.lock = threading.Lock()

    def samples(self) -> list[str]:  # each kind writes its own (called under ``lock``)
        raise NotImplementedError

    def render(self) -> list[str]:
        with self.lock:
            return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples()]


class Counter(Metric):
    """A count that only grows, optionally split by one label (every value listed up front, so
    each series exists at zero from the start and a rate over it is defined)."""

    def __init__(self, name: str, help_text: str, label: str | None = None, values: tuple[str, ...] = ()):
        super().__init__(name, help_text, "counter")
        self.label = label
        self.values: dict[str, float] = {v: 0.0 for v in values} if label else {"": 0.0}

    def inc(self, amount: float = 1.0, value: str = "") -> None:
        with self.lock:
            self.values[value] = self.values.get(value, 0.0) + amount

    def get(self, value: str = "") -> float:
        with self.lock:
            return self.values.get(value, 0.0)

    def samples(self) -> list[str]:
        return [f"{self.name}{label_text({self.label: v} if self.label else {})} {number(n)}"
                for v, n in self.values.items()]


class Gauge(Metric):
    """A value read when scraped (``read``), e.g. the engine loop's queue length."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]):
        super().__init__(name, help_text, "gauge")
        self.read = read

    def samples(self) -> list[str]:
        return [f"{self.name} {number(self.read())}"]


class Histogram(Metric):
    """Observations counted into fixed buckets (upper bounds, +Inf added), with their sum."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        super().__init__(name, help_text, "histogram")
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        slot = bisect.bisect_left(self.bounds, value)  # a value equal to a bound falls in it (le)
        with self.lock:
            self.counts[slot] += 1
            self.sum += value

    @property
    def count(self) -> int:
        with self.lock:
            return sum(self.counts)

    def samples(self) -> list[str]:
        lines, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            lines.append(f"{self.name}_bucket{label_text({'le': number(bound)})} {total}")
        return [*lines, f"{self.name}_sum {number(self.sum)}", f"{self.name}_count {total}"]


class ServerMetrics:
    """What ``GET /metrics`` reports. ``queue_length`` and ``slots_in_use`` are read from the
    engine loop at scrape time; ``in_progress`` counts the completion handlers running now (a
    handler that never ends, a lost request, shows as a value that does not return to zero)."""

    def __init__(self, slots: int, queue_length: Callable[[], float], slots_in_use: Callable[[], float]):
        self.requests = Counter("archlab_requests_total", "Requests by how they ended: a completion's finish "
                                "reason (stop, length, timeout, cancelled by the client, error) or a refusal "
                                "(invalid, unauthorized, too_large, queue_full).", "outcome", OUTCOMES)
        self.prompt_tokens = Counter("archlab_prompt_tokens_total", "Prompt tokens of the requests admitted.")
        self.generated_tokens = Counter("archlab_generated_tokens_total", "Tokens the engine generated.")
        self.in_progress = 0
        self._progress_lock = threading.Lock()
        self.ttft = Histogram("archlab_time_to_first_token_seconds", "From a request's arrival to its first "
                              "token, the wait for a slot included.", TTFT_BUCKETS)
        self.token_latency = Histogram("archlab_time_per_output_token_seconds", "Between consecutive tokens of "
                                       "one request.", TOKEN_BUCKETS)
        self.duration = Histogram("archlab_request_duration_seconds", "From a request's arrival to its end.",
                                  REQUEST_BUCKETS)
        self.all: list[Metric] = [
            self.requests, self.prompt_tokens, self.generated_tokens,
            Gauge("archlab_requests_in_progress", "Completion requests being handled now.", lambda: self.in_progress),
            Gauge("archlab_queue_length", "Requests waiting for a slot.", queue_length),
            Gauge("archlab_slots_in_use", "KV-cache slots decoding a request.", slots_in_use),
            Gauge("archlab_slots", "KV-cache slots in all (--slots).", lambda: slots),
            self.ttft, self.token_latency, self.duration,
        ]

    def started(self) -> None:
        with self._progress_lock:
            self.in_progress += 1

    def ended(self, outcome: str, seconds: float) -> None:
        with self._progress_lock:
            self.in_progress -= 1
        self.requests.inc(value=outcome)
        self.duration.observe(seconds)

    def render(self) -> str:
        return "\n".join(line for metric in self.all for line in metric.render()) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
