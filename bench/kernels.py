"""`trillm bench kernels`: the paged-KV kernels and references against gather + mx.fast SDPA.

Times paged decode attention (this back-end's kernel where it has one, the reference always) and
`mx.fast.scaled_dot_product_attention` on already-gathered contiguous K/V, over contexts x batches;
reports ms, effective GB/s (K+V bytes read / time) and the fraction of peak memory bandwidth (a measured
read bandwidth on CPU, a known-peak table on GPU). Also: kv_write in place (donated) vs copying, gather,
and on CPU the references' cost per decode step for SmolLM2-like shapes. JSON goes to <results>/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.bench.harness.results import int_list, new_results_dir, write_meta
from trillm.kernels.backend import kernel_backend
from trillm.kernels.kv_gather import kv_gather, kv_gather_ref
from trillm.kernels.kv_write import kv_write_ref
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import KERNELS as ATTENTION_KERNELS
from trillm.kernels.paged_attention import paged_attention_ref

# (num_q_heads, num_kv_heads, head_dim, layers)
SHAPES = {"smollm2": (9, 3, 64, 30), "llama8b": (32, 8, 128, 32)}
# Known peak DRAM bandwidth, GB/s, by device-name substring (first match wins).
PEAK_GBS = {
    "H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40": 864.0, "4090": 1008.0,
    "M4 Max": 546.0, "M4 Pro": 273.0, "M3 Max": 400.0, "M3 Pro": 150.0, "M2 Ultra": 800.0, "M2 Max": 400.0,
    "M2 Pro": 200.0, "M1 Ultra": 800.0, "M1 Max": 400.0, "M1 Pro": 200.0, "M4": 120.0, "M3": 100.0, "M2": 100.0,
    "M1": 68.0,
}  # fmt: skip


def time_ms(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Median wall time of fn() with its result evaluated, in ms."""
    for _ in range(warmup):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def device_peak(override: float | None) -> tuple[str, float]:
    """(device description, peak GB/s): the override, the GPU table, or the CPU's measured read bandwidth."""
    if override:
        return "given", override
    if mx.default_device() == mx.gpu:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        name = str(info.get("device_name") or info.get("architecture") or "gpu")
        for key, gbs in PEAK_GBS.items():
            if key in name:
                return name, gbs
        return name, float("nan")
    from trillm.bench.engine import memory_bandwidth_gbs  # all cores; MLX's own copy is single-threaded

    return "cpu (measured read, all cores)", memory_bandwidth_gbs()


def memory_budget_bytes() -> int | None:
    """Half the GPU's memory as MLX reports it (Metal: the recommended working set; CUDA: free, else total
    memory), or None off the GPU / when MLX says nothing. The defaults' largest point (B=64 x 32k, llama8b
    f16: 8 GiB of K/V, ~4x that with the gathered copies) would not fit a 16-24 GB Mac."""
    if mx.default_device() != mx.gpu or not hasattr(mx, "device_info"):
        return None
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "free_memory", "total_memory", "memory_size"):
        if isinstance(value := info.get(key), int) and value > 0:
            return value // 2
    return None


