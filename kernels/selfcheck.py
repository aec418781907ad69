"""Start-up self-check: each kernel the engine will use, run against its reference on the model's shapes.

For every op (`ENGINE_OPS`) the model uses (`KernelOp.applies`: paged attention for softmax-attention models,
MLA attention for MLA ones) whose back-end has a kernel for the model's shapes, `select_kernels`:
  1. runs the op's check cases (B in {1, 9}, query lengths {1, 3, chunk}, contexts that split decode into
     partitions), so every kernel variant serving will launch is compiled here rather than mid-serving;
     results must be finite and within the op's documented tolerances, or exactly equal where the op says
  2. on an exception or a mismatch, falls back to the reference for that op alone, with one warning that
     names the op, the back-end and the error text (mode "strict" raises `KernelCheckError` instead)
  3. times kernel against reference on the op's timing cases (decode at batch 1 and at the largest batch,
     one prefill chunk) and keeps the faster, per phase where the op says how to tell a call's phase
     (`KernelOp.phase_of`: paged attention's decode and prefill are decided apart, each call routed); within
     TIE_MARGIN (5%) the kernel, since the timing noise of a shared machine is larger and a fallback is cached
Modes: "auto" (the default, as above), "strict", "ref" (every op runs its reference, nothing is checked;
TRILLM_KERNELS=ref forces the same). The result is a `KernelSelection`: the chosen implementation of each op,
and a frozen `KernelReport` saying which runs and why (for /health and /metrics).

Decisions are cached on disk, one JSON file per (mlx version, device, back-end, op, shapes, digest of the
kernel sources) under $TRILLM_KERNEL_CACHE (default ~/.cache/trillm/kernels). A cached "kernel" decision
still runs the check (it compiles the variants) but skips the timing; a cached fallback skips both, except
in "strict" mode, which always checks. A failure that raised (maybe transient: out of memory, a device
fault) expires after FAILURE_TTL_S; a mismatch stays until the sources change. Each check case ends with
mx.synchronize(), so a fault that surfaces at the next sync is that case's failure.

On a GPU back-end (metal, cuda) a check with no cached decision behind it first runs in a child process
(`check_in_child`): a Metal command-buffer fault or a CUDA error can abort the process rather than raise, and
the server must survive it. One child checks every such op of a `select_kernels` call (a new child resumes
after an op that crashed it); a crash, abort, nonzero exit or CHILD_TIMEOUT_S there sets that op's kernel
aside like a failure that raised (cached for FAILURE_TTL_S). Only ops that pass there are checked (which
compiles them here) and timed in this process. On CPU the check stays in-process: the CPU primitives cannot
fault a device. TRILLM_KERNEL_ISOLATE=1 / 0 (or `isolate=`) forces the child on or off.

    python -m trillm.kernels.selfcheck [--preset NAME ...] [--dtype ...] [--kv-dtype ...] [--json FILE] [--no-isolate]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import importlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from trillm.kernels import cpu_ext
from trillm.kernels.backend import Case, Kernel, KernelOp, forced_reference, kernel_backend
from trillm.kernels import conv1d as conv1d_op
from trillm.kernels import gated_delta as gated_delta_op
from trillm.kernels.gated_delta import GatedDeltaFn
from trillm.kernels import ssm_update as ssm_update_op
from trillm.kernels.ssm_update import SsmUpdateFn
from trillm.kernels.kv_gather import OP as KV_GATHER
from trillm.kernels.kv_gather import KvGatherFn, kv_gather, kv_gather_ref
from trillm.kernels import kv_quantize as kv_quantize_op
from trillm.kernels.layout import ModelShapes
from trillm.kernels import linear as linear_op
from trillm.kernels import mla_attention as mla_op
from trillm.kernels import quant_linear as quant_linear_op
from trillm.kernels.mla_attention import MlaAttentionFn
from trillm.kernels import rms_norm as rms_norm_op
from trillm.kernels import rope as rope_op
from trillm.kernels import silu_mul as silu_mul_op
from trillm.kernels.paged_attention import OP as PAGED_ATTENTION
from trillm.kernels.paged_attention import PagedAttentionFn, paged_attention, paged_attention_ref

MODES = ("auto", "strict", "ref")
CACHE_ENV = "TRILLM_KERNEL_CACHE"
# Timings within this fraction of the reference's go to the kernel: on a shared machine two runs of the same
# case differ by more, and a fallback decision is cached, so a coin toss would stick for every later start.
TIE_MARGIN = 0.05
FAILURE_TTL_S = 3600.0  # how long a failure that raised stays cached (a mismatch stays until the sources change)
ISOLATE_ENV = "TRILLM_KERNEL_ISOLATE"  # "1": uncached checks run in a child first; "0": never; unset: on GPU
CHILD_TIMEOUT_S = 300.0  # one child's limit (a first Metal/CUDA compile of every variant takes seconds, not minutes)
ENGINE_OPS: tuple[KernelOp, ...] = (PAGED_ATTENTION, KV_GATHER, kv_quantize_op.OP, rms_norm_op.OP, rope_op.OP,
                                    silu_mul_op.OP, linear_op.OP, mla_op.OP, quant_linear_op.OP, conv1d_op.OP,
                                    gated_delta_op.OP, ssm_update_op.OP)  # fmt: skip
REFERENCE = "reference"
MLX_VERSION = str(getattr(mx, "__version__", "unknown"))  # (mlx's stubs omit __version__)
_PACKAGE_DIR = Path(__file__).resolve().parent
log = logging.getLogger("trillm.kernels.selfcheck")


class KernelCheckError(RuntimeError):
    """A kernel failed its start-up check in "strict" mode."""


class KernelFallbackWarning(RuntimeWarning):
    """A kernel failed its start-up check; its op runs the reference."""


@dataclass(frozen=True, slots=True)
class OpReport:
    """Which implementation one op runs, and why."""

    op: str
    implementation: str  # the back-end whose kernel runs ("metal", "cuda", "cpu"), or "reference"
    backend: str | None  # the back-end considered (None: references forced)
    reason: str
    kernel_ms: float | None = None  # summed medians over the timing cases
    reference_ms: float | None = None
    cached: bool = False  # decided by an earlier run's cached result
    failed: bool = False  # the kernel raised or mismatched (now, or in the cached run)
    # Ops decided per phase: (phase, implementation) pairs, e.g. the kernel for decode, the reference for
    # prefill; None when one implementation serves every call.
    phases: tuple[tuple[str, str], ...] | None = None
    # A cached failure that raised (out of memory, a device fault: maybe transient) is re-checked after
    # this time (time.time()); a mismatch is deterministic for the same sources and device: None, kept.
    expires_at: float | None = None


@dataclass(frozen=True, slots=True)
class KernelReport:
    """The self-check's outcome for one engine."""

    mode: str
    backend: str | None
    device: str
    ops: tuple[OpReport, ...]
    seconds: float  # time the check and the timing took

    def implementation(self, op: str) -> str:
        return next(r.implementation for r in self.ops if r.op == op)

    def implementations(self) -> dict[str, str]:
        return {r.op: r.implementation for r in self.ops}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class KernelSelection:
    """The implementation of each engine op, as chosen, and the report. The ops outside attention default to
    their per-call dispatchers (what `unchecked()` runs)."""

    report: KernelReport
    paged_attention: PagedAttentionFn
    kv_gather: KvGatherFn
    rms_norm: Callable[[mx.array, mx.array, float], mx.array] = rms_norm_op.rms_norm
    rope: Callable[..., mx.array] = rope_op.rope
    silu_mul: Callable[[mx.array, mx.array], mx.array] = silu_mul_op.silu_mul
    linear: Callable[[mx.array, mx.array], mx.array] = linear_op.linear
    mla_attention: MlaAttentionFn = mla_op.mla_attention  # MLA models' attention (trillm.kernels.mla_attention)
    # Linear layers on weights kept quantized (trillm.kernels.quant_linear)
    quant_linear: Callable[..., mx.array] = quant_linear_op.quant_linear
    # Recurrent mixers' depthwise causal convolution (trillm.kernels.conv1d)
    depthwise_conv1d: Callable[..., mx.array] = conv1d_op.depthwise_conv1d
    # Delta-net layers' recurrence (trillm.kernels.gated_delta); None: mlx-lm's own gated_delta_update runs
    # (its Metal kernel on Metal, its ops elsewhere).
    gated_delta: GatedDeltaFn | None = None
    # Mamba-2 mixers' state-space update, decode and prefill (trillm.kernels.ssm_update); None: mlx-lm's own
    # ssm_update runs (its Metal kernel on Metal, its ops elsewhere).
    ssm_update: SsmUpdateFn | None = None
    # The int8 cache's quantize-on-write (trillm.kernels.kv_quantize)
    kv_write_int8: Callable[..., tuple[mx.array, mx.array, mx.array, mx.array]] = kv_quantize_op.kv_write_int8


