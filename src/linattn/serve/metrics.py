"""The server's counters, gauges and latency histograms, written in the Prometheus text format (version 0.0.4)
for `GET /metrics`. Hand-written: a few dozen lines instead of a dependency."""
from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Callable, Dict, List, Tuple

PREFIX = "linattn_serve_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# name -> (help, kind); counters are counted with `count(name, n)`
COUNTERS = {
    "prompt_tokens": "Prompt tokens of the requests that started generating.",
    "generation_tokens": "Tokens generated.",
    "cancelled": "Requests cancelled before they finished (their client disconnected, or shutdown).",
    "prefill_tokens": "Prompt tokens run through the model (those found in the prefix cache are not).",
    "prefix_cache_hit_tokens": "Prompt tokens whose state came from the prefix cache.",
}
HISTOGRAMS = {
    "request_latency_seconds": "Seconds from a request's arrival to its last byte, by endpoint.",
    "time_to_first_token_seconds": "Seconds from a request's arrival to its first generated text, by endpoint.",
}


def _labels(pairs: Tuple[Tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    body = ",".join(f'{k}="{v}"'.replace("\n", " ") for k, v in pairs)
    return "{" + body + "}"


class Metrics:
    """Thread-safe counts; `render(gauges)` writes them with the current gauges (e.g. queue length)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = defaultdict(int)
        self._requests: Dict[Tuple[str, int], int] = defaultdict(int)
        self._hist: Dict[Tuple[str, str], List[float]] = {}   # (name, endpoint) -> bucket counts + [sum, count]

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[(endpoint, status)] += 1

    def observe(self, name: str, endpoint: str, seconds: float) -> None:
        with self._lock:
            h = self._hist.setdefault((name, endpoint), [0.0] * (len(LATENCY_BUCKETS) + 3))
            h[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1   # the first bucket with le >= seconds
            h[-2] += seconds
            h[-1] += 1

    def render(self, gauges: Dict[str, Tuple[str, float]]) -> str:
        """The exposition text; `gauges` maps a name to (help, value)."""
        out: List[str] = []

        def family(name: str, kind: str, help_text: str, samples: Callable[[], List[str]]) -> None:
            out.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}", *samples()])

        with self._lock:
            family("requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
                   lambda: [f"{PREFIX}requests_total{_labels((('endpoint', e), ('code', str(c))))} {n}"
                            for (e, c), n in sorted(self._requests.items())])
            for name, help_text in COUNTERS.items():
                family(f"{name}_total", "counter", help_text,
                       lambda name=name: [f"{PREFIX}{name}_total {self._counts[name]}"])
            for name, help_text in HISTOGRAMS.items():
                family(name, "histogram", help_text, lambda name=name: self._histogram_lines(name))
        for name, (help_text, value) in gauges.items():
            family(name, "gauge", help_text, lambda value=value, name=name: [f"{PREFIX}{name} {value}"])
        return "\n".join(out) + "\n"

    def _histogram_lines(self, name: str) -> List[str]:
        lines = []
        for (n, endpoint), h in sorted(self._hist.items()):
            if n != name:
                continue
            cumulative = 0.0
            for le, c in zip([*map(str, LATENCY_BUCKETS), "+Inf"], h[:-2]):
                cumulative += c
                lines.append(f"{PREFIX}{name}_bucket{_labels((('endpoint', endpoint), ('le', le)))} {int(cumulative)}")
            lines.append(f"{PREFIX}{name}_sum{_labels((('endpoint', endpoint),))} {h[-2]}")
            lines.append(f"{PREFIX}{name}_count{_labels((('endpoint', endpoint),))} {int(h[-1])}")
        return lines
