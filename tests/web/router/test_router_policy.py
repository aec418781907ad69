"""The cost function, the three policies' choices, the Router core's bookkeeping and the health states."""

from __future__ import annotations

import pytest

from trillm.engine.kv_events import KVCacheSpec, KVEvent, StepLoad, StepReport
from trillm.web.router.core import Hello, Router, WorkerKey
from trillm.web.router.health import Health, HealthState
from trillm.web.router.policy import Candidate, CostWeights, Load, Policy, kv_cost

BS = 4
SPEC = KVCacheSpec("mock:m:100", BS, "00" * 16, True)
URLS = ["http://a", "http://b", "http://c"]


def cand(requests: int = 0, blocks: int = 0, prompt: int = 10, cached: int = 0) -> Candidate:
    return Candidate(Load(requests, blocks), prompt, cached)


def test_cost_is_weighted_prefill_plus_load() -> None:
    w = CostWeights(prefill_weight=4.0, block_weight=1.0, request_weight=2.0)
    assert kv_cost(cand(requests=3, blocks=20, prompt=10, cached=6), w) == 4 * 4 + 20 + 2 * 3
    with pytest.raises(ValueError):
        CostWeights(prefill_weight=-1)


def test_kv_policy_trades_cached_prefix_against_load() -> None:
    p = Policy("kv", CostWeights(prefill_weight=4.0))
    # Equal load: the longer cached prefix wins.
    assert p.choose([cand(cached=2), cand(cached=8), cand(cached=5)]) == 1
    # 6 more cached blocks save 24; 30 more blocks in use cost more than that.
    assert p.choose([cand(cached=8, blocks=30), cand(cached=2, blocks=0)]) == 1
    assert p.choose([cand(cached=8, blocks=20), cand(cached=2, blocks=0)]) == 0


def test_ties_rotate_and_round_robin_ignores_everything() -> None:
    kv = Policy("kv")
    assert [kv.choose([cand(), cand(), cand()]) for _ in range(4)] == [0, 1, 2, 0]
    rr = Policy("round-robin")
    assert [rr.choose([cand(cached=9), cand(blocks=99), cand()]) for _ in range(4)] == [0, 1, 2, 0]
    ll = Policy("least-loaded")
    assert ll.choose([cand(requests=2), cand(requests=1, blocks=50), cand(requests=1, blocks=10)]) == 2
    with pytest.raises(ValueError):
        Policy("random")


def ready_router(policy: str = "kv", urls: list[str] = URLS, weights: CostWeights = CostWeights()) -> Router:
    router = Router(urls, Policy(policy, weights))
    for url in urls:
        assert router.on_health(url, True, 0.0)
        router.set_models(url, ["m"])
        router.on_hello(WorkerKey(url, "m"), Hello(1, SPEC))
    return router


def store(router: Router, url: str, hashes: list[str], first_id: int = 1, load: StepLoad | None = None) -> None:
    events = tuple(KVEvent(first_id + i, "stored", h) for i, h in enumerate(hashes))
    load = load or StepLoad(1, 0.0, 0, 0, 0, 100, 0.01)
    assert router.on_steps(WorkerKey(url, "m"), 1, [StepReport(load, events)])


def test_router_sends_a_prompt_where_its_prefix_is_cached() -> None:
    router = ready_router()
    prompt = list(range(10, 42))  # 32 tokens: 8 blocks, 7 of them matchable
    hashes = SPEC.matchable_hashes(prompt)
    assert len(hashes) == 7
    store(router, URLS[1], hashes[:5])
    store(router, URLS[2], hashes[:2])
    a = router.choose(None, prompt)
    assert a is not None and a.worker == WorkerKey(URLS[1], "m")
    assert (a.prompt_blocks, a.cached_blocks, a.prompt_tokens) == (8, 5, 32)
    stats = router.statistics()
    assert (stats.num_routed, stats.prompt_blocks, stats.predicted_cached_blocks) == (1, 8, 5)


def test_in_flight_prompts_count_as_cached_soon_and_as_load() -> None:
    router = ready_router(weights=CostWeights(prefill_weight=4.0))
    system = list(range(3, 3 + 40))  # a shared 10-block prefix
    a = router.choose(None, system + [50, 51, 52, 53, 54])
    assert a is not None
    w = router.worker(a.worker)
    assert w is not None and w.load == Load(1, 12, 12)  # 11 hashed blocks + the tail, all to prefill
    router.on_first_token(a)
    # A second request sharing the prefix follows the first (its blocks are there, or being stored) ...
    b = router.choose(None, system + [60, 61, 62, 63, 64])
    assert b is not None and b.worker == a.worker and b.cached_blocks == 10
    assert w.load == Load(2, 14, 2)  # the shared blocks are counted once
    # ... and an unrelated one goes elsewhere.
    c = router.choose(None, list(range(70, 90)))
    assert c is not None and c.worker != a.worker
    router.release(a)
    router.release(a)  # idempotent
    router.release(b)
    assert w.load == Load(0, 0, 0)


def test_reported_load_counts_when_it_is_larger_than_our_own() -> None:
    router = ready_router(weights=CostWeights(prefill_weight=4.0))
    store(router, URLS[0], [], load=StepLoad(3, 0.0, 5, 7, 300, 400, 0.01))  # busy with someone else's traffic
    w = router.worker(WorkerKey(URLS[0], "m"))
    assert w is not None and w.load == Load(12, 300)
    picks = {router.choose(None, list(range(3, 30 + i))).worker.replica for i in range(2)}  # type: ignore[union-attr]
    assert URLS[0] not in picks


