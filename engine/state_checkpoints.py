"""Recurrent-state checkpoints at block boundaries: what lets a hybrid model's sequences hit the prefix cache.

A recurrent layer's state after token n cannot be rebuilt from the K/V of tokens 0..n-1, so a prefix-cache hit
of a hybrid model needs the state at the hit's end as well as its blocks. The state pool saves a copy of a
sequence's state whenever its computed tokens reach a multiple of `interval` blocks (one decode step at a time,
or the end of a prefill forward: `prefill_phases` splits each prefill chunk at its last such boundary, so every
chunk leaves one checkpoint and costs at most one extra forward). A saved state waits, pending, until the block
ending at that boundary enters the prefix cache (its hash needs the block's tokens, which a decode launched
ahead does not know yet), and is then keyed by that block's chained hash, so it is matched exactly as the
blocks are (same model, salt and tokens).

A lookup keeps the cached blocks up to the last boundary with a checkpoint at or below the longest hit, and
the sequence's state slot is written from that checkpoint before its first forward: it prefills only the rest
(less than one interval of the hit, plus its new tokens). Checkpoints are evicted with their blocks (a block
reused for other tokens drops the checkpoint keyed by its hash) and least recently used first past
`capacity`; their memory (capacity x the state of one sequence) comes out of the KV memory budget. Pending
copies are bounded by the running batch (a couple per sequence at most, each published or dropped within a
step or two).

Bookkeeping is pure Python on the engine's thread (the block manager calls it); the arrays are opaque here:
the state pool makes and applies them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import mlx.core as mx

if TYPE_CHECKING:
    from trillm.engine.config import EngineConfig
    from trillm.engine.sequence import Sequence

# One saved state: every recurrent layer's entries, flattened in the pool's order, each [1, *entry shape].
Payload = tuple[mx.array, ...]


@dataclass(frozen=True, slots=True)
class CheckpointStatistics:
    num_saved: int  # checkpoints keyed in the prefix cache now
    capacity: int
    num_pending: int  # copies waiting for their block to be published
    num_restored: int  # sequences resumed from a checkpoint, since start
    num_evicted: int  # dropped with their block or past capacity, since start


class StateCheckpoints:
    def __init__(self, interval: int, capacity: int, block_size: int) -> None:
        """interval: blocks between checkpoints; capacity: checkpoints kept at most."""
        assert interval >= 1 and capacity >= 1
        self.interval = interval
        self.capacity = capacity
        self.block_size = block_size
        self._saved: OrderedDict[bytes, Payload] = OrderedDict()  # least recently used first
        self._pending: dict[Sequence, dict[int, Payload]] = {}  # seq -> {boundary (in blocks): its state}
        self.restores: dict[Sequence, Payload] = {}  # written into the sequences' slots before their next forward
        self.num_restored = 0
        self.num_evicted = 0

    @property
    def every_tokens(self) -> int:
        return self.interval * self.block_size

    def is_boundary(self, num_tokens: int) -> bool:
        return num_tokens > 0 and num_tokens % self.every_tokens == 0

    def statistics(self) -> CheckpointStatistics:
        return CheckpointStatistics(len(self._saved), self.capacity, sum(len(p) for p in self._pending.values()),
                                    self.num_restored, self.num_evicted)

    # ---- the block manager's side ------------------------------------------------------------------------
    def resumable(self, hashes: list[bytes], num_hits: int) -> int:
        """How many of `num_hits` leading cached blocks a sequence may reuse: up to the last one that ends at a
        checkpoint (0: none; it starts from a zero state)."""
        for n in range(num_hits, 0, -1):
            if hashes[n - 1] in self._saved:
                return n
        return 0

    def restore(self, seq: Sequence, block_hash: bytes) -> None:
        """seq resumes after the block `block_hash` (a `resumable` hit): queue its slot's write."""
        self._saved.move_to_end(block_hash)
        self.restores[seq] = self._saved[block_hash]
        self.num_restored += 1

    def publish(self, seq: Sequence, num_full: int, hashes: list[bytes], cached: Callable[[bytes], bool]) -> None:
        """seq's first `num_full` blocks are in the prefix cache (or another's identical ones are): key its pending
        states at those boundaries by the block hashes."""
        pending = self._pending.get(seq)
        if not pending:
            return
        for n in [n for n in pending if n <= num_full]:
            payload = pending.pop(n)
            h = hashes[n - 1]
            if cached(h) and h not in self._saved:
                self._saved[h] = payload
                while len(self._saved) > self.capacity:
                    self._saved.popitem(last=False)
                    self.num_evicted += 1
        if not pending:
            del self._pending[seq]

    def drop(self, block_hash: bytes) -> None:
        """The block `block_hash` left the prefix cache: its checkpoint goes with it."""
        if self._saved.pop(block_hash, None) is not None:
            self.num_evicted += 1

    def forget(self, seq: Sequence) -> None:
        """seq gave its blocks and slot back (finished, aborted, preempted)."""
        self._pending.pop(seq, None)
        self.restores.pop(seq, None)

    def check_invariants(self, cached: Callable[[bytes], bool], live: list[Sequence]) -> None:
        assert len(self._saved) <= self.capacity
        assert all(cached(h) for h in self._saved), "a checkpoint outlived its block"
        assert all(s in live for s in self._pending) and all(s in live for s in self.restores)

    # ---- the state pool's side ---------------------------------------------------------------------------
    def save(self, seq: Sequence, num_tokens: int, payload: Payload) -> None:
        """seq's state after its first `num_tokens` tokens (a boundary), until its block is published."""
        self._pending.setdefault(seq, {})[num_tokens // self.block_size] = payload


class _Chunk(Protocol):
    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


C = TypeVar("C", bound=_Chunk)


def prefill_phases(chunks: list[C], checkpoints: StateCheckpoints | None,
                   piece: Callable[[C, int, int], C]) -> list[list[C]]:
    """The step's prefill chunks as forwards to run in order: each chunk that crosses a checkpoint boundary is
    split at its last one (the head in the first phase, the tail in the second), so its forward ends there and
    the state pool can save the state; one piece of a sequence per phase. piece(chunk, start, num_tokens): a
    piece of a chunk (the scheduler's PrefillChunk, which this module cannot import: its block manager calls
    this one)."""
    if checkpoints is None:
        return [chunks]
    every = checkpoints.every_tokens
    heads: list[C] = []
    tails: list[C] = []
    for c in chunks:
        end = c.start + c.num_tokens
        cut = end // every * every  # the last boundary at or before the chunk's end
        if c.start < cut < end:
            heads.append(piece(c, c.start, cut - c.start))
            tails.append(piece(c, cut, end - cut))
        else:
            heads.append(c)
    return [heads, tails] if tails else [heads]


def checkpoints_for(config: EngineConfig, state_bytes: int) -> StateCheckpoints | None:
    """A hybrid model's checkpoints under `config` (state_bytes: one sequence's recurrent state), or None: prefix
    caching off, or not even one checkpoint fits. Unless set, the capacity is 4 per sequence slot, within a
    quarter of the KV memory budget."""
    if not config.enable_prefix_caching or config.state_checkpoint_interval == 0:
        return None
    capacity = config.max_state_checkpoints
    if capacity is None:
        capacity = min(4 * config.max_num_seqs, int(config.kv_cache_memory_gb * 1e9) // 4 // max(state_bytes, 1))
    return StateCheckpoints(config.state_checkpoint_interval, capacity, config.block_size) if capacity > 0 else None
