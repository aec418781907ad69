"""`trillm bench profile-ops`: where one engine step spends its time, per op kind, on the real model's shapes.

MLX's CPU backend has no per-op profiler, so each op kind is timed in isolation on the shapes and weights of
one step (every layer's instances in one graph, so per-op dispatch cost is counted as in the real step):
the linear layers (BLAS or quant_linear, as the self-check chose), the LM head, attention (+ K/V gather
inside the paged attention op), KV writes, norms, activations, RoPE, residual adds, layout copies (the head
transposes), embedding and sampling. Host work is timed apart: building the step's inputs (prepare_inputs)
and building the lazy graph (the model's Python, with the forward's early-compute kicks off).
The parts are then added up and set against the measured step (inputs + graph + evaluation + read-back),
so a gap shows what the isolation missed (op fusion, cache effects, scheduling).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS before mlx)
from trillm.kernels import BLAS

import mlx.core as mx  # noqa: E402

from trillm.bench.harness.results import new_results_dir, write_meta  # noqa: E402
from trillm.engine.fused_ops import fused_ops, quantization_formats  # noqa: E402
from trillm.engine.kv_cache import KVLayout, KVPool  # noqa: E402
from trillm.engine.loader import LoadedModel, load_model  # noqa: E402
from trillm.engine.model_runner import ModelRunner, prepare_inputs  # noqa: E402
from trillm.engine.sampler import Sampler, SampleRow  # noqa: E402
from trillm.engine.sampling_params import SamplingParams  # noqa: E402
from trillm.engine.sequence import Sequence  # noqa: E402
from trillm.kernels.backend import kernel_backend  # noqa: E402
from trillm.kernels.kv_write import kv_write  # noqa: E402
from trillm.kernels import cpu_ext  # noqa: E402
from trillm.kernels.layout import ModelShapes  # noqa: E402
from trillm.kernels.paged_attention import paged_attention  # noqa: E402
from trillm.kernels.selfcheck import KernelReport, KernelSelection, select_kernels  # noqa: E402
from trillm.kernels.silu_mul import silu_mul  # noqa: E402

BLOCK_SIZE = 16
KINDS = (
    "linear layers", "lm_head", "attention + gather", "kv_write", "norms", "activations (SiLU-gate)",
    "RoPE", "residual adds", "layout copies", "embedding", "sampling",
)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    batch: int
    context: int  # tokens in each row's cache after this step
    new_tokens: int  # L: 1 for decode, the chunk for prefill


def time_ms(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Best wall time of fn() with its result evaluated, in ms (the best, as other load only adds time)."""
    for _ in range(warmup):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples)


def host_ms(fn: Callable[[], Any], iters: int) -> float:
    """Best wall time of fn() alone (no evaluation), in ms."""
    samples = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples[1:])


