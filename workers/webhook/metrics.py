"""The reclaim webhook's Prometheus metrics (text format), without a client library."""

from __future__ import annotations

from collections import Counter

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """Counters with fixed label sets plus one latency histogram: enough for /metrics without
    pulling in a client library."""

    def __init__(self) -> None:
        self.counters: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        self.buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0

    def inc(self, name: str, **labels: str) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += 1

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.buckets[i] += 1
        self.latency_sum += seconds
        self.latency_count += 1

    def render(self) -> str:
        lines = []
        for name in sorted({n for n, _ in self.counters}):
            lines.append(f"# TYPE {name} counter")
            for (n, labels), value in sorted(self.counters.items()):
                if n == name:
                    text = ",".join(f'{k}="{v}"' for k, v in labels)
                    lines.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")
        hist = "spotrain_webhook_signal_latency_seconds"
        lines.append(f"# TYPE {hist} histogram")
        for bound, count in zip(LATENCY_BUCKETS, self.buckets, strict=True):
            lines.append(f'{hist}_bucket{{le="{bound}"}} {count}')
        lines.append(f'{hist}_bucket{{le="+Inf"}} {self.latency_count}')
        lines.append(f"{hist}_sum {self.latency_sum}")
        lines.append(f"{hist}_count {self.latency_count}")
        return "\n".join(lines) + "\n"
