"""Per-sequence recurrent state beside the paged KV pool, for the recurrent layers of hybrid models (gated delta
nets, Mamba-2 mixers, short convolutions).

A recurrent layer keeps no per-token K/V but a fixed-size state per sequence: whatever mlx-lm's `ArraysCache`
holds for it (a convolution window, an SSM or delta-net state), shapes read off the model's own caches after
one token (`paged_model.kv_layout`). The pool holds one slot per running sequence for every such layer;
`StateSlots` (pure Python) hands slots out at admission with the sequence's KV blocks and takes them back with
them (finish, abort, preemption).

For one forward, `RecurrentStateCache` stands in for the layer's `ArraysCache`, driven unmodified by the model's
own code: it gathers the batch rows' states by slot (zeros for a row whose first forward this is: position 0,
so a preempted sequence's recompute starts from a zero state whatever its slot held), collects what the layer
writes back, and `StatePool.commit` keeps the new states as the rows' slots (one array per slot:
see `StatePool`). Ragged rows are right-padded
(model_runner.prepare_inputs); the cache's `lengths` (each row's real token count, as mlx-lm's own batched path
sets them with right padding) make `make_mask` mask the padding, so padding never advances the recurrence and
each row's conv window is read at its last real token.

Not every mlx-lm model masks padding in every recurrent layer (Nemotron-H's Mamba-2 mixer does not pass the
lengths to its scan: the engine's ssm_update seam adds them from the mask, engine/fused_ops.py): only the
families listed in `RAGGED_OK`, each checked by the test matrix's ragged batches, batch prefill rows of
different lengths; every other model with recurrent layers batches only chunks of equal length (no padding at
all, so nothing to mask).

Prefix caching: the state cannot be rebuilt from a shared KV prefix, so the pool saves checkpoints of it at
block boundaries and writes a hit's checkpoint into the sequence's slot before its first forward
(engine/state_checkpoints.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import TYPE_CHECKING, Any

import mlx.core as mx

if TYPE_CHECKING:
    from trillm.engine.sequence import Sequence
    from trillm.engine.state_checkpoints import StateCheckpoints


# mlx-lm model modules whose recurrent layers mask right padding themselves (through `lengths` and the mask),
# checked by tests/engine/test_model_matrix.py's ragged batches.
# Nemotron-H's mixer passes the mask alone; the engine's ssm_update seam adds the lengths the mask says
# (engine/fused_ops.py), which every forward of the engine runs inside.
RAGGED_OK = frozenset({"mlx_lm.models.qwen3_next", "mlx_lm.models.qwen3_5", "mlx_lm.models.lfm2",
                       "mlx_lm.models.falcon_h1", "mlx_lm.models.mamba2", "mlx_lm.models.nemotron_h"})


def pads_safely(model: Any) -> bool:
    """May prefill rows of different lengths (right-padded) share a forward of this model's recurrent layers."""
    return type(model).__module__ in RAGGED_OK


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One array a recurrent layer keeps per sequence (without the batch axis)."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.size
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class LayerState:
    """A recurrent layer's per-sequence state: its `ArraysCache` entries, in order."""

    entries: tuple[StateEntry, ...]
    kind: str = "ArraysCache"  # mlx-lm's cache class, for messages

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass(frozen=True, slots=True)
class CacheNode:
    """Where one of the model's caches comes from: pool layer `index` ("kv"), state layer `index` ("state"),
    or a list of caches for one layer ("list", mlx-lm's CacheList: Falcon-H1's mixer and attention)."""

    kind: str
    index: int = -1
    children: tuple[CacheNode, ...] = ()


def bytes_per_slot(layers: tuple[LayerState, ...]) -> int:
    return sum(layer.nbytes for layer in layers)


class StateSlots:
    """Which state slot each running sequence holds (pure Python; the block manager takes and frees them)."""

    def __init__(self, num_slots: int, checkpoints: StateCheckpoints | None = None) -> None:
        """checkpoints: the states saved for prefix-cache hits (None: the model's sequences never hit)."""
        assert num_slots >= 1
        self.num_slots = num_slots
        self.checkpoints = checkpoints
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._of: dict[Sequence, int] = {}  # identity-keyed: Sequence defines no __eq__
        self._holder: dict[int, Sequence] = {}
        self.on_release: Callable[[int], None] | None = None  # the pool's: drop the freed slot's state

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, seq: Sequence) -> bool:
        return seq in self._of

    def take(self, seq: Sequence) -> int:
        assert seq not in self._of, "a sequence holds one slot"
        slot = self._free.pop()
        self._of[seq] = slot
        self._holder[slot] = seq
        return slot

    def release(self, seq: Sequence) -> None:
        slot = self._of.pop(seq, None)
        if slot is not None:
            self._free.append(slot)
            del self._holder[slot]
            if self.on_release is not None:
                self.on_release(slot)
        if self.checkpoints is not None:
            self.checkpoints.forget(seq)

    def holder(self, slot: int) -> Sequence:
        return self._holder[slot]

    def slot(self, seq: Sequence) -> int:
        return self._of[seq]

    def check_invariants(self, live: list[Sequence]) -> None:
        """Each live sequence holds exactly one slot, no slot is held twice, and every other slot is free."""
        held = [self._of[s] for s in live]
        assert set(self._of) == set(live), (len(self._of), len(live))
        assert len(set(held)) == len(held)
        assert sorted(held + self._free) == list(range(self.num_slots))
        assert all(self._holder[self._of[s]] is s for s in live) and len(self._holder) == len(live)


