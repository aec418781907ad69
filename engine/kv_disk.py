"""The prefix cache's disk tier: blocks the memory tier evicts (and, at close, the ones it still holds) are
kept in a directory and loaded again, by their chained block hash, by a later request or a restarted server.

One file per block, named by its hash, under a folder named by the KV identity (`kv_identity`: the model's
fingerprint, the block size and the pool's per-block shapes and dtypes, so a change of quantization or KV
dtype never reads another layout's bytes; the cache salt is already in the chained hash). A file is a header
(magic, version, identity, hash, payload size, blake2b of the payload) and the block's bytes, every pool array's
block in pool order. Writes go to a temporary file, fsynced, then `os.replace`d into place: a crash leaves the
old name or the whole new file, never a part; leftovers of a crash are removed at start. The folder is fsynced
after the renames (once the queue is empty: a burst of writes shares one), so a power loss keeps them too. A read checks
everything in the header against what it expects and the checksum over the payload; a file that fails is
deleted and counted (`num_corrupt`), and the block is recomputed.

Threads: `DiskTier` does file work only (no MLX). Its writer thread takes payloads from a bounded queue (full:
the write is dropped and counted, never waited for, so a step never blocks on the disk) and keeps the folder
under `max_bytes`, least recently used first. Reads run on a pool of 4 threads: `prefetch` at admission, `get`
when the block manager takes the blocks (a block not prefetched is read on the caller's thread). `PooledDiskTier`
bridges it to an MLX pool on the engine thread, where all MLX work stays: an evicted block is gathered into
one byte array (queued before any forward can overwrite it), turned into numpy after the step is read back,
then handed to the writer; a load copies the files' bytes into the pool's free blocks in one scatter per
array, evaluated with the next forward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import mlx.core as mx

    from trillm.engine.kv_cache import KVPool

MAGIC = b"TRILLMKV"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
SUFFIX = ".kv"

log = logging.getLogger("trillm.engine.kv_disk")


def kv_identity(model_id: str, block_size: int, arrays: Sequence[tuple[tuple[int, ...], str]]) -> str:
    """What a block's bytes mean: the model, the block size and each pool array's block shape and dtype."""
    spec = json.dumps([model_id, block_size, [[list(shape), dtype] for shape, dtype in arrays]])
    return hashlib.blake2b(b"trillm-kv-disk-v1:" + spec.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    directory: Path  # the --kv-cache-dir; this identity's blocks go to directory / identity
    max_bytes: int  # the cap on this identity's files
    identity: str  # kv_identity()
    block_bytes: int  # every block's payload size
    max_pending_bytes: int = 256 * 2**20  # queued writes (past it a write is dropped) and prefetched reads


class DiskTier:
    def __init__(self, config: DiskTierConfig) -> None:
        self.config = config
        self.folder = config.directory / config.identity
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards the index, the pending writes and the events
        self._index: OrderedDict[str, int] = OrderedDict()  # hash hex -> file size, least recently used first
        self.nbytes = 0
        self._pending: dict[bytes, bytes] = {}  # queued writes, readable before they land
        self._events: list[tuple[str, bytes]] = []  # ("stored" | "removed", hash) since take_events
        self.num_written = self.num_loaded = self.num_corrupt = self.num_dropped = self.num_evicted = 0
        self.read_seconds = self.write_seconds = 0.0  # in file reads (with their check) and writes, all threads
        self._scan()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="trillm-kv-disk-write", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="trillm-kv-disk-read")
        self._prefetched: OrderedDict[bytes, Future[bytes | None]] = OrderedDict()
        self._max_prefetched = max(1, config.max_pending_bytes // max(1, config.block_bytes))
        self._closed = False

    def _scan(self) -> None:
        """Index what a previous process left, oldest use first; remove a crash's temporary files."""
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name[: -len(SUFFIX)], st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self.nbytes += size
        self._evict_over_cap()

    # ---- the engine's side ---------------------------------------------------------------------------------
    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self._pending or h.hex() in self._index

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def put(self, h: bytes, payload: bytes, *, wait: bool = False) -> bool:
        """Queue a block's write; False (dropped, counted) when the queue holds max_pending_bytes already,
        unless `wait` (a close): then wait for the queue to empty."""
        assert len(payload) == self.config.block_bytes, (len(payload), self.config.block_bytes)
        with self._lock:
            if h in self._pending or h.hex() in self._index:
                return True
            full = (len(self._pending) + 1) * len(payload) > self.config.max_pending_bytes
        if full and wait:
            self.flush()
        elif full:
            self.num_dropped += 1
            return False
        with self._lock:
            self._pending[h] = payload
        self._queue.put((h, payload))
        return True

    def prefetch(self, hashes: Sequence[bytes]) -> None:
        """Start reading these blocks (a request's, at admission) so that `get` finds them read."""
        for h in hashes:
            if h in self._prefetched or h not in self:
                continue
            self._prefetched[h] = self._readers.submit(self._read, h)
            while len(self._prefetched) > self._max_prefetched:  # an aborted request's reads are never taken
                self._prefetched.popitem(last=False)

    def get(self, h: bytes) -> bytes | None:
        """The block's verified payload, or None (not here, or the file was bad: it is gone now)."""
        future = self._prefetched.pop(h, None)
        return future.result() if future is not None else self._read(h)

    def take_events(self) -> list[tuple[str, bytes]]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def flush(self) -> None:
        """Wait until every queued write has landed."""
        self._queue.join()

    def close(self) -> None:
        """Flush the queued writes and stop the threads."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        self._readers.shutdown(wait=True, cancel_futures=True)

    # ---- files ---------------------------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        return self.folder / (name + SUFFIX)

    def _read(self, h: bytes) -> bytes | None:
        with self._lock:
            pending = self._pending.get(h)
        if pending is not None:
            return pending
        name = h.hex()
        path = self._path(name)
        t0 = time.perf_counter()
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted meanwhile
            self._forget(name, removed=False)
            return None
        payload = self._verify(data, name)
        with self._lock:
            self.read_seconds += time.perf_counter() - t0
        if payload is None:
            log.warning("%s: a bad KV block file (truncated, altered or of another layout); deleted, recomputed", path)
            with self._lock:
                self.num_corrupt += 1
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self._forget(name, removed=True)
            return None
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            self.num_loaded += 1
        try:
            os.utime(path)  # the least-recently-used order survives a restart
        except FileNotFoundError:
            pass
        return payload

    def _verify(self, data: bytes, name: str) -> bytes | None:
        if len(data) < _PREFIX.size:
            return None
        magic, version, header_len = _PREFIX.unpack_from(data)
        if magic != MAGIC or version != VERSION or len(data) < _PREFIX.size + header_len:
            return None
        try:
            header = json.loads(data[_PREFIX.size : _PREFIX.size + header_len])
        except ValueError:
            return None
        payload = data[_PREFIX.size + header_len :]
        if not isinstance(header, dict) or header.get("identity") != self.config.identity or header.get("hash") != name:
            return None
        if header.get("size") != len(payload) or len(payload) != self.config.block_bytes:
            return None
        if header.get("blake2b") != hashlib.blake2b(payload, digest_size=16).hexdigest():
            return None
        return payload

    def _forget(self, name: str, *, removed: bool) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self.nbytes -= size
                if removed:
                    self._events.append(("removed", bytes.fromhex(name)))

    def _write_loop(self) -> None:
        renamed = False  # a rename the folder's fsync has not covered yet
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
                renamed = True
                if self._queue.empty():  # before task_done: a flush returns with the renames durable
                    renamed = False
                    self._sync_folder()
            except OSError:  # a full or failing disk costs the block, never the engine
                log.exception("writing a KV block to %s failed", self.folder)
                with self._lock:
                    self._pending.pop(item[0], None)
            finally:
                self._queue.task_done()
        try:
            if renamed:  # the last write was followed by the close
                self._sync_folder()
        except OSError:
            log.exception("syncing %s failed", self.folder)
        finally:
            self._queue.task_done()

    def _sync_folder(self) -> None:
        """fsync the folder: a file's own fsync makes its bytes durable, not the name `os.replace` gave it."""
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write(self, h: bytes, payload: bytes) -> None:
        t0 = time.perf_counter()
        name = h.hex()
        header = json.dumps({"identity": self.config.identity, "hash": name, "size": len(payload),
                             "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()},
                            separators=(",", ":")).encode()
        path = self._path(name)
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        size = _PREFIX.size + len(header) + len(payload)
        with self._lock:
            self._pending.pop(h, None)
            if name not in self._index:
                self.nbytes += size
            self._index[name] = size
            self._index.move_to_end(name)
            self._events.append(("stored", h))
            self.num_written += 1
            self.write_seconds += time.perf_counter() - t0
        self._evict_over_cap()

    def _evict_over_cap(self) -> None:
        while True:
            with self._lock:
                if self.nbytes <= self.config.max_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                self.nbytes -= size
                self.num_evicted += 1
                self._events.append(("removed", bytes.fromhex(name)))
            try:
                os.unlink(self._path(name))
            except FileNotFoundError:
                pass


def _block_arrays(pool: KVPool) -> list[tuple[list[mx.array], int]]:
    """Where each array of a block lives in the pool (a list and an index: growth replaces the arrays): K, V
    and the int8 cache's scales. A pool that gains other per-block arrays must list them here (`pool_identity`
    checks that every array is)."""
    lists = (pool.keys, pool.values, pool.key_scales, pool.value_scales)
    return [(lst, i) for lst in lists for i in range(len(lst))]


def pool_identity(model_id: str, pool: KVPool) -> tuple[str, int]:
    """(kv_identity of the pool's blocks, the bytes of one block)."""
    arrays = [lst[i] for lst, i in _block_arrays(pool)]
    if pool.states is not None or len(pool.arrays()) != len(arrays):
        raise ValueError("the disk tier would not save every array of the pool's blocks")
    spec = [(tuple(a.shape[1:]), str(a.dtype)) for a in arrays]
    return kv_identity(model_id, pool.block_size, spec), sum(a.nbytes // a.shape[0] for a in arrays)


class PooledDiskTier:
    """The block manager's lower tier (block_manager.LowerTier) over an MLX pool. Engine thread only."""

    def __init__(self, disk: DiskTier, pool: KVPool) -> None:
        self.disk = disk
        self.pool = pool
        self._saving: dict[bytes, mx.array] = {}  # gathered blocks, not yet handed to the writer
        self.num_loaded_blocks = 0

    def __contains__(self, h: bytes) -> bool:
        return h in self._saving or h in self.disk

    def save(self, block_id: int, h: bytes) -> None:
        """Keep block_id's contents (called before the block is reused): gathered now, written later."""
        import mlx.core as mx

        if h in self:
            return
        data = mx.concatenate([lst[i][block_id].reshape(-1).view(mx.uint8) for lst, i in _block_arrays(self.pool)])
        mx.async_eval(data)  # queued ahead of any forward that could overwrite the block
        self._saving[h] = data

    def materialize(self, *, wait: bool = False) -> None:
        """Hand the gathered blocks to the writer (after a step is read back they are computed already)."""
        saving, self._saving = self._saving, {}
        for h, data in saving.items():
            self.disk.put(h, np.asarray(data).tobytes(), wait=wait)

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Copy the blocks of `hashes` from disk into `block_ids`; returns how many leading ones were loaded."""
        import mlx.core as mx

        payloads = []
        for h in hashes:
            gathered = self._saving.get(h)  # evicted moments ago (by this very admission)
            p = np.asarray(gathered) if gathered is not None else self.disk.get(h)
            if p is None:
                break
            payloads.append(np.frombuffer(p, np.uint8))
        if not payloads:
            return 0
        k = len(payloads)
        stacked = np.stack(payloads)
        ids = mx.array(list(block_ids[:k]), mx.int32)
        offset = 0
        for lst, i in _block_arrays(self.pool):
            arr = lst[i]
            n = arr.nbytes // arr.shape[0]
            part = mx.array(np.ascontiguousarray(stacked[:, offset : offset + n])).view(arr.dtype)
            lst[i][ids] = part.reshape(k, *arr.shape[1:])
            offset += n
        self.num_loaded_blocks += k
        return k

    def prefetch(self, hashes: Sequence[bytes]) -> None:
        self.disk.prefetch(hashes)

    def take_events(self) -> list[tuple[str, bytes]]:
        return self.disk.take_events()

    def close(self, hot: Sequence[tuple[int, bytes]] = (), chunk: int = 64) -> None:
        """Write the gathered blocks and `hot` (block id, hash), a chunk at a time, then flush and stop."""
        self.materialize(wait=True)
        for start in range(0, len(hot), chunk):
            for block_id, h in hot[start : start + chunk]:
                self.save(block_id, h)
            self.materialize(wait=True)
        self.disk.close()