def unchecked() -> KernelSelection:
    """The per-call dispatchers, for code that builds caches without an engine (tests, benchmarks)."""
    report = KernelReport("unchecked", kernel_backend(), device_description(), (), 0.0)
    # Off CPU, mlx-lm's own (its Metal kernels on Metal): these two ops' GPU bodies run only where a
    # self-check chose them.
    gdn = gated_delta_op.gated_delta if kernel_backend() == "cpu" else None
    ssm = ssm_update_op.ssm_update if kernel_backend() == "cpu" else None
    return KernelSelection(report, paged_attention, kv_gather, gated_delta=gdn, ssm_update=ssm)


def device_description() -> str:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return f"{mx.default_device()} {info.get('device_name', '')} {info.get('architecture', '')}".strip()


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trillm" / "kernels")


def select_kernels(
    shapes: ModelShapes, mode: str = "auto", *, ops: Sequence[KernelOp] | None = None, timing_iters: int = 5,
    isolate: bool | None = None,
) -> KernelSelection:
    """Check, time and choose each op's implementation for `shapes` (see the module docstring).

    `ops` defaults to ENGINE_OPS; the selection runs the reference of any op `ops` leaves out. `isolate`:
    whether checks without a cached decision run in a child process first (None: $TRILLM_KERNEL_ISOLATE,
    else only on the GPU back-ends).
    """
    ops = ENGINE_OPS if ops is None else ops
    if mode not in MODES:
        raise ValueError(f"kernels mode must be one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    backend = None if mode == "ref" else kernel_backend()
    prepared = []
    for op in ops:  # (a loop, not a comprehension: the warnings' stacklevel counts frames)
        prepared.append(_prepare_op(op, shapes, backend, mode))
    child: dict[str, tuple[str | None, bool]] = {}
    isolated = backend is not None and isolating(backend, isolate)
    if fresh := [p.op.name for p in prepared if isinstance(p, _Pending) and p.cached is None]:
        # The pause a first start takes (every variant compiled, checked and timed): say why before it.
        log.info("kernel self-check on %s: no cached decision for %s on these shapes; checking every variant "
                 "against its reference%s, then timing it (decisions cached in %s)", backend, ", ".join(fresh),
                 " in a child process first" if isolated else "", cache_dir())  # fmt: skip
    if isolated:
        # Only a check no earlier start has passed: a cached "kernel" decision was proven in a child then.
        todo = [p for p in prepared if isinstance(p, _Pending) and (p.cached is None or p.cached.failed)]
        todo = [p for p in todo if _isolatable(p.op, p.kernel)]
        if todo:
            child = check_in_child([(p.op, p.kernel) for p in todo], shapes)
    chosen: dict[str, Callable[..., Any]] = {}
    reports = []
    for op, p in zip(ops, prepared):
        op_report, fn = p if not isinstance(p, _Pending) else _finish_op(p, shapes, mode, timing_iters,
                                                                          child.get(op.name))  # fmt: skip
        reports.append(op_report)
        chosen[op.name] = fn
    report = KernelReport(mode, backend, device_description(), tuple(reports), round(time.perf_counter() - t0, 3))
    log.info("kernel self-check on %s (%s) took %.1f s: %s", backend, report.device, report.seconds, summary(report))
    pa = chosen.get(PAGED_ATTENTION.name, paged_attention_ref)
    kg = chosen.get(KV_GATHER.name, kv_gather_ref)
    return KernelSelection(
        report, pa, kg, rms_norm=chosen.get(rms_norm_op.OP.name, rms_norm_op.rms_norm_ref),
        rope=chosen.get(rope_op.OP.name, rope_op.rope_ref),
        silu_mul=chosen.get(silu_mul_op.OP.name, silu_mul_op.silu_mul_ref),
        linear=chosen.get(linear_op.OP.name, linear_op.linear_ref),
        mla_attention=chosen.get(mla_op.OP.name, mla_op.mla_attention_ref),
        quant_linear=chosen.get(quant_linear_op.OP.name, quant_linear_op.quant_linear),
        depthwise_conv1d=chosen.get(conv1d_op.OP.name, conv1d_op.depthwise_conv1d_ref),
        gated_delta=None if _runs_reference(reports, gated_delta_op.OP) else chosen[gated_delta_op.OP.name],
        ssm_update=None if _runs_reference(reports, ssm_update_op.OP) else chosen[ssm_update_op.OP.name],
        kv_write_int8=chosen.get(kv_quantize_op.OP.name, kv_quantize_op.OP.reference),
    )  # fmt: skip


def _runs_reference(reports: list[OpReport], op: KernelOp) -> bool:
    """Whether `op` is left out of the check or runs its reference (then the model's own code runs instead)."""
    return next((r.implementation for r in reports if r.op == op.name), REFERENCE) == REFERENCE


@dataclass(frozen=True, slots=True)
class _Pending:
    """An op whose kernel must be checked now (or was decided by a cached check that still compiles)."""

    op: KernelOp
    kernel: Kernel
    backend: str
    key: str
    cached: OpReport | None


def summary(report: KernelReport) -> str:
    """One line: each op the model uses and what runs it, e.g. "paged_attention=metal for decode, reference
    for prefill, kv_gather=metal (cached), rms_norm=reference"."""
    parts = []
    for r in report.ops:
        if r.reason == "not used by this model":
            continue
        impl = ", ".join(f"{i} for {p}" for p, i in r.phases) if r.phases else r.implementation
        notes = [n for n, on in (("cached", r.cached), ("failed", r.failed)) if on]
        parts.append(f"{r.op}={impl}" + (f" ({', '.join(notes)})" if notes else ""))
    return ", ".join(parts) or "no ops"


def _prepare_op(
    op: KernelOp, shapes: ModelShapes, backend: str | None, mode: str
) -> tuple[OpReport, Callable[..., Any]] | _Pending:
    """The decision that needs no check (no kernel, forced references, a cached fallback), or what to check."""
    ref = op.runs_instead
    if not op.applies(shapes):
        return OpReport(op.name, REFERENCE, backend, "not used by this model"), ref
    if backend is None:
        why = "TRILLM_KERNELS=ref" if forced_reference() else "kernels mode ref"
        return OpReport(op.name, REFERENCE, None, f"references forced ({why})"), ref
    kernel = op.kernels.get(backend)
    if kernel is None:
        return OpReport(op.name, REFERENCE, backend, f"no {backend} kernel for this op"), ref
    if (why_not := kernel.supports(shapes)) is not None:
        return OpReport(op.name, REFERENCE, backend, f"the {backend} kernel does not handle these shapes: {why_not}"), ref
    key = cache_key(op, kernel, backend, shapes)
    cached = _read_cache(key)
    if cached is not None and cached.failed and cached.expires_at is not None and time.time() > cached.expires_at:
        cached = None  # a failure that raised, long enough ago: maybe transient, check again
    if cached is not None and cached.implementation == REFERENCE and not (mode == "strict" and cached.failed):
        if cached.failed:
            _warn(op, backend, f"cached result of an earlier start: {cached.reason}")
        return replace(cached, cached=True), ref
    return _Pending(op, kernel, backend, key, cached)


def _finish_op(
    p: _Pending, shapes: ModelShapes, mode: str, iters: int, child: tuple[str | None, bool] | None
) -> tuple[OpReport, Callable[..., Any]]:
    """Check (unless the child already failed it), time and decide one op. `child`: the child's outcome."""
    op, kernel, backend, key, cached, ref = p.op, p.kernel, p.backend, p.key, p.cached, p.op.runs_instead
    failure, deterministic = child if child is not None and child[0] is not None else _check(op, kernel, shapes)
    if failure is None and cached is not None and cached.implementation == backend:
        return replace(cached, cached=True), _routed(op, kernel.fn, cached)  # checked now; timed by an earlier start
    phases: dict[str, tuple[float, float]] = {}
    if failure is None:
        try:
            timed = time_kernel(op, kernel, shapes, iters)
            phases = timed if isinstance(timed, dict) else {"all": timed}
        except Exception as exc:  # noqa: BLE001  (any failure of the kernel means: use the reference)
            failure, deterministic = f"timing: {_error_text(exc)}", False
    if failure is not None:
        if mode == "strict":
            raise KernelCheckError(f"{op.name}: the {backend} kernel failed its start-up check: {failure}")
        _warn(op, backend, failure)
        expires = None if deterministic else time.time() + FAILURE_TTL_S
        result = OpReport(op.name, REFERENCE, backend, f"check failed: {failure}", failed=True, expires_at=expires)
        _write_cache(key, result)
        return result, ref
    result = _decide(op, backend, phases)
    _write_cache(key, result)
    return result, _routed(op, kernel.fn, result)


def _decide(op: KernelOp, backend: str, phases: dict[str, tuple[float, float]]) -> OpReport:
    """Kernel or reference per phase (within TIE_MARGIN: the kernel); one implementation when all phases agree."""
    kernel_ms = round(sum(k for k, _ in phases.values()), 4)
    ref_ms = round(sum(r for _, r in phases.values()), 4)
    wins = {p: k <= r * (1 + TIE_MARGIN) for p, (k, r) in phases.items()}
    if all(wins.values()):
        why = "faster than the reference" if kernel_ms <= ref_ms else f"within {TIE_MARGIN:.0%} of the reference"
        if len(phases) > 1:
            why += " in every phase"
        return OpReport(op.name, backend, backend, f"checked, {why}", kernel_ms, ref_ms)
    if not any(wins.values()):
        return OpReport(op.name, REFERENCE, backend, "checked, slower than the reference", kernel_ms, ref_ms)
    split = tuple((p, backend if w else REFERENCE) for p, w in sorted(wins.items()))
    detail = ", ".join(f"{p}: {impl} ({phases[p][0]} vs {phases[p][1]} ms)" for p, impl in split)
    return OpReport(op.name, backend, backend, f"checked per phase, {detail}", kernel_ms, ref_ms, phases=split)


def _routed(op: KernelOp, kernel_fn: Callable[..., Any], report: OpReport) -> Callable[..., Any]:
    """What the selection runs for `report`: the kernel, the reference, or each call's phase's choice."""
    if report.implementation == REFERENCE:
        return op.runs_instead
    if not report.phases or op.phase_of is None:
        return kernel_fn
    choice = dict(report.phases)
    phase_of, ref = op.phase_of, op.runs_instead

    def by_phase(*args: Any, **kwargs: Any) -> Any:
        fn = kernel_fn if choice.get(phase_of(*args, **kwargs)) == report.implementation else ref
        return fn(*args, **kwargs)

    return by_phase


def _warn(op: KernelOp, backend: str, failure: str) -> None:
    warnings.warn(f"{op.name}: the {backend} kernel failed its start-up check, running the reference instead: "
                  f"{failure}", KernelFallbackWarning, stacklevel=4)  # fmt: skip


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def check_kernel(op: KernelOp, kernel: Kernel, shapes: ModelShapes) -> str | None:
    """Run every check case on kernel and reference; None when all agree, else what went wrong."""
    return _check(op, kernel, shapes)[0]


def _check(op: KernelOp, kernel: Kernel, shapes: ModelShapes) -> tuple[str | None, bool]:
    """(what went wrong or None, whether that is deterministic: a mismatch is, an exception may not be)."""
    for case in op.check_cases(shapes):
        if (outcome := _check_case(op, kernel, case)) is not None:
            return outcome
    return None, True


def _check_case(op: KernelOp, kernel: Kernel, case: Case) -> tuple[str, bool] | None:
    try:
        got = kernel.fn(*case.args, **case.kwargs)
        mx.eval(got)
        # A GPU fault can surface at a later sync, outside this case: wait for the device here.
        if hasattr(mx, "synchronize"):
            mx.synchronize()
    except Exception as exc:  # noqa: BLE001  (build errors, launch errors, anything: report it)
        return f"{case.label}: {_error_text(exc)}", False
    want = op.reference(*case.args, **case.kwargs)
    mx.eval(want)
    # An op with several outputs (the gated delta rule's y and state) returns a tuple: each is compared.
    wants = want if isinstance(want, tuple) else (want,)
    gots = got if isinstance(got, tuple) else (got,)
    if len(gots) != len(wants):
        return f"{case.label}: returned {len(gots)} outputs, expected {len(wants)}", True
    for i, (g, w) in enumerate(zip(gots, wants)):
        if (problem := compare(g, w, op.exact, op.tolerances.get(w.dtype, (0.0, 0.0)))) is not None:
            where = f" (output {i})" if len(wants) > 1 else ""
            return f"{case.label}{where}: {problem}", True
    return None


# ---------------------------------------------------------------- the first check in a child process
_CHILD_TAG = "trillm-selfcheck-child "  # prefixes the child's protocol lines on stdout (anything else is noise)
_CHILD_CODE = "from trillm.kernels.selfcheck import child_main; raise SystemExit(child_main())"


def isolating(backend: str, isolate: bool | None = None) -> bool:
    """Whether checks without a cached decision run in a child first (see the module docstring)."""
    if isolate is not None:
        return isolate
    env = os.environ.get(ISOLATE_ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    return backend in ("metal", "cuda")


def _fn_path(fn: Callable[..., Any]) -> str | None:
    """'module:qualname' a child can import `fn` by, or None (a lambda, a closure, a callable object)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def _resolve(path: str) -> Any:
    module, qualname = path.split(":", 1)
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _isolatable(op: KernelOp, kernel: Kernel) -> bool:
    """A child can rebuild exactly this check: the op is an engine op (found by name there) and the kernel a
    function it imports by name. Anything else (an op edited in place, a planted lambda) is checked here."""
    if not any(o is op for o in ENGINE_OPS) or (path := _fn_path(kernel.fn)) is None:
        return False
    try:
        return bool(_resolve(path) is kernel.fn)
    except (ImportError, AttributeError, ValueError):
        return False


def _shapes_json(shapes: ModelShapes) -> dict[str, Any]:
    fields: dict[str, Any] = {f: getattr(shapes, f) for f in shapes.__dataclass_fields__}
    fields["dtype"] = str(shapes.dtype).rsplit(".", 1)[-1]  # "mlx.core.float16" -> "float16"
    fields["layer_windows"] = list(shapes.layer_windows)
    return fields


def _shapes_from_json(fields: dict[str, Any]) -> ModelShapes:
    return ModelShapes(**{**fields, "dtype": getattr(mx, fields["dtype"]),
                          "layer_windows": tuple(fields["layer_windows"]),
                          "quantization": tuple(tuple(f) for f in fields.get("quantization", ())),
                          "delta_net": tuple(fields.get("delta_net", ())),
                          "ssm": tuple(fields.get("ssm", ())), "conv": tuple(fields.get("conv", ()))})  # fmt: skip


def check_in_child(
    items: Sequence[tuple[KernelOp, Kernel]], shapes: ModelShapes, timeout_s: float | None = None
) -> dict[str, tuple[str | None, bool]]:
    """Each op's check cases run in a child process: op name -> (what went wrong or None, deterministic).

    One child runs them all, reporting each case before it runs it; when the child dies (a signal, a nonzero
    exit, the timeout), the op it was in fails (not deterministic: maybe a transient device fault) and a new
    child resumes with the ops after it. A child that dies after reporting every op fails the ops it passed:
    a fault that surfaced late is one of theirs. A child that dies before it is set up (importing mlx,
    trillm and the kernels) leaves its ops to the in-process check, with a warning: no kernel ran there.
    """
    timeout_s = CHILD_TIMEOUT_S if timeout_s is None else timeout_s
    outcomes: dict[str, tuple[str | None, bool]] = {}
    pending = list(items)
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    while pending:
        request = dict(shapes=_shapes_json(shapes), device=device, sys_path=sys.path,
                       ops=[dict(op=op.name, kernel=_fn_path(k.fn)) for op, k in pending])  # fmt: skip
        cmd = [sys.executable, "-c", _CHILD_CODE]
        try:
            proc = subprocess.run(cmd, input=json.dumps(request), capture_output=True, text=True, timeout=timeout_s)
            stdout, stderr, death = proc.stdout, proc.stderr, _death(proc.returncode)
        except subprocess.TimeoutExpired as exc:
            stdout, stderr = _text(exc.stdout), _text(exc.stderr)
            death = f"the check's child process did not finish within {timeout_s:g} s"
        except OSError as exc:  # no interpreter to start: nothing to isolate with, check here as before
            warnings.warn(f"kernel self-check: cannot start a child process ({exc}); checking in-process",
                          RuntimeWarning, stacklevel=3)  # fmt: skip
            return outcomes
        done: dict[str, tuple[str | None, bool]] = {}
        current: tuple[str, str] | None = None  # (op, case) started and not yet reported
        ready = False
        for line in stdout.splitlines():
            if not line.startswith(_CHILD_TAG):
                continue
            msg = json.loads(line[len(_CHILD_TAG):])
            if "ready" in msg:
                ready = True
            elif "case" in msg:
                current = (str(msg["op"]), str(msg["case"]))
            else:
                done[str(msg["op"])] = (msg["failure"], bool(msg["deterministic"]))
                current = None
        outcomes.update(done)
        if death is None and len(done) == len(pending):
            break
        why = death or "the check's child process exited without reporting every op"
        if (tail := _last_line(stderr)) is not None:
            why += f": {tail}"
        if not ready:  # it died importing mlx or trillm, before any kernel ran: not a kernel's fault
            warnings.warn(f"kernel self-check: the check's child process failed before it checked anything ({why}); "
                          "checking in-process", RuntimeWarning, stacklevel=3)  # fmt: skip
            return outcomes
        left = [(op, k) for op, k in pending if op.name not in done]
        if not left:  # every op reported, then the child died: blame those it ran
            for op, _ in pending:
                outcomes[op.name] = (f"passed in the check's child process, which then died ({why})", False)
            break
        culprit = left[0][0].name
        where = f"{current[1]}: " if current is not None and current[0] == culprit else ""
        outcomes[culprit] = (f"{where}{why}", False)
        pending = left[1:]
    return outcomes


def _death(returncode: int) -> str | None:
    if returncode == 0:
        return None
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the check's child process was killed by {name}"
    return f"the check's child process exited with status {returncode}"


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _last_line(text: str, limit: int = 300) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else None


def child_main() -> int:
    """The child's side of `check_in_child`: the request on stdin, one tagged JSON line per case and op."""
    request = json.loads(sys.stdin.read())
    sys.path.extend(p for p in request["sys_path"] if p not in sys.path)  # the parent's (tests' helper modules)
    mx.set_default_device(mx.gpu if request["device"] == "gpu" else mx.cpu)
    shapes = _shapes_from_json(request["shapes"])
    by_name = {op.name: op for op in ENGINE_OPS}

    def say(**msg: Any) -> None:
        print(_CHILD_TAG + json.dumps(msg), flush=True)  # flushed: the next case may kill this process

    todo = [(by_name[item["op"]], Kernel(_resolve(item["kernel"]))) for item in request["ops"]]
    say(ready=True)  # set up: from here on, a death is the kernel's
    for op, kernel in todo:
        outcome: tuple[str | None, bool] = (None, True)
        for case in op.check_cases(shapes):
            say(op=op.name, case=case.label)
            if (failed := _check_case(op, kernel, case)) is not None:
                outcome = failed
                break
        say(op=op.name, failure=outcome[0], deterministic=outcome[1])
    return 0


def compare(got: Any, want: mx.array, exact: bool, tolerance: tuple[float, float]) -> str | None:
    """None when `got` matches `want` (exactly, or finite and within (atol, rtol)), else the mismatch."""
    if not isinstance(got, mx.array) or got.shape != want.shape or got.dtype != want.dtype:
        desc = f"{got.shape} {got.dtype}" if isinstance(got, mx.array) else type(got).__name__
        return f"returned {desc}, expected {want.shape} {want.dtype}"
    if exact:
        return None if mx.array_equal(got, want).item() else "differs from the reference (exact equality required)"
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    if not mx.all(mx.isfinite(g)).item():
        return "non-finite output"
    atol, rtol = tolerance
    excess = mx.abs(g - w) - (atol + rtol * mx.abs(w))
    if bool(mx.any(excess > 0).item()):
        err = mx.max(mx.abs(g - w)).item()
        return f"max |kernel - reference| = {err:.3g} exceeds atol {atol:g} + rtol {rtol:g} x |reference|"
    return None


def time_kernel(
    op: KernelOp, kernel: Kernel, shapes: ModelShapes, iters: int
) -> dict[str, tuple[float, float]] | tuple[float, float]:
    """Phase -> (kernel, reference) ms: per phase (the first word of a timing case's label when the op has
    `phase_of`, else one phase "all"), the sum over its cases of each one's median, measured interleaved.
    (A bare tuple, as mocks return, counts as one phase.)"""
    sums: dict[str, list[float]] = {}
    for case in op.timing_cases(shapes):
        totals = sums.setdefault(case.label.split()[0] if op.phase_of is not None else "all", [0.0, 0.0])
        mx.eval([a for a in case.args if isinstance(a, mx.array)])
        fns = (kernel.fn, op.runs_instead)
        samples: list[list[float]] = [[], []]
        for i in range(iters + 1):
            for which, fn in enumerate(fns):
                t0 = time.perf_counter()
                mx.eval(fn(*case.args, **case.kwargs))
                if i:  # the first round warms up
                    samples[which].append((time.perf_counter() - t0) * 1e3)
        for which in (0, 1):
            totals[which] += statistics.median(samples[which])
    return {phase: (round(k, 4), round(r, 4)) for phase, (k, r) in sums.items()}


# ---------------------------------------------------------------- decision cache
def sources_digest(kernel: Kernel) -> str:
    """Hash of this package's files (kernel texts, launch code, a built extension) and the kernel's module."""
    h = hashlib.sha256()
    files = sorted(p for p in _PACKAGE_DIR.iterdir() if p.suffix in (".py", ".so", ".dylib", ".pyd", ".metal", ".cu"))
    fn_file = inspect.getsourcefile(kernel.fn) if inspect.isfunction(kernel.fn) else None
    for path in files + ([Path(fn_file)] if fn_file else []):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(getattr(kernel.fn, "__qualname__", repr(kernel.fn)).encode())
    return h.hexdigest()


def cache_key(op: KernelOp, kernel: Kernel, backend: str, shapes: ModelShapes) -> str:
    fields = {f: str(getattr(shapes, f)) for f in shapes.__dataclass_fields__}
    parts = dict(mlx=MLX_VERSION, device=device_description(), backend=backend, op=op.name, shapes=fields,
                 sources=sources_digest(kernel))  # fmt: skip
    if backend == "cpu":  # the extension's C++ sources and the ISA it is built for (TRILLM_CPU_ISA)
        parts["cpu_ext"] = _cpu_ext_key()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _cpu_ext_key() -> str:
    try:
        return cpu_ext.cache_key()
    except cpu_ext.BuildError as exc:  # an ISA this CPU cannot run: the check reports it unavailable
        return f"unavailable: {exc}"


def _read_cache(key: str) -> OpReport | None:
    try:
        data = json.loads((cache_dir() / f"{key}.json").read_text())
        if data.get("phases") is not None:  # JSON has no tuples
            data["phases"] = tuple((str(p), str(i)) for p, i in data["phases"])
        return OpReport(**data)
    except (OSError, ValueError, TypeError):
        return None


def _write_cache(key: str, report: OpReport) -> None:
    path = cache_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(report)))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs the next start its timing pass


