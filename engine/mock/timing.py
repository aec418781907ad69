"""How long one engine step takes, predicted from its shape instead of measured on a model.

A step of the real engine is one forward over every decode (batch B, each row attending to its context) plus
one forward per prefill chunk, run one after another (engine/model_runner.py), so the models here price a
step as decode cost + the sum of its chunks' costs:

- `LinearCostModel`: decode = base + per_seq * B + per_ctx * sum(context); chunk = base + per_token * n
  + per_attn * n * (mean context of the chunk). `from_roofline` derives the coefficients from bytes and
  FLOPs (decode reads the weights plus every running sequence's KV over the memory bandwidth); `fit`
  derives them from a profile measured on the real engine (`trillm bench profile`).
- `InterpolatedModel`: piecewise-linear over a measured grid (decode over (batch, context), prefill over
  chunk tokens), falling back to the linear fit outside it.
- `PolynomialModel`: NVIDIA Dynamo mocker's default constants, for comparison with Dynamo.

A speculating decode row (engine/spec_decode.py) runs 1 + k positions in the decode forward: its k proposed
tokens are priced like k more tokens of a prefill chunk, without a second base cost (`StepShape.verify_rows`).

Pure Python + numpy: no MLX, no trio.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from trillm.engine.scheduler import ScheduledBatch


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's cost depends on."""

    decode_contexts: tuple[int, ...] = ()  # per decode row: tokens attended (computed + the new one)
    prefill_chunks: tuple[tuple[int, int], ...] = ()  # per chunk: (new tokens, tokens already computed)
    kv_usage: float = 0.0  # fraction of the pool the batch's sequences hold (Dynamo's decode input)
    # Per speculating decode row: (proposed tokens k, its context): the decode forward then runs 1 + k positions
    # for that row, which costs like a short prefill chunk's k more tokens (engine/spec_decode.py).
    verify_rows: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, batch: ScheduledBatch, num_blocks: int) -> StepShape:
        seqs = list(batch.decodes) + [c.seq for c in batch.prefills]
        blocks = sum(len(s.block_table) for s in seqs)
        return cls(
            tuple(s.num_computed_tokens for s in batch.decodes),  # committed: includes the new token
            tuple((c.num_tokens, c.start) for c in batch.prefills),
            blocks / max(1, num_blocks - 1),
            tuple((len(d), s.num_computed_tokens) for s in batch.decodes if (d := batch.drafts.get(s.request_id))),
        )


class PerfModel(Protocol):
    def step_seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True, slots=True)
