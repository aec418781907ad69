"""Resident memory after load with the weights kept quantized, against their dequantized float32 load.

    trillm bench quant-memory [--layers N] [--skip-default]
    trillm bench quant-memory --serve-idle [--idle-s S] [--load N] [--llama-server PATH]

1. The default model (SmolLM2-135M-Instruct, Q4_1 GGUF), loaded by `load_model` in a fresh process with
   `--dtype quantized` (the default) and with `--dtype float32`: VmRSS after the load.
2. A Qwen-2.5-7B-shaped model (mlx-lm's qwen2 with 7B's config) with random Q4_0 weights (4-bit, groups of
   32, float16 scales, bias -8 * scale: what engine/gguf.py repacks Q4_0 into), built in place: every
   packed array is random words, never a float32 copy. VmRSS after it is evaluated, its weight bytes, the
   float32 bytes it would take, and three decode steps through trillm's fused ops (quant_linear).
   `--layers N` builds N of its 28 layers (the figure is then extrapolated per layer, and says so).
3. `--serve-idle` (instead of 1 and 2): the idle resident memory of a served model, each server started alone,
   healthy, then left idle `--idle-s` seconds: `trillm serve` on the default GGUF, and `trillm serve` and
   `mlx_lm.server` on the same fp32 MLX folder (bench/harness/export_mlx.py, what `bench peers` serves); with
   `--llama-server PATH`, llama.cpp's own server on the default GGUF too. VmRSS of the server's whole process
   tree (trillm's self-check child, if one is still alive, counts). Then (`--load N`, default 8; 0: none) N
   concurrent chat requests of a ~`--load-prompt-tokens`-token prompt and `--load-max-tokens` tokens each, and
   again VmRSS, and the peak: the sum of VmHWM over the tree (each process's own high-water mark; an upper
   bound on the tree's), also read before the load (the start-up's peak).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

QWEN_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "vocab_size": 152064,
    "rope_theta": 1e6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
}  # fmt: skip


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _one_default(dtype: str) -> None:
    from trillm.engine.loader import load_model

    before = rss_mb()
    loaded = load_model(None, dtype=dtype)
    print(json.dumps({"dtype": dtype, "rss_before_mb": before, "rss_mb": rss_mb(),
                      "weight_mb": loaded.num_bytes / 2**20}))  # fmt: skip


def default_model_rows() -> list[dict[str, Any]]:
    rows = []
    for dtype in ("quantized", "float32"):
        proc = subprocess.run([sys.executable, "-m", "trillm.bench.quant_memory", "--one-default", dtype],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def build_qwen_q4_0(layers: int) -> nn.Module:
    """Qwen 2.5 7B's modules with random Q4_0 weights, evaluated; no float32 matrix is ever materialized
    (mlx-lm's initializers stay lazy graphs that are replaced before anything evaluates them)."""
    from mlx_lm.models import qwen2

    model = qwen2.Model(qwen2.ModelArgs.from_dict({**QWEN_7B, "num_hidden_layers": layers}))
    nn.quantize(model, group_size=32, bits=4)  # lazy: replaced below
    for i, (_, m) in enumerate(model.named_modules()):
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n, k = m.weight.shape[0], m.weight.shape[1] * 8
            key = mx.random.key(i)
            m.weight = mx.random.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=mx.int32, key=key).view(mx.uint32)
            m.scales = (mx.random.uniform(0.5, 1.5, (n, k // 32), key=mx.random.split(key)[0]) * (0.5 / k**0.5)
                        ).astype(mx.float16)
            m.biases = m.scales * mx.array(-8.0, dtype=mx.float16)
            if isinstance(m, nn.QuantizedEmbedding):  # lookups dequantize in the scales' dtype (as the loader)
                m.scales, m.biases = m.scales.astype(mx.float32), m.biases.astype(mx.float32)
            mx.eval(m.weight, m.scales, m.biases)
    mx.eval(model.parameters())
    return model


def qwen_row(layers: int) -> dict[str, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    from trillm.engine.fused_ops import fused_ops, install_fused_ops
    from trillm.engine.loader import parameters

    before = rss_mb()
    t0 = time.perf_counter()
    model = build_qwen_q4_0(layers)
    build_s = time.perf_counter() - t0
    after = rss_mb()
    weight_bytes = sum(v.nbytes for _, v in parameters(model))
    layer_bytes = sum(v.nbytes for _, v in parameters(model.model.layers[0]))
    params = sum(v.size * (8 if v.dtype == mx.uint32 else 1) for k, v in parameters(model)
                 if not k.endswith((".scales", ".biases")))
    install_fused_ops(model)
    cache = make_prompt_cache(model)
    token = mx.array([[1]])
    times = []
    with fused_ops():
        for _ in range(3):
            t0 = time.perf_counter()
            logits = model(token, cache=cache)
            token = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(token)
            times.append(time.perf_counter() - t0)
    return {"layers": layers, "rss_before_mb": before, "rss_mb": after, "weight_mb": weight_bytes / 2**20,
            "params": params, "fp32_mb": params * 4 / 2**20, "layer_mb": layer_bytes / 2**20, "build_s": build_s, "decode_s": min(times[1:])}


def tree_rss_mb(pid: int, field: str = "VmRSS") -> float:
    """`field` (VmRSS, VmHWM) of `pid` and its descendants (from /proc), summed, MiB."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


GGUF_LABEL = "default GGUF (Q4_1 kept quantized)"
FOLDER_LABEL = "fp32 MLX folder"
# Each peer against trillm on the same file: mlx_lm.server on the fp32 folder, llama-server on the GGUF.
PEER_FILES = (("mlx_lm.server", FOLDER_LABEL), ("llama-server", GGUF_LABEL))


def offer_load(url: str, concurrency: int, prompt_tokens: int, max_tokens: int) -> int:
    """`concurrency` chat completions at once (distinct prompts of about `prompt_tokens` tokens, greedy, no
    model field: mlx_lm.server would load another); returns how many came back 200 with text."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    words = "the quick brown fox jumps over the lazy dog while a careful reader counts every word".split()

    def one(i: int) -> bool:
        text = " ".join(words[(i + j) % len(words)] for j in range(prompt_tokens))
        body = {"messages": [{"role": "user", "content": f"Request {i}: {text}. Summarise."}],
                "max_tokens": max_tokens, "temperature": 0.0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600.0)
        return r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"])

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(one, range(concurrency)))


def serve_idle_rows(idle_s: float, *, load: int = 0, load_prompt_tokens: int = 400, load_max_tokens: int = 32,
                    llama_server: str | None = None) -> list[dict[str, Any]]:
    """Each server alone: start, wait healthy, idle `idle_s`, read its tree's RSS; with `load`, offer it and read
    RSS and the peak again; stop."""
    import tempfile

    from trillm.bench import llama_cpp
    from trillm.bench.harness.export_mlx import export_gguf
    from trillm.bench.harness.servers import ServerProcess, free_port, mlx_lm_command, trillm_command
    from trillm.engine.loader import default_model_path

    folder = str(export_gguf())
    gguf = str(default_model_path())
    plan = [("trillm serve", GGUF_LABEL, trillm_command(gguf, free_port())),
            ("trillm serve", FOLDER_LABEL, trillm_command(folder, free_port())),
            ("mlx_lm.server", FOLDER_LABEL, mlx_lm_command(folder, free_port()))]
    if llama_server is not None:
        plan.append(("llama-server", "default GGUF (Q4_1)",
                     llama_cpp.llama_server_command(llama_server, gguf, free_port(), parallel=max(load, 1))))
    rows = []
    logs = Path(tempfile.mkdtemp(prefix="trillm-idle-rss-"))
    for i, (name, model, cmd) in enumerate(plan):
        sp = ServerProcess(name, cmd, int(cmd[cmd.index("--port") + 1]), logs / f"{i}.log")
        if name == "llama-server":
            sp.env = llama_cpp.server_env()
        if name == "mlx_lm.server":
            sp.health_path = "/v1/models"
        with sp:
            ready_s = sp.wait_ready()
            time.sleep(idle_s)
            assert sp.proc is not None
            row: dict[str, Any] = {"server": name, "model": model, "ready_s": ready_s,
                                   "rss_mb": tree_rss_mb(sp.proc.pid), "idle_peak_mb": tree_rss_mb(sp.proc.pid, "VmHWM")}
            if load:
                t0 = time.perf_counter()
                row["load_ok"] = offer_load(sp.url, load, load_prompt_tokens, load_max_tokens)
                row["load_s"] = time.perf_counter() - t0
                row["loaded_rss_mb"] = tree_rss_mb(sp.proc.pid)
                row["peak_mb"] = tree_rss_mb(sp.proc.pid, "VmHWM")
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trillm bench quant-memory", description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28, help="Qwen 7B layers to build (of 28)")
    ap.add_argument("--skip-default", action="store_true")
    ap.add_argument("--serve-idle", action="store_true", help="idle RSS of trillm serve against mlx_lm.server")
    ap.add_argument("--idle-s", type=float, default=10.0, help="--serve-idle: seconds idle before reading RSS")
    ap.add_argument("--load", type=int, default=8, help="--serve-idle: then this many concurrent requests (0: none)")
    ap.add_argument("--load-prompt-tokens", type=int, default=400, help="--serve-idle --load: words per prompt")
    ap.add_argument("--load-max-tokens", type=int, default=32, help="--serve-idle --load: tokens per answer")
    ap.add_argument("--llama-server", default=None, help="--serve-idle: llama.cpp's llama-server binary, on the GGUF")
    ap.add_argument("--one-default", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_default:
        _one_default(args.one_default)
        return 0
    from trillm.kernels import cpu_ext

    ext = cpu_ext.load()
    print(f"CPU kernels: {ext.SIMD if ext is not None else 'unavailable'}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.serve_idle:
        if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
            raise SystemExit(f"--llama-server {args.llama_server} is not an executable file")
        rows = serve_idle_rows(args.idle_s, load=args.load, load_prompt_tokens=args.load_prompt_tokens,
                               load_max_tokens=args.load_max_tokens, llama_server=args.llama_server)
        for r in rows:
            line = (f"{r['server']:>13} on {r['model']}: idle RSS {r['rss_mb']:6.0f} MiB, peak so far {r['idle_peak_mb']:6.0f} "
                    f"MiB (healthy after {r['ready_s']:.1f} s)")
            if args.load:
                line += (f"; after {args.load} concurrent requests ({r['load_ok']} answered, {r['load_s']:.1f} s) "
                         f"RSS {r['loaded_rss_mb']:6.0f} MiB, peak (VmHWM) {r['peak_mb']:6.0f} MiB")
            print(line)
        for key, what in (("rss_mb", "idle"), ("idle_peak_mb", "start-up peak"), ("loaded_rss_mb", "loaded"),
                          ("peak_mb", "peak")):
            if key not in rows[0]:
                continue
            for peer, mine_model in PEER_FILES:
                base = next((r[key] for r in rows if r["server"] == peer), None)
                mine = next(r[key] for r in rows if r["server"] == "trillm serve" and r["model"] == mine_model)
                if base:
                    print(f"{what}: trillm serve / {peer} on the same file ({mine_model}): {mine / base:.2f}x")
        if not all(r["rss_mb"] > 0 for r in rows) or any(args.load and r["load_ok"] != args.load for r in rows):
            raise SystemExit("bench quant-memory --serve-idle measured nothing (or a server failed requests)")
        return 0
    measured = False
    if not args.skip_default:
        for r in default_model_rows():
            print(f"SmolLM2-135M Q4_1 --dtype {r['dtype']:>9}: RSS after load {r['rss_mb']:7.0f} MiB "
                  f"(process before the load {r['rss_before_mb']:.0f} MiB; weights {r['weight_mb']:.0f} MiB)")
            measured |= float(r["rss_mb"]) > float(r["rss_before_mb"])
    r = qwen_row(args.layers)
    missing = 28 - int(r["layers"])  # Qwen 2.5 7B's layers
    note = "" if not missing else (f" ({r['layers']} of 28 layers built; with the other {missing} at "
                                   f"{r['layer_mb']:.0f} MiB each: ~{r['rss_mb'] + missing * r['layer_mb']:.0f} MiB)")
    print(f"Qwen-2.5-7B-shaped Q4_0 (random): RSS after load {r['rss_mb']:.0f} MiB (before {r['rss_before_mb']:.0f}; "
          f"weights {r['weight_mb']:.0f} MiB; {r['params'] / 1e9:.2f}B parameters, {r['fp32_mb']:.0f} MiB as float32)"
          f"{note}; one decode step {r['decode_s'] * 1e3:.0f} ms")
    measured |= r["rss_mb"] > r["rss_before_mb"] and r["decode_s"] > 0
    if not measured:
        raise SystemExit("bench quant-memory measured nothing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