# ---------------------------------------------------------------- command line
PRESETS: dict[str, ModelShapes] = {
    "smollm2-135m": ModelShapes(9, 3, 64, 16, mx.float32),
    "qwen2.5-0.5b": ModelShapes(14, 2, 64, 16, mx.float32),
    "llama-3-8b": ModelShapes(32, 8, 128, 16, mx.float32),
    "sinks-window": ModelShapes(64, 8, 64, 16, mx.float32, window=128, sinks=True),
    "gemma-2-2b": ModelShapes(8, 4, 256, 16, mx.float32, softcap=50.0, layer_windows=(4096, None)),
    # Llama 4 Scout's heads with chunked attention; its 8192-token chunk shrunk to 1000 (not a multiple of
    # the block size) so the check cases' chunk boundaries fall within max_context
    "llama-4-chunked": ModelShapes(40, 8, 128, 16, mx.float32, attention_chunk=1000),
    # MLA: the latent pool is one 512-wide head (kv_lora_rank), k_pe 64 wide; 16 query heads
    "deepseek-v2-lite": ModelShapes(16, 1, 512, 16, mx.float32, kv_lora_rank=512, qk_rope_head_dim=64),
    # Qwen3-Next-80B-A3B's delta-net layers: 16 key heads, 32 value heads of 128 (its attention beside them)
    "qwen3-next": ModelShapes(16, 2, 256, 16, mx.float32, delta_net=(16, 32, 128, 128), conv=(8192, 4)),
    # Mamba-2 2.7B's mixers: 80 heads of 64, one group, state 128 (a conv over 5,120 + 2 x 128 channels)
    "mamba2": ModelShapes(8, 8, 64, 16, mx.float32, ssm=(80, 1, 64, 128), conv=(5376, 4)),
    # Nemotron-H 8B's mixers: 128 heads of 64 reading 8 groups of B and C (state 128), its attention beside them
    "nemotron-h": ModelShapes(32, 8, 128, 16, mx.float32, ssm=(128, 8, 64, 128), conv=(10240, 4)),
    # SmolLM2's heads over the int8 KV cache (--kv-cache-dtype int8): the int8 attention variants, the gather
    # of int8 pools and the quantize-on-write
    "smollm2-135m-int8": ModelShapes(9, 3, 64, 16, mx.float32, kv_dtype="int8"),
    # ... and over the int4 cache: the int4 attention variants (its writes and gathers are MLX's own ops)
    "smollm2-135m-int4": ModelShapes(9, 3, 64, 16, mx.float32, kv_dtype="int4"),
}


