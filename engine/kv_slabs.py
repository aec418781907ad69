"""A KV pool that follows the load: it grows in slabs as requests need blocks and shrinks when idle.

Every paged kernel (kv_write, kv_gather, paged and MLA attention: the CPU ISA variants, Metal, CUDA and the
references) takes one array per layer, [num_blocks, block_size, heads, dim], and finds block b at
`b * block_size`. Rather than a list of slabs with a block id -> (slab, offset) map, which every kernel and
its self-check would have to learn, the pool stays one array per layer and is reallocated: growing copies it
into a larger array, so every block keeps its id; shrinking (only while no sequence holds a block) gathers
the blocks it keeps to the front, and the block manager renames them. The kernels never see a difference.
A growth copies one layer at a time and frees the old array before the next, so it needs one layer's worth
of extra memory, not the whole pool's; growth is geometric (at least 1.5x, in whole slabs), so the copies
cost O(1) per block over a pool's life.

`PoolCapacity` decides how many blocks exist now and how far the pool may still grow: up to the engine's
block count (`--kv-cache-memory-gb`, the model's context) and within the process's memory budget
(engine/memory.py). `resize_pool` reallocates an MLX pool to match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from trillm.engine.errors import Overloaded
from trillm.engine.memory import MemoryBudget, release_freed_heap

if TYPE_CHECKING:
    from trillm.engine.config import EngineConfig
    from trillm.engine.kv_cache import KVPool
    from trillm.engine.sequence import Sequence as Sequence_

GROWTH = 1.5  # a growth takes the pool to at least this many times its blocks (amortizes the copies)

# (new number of blocks, None: grown in place of ids | the old ids of the blocks kept, in their new order)
ResizeHook = Callable[[int, "Sequence[int] | None"], None]


class BlockCounts(Protocol):
    """What the memory checks read of the block manager (a protocol: the block manager imports this module)."""

    @property
    def blocks(self) -> Sequence[object]: ...
    @property
    def num_used_blocks(self) -> int: ...
    def blocks_needed(self, num_tokens: int) -> int: ...


class PoolCapacity:
    """How many of the pool's blocks exist (`capacity`, block 0 the reserved one among them) and how many more
    it may take now: `max_blocks` at most, and what the memory budget leaves the pool."""

    def __init__(self, max_blocks: int, slab_blocks: int, bytes_per_block: int, *, num_arrays: int = 1,
                 budget: MemoryBudget | None = None, idle_keep_blocks: int = 0) -> None:
        assert max_blocks >= 2 and slab_blocks >= 1
        self.max_blocks = max_blocks
        self.slab_blocks = slab_blocks
        self.bytes_per_block = bytes_per_block
        self.num_arrays = max(1, num_arrays)  # the pool's arrays: a growth holds one old array beside the new
        self.budget = budget
        self.idle_keep_blocks = idle_keep_blocks  # cached blocks an idle pool keeps, in whole slabs
        self.capacity = min(max_blocks, max(2, slab_blocks))
        self.on_resize: ResizeHook | None = None  # the MLX pool's reallocation (none: bookkeeping only)
        self.num_grows = 0
        self.num_shrinks = 0

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_block

    @property
    def idle_floor(self) -> int:
        """The smallest pool: one slab (a shrink never goes below it)."""
        return min(self.max_blocks, max(2, self.slab_blocks))

    def budget_blocks(self) -> int:
        """The most blocks the pool may hold under the memory budget now (a growth's copy counted)."""
        if self.budget is None:
            return self.max_blocks
        room = self.budget.room_for_pool(self.nbytes)
        if room is None:
            return self.max_blocks
        return int(room / (self.bytes_per_block * (1 + 1 / self.num_arrays)))

    @property
    def budget_bound(self) -> bool:
        """Whether memory, not the configured block count, is what stops the pool's growth now."""
        return self.budget_blocks() < self.max_blocks

    def growable(self) -> int:
        """Blocks the pool can still add now."""
        return max(0, min(self.max_blocks, self.budget_blocks()) - self.capacity)

    def grow(self, need: int, *, promised: bool = False) -> range:
        """Add at least `need` blocks (whole slabs, geometric, within the limits); returns the new ids (empty:
        no room). promised: `growable()` already counted these blocks as free (a reading of the memory taken
        moments before may differ slightly; the promise is kept)."""
        old = self.capacity
        budget = self.budget_blocks()
        limit = min(self.max_blocks, max(budget, old + need) if promised else budget)
        if old + need > limit:
            return range(old, old)
        target = max(old + need, int(old * GROWTH))
        target = -(-target // self.slab_blocks) * self.slab_blocks
        self.capacity = new = max(old + need, min(target, limit))
        self.num_grows += 1
        if self.on_resize is not None:
            self.on_resize(new, None)
        if self.budget is not None:
            self.budget.usage(fresh=True)
        return range(old, new)

    def shrunk_capacity(self, num_kept: int) -> int:
        """The capacity a shrink keeping num_kept blocks leaves (the current one: no shrink)."""
        return min(self.capacity, max(self.idle_floor, -(-num_kept // self.slab_blocks) * self.slab_blocks))

    def shrink(self, kept: Sequence[int]) -> int:
        """Reallocate to the slabs holding `kept` (old ids, the reserved block first): block kept[i] becomes
        block i. Returns the new capacity."""
        new = self.shrunk_capacity(len(kept))
        if new == self.capacity:
            return new
        self.capacity = new
        self.num_shrinks += 1
        if self.on_resize is not None:
            self.on_resize(new, kept)
        if self.budget is not None:
            self.budget.usage(fresh=True)
        return new


def resize_pool(pool: KVPool, num_blocks: int, kept: Sequence[int] | None = None) -> None:
    """Reallocate every layer's K and V (and the int8 cache's scales) to `num_blocks` blocks. kept None: grown, every block keeps its id;
    else block kept[i] moves to id i (the rest of the new array is padding: free blocks' contents are never
    read). One layer at a time, freeing the old array (and MLX's cached buffers) before the next; after a
    shrink, the C heap's free pages go back to the system (arrays under glibc's risen mmap threshold come from
    its heap: freed, they stayed resident, 85 of 128 MiB returned in one suite run)."""
    import mlx.core as mx

    index = None if kept is None else mx.array(list(kept) + [0] * (num_blocks - len(kept)), mx.int32)
    for arrays in (pool.keys, pool.values, pool.key_scales, pool.value_scales):
        for i in range(len(arrays)):
            old = arrays[i]
            if index is None:
                new = mx.concatenate([old, mx.zeros((num_blocks - old.shape[0], *old.shape[1:]), old.dtype)])
            else:
                new = old[index]
            mx.eval(new)
            arrays[i] = new
            del old, new
            mx.clear_cache()
    if kept is not None:
        release_freed_heap()


def slab_blocks_for(slab_bytes: int, bytes_per_block: int) -> int:
    return max(1, slab_bytes // max(1, bytes_per_block))


def pool_capacity_for(config: EngineConfig, num_blocks: int, bytes_per_block: int, num_arrays: int,
                      budget: MemoryBudget) -> PoolCapacity:
    """The growing pool of an engine of `num_blocks` blocks at most."""
    slab = slab_blocks_for(int(config.kv_slab_mb * 2**20), bytes_per_block)
    keep = int(config.kv_idle_keep_mb * 2**20) // max(1, bytes_per_block)
    return PoolCapacity(num_blocks, slab, bytes_per_block, num_arrays=num_arrays, budget=budget,
                        idle_keep_blocks=keep)


def check_memory(cap: PoolCapacity, block_manager: BlockCounts, waiting: Sequence[Sequence_], seq: Sequence_) -> None:
    """Refuse a request (Overloaded: 503 with Retry-After) when memory, not the configured pool size, bounds
    the pool and the prompts already waiting plus this one need more blocks than the pool can ever hold
    within the budget: queued, it would wait on memory that never comes."""
    if cap.budget is None or cap.budget.limit_bytes is None or not cap.budget_bound:
        return
    possible = len(block_manager.blocks) - 1 + cap.growable()
    bm = block_manager
    demand = bm.blocks_needed(seq.num_tokens) + sum(bm.blocks_needed(s.num_tokens) for s in waiting)
    if demand > possible:
        limit = cap.budget.limit_bytes
        raise Overloaded(f"out of memory for the KV cache: the waiting prompts need {demand} KV blocks, and "
                         f"--memory-limit {limit / 1e9:.2f} GB leaves room for {possible}; retry later")


def memory_statistics(budget: MemoryBudget, block_manager: BlockCounts, bytes_per_block: int) -> dict[str, int]:
    """The memory fields of EngineStatistics."""
    snap = budget.snapshot()
    return {"memory_rss_bytes": snap.rss_bytes, "memory_peak_bytes": snap.peak_rss_bytes,
            "memory_limit_bytes": snap.limit_bytes or 0,
            "kv_pool_bytes": len(block_manager.blocks) * bytes_per_block,
            "kv_pool_used_bytes": block_manager.num_used_blocks * bytes_per_block}
