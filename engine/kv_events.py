"""KV events and per-step load, from any LLMEngine (real or mock), for a KV-aware router.

Emission follows Dynamo's mocker: "stored" when a full block enters the prefix cache, "removed" when one is
evicted from it (not when its last reference goes: a free block stays matchable). With a disk tier, its own
"stored" (a block written) and "removed" (a file evicted or found bad) come as medium "disk" (vLLM's field). Event ids increase by one
per event for as long as one `KVEventLog` lives (one engine); a consumer that sees a gap has missed events,
and one that sees ids restart is talking to a new engine: both must resync.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

from trillm.engine.block_manager import BlockManager, block_hashes, salted_root


@dataclass(frozen=True, slots=True)
class KVEvent:
    event_id: int
    kind: str  # "stored" | "removed"
    block_hash: str  # hex of the chained 16-byte block hash
    parent_hash: str | None = None  # memory stored only: the previous block's hash (None for a first block)
    # "memory": the prefix cache's blocks; "disk": its disk tier's (engine/kv_disk.py), matchable at a load's cost
    medium: str = "memory"


@dataclass(frozen=True, slots=True)
class StepLoad:
    step: int
    time: float  # time.time() when the step ended
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int
    step_s: float  # the step's duration (the mock's predicted one, or measured)


@dataclass(frozen=True, slots=True)
class StepReport:
    load: StepLoad
    kv_events: tuple[KVEvent, ...]

    def to_json(self) -> dict[str, Any]:
        return {"load": asdict(self.load), "kv_events": [asdict(e) for e in self.kv_events]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> StepReport:
        return cls(StepLoad(**doc["load"]), tuple(KVEvent(**e) for e in doc["kv_events"]))


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """How one engine names its cached blocks: what a router needs to hash prompts the way the engine does."""

    model_id: str
    block_size: int
    hash_seed: str  # hex of the root hash every chain of block hashes starts from
    prefix_caching: bool  # False: nothing is ever cached (and no KV events are published)

    @classmethod
    def of(cls, block_manager: BlockManager, model_id: str) -> KVCacheSpec:
        return cls(model_id, block_manager.block_size, block_manager.hash_seed.hex(),
                   block_manager.enable_prefix_caching)

    def matchable_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[str]:
        """The hex hashes of the prompt's blocks a prefix-cache hit can cover (never its last token); a salted
        prompt's chain from its salt's root, as the engine's (BlockManager._root_of)."""
        if not self.prefix_caching or not token_ids:
            return []
        limit = (len(token_ids) - 1) // self.block_size
        root = bytes.fromhex(self.hash_seed) if cache_salt is None else salted_root(self.model_id, cache_salt)
        return [h.hex() for h in block_hashes(root, token_ids, self.block_size, limit)]


class KVEventLog:
    """Collects a BlockManager's KV events between steps (it owns the manager's `on_kv_event` hook)."""

    def __init__(self, block_manager: BlockManager) -> None:
        self._ids = itertools.count(1)
        self._pending: list[KVEvent] = []
        block_manager.on_kv_event = self._on_kv_event

    def _on_kv_event(self, kind: str, h: bytes, parent: bytes | None, medium: str) -> None:
        self._pending.append(KVEvent(next(self._ids), kind, h.hex(), parent.hex() if parent is not None else None,
                                     medium))

    def take(self) -> tuple[KVEvent, ...]:
        """The events since the previous call, oldest first."""
        events, self._pending = tuple(self._pending), []
        return events
