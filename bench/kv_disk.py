"""`trillm bench kv-disk`: the prefix cache's disk tier (engine/kv_disk.py) on the default model.

1. Restart: a long shared system prompt (4k tokens) and a question. TTFT of a fresh engine without a disk
   tier (cold) against a fresh engine over a disk tier an earlier engine filled and closed (a restart), with
   the files in the page cache and with them dropped from it (posix_fadvise DONTNEED); the output must be the
   cold run's, token for token. Also TTFT of a memory-tier hit, for scale.
2. More prefixes than memory holds: --prefixes distinct prefixes, the memory tier sized (--kv-cache-memory-gb)
   for --memory-prefixes of them; one round in order, then --rounds shuffled rounds, one request at a time.
   Hit rate and TTFT of the shuffled rounds, memory only against memory + disk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS before mlx)

from trillm.engine.config import EngineConfig  # noqa: E402
from trillm.engine.kv_cache import KVLayout  # noqa: E402
from trillm.engine.llm_engine import LLMEngine  # noqa: E402
from trillm.engine.loader import LoadedModel, load_model  # noqa: E402
from trillm.engine.sampling_params import SamplingParams  # noqa: E402
from trillm.kernels import cpu_ext  # noqa: E402

TEXT = ("You are a careful assistant for a hardware shop. Answer questions about tools, paint, timber and "
        "fasteners; say when you do not know; never invent prices or stock levels. ")
QUESTIONS = ["Which screws hold oak shelves?", "How long does gloss paint take to dry?",
             "Can I cut plywood with a jigsaw?", "What is a masonry bit for?", "Do you sell wood glue?"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def system_prompt(model: LoadedModel, n: int, variant: int = 0) -> list[int]:
    """n tokens of shop rules; `variant` changes the first token (a distinct prefix from block 0 on)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += model.tokenizer.encode(TEXT)
    return [100 + variant] + ids[: n - 1]


def question(model: LoadedModel, i: int) -> list[int]:
    return model.tokenizer.encode(f"\nuser: {QUESTIONS[i % len(QUESTIONS)]} (#{i})\nassistant:")


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, tuple[int, ...]]:
    """(seconds to the first token, the output's tokens) of one request on an idle engine."""
    rid = f"kvd-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, PARAMS)
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                first = first if first is not None else time.perf_counter() - t0
                tokens += out.new_token_ids
    if first is None:
        raise SystemExit("bench kv-disk: a request produced no token")
    return first, tuple(tokens)


def drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engine(model: LoadedModel, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(max_num_batched_tokens=2048, verify_model=False, **kw), loaded=model)


def restart(model: LoadedModel, tokens: int, trials: int) -> dict[str, Any]:
    system = system_prompt(model, tokens)
    prompt = system + question(model, 0)
    rows: dict[str, list[float]] = {"cold": [], "disk": [], "disk_dropped": [], "memory_hit": []}
    loaded = []
    for t in range(trials):
        with tempfile.TemporaryDirectory(prefix="trillm-kvd-") as d:
            cold_s, want = ttft(engine(model), prompt)
            filler = engine(model, kv_cache_dir=d)
            ttft(filler, system + question(model, 1))  # its blocks stay in memory, then go to disk at close
            filler.close()
            warm = engine(model, kv_cache_dir=d)
            disk_s, got = ttft(warm, prompt)
            warm.close()
            drop_page_cache(Path(d))
            fresh = engine(model, kv_cache_dir=d)
            dropped_s, got_dropped = ttft(fresh, prompt)
            mem_s, _ = ttft(fresh, system + question(model, 2 + t))
            loaded.append(fresh.statistics().kv_disk_hit_tokens)
            fresh.close()
            if got != want or got_dropped != want:
                raise SystemExit(f"bench kv-disk: the disk tier's output {got} / {got_dropped} is not the cold run's {want}")
            for k, v in zip(rows, (cold_s, disk_s, dropped_s, mem_s)):
                rows[k].append(v)
        print(f"trial {t}: TTFT cold {cold_s:.3f} s, restart + disk {disk_s:.3f} s "
              f"(page cache dropped {dropped_s:.3f} s), memory hit {mem_s:.3f} s", flush=True)
    if min(loaded) < tokens // 16 * 16:
        raise SystemExit(f"bench kv-disk: the restarted engine loaded only {min(loaded)} of {tokens} tokens")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"prompt_tokens": len(prompt), "trials": trials, "loaded_tokens": min(loaded), "median_s": med,
            "disk_over_cold": med["disk"] / med["cold"], "disk_dropped_over_cold": med["disk_dropped"] / med["cold"]}


