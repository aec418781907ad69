"""The router hashes a salted prompt under its cache_salt, as the replicas' prefix cache does: its prediction
equals the cached tokens a real engine (the mock's scheduler and block manager) reports, salt by salt, and a
salted request neither hits nor is steered by another salt's blocks."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from trillm.engine.block_manager import root_hash
from trillm.engine.config import EngineConfig
from trillm.engine.kv_events import KVCacheSpec, KVEvent, KVEventLog
from trillm.engine.mock import LinearCostModel, MockModelSpec, make_mock_engine
from trillm.engine.sampling_params import SamplingParams
from trillm.web.router.core import Hello, Router, Worker, WorkerKey
from trillm.web.router.policy import Policy

SPEC = MockModelSpec(name="tiny", vocab_size=64, max_model_len=512)
SALTS = st.sampled_from([None, "A", "B"])
# Shared prefixes make cross-salt hits possible if the salts were ignored.
PREFIXES = [[5] * 12, [7, 8, 9] * 4]
prompts = st.lists(st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(3, 63), max_size=6), SALTS),
                   min_size=1, max_size=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts)
def test_the_routers_prediction_for_a_salted_prompt_is_the_engines_hit(batch: list[Any]) -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    engine = make_mock_engine(config, spec=SPEC, perf=LinearCostModel())
    log = KVEventLog(engine.block_manager)
    spec = KVCacheSpec.of(engine.block_manager, engine.loaded.model_id)
    worker = Worker(WorkerKey("http://replica", "m"))  # nothing in flight: its index alone predicts
    index = worker.index
    index.start(epoch=1)
    for prefix, tail, salt in batch:
        prompt = prefix + tail
        predicted = worker.cached(spec.matchable_hashes(prompt, salt)) * config.block_size
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt))
        assert out.usage.cached_tokens == predicted, (prompt, salt)
        assert index.apply(1, log.take())
    assert index.blocks == {h.hex() for h in engine.block_manager.cached_block_hashes}


def test_salted_hashes_differ_per_salt_and_from_the_unsalted() -> None:
    spec = KVCacheSpec("m", 4, root_hash("m").hex(), True)
    ids = list(range(3, 20))
    chains = [spec.matchable_hashes(ids, salt) for salt in (None, "A", "B")]
    assert all(len(c) == 4 for c in chains)
    assert not set(chains[0]) & set(chains[1]) and not set(chains[1]) & set(chains[2])
    assert spec.matchable_hashes(ids, "A") == chains[1]  # deterministic: a salt's own requests still hit


def _router(spec: KVCacheSpec) -> tuple[Router, WorkerKey, WorkerKey]:
    router = Router(["http://r1", "http://r2"], Policy("kv"))
    keys = []
    for url in ("http://r1", "http://r2"):
        (key,), _ = router.set_models(url, ["m"])
        router.on_health(url, True, 0.0)
        router.on_hello(key, Hello(1, spec))
        keys.append(key)
    return router, keys[0], keys[1]


def _store(router: Router, key: WorkerKey, hashes: list[str]) -> None:
    worker = router.worker(key)
    assert worker is not None
    assert worker.index.apply(1, [KVEvent(i + 1, "stored", h, None) for i, h in enumerate(hashes)])


def test_a_salted_request_follows_its_salts_blocks_and_only_those() -> None:
    spec = KVCacheSpec("m", 4, root_hash("m").hex(), True)
    ids = list(range(3, 40))
    router, r1, r2 = _router(spec)
    _store(router, r1, spec.matchable_hashes(ids, "A"))  # salt A's conversation lives on r1
    _store(router, r2, spec.matchable_hashes(ids))  # the same prompt, unsalted, on r2
    blocks = (len(ids) - 1) // spec.block_size

    a = router.choose("m", ids, cache_salt="A")
    assert a is not None and (a.worker, a.cached_blocks) == (r1, blocks)
    router.release(a)
    plain = router.choose("m", ids)
    assert plain is not None and (plain.worker, plain.cached_blocks) == (r2, blocks)
    router.release(plain)
    # Salt B has nothing anywhere: no hit is predicted on either replica, and both candidates cost the same
    # (neither A's nor the unsalted blocks pull it), so the choice is the policy's tie-break in turn.
    for _ in range(2):
        b = router.choose("m", ids, cache_salt="B")
        assert b is not None and b.cached_blocks == 0 and not set(b.hashes) & (
            set(spec.matchable_hashes(ids)) | set(spec.matchable_hashes(ids, "A")))
        router.release(b)
    # An unsalted request is not pulled to A's replica either, and A's in-flight blocks do not count for it.
    a2 = router.choose("m", ids, cache_salt="A")
    assert a2 is not None and a2.worker == r1
    other = router.choose("m", ids)
    assert other is not None and other.worker == r2 and other.cached_blocks == blocks
