"""--scheduling-policy: fcfs ignores `priority`; priority admits lower values first (vLLM's semantics), aged so
that a stream of urgent work delays a lower class by a bounded number of admissions, never forever."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.engine.admission import RequestLimits
from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduler import SampledToken, Scheduler
from trillm.engine.sequence import Sequence, SequenceStatus


def make(policy: str, aging: int = 4, max_num_seqs: int = 1) -> Scheduler:
    cfg = EngineConfig(block_size=4, num_kv_blocks=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                       scheduling_policy=policy, priority_aging=aging)
    bm = BlockManager(256, 4, model_id="t", enable_prefix_caching=False)
    return Scheduler(cfg, bm, RequestLimits(256, 4, bm.num_usable_blocks, 1000, 1000))


def seq(name: str, priority: int, group: str | None = None) -> Sequence:
    return Sequence(name, [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True), priority=priority, group=group)


def drain(s: Scheduler) -> list[str]:
    """Run to completion (one token per request); the order in which requests were admitted."""
    order: list[str] = []
    while s.has_work():
        batch = s.schedule()
        order += [c.seq.request_id for c in batch.prefills if c.start == 0]
        s.postprocess(batch, [SampledToken(q, 9) for q in batch.sampled])
    return order


def test_fcfs_ignores_priority() -> None:
    s = make("fcfs")
    for name, p in (("a", 5), ("b", 0), ("c", 3)):
        s.add(seq(name, p))
    assert drain(s) == ["a", "b", "c"]


def test_strict_priority_lower_first_then_arrival() -> None:
    s = make("priority", aging=0)
    for name, p in (("a", 5), ("b", 0), ("c", 3), ("d", 0)):
        s.add(seq(name, p))
    assert drain(s) == ["b", "d", "c", "a"]


def test_aged_priority_lets_a_low_class_in_after_a_bounded_wait() -> None:
    """A class-2 request amid a never-ending stream of class-0 ones: strict priority starves it; aged (4) it is
    admitted after at most 2 x 4 of them."""
    for aging, bound in ((0, None), (4, 8)):
        s = make("priority", aging=aging)
        s.add(seq("low", 2))
        admitted: list[str] = []
        for i in range(40):
            s.add(seq(f"hi{i}", 0))  # one urgent arrival per step: the queue is never empty of them
            batch = s.schedule()
            admitted += [c.seq.request_id for c in batch.prefills]
            s.postprocess(batch, [SampledToken(q, 9) for q in batch.sampled])
        if bound is None:
            assert "low" not in admitted  # starved
        else:
            assert "low" in admitted and admitted.index("low") <= bound, admitted[:12]


def test_priority_keeps_fair_admission_between_groups() -> None:
    """Within one class, the groups of two requests (prompts x n) are still admitted round-robin; a more urgent
    class still goes first."""
    s = make("priority", aging=100)
    for i in range(3):
        s.add(seq(f"A{i}", 1, group="A"))
    for i in range(3):
        s.add(seq(f"B{i}", 1, group="B"))
    s.add(seq("U", 0, group="U"))
    assert drain(s) == ["U", "A0", "B0", "A1", "B1", "A2", "B2"]


def test_config_refuses_unknown_policies() -> None:
    with pytest.raises(InvalidRequest, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(InvalidRequest, match="priority_aging"):
        EngineConfig(priority_aging=-1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       aging=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_aged_priority_bounds_every_overtake(arrivals: list[int], aging: int, seed: int) -> None:
    """Under random arrivals (bursts included), a waiting sequence of class p is overtaken (a later arrival
    admitted before it) only by sequences that arrived within p x aging rounds of virtual time after it (the
    virtual time read when each arrived), and everything is served."""
    rng = random.Random(seed)
    s = make("priority", aging=aging, max_num_seqs=2)
    pending = list(arrivals)
    arrival_of: dict[str, int] = {}
    vtime_at_arrival: dict[str, int] = {}
    clock = 0
    for _ in range(2000):
        while pending and rng.random() < 0.6:
            q = seq(f"r{clock}", pending.pop(0))
            vtime_at_arrival[q.request_id] = s._vtime
            s.add(q)
            arrival_of[q.request_id] = clock
            clock += 1
        before = list(s.waiting)
        batch = s.schedule()
        for c in batch.prefills:
            if c.start:
                continue
            a = c.seq.request_id
            for w in before:
                if w.status is SequenceStatus.WAITING and arrival_of[w.request_id] < arrival_of[a]:
                    rounds = vtime_at_arrival[a] - vtime_at_arrival[w.request_id]
                    assert rounds < w.priority * aging, (w, c.seq, rounds)
        s.postprocess(batch, [SampledToken(q, 9) for q in batch.sampled])
        if not pending and not s.has_work():
            break
    assert not s.has_work(), "a sequence starved"