@dataclass(frozen=True, slots=True)
class StateRows:
    """The rows of one forward, as the state pool needs them."""

    slots: mx.array  # int32 [B]: each row's slot
    fresh: mx.array | None  # bool [B]: rows at position 0 (their state starts at zero); None: no such row
    all_fresh: bool
    lengths: mx.array | None  # int32 [B]: real tokens per row, when rows are ragged (right padding); else None
    host_slots: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()  # each row's computed tokens after this forward (where checkpoints are taken)
    width: int = 1  # tokens per row in this forward (the longest row's)


def state_rows(slots: list[int], starts: list[int], lengths: list[int]) -> StateRows:
    fresh = [st == 0 for st in starts]
    return StateRows(mx.array(slots, mx.int32), mx.array(fresh) if any(fresh) else None, all(fresh),
                     mx.array(lengths, mx.int32) if len(set(lengths)) > 1 else None, tuple(slots),
                     tuple(st + n for st, n in zip(starts, lengths)), max(lengths, default=1))


class StatePool:
    """Each recurrent layer's entries, one [1, *entry shape] array per slot.

    Per-slot arrays, not one [num_slots, ...] array per entry, so that a step costs what its rows hold, not what
    the pool holds: MLX scatters out of place, and `pool[slots] = new` copies the whole pool whenever the old
    pool is still referenced (the step's gather, a launched-ahead step, a checkpoint), which in the engine is
    always. A commit keeps each row's new state as a view of the layer's output (no copy); the next forward over
    the same rows in the same order reads that output back whole (no gather), any other batch concatenates its
    rows' slots (a copy of the batch's rows only). A live sequence left out of later batches keeps its view, and
    with it that batch's output, alive until its next commit or its release; a multi-token forward's states are
    copied out first (a gather of the batch's states), since there the output can be a view of the layer's whole
    input (see `commit`)."""

    def __init__(self, layers: tuple[LayerState, ...], slots: StateSlots) -> None:
        self.layers = layers
        self.slots = slots
        # [layer][entry] -> the zero state every free slot shares (never written: a commit replaces arrays)
        self._zeros = [[mx.zeros((1, *e.shape), e.dtype) for e in layer.entries] for layer in layers]
        mx.eval(self._zeros)
        self.by_slot: list[list[list[mx.array]]] = [[[z] * slots.num_slots for z in zs] for zs in self._zeros]
        # [layer][entry] -> (the slots, in row order, whose states are rows of `array`; that array)
        self._last: list[list[tuple[tuple[int, ...], mx.array] | None]] = [[None for _ in layer.entries]
                                                                           for layer in layers]
        self.rows: StateRows | None = None
        self._caches = [RecurrentStateCache(self, j) for j in range(len(layers))]
        slots.on_release = self.free

    @property
    def nbytes(self) -> int:
        """What the pool holds at most: every slot's state (free slots share one zero state until written)."""
        return self.slots.num_slots * bytes_per_slot(self.layers)

    @property
    def arrays_by_layer(self) -> list[list[mx.array]]:
        """[layer][entry] -> [num_slots, *entry shape], stacked (a copy: for inspection, not for the step)."""
        return [[mx.concatenate(per_slot, axis=0) for per_slot in layer] for layer in self.by_slot]

    def set_states(self, layer: int, entry: int, states: mx.array) -> None:
        """Write [num_slots, *entry shape] into every slot of one entry (tests, tools)."""
        self.by_slot[layer][entry] = [states[i : i + 1] for i in range(self.slots.num_slots)]
        self._last[layer][entry] = None

    def arrays(self) -> list[mx.array]:
        """Every slot's arrays, for evaluating the pool (each distinct pending array once)."""
        seen: dict[int, mx.array] = {}
        for layer in self.by_slot:
            for per_slot in layer:
                for a in per_slot:
                    seen.setdefault(id(a), a)
        return list(seen.values())

    def caches(self) -> list[RecurrentStateCache]:
        return self._caches

    def begin(self, rows: StateRows | None) -> None:
        assert rows is not None, "a forward of a model with recurrent layers needs its rows' state slots"
        if self.slots.checkpoints is not None and self.slots.checkpoints.restores:
            self._restore(self.slots.checkpoints.restores)
        self.rows = rows
        for c in self._caches:
            c.begin(rows)

    def gather(self, layer: int, entry: int, rows: StateRows) -> mx.array:
        """[B, *entry shape]: the rows' states, by slot."""
        per_slot = self.by_slot[layer][entry]
        last = self._last[layer][entry]
        if last is not None and last[0] == rows.host_slots:
            return last[1]  # the previous commit's output, rows in this order: nothing to gather
        if len(rows.host_slots) == 1:
            return per_slot[rows.host_slots[0]]
        return mx.concatenate([per_slot[s] for s in rows.host_slots], axis=0)

    def commit(self) -> None:
        """Keep the states the layers wrote this forward as their rows' slots."""
        rows = self.rows
        assert rows is not None
        for j, c in enumerate(self._caches):
            for e, new in c.written.items():
                new = new.astype(self._zeros[j][e].dtype)
                if rows.width > 1:
                    # A multi-token forward's state may be a view of the layer's whole input (mlx-lm's Mamba-2
                    # keeps its conv window as a slice of it): a gather copies out just the state, or each slot
                    # would keep that input alive until its next forward. A decode's views are about the state's size.
                    new = new[mx.arange(new.shape[0])]
                per_slot = self.by_slot[j][e]
                for i, slot in enumerate(rows.host_slots):
                    per_slot[slot] = new[i : i + 1]
                self._last[j][e] = (rows.host_slots, new)
        ck = self.slots.checkpoints
        if ck is not None:
            for slot, end in zip(rows.host_slots, rows.ends):
                if ck.is_boundary(end):
                    payload = self._copy(slot)
                    mx.async_eval(*payload)
                    ck.save(self.slots.holder(slot), end, payload)

    def _copy(self, slot: int) -> tuple[mx.array, ...]:
        # A gather copies (a slice would be a view keeping the whole batch's output alive).
        index = mx.array([0])
        return tuple(per_slot[slot][index] for layer in self.by_slot for per_slot in layer)

    def free(self, slot: int) -> None:
        """Drop a freed slot's state (its view would keep a batch's output alive)."""
        self._put(slot, [z for zs in self._zeros for z in zs])

    def _restore(self, restores: dict[Sequence, tuple[mx.array, ...]]) -> None:
        """Write checkpoints into their sequences' slots (prefix-cache hits admitted this step)."""
        for seq, payload in restores.items():
            self._put(self.slots.slot(seq), payload)  # checkpoints are never written: sharing one is safe
        restores.clear()

    def _put(self, slot: int, states: Sequence_[mx.array]) -> None:
        """One slot's arrays, entry by entry in layer order; the last output no longer holds that slot's rows."""
        it = iter(states)
        for j, layer in enumerate(self.by_slot):
            for e, per_slot in enumerate(layer):
                per_slot[slot] = next(it)
                last = self._last[j][e]
                if last is not None and slot in last[0]:
                    self._last[j][e] = None

    def end(self) -> None:
        self.rows = None
        for c in self._caches:
            c.end()