def many_prefixes(model: LoadedModel, n: int, memory_prefixes: int, tokens: int, rounds: int,
                  disk_gb: float) -> dict[str, Any]:
    per_block = KVLayout.uniform(model.num_layers, model.num_kv_heads, model.head_dim).bytes_per_block(16, model.dtype)
    blocks = -(-(tokens + 32) // 16)
    memory_gb = (memory_prefixes * blocks + 1) * per_block / 1e9
    prefixes = [system_prompt(model, tokens, v) for v in range(n)]
    rng = random.Random(0)
    order = list(range(n)) + [i for _ in range(rounds) for i in rng.sample(range(n), n)]
    out: dict[str, Any] = {"prefixes": n, "memory_prefixes": memory_prefixes, "prefix_tokens": tokens,
                           "kv_cache_memory_gb": memory_gb, "rounds": rounds}
    with tempfile.TemporaryDirectory(prefix="trillm-kvd-") as d:
        for name, kw in (("memory", {}), ("memory+disk", {"kv_cache_dir": d, "kv_cache_dir_gb": disk_gb})):
            eng = engine(model, kv_cache_memory_gb=memory_gb, **kw)
            times = []
            for j, i in enumerate(order):
                if j == n:  # the shuffled rounds are measured
                    eng.block_manager.num_queried_tokens = eng.block_manager.num_hit_tokens = 0
                s, _ = ttft(eng, prefixes[i] + question(model, j))
                if j >= n:
                    times.append(s)
            stats = eng.statistics()
            eng.close()
            row = {"hit_rate": stats.prefix_cache_hit_rate, "ttft_mean_s": statistics.mean(times),
                   "ttft_p50_s": statistics.median(times), "ttft_p90_s": sorted(times)[int(0.9 * len(times))],
                   "disk_writes": stats.kv_disk_writes, "disk_dropped_writes": stats.kv_disk_dropped_writes,
                   "disk_gb": stats.kv_disk_bytes / 1e9}
            out[name] = row
            print(f"{name:>11}: hit rate {row['hit_rate']:.2f}, TTFT mean {row['ttft_mean_s']:.3f} s, p50 "
                  f"{row['ttft_p50_s']:.3f} s, p90 {row['ttft_p90_s']:.3f} s; disk writes {row['disk_writes']} "
                  f"(dropped {row['disk_dropped_writes']}), {row['disk_gb']:.2f} GB on disk", flush=True)
    if out["memory+disk"]["hit_rate"] <= out["memory"]["hit_rate"]:
        raise SystemExit("bench kv-disk: the disk tier added no hits")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trillm bench kv-disk", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--system-tokens", type=int, default=4096, help="the shared system prompt's length")
    ap.add_argument("--trials", type=int, default=3, help="restart trials; the median counts")
    ap.add_argument("--prefixes", type=int, default=40, help="distinct prefixes (10x --memory-prefixes)")
    ap.add_argument("--memory-prefixes", type=int, default=4, help="prefixes the memory tier holds")
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="shuffled rounds measured after the first, in order")
    ap.add_argument("--kv-cache-dir-gb", type=float, default=10.0)
    ap.add_argument("--skip-restart", action="store_true")
    ap.add_argument("--skip-prefixes", action="store_true")
    ap.add_argument("--results", default="results", help="folder for the JSON result")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    ext = cpu_ext.load()
    print(f"model {model.name} ({model.dtype}); CPU kernels {ext.SIMD if ext is not None else 'unavailable'}; "
          f"load {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    result: dict[str, Any] = {"model": model.name, "cpu_isa": ext.SIMD if ext is not None else None,
                              "load": os.getloadavg()[0]}
    if not args.skip_restart:
        r = result["restart"] = restart(model, args.system_tokens, args.trials)
        m = r["median_s"]
        print(f"restart, {r['prompt_tokens']} tokens ({r['loaded_tokens']} from disk): TTFT cold {m['cold']:.3f} s, "
              f"disk {m['disk']:.3f} s ({r['disk_over_cold']:.2f}x), page cache dropped {m['disk_dropped']:.3f} s "
              f"({r['disk_dropped_over_cold']:.2f}x), memory hit {m['memory_hit']:.3f} s")
    if not args.skip_prefixes:
        result["prefixes"] = many_prefixes(model, args.prefixes, args.memory_prefixes, args.prefix_tokens,
                                           args.rounds, args.kv_cache_dir_gb)
    if len(result) == 3:
        raise SystemExit("bench kv-disk measured nothing (both parts skipped)")
    result["load_end"] = os.getloadavg()[0]  # a shared machine's load moves during a run: both ends recorded
    print(f"load at the end {result['load_end']:.2f}")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kv-disk-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
