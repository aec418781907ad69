"""The KV pool follows the load: it grows in slabs, shrinks when idle, and stays within --memory-limit."""

from __future__ import annotations

import mlx.core as mx
import pytest

from trillm.engine.config import EngineConfig
from trillm.engine.errors import Overloaded
from trillm.engine.kv_cache import KVLayout, KVPool
from trillm.engine.kv_slabs import PoolCapacity, resize_pool
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel
from trillm.engine.memory import MemoryBudget, parse_memory_size, process_rss
from trillm.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def engine(model: LoadedModel, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(block_size=16, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=128,
                                  verify_model=False)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=model)  # type: ignore[arg-type]


def prompts(model: LoadedModel) -> list[list[int]]:
    texts = ["the quick brown fox jumps over the lazy dog " * 6, "once upon a time there was " * 8,
             "0123456789 " * 12, "hello world " * 10, "a b c d e f g " * 9]
    return [model.tokenizer.encode(t) for t in texts]


def test_growth_across_slabs_generates_what_one_big_pool_does(tiny_model: LoadedModel) -> None:
    big = engine(tiny_model, kv_slab_mb=1024)  # one slab holds all 256 blocks: allocated up front
    assert big.pool_capacity is not None and big.pool_capacity.capacity == 256
    small = engine(tiny_model, kv_slab_mb=0.25)  # 16 blocks of the tiny model per slab
    cap = small.pool_capacity
    assert cap is not None and cap.capacity == cap.slab_blocks == 16
    want = [o.new_token_ids for o in big.generate(prompts(tiny_model), GREEDY)]
    got = [o.new_token_ids for o in small.generate(prompts(tiny_model), GREEDY)]
    assert got == want
    assert cap.num_grows >= 2 and cap.capacity > 32, cap.capacity
    pool = small.runner.pool  # type: ignore[attr-defined]
    assert all(a.shape[0] == cap.capacity for a in pool.keys + pool.values)
    small.block_manager.check_invariants([])


def test_idle_shrink_keeps_recent_prefixes_under_new_ids(tiny_model: LoadedModel) -> None:
    eng = engine(tiny_model, kv_slab_mb=0.25, kv_idle_keep_mb=0.25, kv_idle_release_s=0)
    ps = prompts(tiny_model)
    eng.generate(ps[:4], GREEDY)
    first = eng.generate([ps[4]], GREEDY)[0]  # the most recently used prefix
    cap = eng.pool_capacity
    assert cap is not None
    grown = eng.statistics().kv_pool_bytes
    assert eng.idle_release_in == 0.0
    released = eng.release_idle_memory()
    assert released > 0 and eng.statistics().kv_pool_bytes == grown - released
    assert cap.capacity == cap.slab_blocks and eng.idle_release_in is None
    pool = eng.runner.pool  # type: ignore[attr-defined]
    assert all(a.shape[0] == cap.capacity for a in pool.keys + pool.values)
    eng.block_manager.check_invariants([])
    # The kept blocks were moved and renamed: a hit on them must give the same tokens.
    again = eng.generate([ps[4]], GREEDY)[0]
    assert again.new_token_ids == first.new_token_ids
    assert again.usage.cached_tokens >= 16
    eng.block_manager.check_invariants([])


def test_shrink_returns_memory_to_the_system() -> None:
    layout = KVLayout.uniform(4, 4, 64)  # 128 KiB per 16-token fp32 block
    pool = KVPool(layout, 16, 16, mx.float32)
    per_block = layout.bytes_per_block(16, mx.float32)
    before = process_rss()
    resize_pool(pool, 16 + 1024)  # +128 MiB
    grown = process_rss()
    resize_pool(pool, 16, kept=list(range(16)))
    shrunk = process_rss()
    assert grown - before > 0.8 * 1024 * per_block, (before, grown)
    assert grown - shrunk > 0.8 * 1024 * per_block, (grown, shrunk)


_HEAP_SCRIPT = """
import trillm.kernels, mlx.core as mx
from trillm.engine.memory import process_rss, release_freed_heap
before = process_rss()
big = mx.zeros((4 << 20,)); mx.eval(big); del big; mx.clear_cache()  # freed mmapped: glibc's threshold rises
arrays = [mx.zeros((1 << 20,)) + i for i in range(100)]; mx.eval(arrays)  # 100 x 4 MiB, from the heap now
pin = mx.zeros((16,)) + 1; mx.eval(pin)  # allocated last: the heap's top stays in use
del arrays; mx.clear_cache()
freed = process_rss(); release_freed_heap(); print(before, freed, process_rss())
"""


def test_freed_heap_goes_back_to_the_system() -> None:
    """What MLX frees on CPU stays resident in glibc's arenas until trimmed (the self-check's and the probe's
    buffers: about 420 MiB of SmolLM2's idle RSS). In a fresh process, where the heap's state is known."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's heap")
    out = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT], capture_output=True, text=True, check=True)
    before, freed, trimmed = map(int, out.stdout.split())
    # free() alone keeps 90-400 MiB of the 400 resident here, depending on which threads' arenas served it.
    assert trimmed - before < 64 * 2**20, (before, freed, trimmed)


def test_memory_limit_refuses_with_overloaded_and_never_allocates_past_it(tiny_model: LoadedModel) -> None:
    eng = engine(tiny_model, kv_slab_mb=0.25)
    cap = eng.pool_capacity
    assert cap is not None
    outside = 10**9  # what the process holds beside the pool, pinned so the test is exact
    per_block = cap.bytes_per_block
    limit = outside + int(40 * per_block * (1 + 1 / cap.num_arrays))  # room for 40 blocks
    budget = MemoryBudget(limit, usage=lambda: outside + cap.nbytes)
    cap.budget = eng.memory = budget
    assert cap.budget_bound
    ps = prompts(tiny_model)
    admitted, refused = [], 0
    for i in range(30):  # ~6 blocks each: far more than 40 blocks
        try:
            eng.add_request(f"r{i}", ps[i % len(ps)], GREEDY)
            admitted.append(f"r{i}")
        except Overloaded as exc:
            assert "--memory-limit" in str(exc)
            refused += 1
    assert refused > 0 and admitted
    done: set[str] = set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done.add(out.request_id)
        assert cap.capacity <= 40 and budget.usage() <= limit
    assert done == set(admitted)
    st = eng.statistics()
    assert st.memory_limit_bytes == limit and st.kv_pool_bytes == cap.capacity * per_block


def test_budget_grows_the_pool_only_within_the_limit() -> None:
    held = [100]
    cap = PoolCapacity(1000, 10, 1, num_arrays=4, budget=MemoryBudget(260, usage=lambda: held[0], max_age_s=0))
    held[0] = 100 + cap.nbytes
    assert cap.budget_blocks() == int(160 / 1.25) and cap.growable() == 128 - 10
    assert list(cap.grow(5)) == list(range(10, 20))  # 1.5x rounded up to a whole slab
    assert not cap.grow(500)  # past the budget: nothing
    assert cap.grow(500, promised=False).start == 20


def test_parse_memory_size() -> None:
    assert parse_memory_size("12GB") == 12 * 10**9 and parse_memory_size("512MiB") == 512 * 2**20
    assert parse_memory_size("1.5") == 1_500_000_000
    for bad in ("", "-1G", "12 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_memory_size(bad)
