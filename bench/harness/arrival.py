"""When requests start: a fixed concurrency, a Poisson/gamma rate, or one burst."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Arrival:
    """How units of work (sessions) are released.

    concurrency: at most max_concurrency sessions in flight, all ready at t=0.
    rate: session i starts at the i-th gamma arrival (vLLM's burstiness knob; 1.0 is Poisson); an optional
        max_concurrency caps the sessions in flight.
    burst: every session starts at t=0 on its own connection, no cap.
    """

    mode: str  # "concurrency" | "rate" | "burst"
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("concurrency", "rate", "burst"):
            raise ValueError(f"unknown arrival mode {self.mode!r}")
        if self.mode == "concurrency" and (self.max_concurrency or 0) < 1:
            raise ValueError("concurrency mode needs max_concurrency >= 1")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError("request_rate and burstiness must be > 0")

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"c{self.max_concurrency}"
        if self.mode == "rate":
            cap = f"-c{self.max_concurrency}" if self.max_concurrency else ""
            return f"r{self.request_rate:g}-b{self.burstiness:g}{cap}"
        return "burst"


def start_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Start times (s from the run's start) of n arrivals with gamma inter-arrival gaps.

    The gaps have mean 1/request_rate; shape = burstiness (1.0 is exponential, i.e. Poisson arrivals; below 1
    burstier, above 1 more regular), as in vLLM's benchmark_serving. An infinite rate starts all at once.
    """
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out
