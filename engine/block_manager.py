"""The paged KV pool's bookkeeping: block allocation, reference counts and the prefix cache.

Prefix caching hashes each *full* block of a sequence's tokens, chained through its parent's hash and seeded
by the model's identity, with blake2b (stable across processes; never Python's `hash()`). A block whose last
reference is dropped keeps its hash and stays matchable until it is evicted for reuse, least recently freed
first. Only full, computed blocks are ever shared, so a sequence writes only into blocks it owns alone.

A lower tier (engine/kv_disk.py) may sit under the prefix cache: an evicted block is handed to it before its
block is reused, and where a sequence's memory hits end, the blocks the lower tier holds next are loaded into
free blocks at admission and count as hits (published as if computed).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from trillm.kernels.layout import RESERVED_BLOCK
from trillm.engine.sequence import Sequence

if TYPE_CHECKING:
    from trillm.engine.kv_slabs import PoolCapacity
    from trillm.engine.state_pool import StateSlots


def hash_block(parent: bytes, token_ids: Seq[int]) -> bytes:
    """Chained block hash: blake2b(parent || int32 token ids)."""
    return hashlib.blake2b(parent + array("i", token_ids).tobytes(), digest_size=16).digest()


def root_hash(model_id: str) -> bytes:
    return hashlib.blake2b(b"trillm-prefix-v1:" + model_id.encode(), digest_size=16).digest()


def salted_root(model_id: str, cache_salt: str) -> bytes:
    """The root a request with this cache_salt chains its block hashes from (a router hashes it the same)."""
    return root_hash(f"{model_id}\x00salt:{cache_salt}")


def block_hashes(root: bytes, token_ids: Seq[int], block_size: int, max_blocks: int | None = None) -> list[bytes]:
    """The chained hashes of token_ids' full blocks (at most max_blocks), as the prefix cache computes them."""
    n = len(token_ids) // block_size if max_blocks is None else min(max_blocks, len(token_ids) // block_size)
    out: list[bytes] = []
    parent = root
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


class LowerTier(Protocol):
    """Where evicted blocks go and come back from, by chained hash (engine/kv_disk.py's PooledDiskTier)."""

    def __contains__(self, h: bytes) -> bool: ...
    def save(self, block_id: int, h: bytes) -> None: ...  # called before block_id is reused
    def load(self, hashes: Seq[bytes], block_ids: Seq[int]) -> int: ...  # how many leading blocks it loaded
    def materialize(self) -> None: ...  # take the saved blocks' contents out of the pool now