class Setup:
    """The model, a pool big enough for the case, and `batch` sequences with `context - L` tokens cached."""

    def __init__(self, loaded: LoadedModel, case: Case, kernels: KernelSelection | None = None) -> None:
        self.loaded = loaded
        self.case = case
        blocks_per_row = -(-case.context // BLOCK_SIZE)
        layout = KVLayout.uniform(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim)
        self.pool = KVPool(layout, 1 + case.batch * blocks_per_row, BLOCK_SIZE, loaded.dtype, kernels=kernels)
        for arr in self.pool.arrays():  # random K/V: timing only, but no denormals or NaN paths
            arr[...] = mx.random.normal(arr.shape).astype(arr.dtype) * 0.5
        mx.eval(*self.pool.arrays())
        self.runner = ModelRunner(loaded.model, self.pool, Sampler())
        vocab = loaded.tokenizer.vocab_size
        self.seqs = []
        self.starts = []
        for b in range(case.batch):
            ids = [(13 * b + 7 * i + 5) % (vocab - 10) + 5 for i in range(case.context)]
            s = Sequence(f"r{b}", ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            s.block_table = [1 + b * blocks_per_row + i for i in range(blocks_per_row)]
            s.num_computed_tokens = case.context - case.new_tokens
            self.seqs.append(s)
            self.starts.append(case.context - case.new_tokens)
        self.rows = [SampleRow(s.params, 0, s.token_ids, []) for s in self.seqs]

    def inputs(self) -> Any:
        lens = [self.case.new_tokens] * self.case.batch
        return prepare_inputs(self.seqs, self.starts, lens, BLOCK_SIZE)

    def step(self) -> list[int]:
        """One whole step as the runner does it: inputs, forward, sample, one host read-back."""
        logits = self.runner.forward(self.inputs())
        lazy = self.runner.sampler.sample(logits, self.rows)
        mx.eval(*self.pool.arrays())  # the runner's async_eval: on CPU it computes the graph before returning
        return self.runner.sampler.read(lazy).token_ids


def _layers(loaded: LoadedModel) -> list[Any]:
    return list(loaded.model.model.layers)


def isolated_parts(setup: Setup, iters: int) -> dict[str, float]:
    """ms per op kind for one step's shapes, each kind timed alone over all layers."""
    loaded, case = setup.loaded, setup.case
    layers = _layers(loaded)
    attn0 = layers[0].self_attn
    hq, hkv, d = attn0.n_heads, attn0.n_kv_heads, attn0.head_dim
    dim = layers[0].input_layernorm.weight.shape[0]
    ffn = layers[0].mlp.gate_proj.weight.shape[0]
    B, L = case.batch, case.new_tokens
    dtype = loaded.dtype
    x = mx.random.normal((B, L, dim)).astype(dtype)
    hid = mx.random.normal((B, L, ffn)).astype(dtype)
    q_heads = mx.random.normal((B, hq, L, d)).astype(dtype)
    k_heads = mx.random.normal((B, hkv, L, d)).astype(dtype)
    mx.eval(x, hid, q_heads, k_heads)
    inputs = setup.inputs()
    lay = inputs.layout
    offset: int | mx.array = lay.uniform_offset if lay.uniform_offset is not None else lay.offsets
    inner = loaded.model.model

    def matmuls() -> list[mx.array]:
        out = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            out += [a.q_proj(x), a.k_proj(x), a.v_proj(x), a.o_proj(x), m.gate_proj(x), m.up_proj(x),
                    m.down_proj(hid)]
        return out

    last = x[:, -1, :]

    def lm_head() -> mx.array:
        head = getattr(loaded.model, "lm_head", None)
        out: mx.array = head(last) if head is not None else inner.embed_tokens.as_linear(last)
        return out

    def attention() -> list[mx.array]:
        return [paged_attention(q_heads, setup.pool.keys[i], setup.pool.values[i], lay.block_tables,
                                lay.context_lens, scale=attn0.scale) for i in range(len(layers))]

    new_k = mx.random.normal((B * L, hkv, d)).astype(dtype)
    mx.eval(new_k)

    def writes() -> list[mx.array]:
        pool = setup.pool
        for i in range(len(layers)):
            pool.keys[i], pool.values[i] = kv_write(pool.keys[i], pool.values[i], new_k, new_k, lay.slot_mapping)
        return pool.arrays()

    def norms() -> list[mx.array]:
        out = []
        for layer in layers:
            out += [layer.input_layernorm(x), layer.post_attention_layernorm(x)]
        return out + [inner.norm(x)]

    def activations() -> list[mx.array]:
        return [silu_mul(hid, hid) for _ in layers]

    def rope() -> list[mx.array]:
        out = []
        for layer in layers:
            r = layer.self_attn.rope
            out += [r(q_heads, offset=offset), r(k_heads, offset=offset)]
        return out

    def residuals() -> list[mx.array]:
        return [x + x for _ in range(2 * len(layers))]

    q_lin = mx.random.normal((B, L, hq * d)).astype(dtype)
    kv_lin = mx.random.normal((B, L, hkv * d)).astype(dtype)
    mx.eval(q_lin, kv_lin)

    def layout_copies() -> list[mx.array]:
        # What the attention block's reshapes/transposes materialise: q/k/v to head-major (RoPE reads them
        # strided; a decode's [B, H, 1, D] is a free reshape) and the output back to [B, L, Hq * D].
        out = []
        for _ in layers:
            if L > 1:
                out += [mx.contiguous(q_lin.reshape(B, L, hq, d).transpose(0, 2, 1, 3)),
                        mx.contiguous(kv_lin.reshape(B, L, hkv, d).transpose(0, 2, 1, 3)),
                        mx.contiguous(kv_lin.reshape(B, L, hkv, d).transpose(0, 2, 1, 3)),
                        mx.contiguous(q_heads.transpose(0, 2, 1, 3)).reshape(B, L, hq * d)]
            else:
                out.append(mx.contiguous(q_heads.transpose(0, 2, 1, 3)).reshape(B, L, hq * d))
        return out

    def embedding() -> mx.array:
        out: mx.array = inner.embed_tokens(inputs.tokens)
        return out

    logits = mx.random.normal((B, inner.embed_tokens.weight.shape[0])).astype(dtype)
    mx.eval(logits)

    def sampling() -> mx.array:
        return setup.runner.sampler.sample(logits, setup.rows).tokens

    fns: dict[str, Callable[[], Any]] = {
        "linear layers": matmuls, "lm_head": lm_head, "attention + gather": attention, "kv_write": writes,
        "norms": norms, "activations (SiLU-gate)": activations, "RoPE": rope, "residual adds": residuals,
        "layout copies": layout_copies, "embedding": embedding, "sampling": sampling,
    }  # fmt: skip
    with fused_ops(setup.pool.kernels):  # the model's linears, norms and RoPE run what the engine's forward runs
        return {kind: time_ms(fns[kind], iters) for kind in KINDS}


def profile_case(loaded: LoadedModel, case: Case, iters: int, kernels: KernelSelection | None = None) -> dict[str, Any]:
    setup = Setup(loaded, case, kernels)
    for _ in range(3):
        setup.step()
    step_ms = host_ms(setup.step, iters)
    prepare = host_ms(setup.inputs, iters)
    inputs = setup.inputs()

    def build() -> Any:
        logits = setup.runner.forward(inputs)
        return setup.runner.sampler.sample(logits, setup.rows).tokens

    # Building alone: the step's forward starts computing early layers while it builds the rest (its kicks), which
    # would count compute as building here.
    kicks, setup.runner.kick_every = setup.runner.kick_every, 0
    graph = host_ms(build, iters)
    evaluate = time_ms(build, iters) - graph  # the graph's compute alone (building it is subtracted)
    setup.runner.kick_every = kicks
    parts = isolated_parts(setup, iters)
    flops = 2 * loaded.num_parameters * case.batch * case.new_tokens
    return dict(
        case=case.name, batch=case.batch, context=case.context, new_tokens=case.new_tokens,
        step_ms=step_ms, prepare_inputs_ms=prepare, graph_build_ms=graph, evaluate_ms=evaluate,
        parts_ms=parts, parts_sum_ms=sum(parts.values()) + prepare + graph,
        gflops=flops / (step_ms * 1e-3) / 1e9,
    )


def markdown(results: list[dict[str, Any]], header: str) -> str:
    names = [r["case"] for r in results]
    lines = [header, "", "| op kind | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]

    def row(label: str, vals: list[float], steps: list[float]) -> str:
        cells = [f"{v:.2f} ({100 * v / s:.0f}%)" for v, s in zip(vals, steps)]
        return f"| {label} | " + " | ".join(cells) + " |"

    steps = [r["step_ms"] for r in results]
    for kind in KINDS:
        lines.append(row(kind, [r["parts_ms"][kind] for r in results], steps))
    lines.append(row("host: prepare_inputs", [r["prepare_inputs_ms"] for r in results], steps))
    lines.append(row("host: graph building", [r["graph_build_ms"] for r in results], steps))
    lines.append(row("**sum of the parts**", [r["parts_sum_ms"] for r in results], steps))
    lines.append(row("evaluation alone (built graph)", [r["evaluate_ms"] for r in results], steps))
    lines.append("| **measured step** | " + " | ".join(f"**{s:.2f}**" for s in steps) + " |")
    lines.append("| step GFLOP/s (2 x params x tokens) | " + " | ".join(f"{r['gflops']:.1f}" for r in results) + " |")
    return "\n".join(lines)


@contextmanager
def _references(on: bool) -> Iterator[None]:
    old = os.environ.get("TRILLM_KERNELS")
    if on:
        os.environ["TRILLM_KERNELS"] = "ref"
    try:
        yield
    finally:
        if on:
            if old is None:
                del os.environ["TRILLM_KERNELS"]
            else:
                os.environ["TRILLM_KERNELS"] = old


def self_check(loaded: LoadedModel) -> KernelSelection:
    """The engine's start-up self-check on this model's shapes: per op, the kernel or the reference, and why."""
    args = getattr(loaded.model, "args", None)
    shapes = ModelShapes(loaded.num_attention_heads, loaded.num_kv_heads, loaded.head_dim, BLOCK_SIZE, loaded.dtype,
                         max_batch=64, chunk=512, hidden_size=int(getattr(args, "hidden_size", 0) or 0),
                         intermediate_size=int(getattr(args, "intermediate_size", 0) or 0),
                         vocab_size=int(getattr(args, "vocab_size", 0) or 0),
                         quantization=quantization_formats(loaded.model))  # fmt: skip
    return select_kernels(shapes)


def self_check_lines(report: KernelReport) -> list[str]:
    out = []
    for r in report.ops:
        if r.reason == "not used by this model":
            continue
        timing = f"; kernel {r.kernel_ms} ms vs reference {r.reference_ms} ms" if r.kernel_ms is not None else ""
        phases = f" ({', '.join(f'{i} for {p}' for p, i in r.phases)})" if r.phases else ""
        out.append(f"{r.op}: {r.implementation}{phases}, {r.reason}{timing}" + (" (cached)" if r.cached else ""))
    return out


def _kernels() -> str:
    if kernel_backend() is not None and kernel_backend() != "cpu":
        return kernel_backend() or ""
    if cpu_ext.enabled() and cpu_ext.load() is not None:
        return f"trillm CPU primitives ({cpu_ext.load().SIMD}, {cpu_ext.load().num_threads()} threads)"  # type: ignore[union-attr]
    return "pure-mx references"


def _cases(text: str) -> list[Case]:
    out = []
    for item in text.split(","):
        kind, _, rest = item.partition(":")
        if kind == "decode":
            b, c = (int(v) for v in rest.split("x"))
            out.append(Case(f"decode B={b} ctx={c}", b, c, 1))
        elif kind == "prefill":
            n, _, prefix = rest.partition("+")
            out.append(Case(f"prefill {n}" + (f" +{prefix} cached" if prefix else ""), 1, int(n) + int(prefix or 0),
                            int(n)))
        else:
            raise SystemExit(f"unknown case {item!r}: use decode:BxCTX or prefill:N[+CACHED]")
    return out


DEFAULT_CASES = "decode:1x128,decode:8x128,decode:32x128,decode:1x2048,decode:8x2048,decode:32x2048,prefill:512"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trillm bench profile-ops", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF, its Q4_1 kept)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma list (default {DEFAULT_CASES})")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--results", type=Path, default=Path("results"), help="results root folder")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table(s) to this file")
    ap.add_argument("--references", action="store_true",
                    help="also profile each case on the pure-mx references (TRILLM_KERNELS=ref), alternating")
    args = ap.parse_args(argv)
    loaded = load_model(args.model)
    selection = self_check(loaded)
    print(f"kernel self-check ({_kernels()}):", flush=True)
    for line in self_check_lines(selection.report):
        print("  " + line, flush=True)
    modes = ["kernels", "references"] if args.references else ["kernels"]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    headers: dict[str, str] = {}
    for case in _cases(args.cases):
        for mode in modes:  # alternating per case, so load from elsewhere hits both alike
            with _references(mode == "references"):
                headers[mode] = (f"Model {loaded.name} ({loaded.num_parameters / 1e6:.1f}M params, {loaded.dtype}), "
                                 f"BLAS {BLAS.name}, kernels: {_kernels()}; best-of-{args.iters} ms per step "
                                 "(share of the measured step)")
                r = profile_case(loaded, case, args.iters, selection if mode == "kernels" else None)
            r["mode"] = mode
            results[mode].append(r)
            print(f"{case.name} [{mode}]: step {r['step_ms']:.2f} ms, parts {r['parts_sum_ms']:.2f} ms, "
                  f"eval {r['evaluate_ms']:.2f} ms", flush=True)
    if any(not rs or any(r["step_ms"] <= 0 for r in rs) for rs in results.values()):
        raise SystemExit("profile-ops measured nothing")
    table = "\n\n".join(markdown(results[m], f"**{m}** — {headers[m]}") for m in modes)
    table += "\n\nKernel self-check (kernels mode runs what it chose):\n" + "\n".join(
        f"- {line}" for line in self_check_lines(selection.report))
    print("\n" + table)
    out_dir = new_results_dir(args.results, "profile-ops-" + time.strftime("%Y%m%d-%H%M%S"))
    payload: dict[str, Any] = {**results, "cpu_isa": cpu_ext.isa(), "self_check": selection.report.as_dict()}
    (out_dir / "profile_ops.json").write_text(json.dumps(payload, indent=2))
    write_meta(out_dir, "trillm bench profile-ops", list(argv or []), vars(args) | {"results": str(args.results)})
    if args.markdown:
        args.markdown.write_text(table + "\n")
    print(f"wrote {out_dir / 'profile_ops.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
