"""Service-level objectives and goodput: which requests of a run are inside the SLO, and the requests per
second a configuration serves with at least 90% of them inside (vLLM's goodput, per request: TTFT, time
per output token after the first, end-to-end time)."""

from __future__ import annotations

import difflib
import re

from turbollm.errors import BenchmarkError
from turbollm.planner.simulate import SimResult

# the names accepted in --slo, and the per-request measure each bounds (itl: the request's mean inter-token
# latency, vLLM's TPOT)
SLO_KEYS = {"ttft": "ttft", "ttft_p99": "ttft", "itl": "tpot", "itl_p99": "tpot", "tpot": "tpot",
            "tpot_p99": "tpot", "e2e": "e2e", "e2e_p99": "e2e"}
ATTAINMENT = 0.9  # the share of requests that must be inside the SLO
_VALUE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_p99=2000,itl_p99=150' (milliseconds; '2s' also works) -> {"ttft": 2.0, "tpot": 0.15} (seconds)."""
    out: dict[str, float] = {}
    if not text or not text.strip():
        raise BenchmarkError("--slo is empty: give e.g. 'ttft_p99=2000,itl_p99=200' (milliseconds)")
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq:
            raise BenchmarkError(f"--slo: {part.strip()!r} is not NAME=VALUE (e.g. ttft_p99=2000)")
        if key not in SLO_KEYS:
            near = difflib.get_close_matches(key, SLO_KEYS, n=1)
            raise BenchmarkError(f"--slo: unknown objective {key!r}" + (f"; did you mean {near[0]!r}?" if near else
                                                                        f"; known: {', '.join(SLO_KEYS)}"))
        m = _VALUE.match(value)
        if not m or float(m.group(1)) <= 0:
            raise BenchmarkError(f"--slo: {key}={value.strip()!r} is not a positive time (milliseconds, or with s)")
        out[SLO_KEYS[key]] = float(m.group(1)) * (1.0 if m.group(2) == "s" else 1e-3)
    return out


def inside(result: SimResult, slo: dict[str, float]) -> list[bool]:
    """Per finished request, whether every bound holds."""
    measures = {"ttft": result.ttft, "tpot": result.tpot, "e2e": result.e2e}
    return [all(measures[k][i] <= bound for k, bound in slo.items()) for i in range(len(result.ttft))]


def attainment(result: SimResult, slo: dict[str, float], total: int) -> float:
    """The share of `total` requests inside the SLO (one that did not finish is outside)."""
    return sum(inside(result, slo)) / max(1, total)


def served_rate(result: SimResult) -> float:
    """Requests finished per second of the run."""
    return len(result.ttft) / result.duration if result.duration > 0 else 0.0
