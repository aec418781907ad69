"""Which worker serves a request: the load each worker carries, the KV-aware cost, and the three policies.

The KV-aware cost follows NVIDIA Dynamo's KV router: a worker that already caches a long prefix of the prompt
saves that much prefill, weighed against how busy it is,

    cost = prefill_weight * (prompt blocks not cached there + prefill blocks queued there)
           + block_weight * (KV blocks in use) + request_weight * (running + waiting requests)

and the cheapest worker wins. The queued prefill (uncached blocks of requests sent there that have not
produced a token yet) is work the new request waits behind, like Dynamo's "potential prefill blocks".
The default prefill weight, 8, is the time of prefilling one block against holding one block through a
decode of a few dozen tokens, about 9:1 in the mock engine's roofline model of SmolLM2 (more on the CPU
engine); in the simulator it was the smallest weight that kept every conversation on its replica, with
round-robin's hit rate or better on shared prefixes and bursts (bench/simulate.py, `--replicas`). Ties go round-robin, so equal workers share the load. Everything is in KV
blocks of the worker's block size; pure functions of frozen records, so they are testable without a server.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Load:
    """One worker's load as the router sees it: the larger of what the worker last reported and what this
    router has sent it since (the report lags by a step and a publish interval)."""

    requests: int  # running + waiting
    active_blocks: int  # KV blocks in use
    prefill_blocks: int = 0  # uncached prompt blocks of requests routed there still before their first token


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker a request could go to."""

    load: Load
    prompt_blocks: int  # blocks the prompt occupies (ceil(tokens / block size)); 0 when the prompt is unknown
    cached_blocks: int  # of those, a prefix the worker caches now, or will once requests sent there computed it

    @property
    def prefill_blocks(self) -> int:
        return self.prompt_blocks - self.cached_blocks


@dataclass(frozen=True, slots=True)
class CostWeights:
    prefill_weight: float = 8.0
    block_weight: float = 1.0
    request_weight: float = 0.0

    def __post_init__(self) -> None:
        if min(self.prefill_weight, self.block_weight, self.request_weight) < 0:
            raise ValueError("cost weights must be >= 0")


def kv_cost(c: Candidate, w: CostWeights) -> float:
    return (w.prefill_weight * (c.prefill_blocks + c.load.prefill_blocks) + w.block_weight * c.load.active_blocks
            + w.request_weight * c.load.requests)


class PolicyName(str, enum.Enum):
    KV = "kv"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


class Policy:
    """Chooses among candidates (in a stable order); one instance per router (it keeps the rotation)."""

    def __init__(self, name: PolicyName | str, weights: CostWeights = CostWeights()) -> None:
        self.name = PolicyName(name)
        self.weights = weights
        self._turn = 0

    @property
    def uses_kv(self) -> bool:
        return self.name is PolicyName.KV

    def score(self, c: Candidate) -> tuple[float, ...]:
        """Lower is better (round-robin: every candidate ties)."""
        if self.name is PolicyName.KV:
            return (kv_cost(c, self.weights),)
        if self.name is PolicyName.LEAST_LOADED:
            return (c.load.requests, c.load.active_blocks)
        return ()

    def choose(self, candidates: Sequence[Candidate]) -> int:
        """The index of the best candidate; among equals, the next one in turn after the previous choice."""
        if not candidates:
            raise ValueError("no candidates")
        scores = [self.score(c) for c in candidates]
        best = min(scores)
        n = len(candidates)
        start = self._turn % n
        for k in range(n):
            i = (start + k) % n
            if scores[i] == best:
                self._turn = i + 1
                return i
        raise AssertionError("unreachable")