class LinearCostModel:
    """Step seconds as a sum of linear terms; every coefficient is in seconds per unit."""

    decode_base_s: float = 2e-3
    decode_per_seq_s: float = 2e-4
    decode_per_ctx_token_s: float = 5e-7
    prefill_base_s: float = 2e-3
    prefill_per_token_s: float = 1e-4
    prefill_per_attn_s: float = 1e-9  # per (new token x context token)

    def decode_seconds(self, batch: int, total_context: int) -> float:
        if batch == 0:
            return 0.0
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * total_context

    def prefill_seconds(self, num_tokens: int, start: int) -> float:
        if num_tokens == 0:
            return 0.0
        mean_ctx = start + (num_tokens + 1) / 2
        return self.prefill_base_s + self.prefill_per_token_s * num_tokens + self.prefill_per_attn_s * num_tokens * mean_ctx

    def verify_seconds(self, verify_rows: Iterable[tuple[int, int]]) -> float:
        """What speculating rows add to the decode forward: their proposed tokens at the prefill's per-token and
        attention rates (the forward's base is the decode's)."""
        return sum(self.prefill_per_token_s * k + self.prefill_per_attn_s * k * (ctx + (k + 1) / 2)
                   for k, ctx in verify_rows)

    def step_seconds(self, shape: StepShape) -> float:
        t = self.decode_seconds(len(shape.decode_contexts), sum(shape.decode_contexts))
        t += self.verify_seconds(shape.verify_rows)
        return t + sum(self.prefill_seconds(n, s) for n, s in shape.prefill_chunks)

    @classmethod
    def from_roofline(
        cls,
        *,
        weight_bytes: float,
        kv_bytes_per_token: float,
        num_params: float,
        num_layers: int,
        hidden_size: int,
        mem_bandwidth_gbps: float = 100.0,
        tflops: float = 4.0,
        step_overhead_s: float = 1e-3,
        per_seq_overhead_s: float = 1e-4,
    ) -> LinearCostModel:
        """Decode is memory bound (weights + KV over the bandwidth); prefill is compute bound (2 FLOPs per
        parameter per token, 4 * layers * hidden per attended token pair)."""
        bw = mem_bandwidth_gbps * 1e9
        flops = tflops * 1e12
        weights_s = weight_bytes / bw
        return cls(
            decode_base_s=step_overhead_s + weights_s,
            decode_per_seq_s=per_seq_overhead_s,
            decode_per_ctx_token_s=kv_bytes_per_token / bw,
            prefill_base_s=step_overhead_s + weights_s,
            prefill_per_token_s=2 * num_params / flops,
            prefill_per_attn_s=4 * num_layers * hidden_size / flops,
        )

    @classmethod
    def fit(cls, decode: Iterable[DecodeSample], prefill: Iterable[PrefillSample]) -> LinearCostModel:
        """Least-squares fit (coefficients clipped at 0) to measured step times."""
        d = _medians(list(decode), lambda s: (s.batch, s.context), lambda k, t: DecodeSample(*k, t))
        p = _medians(list(prefill), lambda s: (s.tokens, s.start), lambda k, t: PrefillSample(*k, t))
        base = cls()
        dc: tuple[float, ...] = (base.decode_base_s, base.decode_per_seq_s, base.decode_per_ctx_token_s)
        pc: tuple[float, ...] = (base.prefill_base_s, base.prefill_per_token_s, base.prefill_per_attn_s)
        if len(d) >= 3:
            a = np.array([[1.0, s.batch, s.batch * s.context] for s in d])
            dc = tuple(_nnls(a, np.array([s.seconds for s in d])))
        if len(p) >= 3:
            a = np.array([[1.0, s.tokens, s.tokens * (s.start + (s.tokens + 1) / 2)] for s in p])
            pc = tuple(_nnls(a, np.array([s.seconds for s in p])))
        return cls(*dc, *pc)


class _Timed(Protocol):
    @property
    def seconds(self) -> float: ...


_S = TypeVar("_S", bound=_Timed)


def _medians(samples: list[_S], key: Callable[[_S], tuple[int, int]],
             make: Callable[[tuple[int, int], float], _S]) -> list[_S]:
    """One sample per shape, its median time: a stray step (one whose work overlapped the previous step's
    read-back) would otherwise pull a fit weighted by 1/y far off."""
    by_shape: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        by_shape.setdefault(key(s), []).append(s.seconds)
    return [make(k, float(np.median(ts))) for k, ts in by_shape.items()]