def main(argv: list[str] | None = None) -> int:
    """Check every preset x dtype; exit 1 when a kernel failed, 2 when this device has no kernels at all."""
    parser = argparse.ArgumentParser(prog="python -m trillm.kernels.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="default: all")
    parser.add_argument("--dtype", action="append", choices=["float32", "float16", "bfloat16"], help="default: all")
    parser.add_argument("--kv-dtype", choices=["float32", "float16", "bfloat16", "int8", "int4"], default=None,
                        help="the KV pool's dtype (--kv-cache-dtype; default: the preset's, else each --dtype's own)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--mode", choices=MODES, default="auto")
    parser.add_argument("--json", type=Path, help="write the reports here")
    parser.add_argument("--no-isolate", dest="isolate", action="store_const", const=False, default=None,
                        help="run every check in this process (default: uncached checks on a GPU in a child first)")
    args = parser.parse_args(argv)
    backend = kernel_backend()
    isa = f" ({cpu_ext.isa()})" if backend == "cpu" else ""
    print(f"mlx {MLX_VERSION}, device {device_description()}, kernel back-end {backend}{isa}", flush=True)
    if backend is None or not any(backend in op.kernels for op in ENGINE_OPS):
        print(f"no kernels to check on back-end {backend}", file=sys.stderr)
        return 2
    failed = False
    out = []
    for name in args.preset or sorted(PRESETS):
        for dtype in args.dtype or ["float32", "float16", "bfloat16"]:
            kv = PRESETS[name].kv_dtype if args.kv_dtype is None else None if args.kv_dtype == dtype else args.kv_dtype
            shapes = replace(PRESETS[name], dtype=getattr(mx, dtype), max_batch=args.max_batch, chunk=args.chunk,
                             kv_dtype=kv)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", KernelFallbackWarning)  # the report below says it
                report = select_kernels(shapes, args.mode, isolate=args.isolate).report
            for r in report.ops:
                failed |= r.failed
                timing = f" kernel {r.kernel_ms} ms vs reference {r.reference_ms} ms" if r.kernel_ms is not None else ""
                print(f"{name:>13} {dtype:>8} {r.op:>16}: {r.implementation:<9} {r.reason}{timing}", flush=True)
            out.append(dict(preset=name, dtype=dtype, report=report.as_dict()))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