def test_unhealthy_replicas_and_tried_ones_are_skipped() -> None:
    router = ready_router("round-robin")
    router.on_health(URLS[1], False, 1.0, "refused")
    assert {router.choose(None).worker.replica for _ in range(4)} == {URLS[0], URLS[2]}  # type: ignore[union-attr]
    a = router.choose(None, exclude=[URLS[0]])
    assert a is not None and a.worker.replica == URLS[2]
    assert router.choose(None, exclude=[URLS[0], URLS[2]]) is None
    assert router.statistics().num_unroutable == 1
    router.on_health(URLS[1], True, 2.0)
    assert router.in_pool(URLS[1])


def test_models_pick_their_workers_and_an_unknown_model_still_reaches_a_replica() -> None:
    router = Router(URLS[:2], Policy("round-robin"))
    for url in URLS[:2]:
        router.on_health(url, True, 0.0)
    router.set_models(URLS[0], ["small", "big"])
    router.set_models(URLS[1], ["big"])
    assert {router.choose("small").worker for _ in range(3)} == {WorkerKey(URLS[0], "small")}  # type: ignore[union-attr]
    assert {router.choose("big").worker.replica for _ in range(2)} == set(URLS[:2])  # type: ignore[union-attr]
    defaults = {router.choose(None).worker for _ in range(2)}  # type: ignore[union-attr]
    assert defaults == {WorkerKey(URLS[0], "small"), WorkerKey(URLS[1], "big")}
    # A model nobody serves goes to a default worker, so that the replica answers with its own 404.
    assert router.choose("nope") is not None
    # A replica whose models changed drops its old workers; what was in flight there releases harmlessly.
    a = router.choose("small")
    assert a is not None
    added, removed = router.set_models(URLS[0], ["big"])
    assert (added, removed) == ([], [WorkerKey(URLS[0], "small")])
    router.release(a)


def test_a_broken_stream_clears_the_index() -> None:
    router = ready_router()
    key = WorkerKey(URLS[0], "m")
    store(router, URLS[0], ["a", "b"])
    load = StepLoad(2, 0.0, 1, 0, 2, 100, 0.01)
    assert not router.on_steps(key, 1, [StepReport(load, (KVEvent(5, "stored", "c"),))])  # gap: 3, 4 lost
    w = router.worker(key)
    assert w is not None and len(w.index) == 0 and w.reported == load  # the load is still news
    router.on_hello(key, Hello(2, SPEC))
    assert w.index.synced and w.index.epoch == 2


def test_a_worker_not_yet_synced_is_priced_uncached_at_the_others_block_size() -> None:
    router = Router(URLS[:2], Policy("kv"))
    for url in URLS[:2]:
        router.on_health(url, True, 0.0)
        router.set_models(url, ["m"])
    router.on_hello(WorkerKey(URLS[0], "m"), Hello(1, SPEC))
    prompt = list(range(3, 3 + 4 * BS))
    store(router, URLS[0], SPEC.matchable_hashes(prompt))
    a = router.choose(None, prompt)
    assert a is not None and a.worker.replica == URLS[0] and a.cached_blocks == 3


def test_health_leaves_at_once_and_rejoins_after_good_checks() -> None:
    h = HealthState(rejoin_after=2)
    assert h.state is Health.UNKNOWN and not h.in_pool
    assert not h.on_success(0.0) and h.on_success(1.0) and h.in_pool
    assert h.on_failure(2.0, "connection refused") and not h.in_pool
    assert not h.on_failure(3.0, "still down")
    assert h.statistics().reason == "still down"
    assert not h.on_success(4.0) and not h.in_pool
    assert h.on_success(5.0) and h.in_pool
    st = h.statistics()
    assert (st.num_failures, st.num_transitions) == (2, 3)


def test_a_computed_prompt_stays_cached_soon_until_its_events_have_surely_come() -> None:
    router = ready_router(weights=CostWeights(prefill_weight=4.0))
    prompt = list(range(3, 3 + 12 * BS))
    a = router.choose(None, prompt)
    assert a is not None
    router.release(a, computed=True)  # answered, but its "stored" events are still on their way
    b = router.choose(None, prompt + [1, 2])
    assert b is not None and b.worker == a.worker and b.cached_blocks == 11
    router.release(b)  # moved elsewhere or failed: nothing to remember
    key = a.worker
    empty = StepReport(StepLoad(1, 0.0, 0, 0, 0, 100, 0.01), ())
    for _ in range(2):  # two event batches without those blocks: they were not stored after all
        assert router.on_steps(key, 1, [empty])
    w = router.worker(key)
    assert w is not None and w.cached(SPEC.matchable_hashes(prompt)) == 0


def test_queued_prefill_spreads_a_burst_of_one_shared_prefix() -> None:
    router = ready_router(weights=CostWeights(prefill_weight=4.0))
    system = list(range(3, 3 + 10 * BS))
    first = router.choose(None, system + [90, 91])
    assert first is not None
    w = router.worker(first.worker)
    assert w is not None and w.load.prefill_blocks == 11
    # While the first is still computing the prefix, waiting behind it costs more than computing it anew.
    second = router.choose(None, system + [92, 93])
    assert second is not None and second.worker != first.worker
    router.on_first_token(first)
    router.on_first_token(first)  # idempotent
    assert w.load.prefill_blocks == 0
    third = router.choose(None, system + [94, 95])  # now the prefix is there (or being computed elsewhere)
    assert third is not None and third.worker in (first.worker, second.worker) and third.cached_blocks == 10


def test_a_batch_without_events_from_a_new_epoch_still_breaks_the_stream() -> None:
    router = ready_router()
    key = WorkerKey(URLS[0], "m")
    store(router, URLS[0], ["a"])
    assert not router.on_steps(key, 2, [])  # the replica rebuilt its engine: what we knew is gone
    w = router.worker(key)
    assert w is not None and len(w.index) == 0 and not w.index.synced
