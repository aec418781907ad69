"""The prefix cache's disk tier in /metrics and /stats, through the HTTP app over a real restart: the first
server's lookups miss and its evictions are written; the second finds the folder's files (counted against the
files themselves) and loads the prompt's blocks from them (counted against the usage's cached tokens)."""

from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from conftest import running_app
from trillm.engine.config import EngineConfig
from trillm.engine.llm_engine import LLMEngine

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md"
BODY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = "the quick brown fox jumps over the lazy dog " * 20  # 23 full blocks of the tiny model's tokens
# /metrics family (counters without _total, as the parser names them) -> /stats field
FIELDS = {"trillm_kv_disk_blocks": "kv_disk_blocks", "trillm_kv_disk_bytes": "kv_disk_bytes",
          "trillm_kv_disk_hit_blocks": "kv_disk_hit_blocks", "trillm_kv_disk_miss_blocks": "kv_disk_miss_blocks",
          "trillm_kv_disk_writes": "kv_disk_writes", "trillm_kv_disk_dropped_writes": "kv_disk_dropped_writes",
          "trillm_kv_disk_load_failures": "kv_disk_corrupt_blocks",
          "trillm_kv_disk_read_seconds": "kv_disk_read_seconds",
          "trillm_kv_disk_write_seconds": "kv_disk_write_seconds"}


class DiskFactory:
    def __init__(self, model: Path, directory: Path) -> None:
        self.model, self.directory = model, directory
        self.engines: list[LLMEngine] = []

    def __call__(self) -> LLMEngine:
        engine = LLMEngine(EngineConfig(model=str(self.model), block_size=16, num_kv_blocks=40, max_num_seqs=4,
                                        max_num_batched_tokens=64, verify_model=False, kv_slab_mb=1024,
                                        kv_cache_dir=str(self.directory)))
        self.engines.append(engine)
        return engine


async def disk_numbers(client: Any) -> dict[str, float]:
    """/stats' disk fields, after checking that /metrics says the same."""
    (model,) = (await (await client.get("/stats")).get_json())["models"]
    stats = model["engine"]
    text = await (await client.get("/metrics")).get_data(as_text=True)
    families = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("trillm_kv_disk_")}
    assert set(families) == set(FIELDS), set(families) ^ set(FIELDS)
    for name, field in FIELDS.items():
        (sample,) = families[name].samples
        assert sample.value == stats[field], (name, sample.value, stats[field])
        assert families[name].type == ("gauge" if name in ("trillm_kv_disk_blocks", "trillm_kv_disk_bytes")
                                       else "counter"), name
    return {field: stats[field] for field in (*FIELDS.values(), "kv_disk_hit_tokens")}


async def complete(client: Any, prompt: str) -> dict[str, Any]:
    r = await client.post("/v1/completions", json={**BODY, "prompt": prompt})
    assert r.status_code == 200, await r.get_data(as_text=True)
    usage: dict[str, Any] = (await r.get_json())["usage"]
    return usage


async def test_disk_tier_counters_over_a_restart(tiny_model_path: Path, tmp_path: Path) -> None:
    factory = DiskFactory(tiny_model_path, tmp_path)
    with trio.fail_after(120):
        async with running_app(factory) as client:
            usage = await complete(client, PROMPT)
            full = (usage["prompt_tokens"] - 1) // 16  # the blocks admission may take from a cache
            first = await disk_numbers(client)
            assert first["kv_disk_miss_blocks"] == full and first["kv_disk_hit_blocks"] == 0
            assert first["kv_disk_blocks"] == first["kv_disk_writes"] == 0  # nothing evicted yet
            await complete(client, "once upon a time there was a " * 30)  # takes blocks: the first's are evicted
            while (first := await disk_numbers(client))["kv_disk_writes"] == 0:  # written off the engine thread
                await complete(client, "a")  # a step refreshes the statistics
                await trio.sleep(0.02)
            assert first["kv_disk_write_seconds"] > 0 and first["kv_disk_blocks"] > 0
            disk = factory.engines[0].kv_disk
            assert disk is not None
            writer = disk.disk._writer
        await trio.to_thread.run_sync(writer.join, 30)  # the engine's close writes the hot blocks
        files = sorted(tmp_path.glob("*/*.kv"))
        assert len(files) >= full

        async with running_app(factory) as client:
            found = await disk_numbers(client)  # before any request: what the folder holds
            assert found["kv_disk_blocks"] == len(files)
            assert found["kv_disk_bytes"] == sum(f.stat().st_size for f in files)
            usage = await complete(client, PROMPT)
            second = await disk_numbers(client)
    assert usage["prompt_tokens_details"]["cached_tokens"] == full * 16  # all from disk: a new engine's memory is empty
    assert second["kv_disk_hit_blocks"] == full and second["kv_disk_miss_blocks"] == 0
    assert second["kv_disk_hit_tokens"] == full * 16
    assert second["kv_disk_read_seconds"] > 0 and second["kv_disk_corrupt_blocks"] == 0
    assert len(factory.engines) == 2


def test_the_operations_page_names_every_disk_tier_metric() -> None:
    doc = DOC.read_text()
    for name in FIELDS:
        exposed = name if name in ("trillm_kv_disk_blocks", "trillm_kv_disk_bytes") else name + "_total"
        assert f"`{exposed}`" in doc, exposed