class RecurrentStateCache:
    """One recurrent layer's stand-in for mlx-lm's `ArraysCache` during one forward (see the module docstring)."""

    def __init__(self, pool: StatePool, layer: int) -> None:
        self.pool = pool
        self.layer = layer
        self.lengths: mx.array | None = None  # as ArraysCache's: real tokens left per row (right padding)
        self.left_padding: mx.array | None = None  # never: rows are right-padded
        self._rows: StateRows | None = None
        self._read: dict[int, mx.array] = {}
        self.written: dict[int, mx.array] = {}

    def begin(self, rows: StateRows) -> None:
        self._rows = rows
        self.lengths = rows.lengths
        self._read.clear()
        self.written.clear()

    def end(self) -> None:
        self._rows = None
        self.lengths = None
        self._read.clear()
        self.written.clear()

    def __getitem__(self, idx: int) -> mx.array:
        if idx in self.written:
            return self.written[idx]
        if idx not in self._read:
            rows = self._rows
            assert rows is not None, "begin the forward first"
            zero = self.pool._zeros[self.layer][idx]
            B = rows.slots.shape[0]
            if rows.all_fresh:
                state = mx.zeros((B, *zero.shape[1:]), zero.dtype)
            else:
                state = self.pool.gather(self.layer, idx, rows)
                if rows.fresh is not None:
                    state = mx.where(rows.fresh.reshape(B, *([1] * (zero.ndim - 1))), mx.zeros_like(state), state)
            self._read[idx] = state
        return self._read[idx]

    def __setitem__(self, idx: int, value: mx.array) -> None:
        self.written[idx] = value

    @property
    def cache(self) -> list[mx.array]:
        return [self[i] for i in range(len(self.pool.layers[self.layer].entries))]

    def advance(self, N: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - N

    def make_mask(self, N: int, **_: Any) -> mx.array | None:
        """[B, N] bool, True at each row's real tokens; None when no row is padded (mlx-lm's own convention)."""
        if self.lengths is None:
            return None
        return mx.arange(N)[None, :] < self.lengths[:, None]

    # mlx-lm's cache protocol, for code that inspects caches.
    @property
    def batch_size(self) -> int:
        return 0 if self._rows is None else int(self._rows.slots.shape[0])

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.pool.slots.num_slots * self.pool.layers[self.layer].nbytes
