"""Never silently wrong: at load, the engine's paged forward is compared with mlx-lm's own forward of the same
model object with its own caches.

A few prompts of ragged lengths (one longer than every sliding window, up to a cap) run through the engine
itself: batched, with prompt logprobs and a few greedy tokens each, then the first one again alone (a prefix
cache hit). mlx-lm's forward, teacher-forced on the same tokens, gives the reference log-probabilities of every
prompt token and every generated one (on CPU with quantized layers multiplying by their dequantized weights,
`fused_ops.dequantized_matmuls`: MLX's CPU quantized matmul made the probe of the default model take 10 s). A
model whose paged forward disagrees is refused (`UnverifiedModel`) in one line naming the first disagreement,
unless the operator allows it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

from trillm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Iterable

    from trillm.engine.admission import RequestLimits
    from trillm.engine.config import EngineConfig
    from trillm.engine.kv_cache import KVLayout
    from trillm.engine.outputs import RequestOutput
    from trillm.engine.runner import ModelFacts
    from trillm.engine.tokenizer import TokenizerLike

PROBE_SALT = "trillm-load-probe"  # keeps the probe's blocks apart from every request's prefix-cache entries
DECODE_TOKENS = 8
MAX_PROBE_LEN = 1100  # covers Gemma 3's 1024-token window; longer windows are checked up to here only
# |logprob difference| allowed, by compute dtype: kernels and fused ops reorder sums, nothing more.
TOLERANCE = {mx.float32: 2e-2, mx.float16: 0.25, mx.bfloat16: 0.35}
# A KV cache narrower than the model's dtype (--kv-cache-dtype) rounds every cached K/V: at least this much.
# int8 (per token and head): SmolLM2-135M's prompt logprobs moved by 0.03 on average and 0.76 at worst over
# 2,999 tokens of English (docs/performance.md), so 1.0: a wrong layout or scale moves them by several.
# int4 (per group of 32, with a minimum): 16 levels moved SmolLM2's prompt logprobs by 0.37 on average and 9.2 at
# worst over 2,999 tokens (docs/performance.md), so its bound (12) catches little more than a broken pool.
KV_TOLERANCE = {"float16": 0.25, "bfloat16": 0.35, "int8": 1.0, "int4": 12.0}
# Weights kept quantized on an x86 CPU with TRILLM_QUANT_LINEAR_XBITS=8: every call of up to 32 rows (decode,
# short prompts) rounds x to int8 per block of 32, as llama.cpp does (trillm.kernels.quant_linear).
# SmolLM2-135M Q4_1: up to 0.63, on prompt tokens it gives logprob -18 to -22 (int16, the default: 2.4e-4).
INT8_ROWS_TOLERANCE = 1.0


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What `/health` reports of the load-time probe."""

    verified: bool
    detail: str  # one line: what was compared, or the first disagreement
    max_logprob_diff: float
    tokens_compared: int
    prompt_lengths: tuple[int, ...]
    seconds: float
    allowed_anyway: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ProbedEngine(Protocol):
    """What the probe reads of the engine it checks (LLMEngine)."""

    config: EngineConfig
    loaded: ModelFacts
    tokenizer: TokenizerLike
    eos_token_ids: frozenset[int]
    limits: RequestLimits
    kv_layout: KVLayout | None
    max_model_len: int

    def generate(self, prompts: Iterable[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]: ...
    def live_request_ids(self) -> list[str]: ...
    def abort(self, request_id: str) -> None: ...


def probe_prompts(engine: ProbedEngine) -> list[list[int]]:
    """Deterministic prompts of ordinary (non-special) token ids: short, past two blocks, past every window."""
    tok = engine.tokenizer
    special = set(engine.eos_token_ids) | set(getattr(tok, "all_special_ids", ()) or ())
    ids = np.random.default_rng(1234).permutation(min(tok.vocab_size, engine.limits.vocab_size))
    ordinary = [int(i) for i in ids if int(i) not in special][:4096]
    bs = engine.config.block_size
    windows = [w for w in (engine.kv_layout.windows if engine.kv_layout else ()) if w]
    cap = min(MAX_PROBE_LEN, engine.max_model_len - DECODE_TOKENS - 1)
    # 2 * bs + 3 and (2 * bs + 3) // 3 + 1 share one right-padded prefill forward (group_chunks pads at most
    # 1.5x), so the shorter row carries as much padding as serving ever gives it
    lengths = [min(5, cap), min(2 * bs + 3, cap), min((2 * bs + 3) // 3 + 1, cap)]
    if windows:
        lengths.append(min(max(windows) + bs + 3, cap))
    return [[ordinary[(7 * n + 13 * j) % len(ordinary)] for j in range(n)] for n in lengths]


def reference_logprobs(model: Any, prompt: list[int], generated: list[int],
                       vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """mlx-lm's own forward with its own caches (the prompt in one call, then the generated tokens in a second
    call on the same caches): log-probabilities [len(prompt) + len(generated) - 1, V], row i after token i, over every
    logit (as prompt logprobs score them) and over the first `vocab_size` (as trillm's sampler sees them:
    padded embedding rows are never sampled)."""
    from mlx_lm.models.cache import make_prompt_cache

    from trillm.engine.fused_ops import dequantized_matmuls

    cache = make_prompt_cache(model)
    with dequantized_matmuls() if mx.default_device() == mx.cpu else contextlib.nullcontext():
        rows = [model(mx.array([prompt]), cache=cache)[0]]
        if len(generated) > 1:  # teacher-forced in one call on the same caches (one mlx-lm decode step per token
            rows.append(model(mx.array([generated[:-1]]), cache=cache)[0])  # costs ~8x more at start, same truth)
    logits = mx.concatenate(rows, axis=0).astype(mx.float32)
    full = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    head = logits[:, :vocab_size]
    sampled = head - mx.logsumexp(head, axis=-1, keepdims=True)
    return np.array(full), np.array(sampled)


def probe(engine: ProbedEngine) -> ProbeResult:
    t0 = time.perf_counter()
    prompts = probe_prompts(engine)
    from trillm.engine.loader import LoadedModel

    lm = engine.loaded
    assert isinstance(lm, LoadedModel), "the probe compares a real model"
    tol = TOLERANCE.get(lm.dtype, 0.35)
    if engine.kv_layout is not None and engine.kv_layout.kv_dtype != str(lm.dtype).rsplit(".", 1)[-1]:
        tol = max(tol, KV_TOLERANCE.get(engine.kv_layout.kv_dtype or "", 0.0))
    from trillm.engine.fused_ops import quantization_formats
    from trillm.kernels import quant_linear

    if quant_linear.rounded_x_bits() == 8 and quantization_formats(lm.model):
        tol = max(tol, INT8_ROWS_TOLERANCE)
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True,
                            prompt_logprobs=0, skip_special_tokens=False, cache_salt=PROBE_SALT)
    try:
        batched = engine.generate(prompts, params)
        # Alone, its full blocks from the prefix cache (which prompt logprobs bypass).
        alone = engine.generate(prompts[:1], dataclasses.replace(params, prompt_logprobs=None))
    except Exception as exc:  # a forward that crashes is refused like one that disagrees
        for rid in list(engine.live_request_ids()):
            engine.abort(rid)
        return _result(False, f"the paged forward raised {type(exc).__name__}: {_one_line(exc)}", 0.0, 0, prompts,
                       t0)
    worst, compared, failure = 0.0, 0, ""
    references: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
    for label, prompt, out in [("batched", p, o) for p, o in zip(prompts, batched)] + [("cached", prompts[0], alone[0])]:
        if out.error:
            return _result(False, f"the paged forward failed ({label}, {len(prompt)} tokens): {out.error}", worst,
                           compared, prompts, t0)
        generated = list(out.new_token_ids)
        key = (tuple(prompt), tuple(generated))  # the cached run repeats a batched one: one reference each
        if key not in references:
            references[key] = reference_logprobs(lm.model, prompt, generated, engine.tokenizer.vocab_size)
        full, sampled = references[key]
        # row i - 1 of ref predicts prompt token i; row n - 1 + j predicts generated token j
        n = len(prompt)
        pairs: list[tuple[str, int, float, int, np.ndarray]] = []  # (what, token, trillm's logprob, row, reference)
        for i, lp in enumerate(out.prompt_logprobs or ()):
            if lp is not None:
                pairs.append((f"prompt token {i}", lp.token_id, lp.logprob, i - 1, full))
        for j, lp in enumerate(out.logprobs or ()):
            pairs.append((f"generated token {j}", lp.token_id, lp.logprob, n - 1 + j, sampled))
        for what, token, got, row, ref in pairs:
            if row < 0 or row >= ref.shape[0]:
                continue
            want = float(ref[row, token])
            diff = abs(got - want)
            compared += 1
            if diff > worst:
                worst = diff
            if diff > tol and not failure:
                failure = (f"{label} prompt of {len(prompt)} tokens, {what}: logprob {got:.4f} vs mlx-lm's "
                           f"{want:.4f}")
            if what.startswith("generated") and not failure:
                best = int(ref[row].argmax())
                if best != token and float(ref[row, best]) - want > tol:
                    failure = (f"{label} prompt of {len(prompt)} tokens, {what}: greedy picked {token}, "
                               f"mlx-lm's forward ranks {best} first by {float(ref[row, best]) - want:.3f}")
    if failure:
        return _result(False, failure, worst, compared, prompts, t0)
    return _result(True, f"{compared} logprobs within {tol:g} of mlx-lm's own forward", worst, compared, prompts, t0)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 240 else text[:237] + "..."


def _result(ok: bool, detail: str, worst: float, compared: int, prompts: list[list[int]], t0: float) -> ProbeResult:
    return ProbeResult(ok, detail, round(worst, 6), compared, tuple(len(p) for p in prompts),
                       round(time.perf_counter() - t0, 3))
