"""`GET /metrics`: the server's counters in Prometheus' text format (no client library needed)."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

UNJUDGED = ("baseline", "final", None)  # step verdicts of steps no judge saw
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped)) + "}"


class Metrics:
    """Counts of requests, tokens, speculation and steps, and latency histograms, by label."""

    def __init__(self, gauges: Callable[[], dict[str, float]] | None = None) -> None:
        self.counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.histograms: dict[str, dict[tuple, Histogram]] = defaultdict(dict)
        self.gauges = gauges or (lambda: {})

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.counters[name][tuple(sorted(labels.items()))] += value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.histograms[name].setdefault(key, Histogram()).observe(value)

    def request(self, route: str, model: str, status: int, seconds: float) -> None:
        self.inc("thinkahead_requests_total", route=route, model=model, status=str(status))
        self.observe("thinkahead_request_duration_seconds", seconds, route=route)

    def tokens(self, prompt: int, completion: int, cached: int = 0) -> None:
        self.inc("thinkahead_prompt_tokens_total", prompt)
        self.inc("thinkahead_completion_tokens_total", completion)
        self.inc("thinkahead_cached_tokens_total", cached)

    def speculation(self, spec: dict[str, float]) -> None:
        """SGLang-named counters of one or more generations (`spec_verify_ct`, ...)."""
        for key in ("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts"):
            if spec.get(key):
                self.inc(f"thinkahead_{key}_total", float(spec[key]))
        if spec.get("spec_verify_ct") and spec.get("completion_tokens"):
            self.inc("thinkahead_spec_tokens_total", float(spec["completion_tokens"]))

    def step(self, author: str, verdict: str) -> None:
        self.inc("thinkahead_steps_total", author=author, verdict=verdict)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        lines: list[str] = []
        for name, series in sorted(self.counters.items()):
            lines.append(f"# TYPE {name} counter")
            lines += [f"{name}{_labels(key)} {value:g}" for key, value in sorted(series.items())]
        derived = dict(self.gauges())
        verify = sum(self.counters["thinkahead_spec_verify_ct_total"].values())
        if verify:
            derived["thinkahead_spec_accept_length"] = sum(self.counters["thinkahead_spec_tokens_total"].values()) / verify
        steps = self.counters.get("thinkahead_steps_total", {})
        judged = sum(v for k, v in steps.items() if dict(k).get("verdict") not in UNJUDGED)
        if judged:
            accepted = sum(v for k, v in steps.items() if dict(k).get("verdict") == "accepted")
            derived["thinkahead_step_accept_rate"] = accepted / judged  # of the drafted steps a judge saw
        for name, value in sorted(derived.items()):
            lines += [f"# TYPE {name} gauge", f"{name} {value:g}"]
        for name, series in sorted(self.histograms.items()):
            lines.append(f"# TYPE {name} histogram")
            for key, h in sorted(series.items()):
                cumulative = 0
                for bound, count in zip((*h.buckets, float("inf")), h.counts):
                    cumulative += count
                    le = "+Inf" if bound == float("inf") else f"{bound:g}"
                    lines.append(f"{name}_bucket{_labels((*key, ('le', le)))} {cumulative}")
                lines.append(f"{name}_sum{_labels(key)} {h.total:g}")
                lines.append(f"{name}_count{_labels(key)} {h.n}")
        return "\n".join(lines) + "\n"