def _nnls(a: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with non-negative coefficients: drop the most negative one and refit (3 columns at most).

    Rows are weighted by 1/y so small steps (the common decode) count as much as big ones (relative error).
    """
    w = 1.0 / np.maximum(y, 1e-9)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


@dataclass(frozen=True, slots=True)
class DecodeSample:
    batch: int
    context: int  # per sequence
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillSample:
    tokens: int
    start: int
    seconds: float


@dataclass(frozen=True, slots=True)
class InterpolatedModel:
    """Measured step times, interpolated: decode bilinearly over (batch, context per sequence), a prefill
    chunk over its token count at each measured start; outside the grid, the linear fit takes over."""

    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_seconds: tuple[tuple[float, ...], ...]  # [batch index][context index]
    prefill_tokens: tuple[int, ...]
    prefill_seconds: tuple[float, ...]  # at start 0
    fallback: LinearCostModel = field(default_factory=LinearCostModel)

    def _decode(self, batch: int, total_ctx: int) -> float:
        if batch == 0:
            return 0.0
        ctx = total_ctx / batch
        bs, cs = self.decode_batches, self.decode_contexts
        if not (bs[0] <= batch <= bs[-1] and cs[0] <= ctx <= cs[-1]):
            return self.fallback.decode_seconds(batch, total_ctx)
        grid = np.asarray(self.decode_seconds)
        per_ctx = [float(np.interp(ctx, cs, row)) for row in grid]
        return float(np.interp(batch, bs, per_ctx))

    def _prefill(self, n: int, start: int) -> float:
        if n == 0:
            return 0.0
        ts = self.prefill_tokens
        if not ts[0] <= n <= ts[-1]:
            return self.fallback.prefill_seconds(n, start)
        # The grid is at start 0; the linear fit supplies what attending to earlier context adds.
        extra = self.fallback.prefill_seconds(n, start) - self.fallback.prefill_seconds(n, 0)
        return float(np.interp(n, ts, self.prefill_seconds)) + extra

    def step_seconds(self, shape: StepShape) -> float:
        t = self._decode(len(shape.decode_contexts), sum(shape.decode_contexts))
        t += self.fallback.verify_seconds(shape.verify_rows)
        return t + sum(self._prefill(n, s) for n, s in shape.prefill_chunks)


@dataclass(frozen=True, slots=True)
class PolynomialModel:
    """Dynamo mocker's defaults: prefill ms = 4.209989e-7 N^2 + 1.518344e-2 N + 16.50142 over the step's N
    new prefill tokens; decode ms = max(1, -25.74 p^2 + 54.01 p + 5.74) at KV occupancy p."""

    def step_seconds(self, shape: StepShape) -> float:
        n = sum(c[0] for c in shape.prefill_chunks)
        prefill_ms = 4.209989e-7 * n * n + 1.518344e-2 * n + 16.50142 if n else 0.0
        p = shape.kv_usage
        decode_ms = max(1.0, -25.74 * p * p + 54.01 * p + 5.74) if shape.decode_contexts else 0.0
        # Speculating rows' proposed tokens: the prefill polynomial without its constant.
        v = sum(k for k, _ in shape.verify_rows)
        verify_ms = 4.209989e-7 * v * v + 1.518344e-2 * v
        return (prefill_ms + decode_ms + verify_ms) / 1000.0


# ---- profiles on disk ------------------------------------------------------------------------------------


def save_profile(path: str | Path, decode: list[DecodeSample], prefill: list[PrefillSample],
                 meta: dict[str, object] | None = None) -> LinearCostModel:
    """Write a measured profile plus its linear fit as JSON; returns the fit."""
    fit = LinearCostModel.fit(decode, prefill)
    doc = {
        "version": 1,
        "meta": meta or {},
        "decode": [asdict(s) for s in decode],
        "prefill": [asdict(s) for s in prefill],
        "linear_fit": asdict(fit),
    }
    Path(path).write_text(json.dumps(doc, indent=1))
    return fit


def load_perf_model(path: str | Path, kind: str = "linear") -> PerfModel:
    """A model from a profile written by `trillm bench profile`: "linear" (the fit) or "interpolated"."""
    doc = json.loads(Path(path).read_text())
    fit = LinearCostModel(**doc["linear_fit"])
    if kind == "linear":
        return fit
    if kind != "interpolated":
        raise ValueError(f"unknown perf model kind {kind!r} (linear or interpolated)")
    decode = [DecodeSample(**s) for s in doc["decode"]]
    prefill = [PrefillSample(**s) for s in doc["prefill"] if s["start"] == 0]
    batches = sorted({s.batch for s in decode})
    contexts = sorted({s.context for s in decode})
    by_point: dict[tuple[int, int], list[float]] = {}
    for s in decode:
        by_point.setdefault((s.batch, s.context), []).append(s.seconds)
    table = {k: float(np.median(v)) for k, v in by_point.items()}  # repeated steps: robust to stragglers
    grid = tuple(
        tuple(table.get((b, c), fit.decode_seconds(b, b * c)) for c in contexts) for b in batches
    )
    by_tokens: dict[int, list[float]] = {}
    for ps in prefill:
        by_tokens.setdefault(ps.tokens, []).append(ps.seconds)
    tokens = sorted(by_tokens)
    if not batches or not contexts or not tokens:
        return fit
    return InterpolatedModel(
        tuple(batches), tuple(contexts), grid, tuple(tokens),
        tuple(float(np.median(by_tokens[t])) for t in tokens), fit,
    )


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.inf