# (kind "stored" | "removed", hash, parent hash or None, medium "memory" | "disk")
KVEventHook = Callable[[str, bytes, "bytes | None", str], None]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and computed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, model_id: str = "", enable_prefix_caching: bool = True,
                 state_slots: StateSlots | None = None, capacity: PoolCapacity | None = None,
                 lower: LowerTier | None = None) -> None:
        """state_slots: a hybrid model's recurrent-state slots, taken and freed with each sequence's blocks.
        capacity: a pool that grows to num_blocks as blocks are needed (engine/kv_slabs.py); None: all exist.
        lower: a lower tier for evicted blocks (never with state_slots: a recurrent state is not in a block)."""
        assert lower is None or state_slots is None, "the lower tier does not cover recurrent state"
        assert num_blocks >= 2
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._model_id = model_id
        self._root = root_hash(model_id)
        self.capacity = capacity
        existing = num_blocks if capacity is None else capacity.capacity
        self.blocks = [Block(i) for i in range(existing)]  # the blocks that exist now
        # ref_count == 0 blocks, least recently freed first; RESERVED_BLOCK is never handed out.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(existing) if i != RESERVED_BLOCK)
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._num_cached_free = 0  # free blocks still holding a hash (kept, not counted: statistics() is per step)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_lower_hit_tokens = 0  # of the hits, tokens loaded from the lower tier
        self.num_lower_queried_blocks = 0  # blocks past the memory hits that admission looked up in the lower tier
        # Optional KV-event hook for a KV-aware router: ("stored", hash, parent hash or None, "memory") when a
        # full block enters the prefix cache, ("removed", hash, None, "memory") when it is evicted; the lower
        # tier's own stores and removals with medium "disk" (`lower_events`). Called on the engine's thread.
        self.on_kv_event: KVEventHook | None = None
        self.state_slots = state_slots
        self.lower = lower

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting those a growing pool can still add."""
        return len(self._free) + (self.capacity.growable() if self.capacity is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - 1 - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    @property
    def hash_seed(self) -> bytes:
        """The root of every chain of block hashes (seeded by the model's identity)."""
        return self._root

    @property
    def cached_block_hashes(self) -> frozenset[bytes]:
        """The hashes the prefix cache can match right now (what KV events have told a router)."""
        return frozenset(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence) -> None:
        """Compute the chained hash of every full block of seq.token_ids not hashed yet."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else self._root_of(seq)
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def _root_of(self, seq: Sequence) -> bytes:
        # A salted request's blocks hash apart from everyone else's: its prompts cannot be probed through the
        # prefix cache (or the KV events), and it hits only blocks computed under the same salt.
        salt = seq.params.cache_salt
        return self._root if salt is None else salted_root(self._model_id, salt)

    def _looks_up(self, seq: Sequence) -> bool:
        """Whether seq may reuse cached blocks. A request for prompt logprobs may not: it needs the logits at
        every prompt position, and a hit skips exactly the forward that computes them (the cache keeps K/V,
        not logits), so a hit saves it nothing. Bypassing the lookup, rather than recomputing hit positions,
        keeps one path (its positions always computed, into blocks it owns) that cannot return a number from
        a skipped position. Its own full blocks are still published for later requests."""
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None

    def _match(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest prefix of seq's tokens, leaving at least its last token to compute
        (its logits are needed, so a full-prompt hit recomputes the last block)."""
        if not self._looks_up(seq):
            return []
        self._extend_hashes(seq)
        hits: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for h in seq.block_hashes[:max_blocks]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        checkpoints = self.state_slots.checkpoints if self.state_slots is not None else None
        if checkpoints is not None:  # a hybrid model resumes only where a recurrent-state checkpoint is
            hits = hits[: checkpoints.resumable(seq.block_hashes, len(hits))]
        return hits

    def _lower_hashes(self, seq: Sequence, start: int) -> list[bytes]:
        """The hashes of seq's blocks from block `start` on that the lower tier holds, up to its first miss."""
        if self.lower is None or not self._looks_up(seq):
            return []
        out = []
        for h in seq.block_hashes[start : (seq.num_tokens - 1) // self.block_size]:
            if h in self._cached or h not in self.lower:
                break
            out.append(h)
        return out

    def lower_candidates(self, seq: Sequence) -> list[bytes]:
        """What admission would load of seq from the lower tier now (to prefetch it)."""
        return self._lower_hashes(seq, len(self._match(seq)))

    def lower_events(self, events: Seq[tuple[str, bytes]]) -> None:
        """Report the lower tier's stores and removals (medium "disk")."""
        if self.on_kv_event is not None:
            for kind, h in events:
                self.on_kv_event(kind, h, None, "disk")

    def num_inflight_prefix_blocks(self, seq: Sequence, running: list[Sequence]) -> int:
        """How many of seq's blocks past its cache hits a running sequence is computing right now.

        Equal chained hashes at the same index mean an identical prefix, so seq could reuse them once
        computed instead of computing them a second time.
        """
        if not self._looks_up(seq) or not running:
            return 0
        start = len(self._match(seq))  # also extends seq.block_hashes
        limit = (seq.num_tokens - 1) // self.block_size
        best = 0
        for other in running:
            self._extend_hashes(other)
            i = start
            while i < limit and i < len(other.block_hashes) and other.block_hashes[i] == seq.block_hashes[i]:
                i += 1
            if i > start and other.num_computed_tokens < i * self.block_size:
                best = max(best, i - start)
        return best

    # ---- allocation --------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        if self.state_slots is not None and self.state_slots.num_free == 0:
            return False
        hits = self._match(seq)
        need = self.blocks_needed(seq.num_tokens) - len(hits)
        # Hit blocks that are free now stop being free once taken.
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return need + reclaimed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its current tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        hits = self._match(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self._num_cached_free -= 1  # a hit block always has its hash
            block.ref_count += 1
        seq.block_table = hits + [self._take_free() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits))]
        loaded = self._load_lower(seq, len(hits))
        seq.num_computed_tokens = (len(hits) + loaded) * self.block_size
        seq.num_hashed_blocks = len(hits) + loaded
        if self.state_slots is not None:
            self.state_slots.take(seq)
            if hits and self.state_slots.checkpoints is not None:
                self.state_slots.checkpoints.restore(seq, seq.block_hashes[len(hits) - 1])
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens
        self.num_lower_hit_tokens += loaded * self.block_size
        if self.lower is not None and self._looks_up(seq):
            self.num_lower_queried_blocks += (seq.num_tokens - 1) // self.block_size - len(hits)

    def _load_lower(self, seq: Sequence, start: int) -> int:
        """Load seq's blocks past its memory hits that the lower tier holds into the free blocks just taken for
        them, and publish them; returns how many (a block the tier cannot give back ends the run: computed)."""
        wanted = self._lower_hashes(seq, start)
        if not wanted:
            return 0
        assert self.lower is not None
        loaded = self.lower.load(wanted, seq.block_table[start : start + len(wanted)])
        for i in range(start, start + loaded):
            self._publish(self.blocks[seq.block_table[i]], seq.block_hashes[i], seq.block_hashes[i - 1] if i else None)
        return loaded

    def _publish(self, block: Block, h: bytes, parent: bytes | None) -> None:
        if block.hash is None and h not in self._cached:
            block.hash = h
            self._cached[h] = block.block_id
            if self.on_kv_event is not None:
                self.on_kv_event("stored", h, parent, "memory")

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of every block the prefix cache can match now."""
        return [(b, h) for h, b in self._cached.items()]

    def _take_free(self) -> int:
        # A growing pool adds blocks rather than evict a cached prefix, while memory allows.
        if self.capacity is not None and (not self._free or self.blocks[next(iter(self._free))].hash is not None):
            self._add_blocks(self.capacity.grow(1, promised=not self._free))
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:  # evict its prefix-cache entry
            self._num_cached_free -= 1
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
                if self.lower is not None:
                    self.lower.save(block_id, block.hash)
                if self.state_slots is not None and self.state_slots.checkpoints is not None:
                    self.state_slots.checkpoints.drop(block.hash)
                if self.on_kv_event is not None:
                    self.on_kv_event("removed", block.hash, None, "memory")
            block.hash = None
        block.ref_count = 1
        return block_id

    def _add_blocks(self, ids: range) -> None:
        """New blocks (a grown pool) go to the front of the free list: taken before any cached block."""
        assert ids.start == len(self.blocks)
        self.blocks.extend(Block(i) for i in ids)
        for i in reversed(ids):
            self._free[i] = None
            self._free.move_to_end(i, last=False)

    def shrink(self) -> list[bytes]:
        """Release a growing pool's slabs while no sequence holds a block: keep the most recently freed cached
        blocks (capacity.idle_keep_blocks at most), renamed to the lowest ids, and drop the rest of the prefix
        cache. Returns the hashes dropped (already reported as removed)."""
        cap = self.capacity
        assert cap is not None and all(b.ref_count == 0 for b in self.blocks[1:]), "shrink only an idle pool"
        recent = [b for b in reversed(self._free) if self.blocks[b].hash is not None]
        kept = recent[: max(0, cap.idle_keep_blocks - 1)]  # the reserved block counts: keep 64 MB = one slab
        ids = [RESERVED_BLOCK] + kept
        if cap.shrunk_capacity(len(ids)) == len(self.blocks):
            return []
        if self.lower is not None:  # before the reallocation drops their contents
            for block_id in recent[len(kept):]:
                h = self.blocks[block_id].hash
                assert h is not None
                self.lower.save(block_id, h)
            self.lower.materialize()  # nothing of the old arrays may outlive the reallocation
        cap.shrink(ids)
        dropped = []
        for block_id in recent[len(kept):]:
            h = self.blocks[block_id].hash
            assert h is not None
            dropped.append(h)
            del self._cached[h]
            if self.state_slots is not None and self.state_slots.checkpoints is not None:
                self.state_slots.checkpoints.drop(h)
            if self.on_kv_event is not None:
                self.on_kv_event("removed", h, None, "memory")
        # Renamed: kept[i] is block i + 1 now, in the same least-recently-freed order; new blocks go first.
        hashes = [self.blocks[b].hash for b in kept]
        self.blocks = [Block(i) for i in range(cap.capacity)]
        self._free = OrderedDict((i, None) for i in range(len(ids), cap.capacity))
        for new_id in range(len(kept), 0, -1):
            h = hashes[new_id - 1]
            assert h is not None
            self.blocks[new_id].hash = h
            self._cached[h] = new_id
            self._free[new_id] = None
        self._num_cached_free = len(kept)
        return dropped

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks first, so a prefix's head outlives its tail in the LRU order.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self._free[block_id] = None
                self._num_cached_free += block.hash is not None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        if self.state_slots is not None:
            self.state_slots.release(seq)

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Make sure seq has slots for its next num_new_tokens computed tokens."""
        for _ in range(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past those its first num_tokens tokens need (slots reserved for speculative
        tokens that were rejected). Such blocks are seq's own and hold no hash (only full, computed blocks are
        shared or published); they go to the front of the free list, ahead of blocks still holding a prefix."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, block
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)

    def register_computed(self, seq: Sequence) -> None:
        """Publish seq's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # min(): a step launched ahead counts its token computed before the token itself is known.
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full <= seq.num_hashed_blocks:
            return
        self._extend_hashes(seq)
        for i in range(seq.num_hashed_blocks, full):
            self._publish(self.blocks[seq.block_table[i]], seq.block_hashes[i], seq.block_hashes[i - 1] if i else None)
        seq.num_hashed_blocks = full
        if self.state_slots is not None and self.state_slots.checkpoints is not None:
            self.state_slots.checkpoints.publish(seq, full, seq.block_hashes, self._cached.__contains__)

    def check_invariants(self, live: list[Sequence]) -> None:
        """Blocks are conserved: each live reference is counted once, and free means unreferenced."""
        refs = [0] * len(self.blocks)
        for seq in live:
            for b in seq.block_table:
                refs[b] += 1
        for block in self.blocks:
            if block.block_id == RESERVED_BLOCK:
                continue
            assert block.ref_count == refs[block.block_id], (block, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self._free), block
        for h, b in self._cached.items():
            assert self.blocks[b].hash == h
        assert self._num_cached_free == sum(1 for b in self._free if self.blocks[b].hash is not None)
        if self.state_slots is not None:
            self.state_slots.check_invariants(live)
            if self.state_slots.checkpoints is not None:
                self.state_slots.checkpoints.check_invariants(self._cached.__contains__, live)
