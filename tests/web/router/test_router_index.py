"""The router's KV index follows a replica's KV events exactly (stores, evictions, gaps, restarts), and
predicts the prefix hits the replica then reports."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from trillm.engine.config import EngineConfig
from trillm.engine.kv_events import KVCacheSpec, KVEvent, KVEventLog
from trillm.engine.mock import LinearCostModel, MockModelSpec, make_mock_engine
from trillm.engine.sampling_params import SamplingParams
from trillm.web.router.core import Worker, WorkerKey
from trillm.web.router.index import KVIndex

SPEC = MockModelSpec(name="tiny", vocab_size=64, max_model_len=512)


def stored(i: int, h: str, parent: str | None = None) -> KVEvent:
    return KVEvent(i, "stored", h, parent)


def removed(i: int, h: str) -> KVEvent:
    return KVEvent(i, "removed", h)


def test_stored_and_removed_blocks() -> None:
    worker = Worker(WorkerKey("http://replica", "m"))  # what the router predicts from a worker's index
    index = worker.index
    index.start(epoch=1)
    assert index.apply(1, [stored(7, "a"), stored(8, "b", "a"), stored(9, "c", "b")])
    assert index.blocks == {"a", "b", "c"}
    assert index.apply(1, [removed(10, "b"), stored(11, "d")])
    assert index.blocks == {"a", "c", "d"}
    assert worker.cached(["a", "b", "c"]) == 1  # the walk stops at the first miss, as the replica's match does
    assert worker.cached(["a"]) == 1 and worker.cached(["x", "a"]) == 0
    assert index.apply(1, [removed(12, "never-seen")])  # cached before the stream began: not an error
    st_ = index.statistics()
    assert (st_.synced, st_.num_blocks, st_.last_event_id, st_.num_unknown_removals, st_.num_resyncs) == (
        True, 3, 12, 1, 0)


def test_a_gap_in_event_ids_clears_the_index_until_the_next_hello() -> None:
    index = KVIndex()
    index.start(epoch=1)
    assert index.apply(1, [stored(1, "a"), stored(2, "b")])
    assert not index.apply(1, [stored(4, "d")])  # event 3 was lost
    assert not index.synced and len(index) == 0 and index.statistics().num_resyncs == 1
    assert not index.apply(1, [stored(5, "e")])  # ignored while out of sync
    assert len(index) == 0
    index.start(epoch=1)  # resubscribed: a new stream starts from whatever id comes next
    assert index.apply(1, [stored(40, "x")]) and index.blocks == {"x"}


def test_a_new_epoch_or_ids_that_restart_mean_a_new_engine() -> None:
    index = KVIndex()
    index.start(epoch=1)
    assert index.apply(1, [stored(1, "a"), stored(2, "b")])
    assert not index.apply(2, [stored(1, "z")])  # the engine was rebuilt: its cache is empty
    assert len(index) == 0 and not index.synced
    index.start(epoch=2)
    assert index.apply(2, [stored(1, "z")])
    assert not index.apply(2, [stored(1, "y")])  # ids went back without a new epoch: also a restart
    assert len(index) == 0 and index.statistics().num_resyncs == 2


def test_an_unknown_event_kind_breaks_the_stream() -> None:
    index = KVIndex()
    index.start(epoch=0)
    assert not index.apply(0, [KVEvent(1, "cleared", "")])
    assert not index.synced


prompts = st.lists(st.lists(st.sampled_from([3, 4, 5]), min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([2, 4]), st.integers(6, 40), st.integers(1, 4), prompts, st.data())
def test_index_mirrors_the_prefix_cache_and_predicts_its_hits(bs: int, blocks: int, seqs: int,
                                                             batch: list[list[int]], data: Any) -> None:
    """Drive a real engine (the mock's scheduler and block manager); after every step the index built from
    its KV events alone equals the engine's prefix cache, and the router's prediction for a prompt alone
    equals the cached tokens the engine reports for it."""
    config = EngineConfig(block_size=bs, num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=seqs + 8)
    engine = make_mock_engine(config, spec=SPEC, perf=LinearCostModel())
    log = KVEventLog(engine.block_manager)
    spec = KVCacheSpec.of(engine.block_manager, engine.loaded.model_id)
    worker = Worker(WorkerKey("http://replica", "m"))  # nothing in flight: its index alone predicts
    index = worker.index
    index.start(epoch=1)
    n = 0
    for prompt in batch:
        limit = engine.limits
        if limit.blocks_needed(len(prompt) + 4) > limit.num_usable_blocks:
            continue
        if data.draw(st.booleans()):  # alone: compare the prediction with what the engine then reports
            while engine.has_unfinished_requests():
                engine.step()
                assert index.apply(1, log.take())
            predicted = worker.cached(spec.matchable_hashes(prompt)) * bs
            (out,) = engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
            assert out.usage.cached_tokens == predicted
            assert index.apply(1, log.take())
        else:
            engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=data.draw(st.integers(1, 4)),
                                                                 ignore_eos=True))
            n += 1
            engine.step()
            assert index.apply(1, log.take())
        assert index.blocks == {h.hex() for h in engine.block_manager.cached_block_hashes}
    while engine.has_unfinished_requests():
        engine.step()
        assert index.apply(1, log.take())
    assert index.blocks == {h.hex() for h in engine.block_manager.cached_block_hashes}
    assert index.statistics().num_unknown_removals == 0
