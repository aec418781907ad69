"""Fair admission between client requests (groups): one request's later prompts and choices never stand in
front of another request's first sequence, one request cannot crowd out the running batch or the queue, and
nothing starves."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.engine.admission import RequestLimits
from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest, Overloaded
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduler import SampledToken, ScheduledBatch, Scheduler
from trillm.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 400, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
         max_waiting: int = 1000, max_model_len: int = 512) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_waiting=max_waiting)
    bm = BlockManager(num_blocks, block_size, model_id="t", enable_prefix_caching=True)
    return Scheduler(cfg, bm, RequestLimits(max_model_len, block_size, bm.num_usable_blocks, 1000, max_waiting))


def step(s: Scheduler, token: int = 7) -> tuple[ScheduledBatch, list[Sequence]]:
    """One scheduling step, every sampled sequence given `token`. Returns (batch, sequences admitted by it)."""
    before = list(s.waiting)
    batch = s.schedule()
    admitted = [q for q in before if q.status is SequenceStatus.RUNNING]
    s.postprocess(batch, [SampledToken(q, token) for q in batch.sampled])
    return batch, admitted


def group(name: str, n: int, prompt_len: int, max_tokens: int, rng: random.Random) -> list[Sequence]:
    return [Sequence(f"{name}-{i}", [rng.randrange(3, 900) for _ in range(prompt_len)],
                     SamplingParams(max_tokens=max_tokens, ignore_eos=True), group=name) for i in range(n)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(huge=st.integers(10, 200), small=st.integers(1, 4), delay=st.integers(0, 12), prompt=st.integers(1, 40),
       max_num_seqs=st.integers(8, 32), seed=st.integers(0, 2**16))
def test_a_small_request_after_a_huge_one_is_admitted_within_one_of_its_sequences(
        huge: int, small: int, delay: int, prompt: int, max_num_seqs: int, seed: int) -> None:
    rng = random.Random(seed)
    # Budget for every decode plus one whole prompt, and blocks for everyone: only the order is tested.
    s = make(num_blocks=4 * (huge + small) * 30, max_num_seqs=max_num_seqs, budget=max_num_seqs + 40)
    for q in group("huge", huge, prompt, 60, rng):
        s.add(q)
    for _ in range(delay):
        step(s)
    late = group("small", small, rng.randint(1, 40), 2, rng)
    for q in late:
        s.add(q)
    huge_first_admissions = 0
    for steps in range(1, 40):
        _, admitted = step(s)
        if any(q.group == "small" for q in admitted):  # (admitted lists them in admission order)
            first = next(i for i, q in enumerate(admitted) if q.group == "small")
            huge_first_admissions += sum(q.group == "huge" and q.num_preemptions == 0 for q in admitted[:first])
            break
        huge_first_admissions += sum(q.group == "huge" and q.num_preemptions == 0 for q in admitted)
    else:
        pytest.fail("the small request was never admitted")
    # At most the huge request's sequence that shares the small one's tag (it arrived earlier).
    assert huge_first_admissions <= 1
    # The huge request gives up a row to the small one's first sequence (its fair share is one row less): the
    # next step, or the one after if that huge sequence took the rest of the step's token budget.
    assert steps <= 2


def test_round_robin_between_requests() -> None:
    """Three requests queued together are admitted alternately, each keeping its own order."""
    rng = random.Random(0)
    s = make(max_num_seqs=64, budget=64)
    a, b, c = group("a", 6, 4, 50, rng), group("b", 3, 4, 50, rng), group("c", 1, 4, 50, rng)
    for q in a + b + c:
        s.add(q)
    _, admitted = step(s)
    assert [q.request_id for q in admitted] == ["a-0", "b-0", "c-0", "a-1", "b-1", "a-2", "b-2",
                                                "a-3", "a-4", "a-5"]


def test_ungrouped_requests_stay_first_come_first_served() -> None:
    rng = random.Random(1)
    s = make(max_num_seqs=4, budget=64)
    seqs = [Sequence(f"r{i}", [rng.randrange(900) for _ in range(5)], SamplingParams(max_tokens=3)) for i in range(12)]
    order = []
    for i, q in enumerate(seqs):
        s.add(q)
        if i % 3 == 2:
            order += [x.request_id for x in step(s)[1]]
    while s.has_work():
        order += [x.request_id for x in step(s)[1]]
    assert order == [q.request_id for q in seqs]


def test_one_request_may_hold_a_quarter_of_the_queue() -> None:
    rng = random.Random(2)
    s = make(max_waiting=40)
    assert s.limits.max_group_waiting == 10
    for q in group("big", 10, 3, 4, rng):
        s.add(q)
    with pytest.raises(InvalidRequest, match=r"at most 10 generations .*--max-waiting 40"):
        s.add(group("big", 11, 3, 4, rng)[10])
    with pytest.raises(InvalidRequest, match="at most 10"):
        s.limits.check_group(11)
    s.limits.check_group(10)
    for q in group("other", 10, 3, 4, rng):  # the others are not refused
        s.add(q)
    assert len(s.waiting) == 20
    # Disabling the queue (max_waiting 0) answers everyone with Overloaded, never this 400.
    make(max_waiting=0).limits.check_group(5)
    with pytest.raises(Overloaded):
        make(max_waiting=0).add(group("x", 1, 3, 4, rng)[0])


def check(s: Scheduler) -> None:
    assert [q.sort_key for q in s.waiting] == sorted(q.sort_key for q in s.waiting)
    waiting = Counter(q.group for q in s.waiting if q.group is not None)
    running = Counter(q.group for q in s.running if q.group is not None)
    assert +s._group_waiting == waiting and +s._group_running == running
    assert set(s._last_tag) <= set(waiting) | set(running)
    s.block_manager.check_invariants(s.running)


workload = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 30), st.integers(1, 10), st.integers(0, 1)),
                    min_size=1, max_size=15)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload, num_blocks=st.integers(16, 80), max_num_seqs=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_groups_under_random_workloads_never_starve(reqs: list[tuple[int, int, int, int]], num_blocks: int,
                                                    max_num_seqs: int, seed: int) -> None:
    rng = random.Random(seed)
    s = make(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=max(max_num_seqs, 24), max_model_len=64)
    pending = list(reqs)
    live: list[Sequence] = []
    shares: dict[str, int] = {}
    fair_shares = s._fair_shares

    def spy() -> dict[str, int]:  # the shares a schedule() uses
        shares.update(fair_shares())
        return shares

    s._fair_shares = spy  # type: ignore[method-assign]
    for _ in range(3000):
        if pending and rng.random() < 0.4:
            n, plen, max_tokens, priority = pending.pop(0)
            name = f"g{len(pending)}"
            for i in range(n):
                q = Sequence(f"{name}-{i}", [rng.randrange(50) for _ in range(plen)],
                             SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority, group=name)
                try:
                    s.add(q)
                    live.append(q)
                except InvalidRequest:
                    pass
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            if not victim.is_finished:
                s.finish(victim)
        check(s)
        before = list(s.waiting)
        shares.clear()
        batch = s.schedule()
        for a in (q for q in before if q.status is SequenceStatus.RUNNING):
            # Overtaken only by a group already holding its fair share of the batch (the shares it used).
            for w in s.waiting:
                if w.sort_key < a.sort_key:
                    assert w.group is not None and s._group_running[w.group] >= shares[w.group], (a, w)
        check(s)
        s.postprocess(batch, [SampledToken(q, rng.randrange(3, 50)) for q in batch.sampled])
        check(s)
        if not pending and not s.has_work():
            break
    assert not s.has_work(), "work left after the loop: a sequence starved"
    assert not s._last_tag and not +s._group_waiting and not +s._group_running, "a finished group is remembered"
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks
