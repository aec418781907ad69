"""The real Scheduler and BlockManager driven through LLMEngine on the mock runner, by hypothesis.

Every step checks block conservation (BlockManager.check_invariants over the live sequences), the step's
limits, and the KV events against an index rebuilt from them alone; the drain checks liveness: every request
not aborted got exactly max_tokens tokens and one final output, and the engine ends idle with zero blocks.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest, Overloaded
from trillm.engine.kv_events import KVEventLog
from trillm.engine.mock import LinearCostModel, MockModelSpec, Recording, make_mock_engine
from trillm.engine.sampling_params import SamplingParams

SPEC = MockModelSpec(name="tiny", vocab_size=64, max_model_len=256)


class KVIndex:
    """An independent consumer of KV events: what a router would know about this replica's prefix cache."""

    def __init__(self) -> None:
        self.hashes: set[str] = set()
        self.last_id = 0

    def apply(self, events: Any) -> None:
        for e in events:
            assert e.event_id == self.last_id + 1, "event ids are gapless and increasing"
            self.last_id = e.event_id
            if e.kind == "stored":
                assert e.block_hash not in self.hashes, "a block is stored twice"
                self.hashes.add(e.block_hash)
            else:
                assert e.block_hash in self.hashes, "removal of an unknown block"
                self.hashes.remove(e.block_hash)


configs = st.builds(
    lambda bs, blocks, seqs, extra, chunked, caching: EngineConfig(
        block_size=bs, num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=seqs + extra,
        enable_chunked_prefill=chunked, enable_prefix_caching=caching, max_waiting=6,
    ),
    st.sampled_from([2, 4]), st.integers(4, 24), st.integers(1, 4), st.integers(0, 12), st.booleans(), st.booleans(),
)
add = st.tuples(st.just("add"), st.lists(st.sampled_from([3, 4, 5]), min_size=1, max_size=14), st.integers(1, 10))
ops = st.lists(
    st.one_of(
        add, add,
        st.tuples(st.just("abort"), st.integers(0, 100), st.just(0)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.lists(add, min_size=1, max_size=8), ops)
def test_scheduler_invariants_on_the_mock(config: EngineConfig, first: list[tuple[str, Any, int]],
                                          script: list[tuple[str, Any, int]]) -> None:
    engine = make_mock_engine(config, spec=SPEC, perf=LinearCostModel())
    events = KVEventLog(engine.block_manager)
    index = KVIndex()
    bm = engine.block_manager
    sch = engine.scheduler
    batches: list[Any] = []

    def spy(phase: str, _: float, batch: Any) -> None:
        if phase == "launch":
            batches.append((batch.num_tokens, len(sch.running)))

    engine.on_phase = spy
    want: dict[str, int] = {}  # live or finished, not aborted -> max_tokens
    got: dict[str, int] = {}
    finished: set[str] = set()
    n = 0

    def step() -> None:
        for out in engine.step():
            assert out.request_id not in finished, "output after the final one"
            got[out.request_id] = got.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        index.apply(events.take())
        bm.check_invariants(sch.running)
        assert len(batches) == (engine.last_step is not None), "the mock launches once per step that runs"
        for num_tokens, running in batches:
            assert num_tokens <= config.max_num_batched_tokens or not config.enable_chunked_prefill
            assert running <= config.max_num_seqs
        batches.clear()
        assert index.hashes == {h.hex() for h in bm.cached_block_hashes}

    for op, a, b in first + script:
        if op == "add":
            rid = f"r{n}"
            n += 1
            try:
                engine.add_request(rid, list(a), SamplingParams(max_tokens=b, ignore_eos=True))
            except (InvalidRequest, Overloaded):
                continue  # too big for this pool or context, or the waiting queue is full
            want[rid] = b
        elif op == "abort":
            live = sorted(s.request_id for s in sch.running + sch.waiting)
            if live:
                rid = live[a % len(live)]
                engine.abort(rid)
                del want[rid]
                bm.check_invariants(sch.running)
        else:
            step()
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        step()
    assert not engine.has_unfinished_requests()
    assert {rid: got.get(rid, 0) for rid in want} == want
    assert set(want) <= finished
    assert bm.num_used_blocks == 0
    assert engine.statistics().num_blocks_used == 0


def test_tokens_replay_a_recording_then_continue_from_the_prng() -> None:
    rec = Recording([([5, 6, 7], [10, 11, 12])])
    engine = make_mock_engine(EngineConfig(num_kv_blocks=32, max_num_seqs=2), spec=SPEC, recording=rec)
    replayed, other = engine.generate([[5, 6, 7], [5, 6, 8]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert replayed.new_token_ids[:3] == (10, 11, 12) and len(replayed.new_token_ids) == 5
    assert other.new_token_ids[:3] != (10, 11, 12)


def test_tokens_do_not_depend_on_batching() -> None:
    prompts = [[3 + i % 3] * (5 + i) for i in range(6)]
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    together = make_mock_engine(EngineConfig(num_kv_blocks=64, max_num_seqs=4), spec=SPEC).generate(prompts, params)
    alone = [make_mock_engine(EngineConfig(num_kv_blocks=64, max_num_seqs=1), spec=SPEC).generate([p], params)[0]
             for p in prompts]
    assert [o.new_token_ids for o in together] == [o.new_token_ids for o in alone]
    assert all(t not in (0, 2) for o in together for t in o.new_token_ids)  # never EOS: exactly max_tokens