def point_bytes(batch: int, ctx: int, shape: tuple[int, int, int, int], bs: int, dtype: mx.Dtype) -> int:
    """Peak bytes of one attention point: the K/V pool, the gathered K/V kept for SDPA, and the gather that
    gather_plus_sdpa makes while those are alive (3 copies of K+V) plus slack for the outputs."""
    _, hkv, d, _ = shape
    kv = 2 * batch * (-(-ctx // bs) * bs) * hkv * d * dtype.size
    return 4 * kv


def make_pool(batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype: mx.Dtype) -> dict[str, Any]:
    """A pool holding `batch` rows of `ctx` tokens in shuffled blocks, plus a decode query."""
    blocks = -(-ctx // bs)
    num_blocks = 1 + batch * blocks
    k_pool = mx.random.normal((num_blocks, bs, hkv, d)).astype(dtype)
    v_pool = mx.random.normal((num_blocks, bs, hkv, d)).astype(dtype)
    tables = (mx.random.permutation(num_blocks - 1)[: batch * blocks] + 1).reshape(batch, blocks).astype(mx.int32)
    q = mx.random.normal((batch, hq, 1, d)).astype(dtype)
    lens = mx.full((batch,), ctx, dtype=mx.int32)
    mx.eval(k_pool, v_pool, tables, q, lens)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, context_lens=lens)


def bench_attention(
    batch: int, ctx: int, shape: tuple[int, int, int, int], bs: int, dtype: mx.Dtype, iters: int, peak: float
) -> dict[str, Any]:
    hq, hkv, d, _ = shape
    p = make_pool(batch, ctx, hq, hkv, d, bs, dtype)
    args = (p["q"], p["k_pool"], p["v_pool"], p["block_tables"], p["context_lens"])
    kv_bytes = 2 * batch * ctx * hkv * d * dtype.size
    row: dict[str, Any] = dict(batch=batch, context=ctx, kv_mb=round(kv_bytes / 2**20, 2))
    timings = {"reference": lambda: paged_attention_ref(*args, scale=d**-0.5)}
    kernel = ATTENTION_KERNELS.get(kernel_backend() or "")
    if kernel is not None and kernel.supports(ModelShapes(hq, hkv, d, bs, dtype)) is None:
        timings["kernel"] = lambda: kernel.fn(*args, scale=d**-0.5)
    keys = kv_gather_ref(p["k_pool"], p["block_tables"], ctx)
    values = kv_gather_ref(p["v_pool"], p["block_tables"], ctx)
    mx.eval(keys, values)
    timings["sdpa_on_gathered"] = lambda: mx.fast.scaled_dot_product_attention(p["q"], keys, values, scale=d**-0.5)
    timings["gather_plus_sdpa"] = lambda: mx.fast.scaled_dot_product_attention(
        p["q"], kv_gather(p["k_pool"], p["block_tables"], ctx), kv_gather(p["v_pool"], p["block_tables"], ctx),
        scale=d**-0.5,
    )  # fmt: skip
    for name, fn in timings.items():
        ms = time_ms(fn, iters)
        gbs = kv_bytes / (ms * 1e-3) / 1e9
        row[name] = dict(ms=round(ms, 4), gbs=round(gbs, 2), peak_frac=round(gbs / peak, 3))
    if "kernel" in row:
        row["kernel_vs_gather_plus_sdpa"] = round(row["gather_plus_sdpa"]["ms"] / row["kernel"]["ms"], 3)
    del p, keys, values
    return row


def bench_kv_write(pool_mb: int, hkv: int, d: int, bs: int, tokens: int, iters: int) -> dict[str, float]:
    """kv_write on a pool_mb pool: rebinding the pool (donated, in place) vs keeping a reference (copy)."""
    num_blocks = pool_mb * 2**20 // (bs * hkv * d * 4)
    k_pool = mx.zeros((num_blocks, bs, hkv, d))
    v_pool = mx.zeros((num_blocks, bs, hkv, d))
    new = mx.random.normal((tokens, hkv, d))
    slots = mx.random.randint(0, num_blocks * bs, (tokens,)).astype(mx.int32)
    mx.eval(k_pool, v_pool, new, slots)
    samples = []
    for i in range(iters + 2):
        t0 = time.perf_counter()
        k_pool, v_pool = kv_write_ref(k_pool, v_pool, new, new, slots)  # rebinding: the old pool dies
        mx.eval(k_pool, v_pool)
        if i >= 2:
            samples.append((time.perf_counter() - t0) * 1e3)
    in_place = statistics.median(samples)
    held = (k_pool, v_pool)  # noqa: F841  (a live reference forces MLX to copy)
    copying = time_ms(lambda: kv_write_ref(k_pool, v_pool, new, new, slots), iters)
    return dict(pool_mb=pool_mb, tokens=tokens, in_place_ms=round(in_place, 4), with_live_reference_ms=round(copying, 3))


def bench_decode_step(
    shape: tuple[int, int, int, int], bs: int, batch: int, ctx: int, iters: int
) -> dict[str, float]:
    """The references' cost per decode step: layers x (kv_write of B tokens + paged attention), fp32."""
    hq, hkv, d, layers = shape
    p = make_pool(batch, ctx, hq, hkv, d, bs, mx.float32)
    new = mx.random.normal((batch, hkv, d))
    slots = (p["block_tables"][:, -1] * bs + (ctx - 1) % bs).astype(mx.int32)
    mx.eval(new, slots)
    pools = [(p["k_pool"], p["v_pool"])]

    def step() -> mx.array:
        k_pool, v_pool = pools.pop()
        out = []
        for _ in range(layers):  # one shared pool stands in for each layer's own (same cost)
            k_pool, v_pool = kv_write_ref(k_pool, v_pool, new, new, slots)
            out.append(paged_attention_ref(p["q"], k_pool, v_pool, p["block_tables"], p["context_lens"], scale=0.125))
        pools.append((k_pool, v_pool))
        return mx.stack(out)

    ms = time_ms(step, iters)
    return dict(batch=batch, context=ctx, layers=layers, ms_per_step=round(ms, 3), ms_per_layer=round(ms / layers, 4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trillm bench kernels", description=__doc__.split("\n")[0])
    gpu = mx.default_device() == mx.gpu
    parser.add_argument("--contexts", type=int_list, default=[512, 2048, 8192, 32768] if gpu else [512, 2048, 8192])
    parser.add_argument("--batches", type=int_list, default=[1, 8, 64] if gpu else [1, 8])
    parser.add_argument("--full", action="store_true", help="contexts 512..32k x batches 1..64")
    parser.add_argument("--max-tokens", type=int, default=1 << 30 if gpu else 65536,
                        help="skip points where batch x context exceeds this (CPU default keeps it to minutes)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b" if gpu else "smollm2")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float16" if gpu else "float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10 if gpu else 5)
    parser.add_argument("--peak-gbs", type=float, default=None, help="override the peak memory bandwidth")
    parser.add_argument("--results", type=Path, default=Path("results"), help="results root folder")
    parser.add_argument("--no-decode-step", action="store_true", help="CPU: skip the references' decode-step cost")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="skip points needing more memory than this (default: half the GPU's, see memory_budget_bytes)")
    args = parser.parse_args(argv)
    if args.full:
        args.contexts, args.batches = [512, 1024, 2048, 4096, 8192, 16384, 32768], [1, 4, 8, 16, 32, 64]
    dtype = getattr(mx, args.dtype)
    shape = SHAPES[args.shape]
    device, peak = device_peak(args.peak_gbs)
    print(f"device {mx.default_device()} ({device}), peak {peak:.1f} GB/s, kernel back-end: {kernel_backend()} "
          f"({'has' if kernel_backend() in ATTENTION_KERNELS else 'no'} attention kernel), "
          f"shape {args.shape} Hq/Hkv/D={shape[:3]}, {args.dtype}, block {args.block_size}")  # fmt: skip
    result: dict[str, Any] = dict(device=device, peak_gbs=peak, backend=kernel_backend(), shape=args.shape,
                                  dtype=args.dtype, block_size=args.block_size, attention=[])  # fmt: skip
    print(f"{'B':>3} {'ctx':>6} {'KV MB':>8} | " + " | ".join(f"{n:>24}" for n in ("reference", "kernel", "sdpa_on_gathered", "gather_plus_sdpa")))
    budget = args.max_bytes or memory_budget_bytes()
    result["memory_budget_bytes"] = budget
    result["skipped_for_memory"] = []
    for ctx in args.contexts:
        for batch in args.batches:
            if batch * ctx > args.max_tokens:
                continue
            if budget is not None and (need := point_bytes(batch, ctx, shape, args.block_size, dtype)) > budget:
                print(f"{batch:>3} {ctx:>6} skipped: needs ~{need / 2**30:.1f} GiB, the budget is {budget / 2**30:.1f} GiB")
                result["skipped_for_memory"].append(dict(batch=batch, context=ctx, bytes=need))
                continue
            row = bench_attention(batch, ctx, shape, args.block_size, dtype, args.iters, peak)
            result["attention"].append(row)
            cells = []
            for n in ("reference", "kernel", "sdpa_on_gathered", "gather_plus_sdpa"):
                c = row.get(n)
                cells.append(f"{c['ms']:8.3f}ms {c['gbs']:6.1f}GB/s {c['peak_frac']:5.2f}" if c else f"{'-':>24}")
            print(f"{batch:>3} {ctx:>6} {row['kv_mb']:>8} | " + " | ".join(cells), flush=True)
    hq, hkv, d, _ = shape
    result["kv_write"] = bench_kv_write(50, hkv, d, args.block_size, 64, args.iters)
    print(f"kv_write 64 tokens into a 50 MB pool: in place {result['kv_write']['in_place_ms']} ms, "
          f"with a live reference (copy) {result['kv_write']['with_live_reference_ms']} ms")
    if not gpu and not args.no_decode_step:
        result["decode_step"] = [
            bench_decode_step(SHAPES["smollm2"], args.block_size, b, c, max(2, args.iters // 2))
            for b, c in ((1, 512), (8, 512), (8, 2048), (32, 1024))
        ]
        for r in result["decode_step"]:
            print(f"reference decode step (SmolLM2 shapes, 30 layers) B={r['batch']} ctx={r['context']}: "
                  f"{r['ms_per_step']} ms ({r['ms_per_layer']} ms/layer)")
    out_dir = new_results_dir(args.results, "kernels-" + time.strftime("%Y%m%d-%H%M%S"))
    (out_dir / "bench_kernels.json").write_text(json.dumps(result, indent=2))
    write_meta(out_dir, "trillm bench kernels", list(argv or []), vars(args) | {"results": str(args.results)})
    print(f"wrote {out_dir / 'bench_kernels.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
