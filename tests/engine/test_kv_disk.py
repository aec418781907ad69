"""The prefix cache's disk tier (engine/kv_disk.py): blocks survive eviction and a restart, bad files are
recomputed and never loaded, and the folder stays under its cap, least recently used first."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

import model_zoo as zoo
from trillm.engine.config import EngineConfig
from trillm.engine.kv_disk import DiskTier, DiskTierConfig, kv_identity
from trillm.engine.kv_events import KVEventLog
from trillm.engine.llm_engine import LLMEngine
from trillm.engine.loader import LoadedModel, load_model
from trillm.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine(model: LoadedModel, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(block_size=16, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=64,
                                  verify_model=False, kv_slab_mb=1024)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=model)  # type: ignore[arg-type]


def prompt(model: LoadedModel, text: str = "the quick brown fox jumps over the lazy dog ") -> list[int]:
    return model.tokenizer.encode(text * 20)  # 23 full blocks of the tiny model's tokens


def uncached(model: LoadedModel, p: list[int]) -> tuple[int, ...]:
    return engine(model, enable_prefix_caching=False).generate([p], GREEDY)[0].new_token_ids


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kv"))


def test_a_restart_loads_the_blocks_instead_of_computing_them(tiny_model: LoadedModel, tmp_path: Path) -> None:
    p = prompt(tiny_model)
    want = uncached(tiny_model, p)
    first = engine(tiny_model, kv_cache_dir=str(tmp_path))
    assert first.generate([p], GREEDY)[0].new_token_ids == want
    assert first.statistics().kv_disk_writes == 0  # nothing evicted yet: the blocks are still in memory
    full = (len(p) - 1) // 16  # the blocks admission may take from a cache
    assert first.statistics().kv_disk_miss_blocks == full and first.statistics().kv_disk_hit_blocks == 0
    first.close()  # the hot blocks go to disk
    assert len(files(tmp_path)) == (len(p) + GREEDY.max_tokens - 1) // 16

    second = engine(tiny_model, kv_cache_dir=str(tmp_path))  # a new process's engine: an empty memory tier
    log = KVEventLog(second.block_manager)
    out = second.generate([p], GREEDY)[0]
    assert out.new_token_ids == want
    stats = second.statistics()
    assert out.usage.cached_tokens == stats.kv_disk_hit_tokens == full * 16
    assert stats.kv_disk_hit_blocks == full and stats.kv_disk_miss_blocks == 0 and stats.kv_disk_read_seconds > 0
    assert stats.num_prompt_tokens == len(p) - out.usage.cached_tokens  # only the tail was prefilled
    stored = [e for e in log.take() if e.kind == "stored"]
    assert {e.medium for e in stored} == {"memory"} and len(stored) >= len(p) // 16  # loaded blocks are published
    second.close()


def test_evicted_blocks_come_back_from_disk(tiny_model: LoadedModel, tmp_path: Path) -> None:
    p = prompt(tiny_model)
    want = uncached(tiny_model, p)
    eng = engine(tiny_model, kv_cache_dir=str(tmp_path))
    log = KVEventLog(eng.block_manager)
    eng.generate([p], GREEDY)
    for i in range(3):  # other prompts take every block: p's are evicted, written off the engine thread
        eng.generate([prompt(tiny_model, f"{i} once upon a time there was ")], GREEDY)
    eng.kv_disk.disk.flush()  # type: ignore[union-attr]
    eng.step()  # reports the writer's events
    disk_stored = [e for e in log.take() if e.medium == "disk" and e.kind == "stored"]
    assert len(disk_stored) == eng.statistics().kv_disk_writes > 0
    out = eng.generate([p], GREEDY)[0]
    assert out.new_token_ids == want
    assert eng.statistics().kv_disk_hit_tokens > 0 and out.usage.cached_tokens >= eng.statistics().kv_disk_hit_tokens
    eng.block_manager.check_invariants([])
    eng.close()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header"])
def test_a_bad_file_is_recomputed_never_loaded(tiny_model: LoadedModel, tmp_path: Path, damage: str) -> None:
    p = prompt(tiny_model)
    want = uncached(tiny_model, p)
    first = engine(tiny_model, kv_cache_dir=str(tmp_path))
    first.generate([p], GREEDY)
    first.close()
    # The first block's file: every later block chains from it, so nothing of the prompt may load.
    (bad,) = tmp_path.glob(f"*/{_first_block_hash(first, p).hex()}.kv")
    data = bytearray(bad.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data[len(data) - 7 if damage == "flip_payload" else 20] ^= 0x10
    bad.write_bytes(bytes(data))

    second = engine(tiny_model, kv_cache_dir=str(tmp_path))
    out = second.generate([p], GREEDY)[0]
    assert out.new_token_ids == want
    stats = second.statistics()
    assert stats.kv_disk_corrupt_blocks == 1 and stats.kv_disk_hit_tokens == 0
    assert stats.kv_disk_miss_blocks == (len(p) - 1) // 16  # the chain breaks at its first block
    assert stats.num_prompt_tokens == len(p)  # all recomputed
    assert not bad.exists()  # deleted, not tried again
    second.close()


def _first_block_hash(eng: LLMEngine, p: list[int]) -> bytes:
    from trillm.engine.block_manager import block_hashes

    return block_hashes(eng.block_manager.hash_seed, p, 16, 1)[0]


def _tier(folder: Path, max_blocks: int, identity: str = "x" * 32) -> DiskTier:
    payload = 1000
    size = 16 + 150 + payload  # about one file
    return DiskTier(DiskTierConfig(folder, max_blocks * size, identity, payload))


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _payload(i: int) -> bytes:
    return np.full(1000, i, np.uint8).tobytes()


def test_the_folder_stays_under_its_cap_least_recently_used_first(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 3)
    for i in range(3):
        tier.put(_h(i), _payload(i))
    tier.flush()
    assert tier.get(_h(0)) == _payload(0)  # used: block 1 is now the least recently used
    tier.put(_h(3), _payload(3))
    tier.flush()
    assert [h in tier for h in map(_h, range(4))] == [True, False, True, True]
    assert tier.nbytes <= tier.config.max_bytes and len(list(tier.folder.glob("*.kv"))) == 3
    assert ("removed", _h(1)) in tier.take_events()
    tier.close()
    # A restart keeps the order of use (mtimes) and the cap; a crash's temporary file is removed.
    (tier.folder / f".{_h(9).hex()}.123.tmp").write_bytes(b"half a block")
    os.utime(tier.folder / f"{_h(2).hex()}.kv", ns=(1, 1))  # used long ago
    again = _tier(tmp_path, 2)
    assert [h in again for h in map(_h, range(4))] == [True, False, False, True]
    assert not list(again.folder.glob("*.tmp"))
    assert again.get(_h(3)) == _payload(3)
    again.close()


def test_another_identity_never_reads_the_files(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 4, "a" * 32)
    tier.put(_h(1), _payload(1))
    tier.close()
    # The same file moved under another identity's folder (a copy, a rename of folders) is refused.
    other = _tier(tmp_path, 4, "b" * 32)
    (tier.folder / f"{_h(1).hex()}.kv").rename(other.folder / f"{_h(1).hex()}.kv")
    other.close()
    other = _tier(tmp_path, 4, "b" * 32)
    assert _h(1) in other and other.get(_h(1)) is None and other.num_corrupt == 1
    other.close()
    assert kv_identity("m", 16, [((16, 2, 8), "mlx.core.float32")]) != kv_identity("m", 16, [((16, 2, 8), "mlx.core.int8")])


def test_a_full_queue_drops_writes_instead_of_waiting(tmp_path: Path) -> None:
    tier = DiskTier(DiskTierConfig(tmp_path, 10**9, "c" * 32, 1000, max_pending_bytes=2000))
    gate = threading.Event()
    real_write = tier._write
    tier._write = lambda h, p: (gate.wait(), real_write(h, p))  # type: ignore[method-assign]  # a slow disk
    assert [tier.put(_h(i), _payload(i)) for i in range(4)] == [True, True, False, False]
    assert tier.num_dropped == 2 and _h(1) in tier and tier.get(_h(1)) == _payload(1)  # readable while queued
    gate.set()
    tier.close()
    assert tier.num_written == 2 and [h in tier for h in map(_h, range(4))] == [True, True, False, False]


def test_a_hybrid_model_gets_no_disk_tier(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    hybrid = load_model(str(zoo.build("qwen3_next", tmp_path_factory.mktemp("hy") / "qwen3_next")))
    eng = engine(hybrid, kv_cache_dir=str(tmp_path), num_kv_blocks=64)
    assert eng.kv_disk is None and eng.block_manager.lower is None
    eng.close()


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_a_quantized_cache_round_trips_and_never_reads_float_blocks(tiny_model: LoadedModel, tmp_path: Path,
                                                                  kv: str) -> None:
    p = prompt(tiny_model)
    fp = engine(tiny_model, kv_cache_dir=str(tmp_path))
    fp.generate([p], GREEDY)
    fp.close()
    want = engine(tiny_model, kv_cache_dtype=kv, enable_prefix_caching=False).generate([p], GREEDY)[0]
    first = engine(tiny_model, kv_cache_dir=str(tmp_path), kv_cache_dtype=kv)
    assert first.generate([p], GREEDY)[0].new_token_ids == want.new_token_ids
    assert first.statistics().kv_disk_hit_tokens == 0  # the float32 blocks are another identity's
    first.close()
    assert len({f.parent for f in files(tmp_path)}) == 2
    second = engine(tiny_model, kv_cache_dir=str(tmp_path), kv_cache_dtype=kv)
    out = second.generate([p], GREEDY)[0]
    assert out.new_token_ids == want.new_token_ids and second.statistics().kv_disk_hit_tokens > 0  # scales too
    second.close()


def test_the_idle_shrink_writes_what_it_drops(tiny_model: LoadedModel, tmp_path: Path) -> None:
    p = prompt(tiny_model)
    want = uncached(tiny_model, p)
    eng = engine(tiny_model, kv_cache_dir=str(tmp_path), kv_slab_mb=0.25, kv_idle_keep_mb=0.25, kv_idle_release_s=0,
                 num_kv_blocks=64)
    eng.generate([p], GREEDY)
    eng.generate([prompt(tiny_model, "once upon a time there was ")], GREEDY)  # the most recent: kept
    assert eng.release_idle_memory() > 0
    eng.kv_disk.disk.flush()  # type: ignore[union-attr]
    assert eng.statistics().kv_disk_writes > 0
    out = eng.generate([p], GREEDY)[0]
    assert out.new_token_ids == want and eng.statistics().kv_disk_hit_tokens > 0
    eng.block_manager.check_invariants([])
    eng.close()


def test_the_folder_is_fsynced_after_the_renames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file's fsync does not make its new name durable: the folder's own fsync after os.replace does."""
    import stat

    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        calls.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tier = _tier(tmp_path, 8)
    tier.put(_h(1), _payload(1))
    tier.flush()  # returns once the rename is durable
    assert calls == ["fsync file", "replace", "fsync folder"]
    for i in range(2, 5):
        tier.put(_h(i), _payload(i))
    tier.close()  # the last rename is synced before the writer stops, however the burst was grouped
    assert calls[-1] == "fsync folder" and calls.count("replace") == 4
    assert all(calls[i - 1] == "fsync file" for i, c in enumerate(calls) if c == "replace")
