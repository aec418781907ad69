"""Scheduler + BlockManager under random workloads (no model): invariants hold after every step."""

from __future__ import annotations

import random

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


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
         max_waiting: int = 1000, max_model_len: int = 256, prefix: bool = True) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_waiting=max_waiting)
    bm = BlockManager(num_blocks, block_size, model_id="t", enable_prefix_caching=prefix)
    return Scheduler(cfg, bm, RequestLimits(max_model_len, block_size, bm.num_usable_blocks, 1000, max_waiting))


def finish_step(s: Scheduler, batch: ScheduledBatch, token: int = 0) -> list[Sequence]:
    """Give every sampled sequence of `batch` the token `token`; returns the ones that finished."""
    kept = s.postprocess(batch, [SampledToken(q, token) for q in batch.sampled])
    return [t.seq for t, finish in kept if finish is not None]


def check(s: Scheduler) -> None:
    ids_w = [id(q) for q in s.waiting]
    ids_r = [id(q) for q in s.running]
    assert len(set(ids_w)) == len(ids_w) and len(set(ids_r)) == len(ids_r)
    assert not set(ids_w) & set(ids_r), "queues overlap"
    assert all(q.status is SequenceStatus.WAITING and not q.block_table for q in s.waiting)
    assert all(q.status is SequenceStatus.RUNNING for q in s.running)
    assert [q.sort_key for q in s.waiting] == sorted(q.sort_key for q in s.waiting)
    assert len(s.running) <= s.config.max_num_seqs
    s.block_manager.check_invariants(s.running)


def run_step(s: Scheduler, rng: random.Random, vocab: int) -> list[Sequence]:
    """One step: schedule, 'sample' random tokens, finish by max_tokens. Returns finished sequences."""
    waiting_before = list(s.waiting)
    batch = s.schedule()
    assert batch.num_tokens <= s.config.max_num_batched_tokens
    admitted = [q for q in waiting_before if q.status is SequenceStatus.RUNNING]
    for a in admitted:  # the head of the queue is never overtaken
        assert all(a.sort_key < w.sort_key for w in s.waiting), "a later request overtook the FIFO head"
    check(s)
    finished = finish_step(s, batch, rng.randrange(3, vocab))
    assert all(q.num_output_tokens == q.params.max_tokens and q.is_finished for q in finished)
    check(s)
    return finished


workload = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.integers(0, 3)),
    min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload, num_blocks=st.integers(12, 48), budget=st.integers(8, 48), seed=st.integers(0, 2**16),
       prefix=st.booleans())
def test_random_workload_invariants(reqs: list[tuple[int, int, int, int]], num_blocks: int, budget: int,
                                    seed: int, prefix: bool) -> None:
    import trillm.engine.scheduler as sched

    saved, sched._MIN_SHARED_PREFIX = sched._MIN_SHARED_PREFIX, 4  # exercise waiting for in-flight prefixes
    try:
        _random_workload(reqs, num_blocks, budget, seed, prefix)
    finally:
        sched._MIN_SHARED_PREFIX = saved


