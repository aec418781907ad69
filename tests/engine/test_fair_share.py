"""Fair shares of the running batch: a request alone may use every row, but beside others the rows are shared
max-min fairly between requests (groups), none taking more than an equal split even while rows are free, a
request under its share takes a row from the one furthest over it by preemption (recompute), and the large
request keeps progressing."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.engine.admission import RequestLimits
from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.mock import make_mock_engine
from trillm.engine.outputs import RequestOutput
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduler import SampledToken, Scheduler
from trillm.engine.sequence import Sequence, SequenceStatus

MAX_PROMPT = 20


def make(max_num_seqs: int) -> Scheduler:
    # Blocks and a token budget for everyone (every decode plus every prompt at once): only rows are scarce.
    budget = max_num_seqs * (MAX_PROMPT + 1)
    cfg = EngineConfig(block_size=4, num_kv_blocks=4000, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                       max_waiting=10_000)
    bm = BlockManager(4000, 4, model_id="t", enable_prefix_caching=True)
    return Scheduler(cfg, bm, RequestLimits(512, 4, bm.num_usable_blocks, 1000, 10_000))


def equal_split(groups: int, rows: int) -> int:
    """The most rows one of `groups` live requests may hold: every row alone, else ceil(rows / groups)."""
    return rows if groups < 2 else -(-rows // groups)


def max_min_fair(demand: dict[str, int], rows: int) -> dict[str, int]:
    """The reference allocation, by its definition: one row at a time to a group that has the fewest and
    wants more (the order among equals is arbitrary, so only the multiset of allocations is compared)."""
    alloc = dict.fromkeys(demand, 0)
    for _ in range(rows):
        wanting = [g for g in alloc if alloc[g] < demand[g]]
        if not wanting:
            break
        alloc[min(wanting, key=alloc.__getitem__)] += 1
    return alloc


requests = st.lists(st.tuples(st.integers(0, 30),  # arrival step
                              st.integers(1, 40),  # generations (prompts x n)
                              st.integers(1, MAX_PROMPT),  # prompt tokens
                              st.integers(1, 30)),  # max_tokens
                    min_size=1, max_size=8)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, max_num_seqs=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_rows_are_shared_max_min_fairly_and_nothing_starves(reqs: list[tuple[int, int, int, int]],
                                                            max_num_seqs: int, seed: int) -> None:
    rng = random.Random(seed)
    s = make(max_num_seqs)
    arrivals = sorted(reqs)
    bound = sum(n * (t + 2) for _, n, _, t in reqs) + 40  # every generation alone, one after another
    for step in range(bound):
        while arrivals and arrivals[0][0] <= step:
            _, n, plen, max_tokens = arrivals.pop(0)
            name = f"g{len(arrivals)}"
            prompt = [rng.randrange(3, 900) for _ in range(plen)]
            for i in range(n):
                s.add(Sequence(f"{name}-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               group=name))
        if not s.has_work():
            if not arrivals:
                break
            continue
        demand = Counter(q.group for q in s.waiting + s.running)
        before = Counter(q.group for q in s.running)
        split = equal_split(len(demand), max_num_seqs)
        wanted = {g: min(d, split) for g, d in demand.items()}  # what each may hold: up to the equal split
        batch = s.schedule()
        held = Counter(q.group for q in s.running)
        waiting = {q.group for q in s.waiting}
        # No request grows past the equal split (one may be left over it from before the others arrived) ...
        assert all(held[g] <= max(split, before[g]) for g in held), (held, before, split)
        # ... and up to it the batch is work-conserving: a sequence waits while a row is free only if its
        # request holds its split.
        assert len(s.running) == max_num_seqs or all(held[g] >= split for g in waiting), (held, split)
        # Max-min fair: while rows are scarce, everyone holds the reference allocation of what they may hold;
        # else everyone holds at least that.
        if sum(wanted.values()) > max_num_seqs:
            assert sorted(held[g] for g in demand) == sorted(max_min_fair(wanted, max_num_seqs).values())
        else:
            assert all(held[g] >= wanted[g] for g in demand), (held, wanted)
            assert len(demand) > 1 or len(s.running) == min(sum(demand.values()), max_num_seqs)  # alone: every row
        assert all(q.status is SequenceStatus.WAITING for q in batch.preempted)
        rows = [(q, q.num_tokens) for q in s.running]
        s.postprocess(batch, [SampledToken(q, rng.randrange(3, 900)) for q in batch.sampled])
        # Progress: every row gets a token every step (a new row's whole prompt fits the step), the large
        # request's rows included.
        assert all(q.num_tokens == n + 1 for q, n in rows)
    assert not arrivals and not s.has_work(), "a request starved"
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks


def test_a_request_alone_uses_every_row_and_gives_one_up_to_a_newcomer() -> None:
    s = make(8)
    fan_out = [Sequence(f"f{i}", [5, 6, i], SamplingParams(max_tokens=100, ignore_eos=True), group="f")
               for i in range(64)]
    for q in fan_out:
        s.add(q)
    batch = s.schedule()
    s.postprocess(batch, [SampledToken(q, 7) for q in batch.sampled])
    assert len(s.running) == 8  # no contention: the whole batch
    newest = s.running[-1]
    short = Sequence("short", [9, 9, 9], SamplingParams(max_tokens=2, ignore_eos=True), group="short")
    s.add(short)
    batch = s.schedule()
    assert short in [c.seq for c in batch.prefills] and batch.preempted == [newest]
    assert newest.status is SequenceStatus.WAITING and newest not in batch.decodes
    assert len(batch.decodes) == 7 and len(s.running) == 8
    s.postprocess(batch, [SampledToken(q, 7) for q in batch.sampled])
    assert short.num_output_tokens == 1
    # The victim waits at the head of the queue but is passed over until the newcomer is done.
    batch = s.schedule()
    s.postprocess(batch, [SampledToken(q, 7) for q in batch.sampled])
    assert short.is_finished and not batch.preempted and newest.status is SequenceStatus.WAITING
    batch = s.schedule()
    assert newest in [c.seq for c in batch.prefills]  # back in the freed row, recomputed from the prefix cache
    assert s.num_preemptions == 1


def test_beside_other_requests_a_fan_out_takes_free_rows_only_up_to_an_equal_split() -> None:
    """A step's time grows with its rows, so the rows a fan-out could fill beside a chat are not free: it holds
    ceil(rows / live requests), and every row again once it is alone."""
    s = make(8)

    def step() -> Counter[str | None]:
        """One step; the rows each request held in it."""
        batch = s.schedule()
        held = Counter(q.group for q in s.running)
        s.postprocess(batch, [SampledToken(q, 7) for q in batch.sampled])
        return held

    chat = Sequence("chat", [9, 9, 9], SamplingParams(max_tokens=8, ignore_eos=True), group="chat")
    s.add(chat)
    step()
    for i in range(64):
        s.add(Sequence(f"f{i}", [5, 6, i], SamplingParams(max_tokens=3, ignore_eos=True), group="f"))
    assert step() == {"chat": 1, "f": 4}  # 8 / 2 live requests: 3 rows left free
    third = Sequence("third", [8, 8], SamplingParams(max_tokens=20, ignore_eos=True), group="third")
    s.add(third)
    assert step() == {"chat": 1, "f": 4, "third": 1}  # a free row; the fan-out keeps the 4 it holds ...
    step()
    assert step() == {"chat": 1, "f": 3, "third": 1}  # ... and is refilled to 8 / 3 once they finish
    while not chat.is_finished:
        step()
    held = step()
    assert held == {"f": 4, "third": 1}, held  # 8 / 2 again
    while not third.is_finished:
        step()
    step()
    assert step() == {"f": 8} and not s.num_preemptions  # alone: every row


def test_a_fan_out_queued_at_its_share_does_not_stop_the_next_decode_step_from_launching_ahead() -> None:
    """Launch-ahead waits for nobody who could not be admitted anyway: the fan-out's queue beside a chat, at its
    equal split, leaves the decode steps pipelined; a newcomer who could take a row stops it."""
    s = make(8)
    s.add(Sequence("chat", [9, 9, 9], SamplingParams(max_tokens=50, ignore_eos=True), group="chat"))
    for i in range(16):
        s.add(Sequence(f"f{i}", [5, 6, i], SamplingParams(max_tokens=50, ignore_eos=True), group="f"))
    batch = s.schedule()
    s.postprocess(batch, [SampledToken(q, 7) for q in batch.sampled])
    assert len(s.running) == 5 and len(s.waiting) == 12  # 4 rows each: the fan-out's 12 more are passed over
    batch = s.schedule()
    assert len(batch.decodes) == 5 and not batch.prefills
    ahead = s.schedule_ahead(batch)
    assert ahead is not None and ahead.decodes == batch.decodes
    s.postprocess(batch, [SampledToken(q, 7) for q in batch.sampled])
    s.add(Sequence("new", [8, 8], SamplingParams(max_tokens=5, ignore_eos=True), group="new"))
    assert s.schedule_ahead(ahead) is None  # it gets a row in the next step, so that step is scheduled


def run_until(engine: LLMEngine, request_id: str, limit: int) -> tuple[int, list[RequestOutput]]:
    """Step until request_id has its first token; returns the steps taken and every output meanwhile."""
    outputs: list[RequestOutput] = []
    for steps in range(1, limit + 1):
        outputs += engine.step()
        if any(o.request_id == request_id and o.new_token_ids for o in outputs):
            return steps, outputs
    raise AssertionError(f"{request_id} got no token in {limit} steps")


def test_short_request_beside_a_fan_out_to_the_cap_gets_its_token_in_the_next_step() -> None:
    """The engine with the mock model, counting steps: a fan-out of 256 generations (the per-request cap) holds
    all 64 rows; a short request added mid-way has its first token from the next step, the fan-out's rows keep
    decoding, and every generation ends with exactly its tokens."""
    cfg = EngineConfig(num_kv_blocks=8192, max_num_seqs=64, max_num_batched_tokens=512, max_waiting=1024)
    engine = make_mock_engine(cfg)
    fan_params = SamplingParams(max_tokens=64, ignore_eos=True)
    for i in range(256):
        engine.add_request(f"fan-{i}", [5, 6, 7, i % 64, i // 64], fan_params, group="fan")
    tokens: Counter[str] = Counter()
    for _ in range(10):
        for o in engine.step():
            tokens[o.request_id] += len(o.new_token_ids)
    assert engine.statistics().num_running == 64  # alone: every row
    for k in range(5):  # short requests one after another, each while the fan-out holds its share
        decoding = {q.request_id for q in engine.scheduler.running}
        engine.add_request(f"short-{k}", [9, 9, k], SamplingParams(max_tokens=2, ignore_eos=True), group=f"s{k}")
        steps, outputs = run_until(engine, f"short-{k}", limit=50)
        assert steps == 1, steps  # first come first served: after a fan-out generation ends, ~60 steps
        for o in outputs:
            tokens[o.request_id] += len(o.new_token_ids)
        advanced = {o.request_id for o in outputs if o.new_token_ids}
        assert len(decoding - advanced) <= 1  # one fan-out row gave way, the other 63 decoded
        # Its fair share: every row but the short requests' (the previous one may have finished meanwhile).
        assert sum(q.group == "fan" for q in engine.scheduler.running) >= 62
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] += len(o.new_token_ids)
    assert all(tokens[f"fan-{i}"] == 64 for i in range(256)) and all(tokens[f"short-{k}"] == 2 for k in range(5))
    assert 1 <= engine.statistics().num_preemptions <= 5  # a row per newcomer at most: freed rows are reused


def test_fair_share_preemption_equals_uninterrupted_generation(tiny_model: LoadedModel) -> None:
    """On a real (tiny) model: greedy outputs of a fan-out whose rows are taken by newcomers mid-decode (a row
    preempted after its decode was scheduled, then recomputed) equal each prompt run alone."""
    tok = tiny_model.tokenizer
    texts = ["hello there", "the quick brown fox", "a b c d e", "once upon a time", "0123456789 " * 3, "paris"]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(block_size=8, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=128)
    alone = [LLMEngine(cfg, loaded=tiny_model).generate([p], params)[0].new_token_ids for p in prompts]
    eng = LLMEngine(cfg, loaded=tiny_model)
    for i, p in enumerate(prompts[:4]):
        eng.add_request(f"fan-{i}", p, params, group="fan")
    got: dict[str, list[int]] = {}
    for step in range(200):
        if step in (3, 9):  # newcomers while the fan-out holds every row
            i = 4 + (step == 9)
            eng.add_request(f"new-{i}", prompts[i], params, group=f"new-{i}")
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not eng.has_unfinished_requests():
            break
    assert eng.statistics().num_preemptions >= 2
    assert [tuple(got[f"fan-{i}"]) for i in range(4)] == alone[:4]
    assert tuple(got["new-4"]) == alone[4] and tuple(got["new-5"]) == alone[5]
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
