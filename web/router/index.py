"""KVIndex: the blocks one worker's prefix cache holds, as far as its KV events tell.

The index follows one event stream (one engine epoch) exactly: "stored" adds a block hash, "removed" drops
it. Event ids increase by one per event, so a gap means events were lost, and a new epoch means the engine
was rebuilt (its cache is empty and its ids restart); either way the index can no longer be trusted: it is
cleared and must be resynced (the shell resubscribes and the replica's hello starts a new stream). Blocks
cached before the stream started are unknown to it, so the index under-reports; it never over-reports
except for blocks evicted in events it did see being lost, which the resync also clears.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trillm.engine.kv_events import KVEvent


@dataclass(frozen=True, slots=True)
class IndexStatistics:
    synced: bool
    epoch: int | None
    num_blocks: int
    last_event_id: int | None
    num_events: int  # applied since the index was created
    num_resyncs: int  # times the index was cleared because its stream broke (gap, new epoch)
    num_unknown_removals: int  # "removed" of a block the index never saw stored (cached before the stream)


class KVIndex:
    def __init__(self) -> None:
        self._blocks: set[str] = set()
        self._epoch: int | None = None
        self._synced = False
        self._last_id: int | None = None
        self._num_events = 0
        self._num_resyncs = 0
        self._num_unknown_removals = 0

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def start(self, epoch: int) -> None:
        """A new stream begins (the replica's hello): empty, expecting this epoch's events."""
        self._blocks.clear()
        self._epoch = epoch
        self._last_id = None
        self._synced = True

    def lose(self) -> None:
        """The stream is gone (disconnected, or it broke): forget everything until the next `start`."""
        self._blocks.clear()
        self._synced = False
        self._last_id = None

    def apply(self, epoch: int, events: Iterable[KVEvent]) -> bool:
        """Apply one batch of events; False (and the index cleared) when the stream broke: resync."""
        if not self._synced:
            return False
        if epoch != self._epoch:
            return self._broken()
        for event in events:
            if self._last_id is not None and event.event_id != self._last_id + 1:
                return self._broken()
            self._last_id = event.event_id
            self._num_events += 1
            if event.medium != "memory":
                continue  # the router predicts memory hits; a disk tier's blocks cost a load
            if event.kind == "stored":
                self._blocks.add(event.block_hash)
            elif event.kind == "removed":
                if event.block_hash in self._blocks:
                    self._blocks.remove(event.block_hash)
                else:
                    self._num_unknown_removals += 1
            else:
                return self._broken()  # a kind this router does not understand: trust nothing
        return True

    def _broken(self) -> bool:
        self.lose()
        self._num_resyncs += 1
        return False

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def blocks(self) -> frozenset[str]:
        return frozenset(self._blocks)

    def statistics(self) -> IndexStatistics:
        return IndexStatistics(self._synced, self._epoch, len(self._blocks), self._last_id, self._num_events,
                               self._num_resyncs, self._num_unknown_removals)