def _random_workload(reqs: list[tuple[int, int, int, int]], num_blocks: int, budget: int, seed: int,
                     prefix: bool) -> None:
    rng = random.Random(seed)
    s = make(num_blocks=num_blocks, budget=budget, prefix=prefix)
    shared = [rng.randrange(50) for _ in range(16)]  # a common prefix, so blocks get shared
    live: list[Sequence] = []
    pending = list(reqs)
    done = 0
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            plen, max_tokens, priority, share = pending.pop(0)
            prompt = (shared[: share * 4] + [rng.randrange(50) for _ in range(plen)])[:60]
            seq = Sequence(f"r{len(live)}", prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
            try:
                s.add(seq)
                live.append(seq)
            except InvalidRequest:
                pass
        if live and rng.random() < 0.05:  # abort something
            victim = rng.choice([q for q in live if not q.is_finished] or live)
            if not victim.is_finished:
                s.finish(victim)
                check(s)
        done += len(run_step(s, rng, 50))
        if not pending and not s.has_work():
            break
    assert not s.has_work(), "work left after the loop: a sequence starved"
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks, "blocks leaked after drain"
    s.block_manager.check_invariants([])


def test_decode_first_and_chunked_prefill() -> None:
    s = make(num_blocks=200, budget=16, block_size=4)
    a = Sequence("a", list(range(10)), SamplingParams(max_tokens=50))
    s.add(a)
    b1 = s.schedule()
    assert [c.num_tokens for c in b1.prefills] == [10]
    finish_step(s, b1, 1)
    long = Sequence("long", list(range(100, 150)), SamplingParams(max_tokens=5))
    s.add(long)
    b2 = s.schedule()
    assert b2.decodes == [a]  # the running decode goes first...
    assert [(c.seq.request_id, c.num_tokens) for c in b2.prefills] == [("long", 15)]  # ...the chunk fills the rest
    finish_step(s, b2, 2)
    b3 = s.schedule()
    assert b3.decodes == [a] and b3.prefills[0].start == 15  # a long prompt never stalls decodes


def test_preempts_newest_first_and_requeues_ahead() -> None:
    s = make(num_blocks=7, block_size=4, budget=64)  # 6 usable blocks
    old = Sequence("old", list(range(8)), SamplingParams(max_tokens=16))
    new = Sequence("new", list(range(20, 28)), SamplingParams(max_tokens=16))
    later = Sequence("later", [1, 2, 3], SamplingParams(max_tokens=2))
    for q in (old, new):
        s.add(q)
    finish_step(s, s.schedule())
    s.add(later)
    preempted = []
    for step in range(12):
        batch = s.schedule()
        preempted += batch.preempted
        finish_step(s, batch)
        if preempted:
            break
    assert preempted and preempted[0] is new
    assert s.waiting[0] is new, "a preempted sequence rejoins ahead of later arrivals"
    assert new.num_computed_tokens == 0 and not new.block_table


def test_prefix_cache_hit_and_full_prompt_recompute() -> None:
    s = make(num_blocks=64, block_size=4, budget=64)
    a = Sequence("a", list(range(12)), SamplingParams(max_tokens=1))
    s.add(a)
    assert finish_step(s, s.schedule(), 7) == [a]  # finished: its three full blocks stay cached
    assert s.block_manager.num_cached_free_blocks == 3
    b = Sequence("b", list(range(12)), SamplingParams(max_tokens=1))  # a full-prompt hit
    s.add(b)
    batch = s.schedule()
    # The last block is recomputed so the first logits are right.
    assert b.num_cached_tokens == 8 and batch.prefills[0].start == 8 and batch.prefills[0].num_tokens == 4
    assert finish_step(s, batch) == [b]
    c = Sequence("c", list(range(13)), SamplingParams(max_tokens=1))
    s.add(c)
    batch = s.schedule()
    assert c.num_cached_tokens == 12 and [ch.num_tokens for ch in batch.prefills] == [1]


def test_block_hashes_are_stable_and_model_seeded() -> None:
    from trillm.engine.block_manager import hash_block, root_hash

    import subprocess
    import sys

    h = hash_block(root_hash("m"), [1, 2, 3, 4])
    code = ("from trillm.engine.block_manager import hash_block, root_hash;"
            "print(hash_block(root_hash('m'), [1, 2, 3, 4]).hex())")
    for seed in ("1", "2"):  # another process, another str-hash seed: the same bytes
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        assert out == h.hex()
    assert h != hash_block(root_hash("other"), [1, 2, 3, 4])


def test_rejections() -> None:
    s = make(num_blocks=8, block_size=4, max_waiting=1, max_model_len=64)
    with pytest.raises(InvalidRequest, match="context length"):
        s.add(Sequence("x", list(range(64)), SamplingParams(max_tokens=1)))
    with pytest.raises(InvalidRequest, match="KV blocks"):  # fits the context, never the pool
        s.add(Sequence("y", list(range(30)), SamplingParams(max_tokens=20)))
    s.add(Sequence("ok", [1, 2], SamplingParams(max_tokens=1)))
    with pytest.raises(Overloaded):
        s.add(Sequence("full", [1, 2], SamplingParams(max_tokens=1)))
