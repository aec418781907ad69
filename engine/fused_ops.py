"""trillm's ops inside an mlx-lm model: linear layers (and a tied LM head), RMSNorm, RoPE, the SwiGLU
activation and the recurrent mixers' depthwise convolution, through trillm.kernels.

`install_fused_ops(model)` swaps the model's `nn.Linear`, `nn.Embedding`, `nn.RMSNorm`, `nn.RoPE` and
depthwise `nn.Conv1d` modules for subclasses (same parameters, same attributes; quantized linear layers and
embeddings, kept quantized, run `quant_linear`) and rebinds `swiglu`, `gated_delta_update` (the delta-net
layers' recurrence: Qwen3-Next, Qwen3.5), `ssm_update` (Mamba-2 mixers: Mamba-2, Nemotron-H, Falcon-H1) and
`nn` (mlx.nn with its `silu` through `silu_mul`: the mixers' SiLU on their conv output, MLX's a scalar exp
on one thread), once, at load, in the model's own mlx-lm modules, the way `install_paged_attention` rebinds
attention.
They run trillm's ops only inside `fused_ops(kernels)`, which ModelRunner.forward enters with the implementations the engine's start-up
self-check chose (`trillm.kernels.selfcheck`; without a selection, the per-call dispatchers): anything else
that runs the same model object or module (mlx-lm's own generate, a benchmark's peer) keeps mlx-lm's
behaviour.

Projections of one input become one matmul: a module's q/k/v and gate/up projections share a
`ProjectionGroup` whose weight is their rows stacked, and each projection's own weight becomes a row slice of
it (no second copy). Inside `fused_ops()` the first projection called with an input runs the group's matmul
and the others slice its output. On CPU every linear weight and the embedding are then packed into one
buffer backed by huge pages (`trillm.kernels.hugepages`): decode streams them all once per step.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from trillm.engine.memory import release_freed_heap
from trillm.kernels import hugepages
from trillm.kernels.quant_linear import quant_linear_ref
from trillm.kernels.selfcheck import KernelSelection, unchecked
from trillm.kernels.silu_mul import silu_mul_ref

_ACTIVE: ContextVar[KernelSelection | None] = ContextVar("trillm_fused_ops", default=None)
_DEQUANTIZED: ContextVar[bool] = ContextVar("trillm_dequantized_matmuls", default=False)
# Float32 weight elements dequantized at a time (64 MiB) by dequantized_matmuls(): a 7B model's LM head
# dequantized whole would be 2 GiB.
DEQUANTIZE_ELEMENTS = 1 << 24
# Fewer rows of x than this keep MLX's quantized matmul under dequantized_matmuls(): its one-row path is fast
# on CPU (the default model's forward: 0.15 s at 1 row, 0.63 s at 5, 4.5 s at 35; dequantized ~0.5 s at any).
DEQUANTIZE_MIN_ROWS = 4
_SWIGLU = "swiglu"
_GATED_DELTA = "gated_delta_update"
# gated_delta_update's parameters the fused one understands; a version of mlx-lm with others runs its own.
_GATED_DELTA_PARAMS = frozenset({"q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask", "use_kernel",
                                 "lower_bound", "allow_neg_eigval"})
_SSM_UPDATE = "ssm_update"
_SSM_UPDATE_PARAMS = frozenset({"hidden_states", "A_log", "B", "C", "D", "dt", "dt_bias", "state",
                                "time_step_limit", "mask", "lengths"})
_PACKED = "_trillm_weights_packed"


class _Kicks:
    """Every `every`-th RMSNorm inside fused_ops() queues the graph built so far (its input: the residual stream
    entering a layer) with `mx.async_eval`, so the device computes the first layers while Python builds the rest.
    A step that is not launched ahead (a speculative verify, a prefill chunk) otherwise waits for the whole
    graph (~6 ms of Python for SmolLM2's 30 layers) before any of it runs."""

    __slots__ = ("every", "seen")

    def __init__(self, every: int) -> None:
        self.every = every
        self.seen = 0

    def norm_input(self, x: mx.array) -> None:
        self.seen += 1
        if self.seen % self.every == 0:
            mx.async_eval(x)


_KICKS: ContextVar[_Kicks | None] = ContextVar("trillm_fused_ops_kicks", default=None)


@contextmanager
def fused_ops(kernels: KernelSelection | None = None, *, kick_every: int = 0) -> Iterator[None]:
    """Within this block the installed modules run trillm's ops, as `kernels` chose them. kick_every > 0:
    start computing the graph built so far at every kick_every-th RMSNorm (`_Kicks`)."""
    token = _ACTIVE.set(kernels if kernels is not None else unchecked())
    kicks = _KICKS.set(_Kicks(kick_every) if kick_every > 0 else None)
    try:
        yield
    finally:
        _KICKS.reset(kicks)
        _ACTIVE.reset(token)


# Sibling projections fused into one matmul, by child name (mlx-lm's llama-family names).
PROJECTION_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class ProjectionGroup:
    """Linear layers applied to one input, run as one matmul over their stacked weights.

    Each member's weight is a row slice of `weight` (for quantized members, their scales and biases too).
    Inside `fused_ops()`, a member called with an input the group has not seen runs `linear(x, weight)`
    (`quant_linear` for quantized members); members called with the same input object (mlx-lm calls q, k, v,
    or gate, up, on one x) slice that output. The output is dropped once every member took its slice, so
    nothing outlives the graph being built. A member whose weight was replaced since (a weight update)
    makes the group restack before its next matmul.
    """

    def __init__(self, members: Sequence[FusedLinear | FusedQuantizedLinear]) -> None:
        self.members = list(members)
        self.keys = ("weight", "scales", "biases") if isinstance(members[0], nn.QuantizedLinear) else ("weight",)
        self.bounds: list[tuple[int, int]] = []
        at = 0
        for m in self.members:
            n = m.weight.shape[0]
            self.bounds.append((at, at + n))
            at += n
        self.arrays: dict[str, mx.array] = {}
        self._views: list[dict[str, mx.array]] = []
        self._restack()
        self._x: mx.array | None = None
        self._y: mx.array | None = None
        self._pending = 0  # bit i: member i has not taken its slice of _y yet

    @property
    def weight(self) -> mx.array:
        return self.arrays["weight"]

    def _restack(self) -> None:
        self.set_arrays({k: mx.concatenate([m[k] for m in self.members], axis=0) for k in self.keys})

    def set_weight(self, weight: mx.array) -> None:
        """Use `weight` (the stacked rows) and make each member's weight a row slice of it."""
        self.set_arrays({**self.arrays, "weight": weight})

    def set_arrays(self, arrays: dict[str, mx.array]) -> None:
        self.arrays = arrays
        self._views = [{k: a[lo:hi] for k, a in arrays.items()} for lo, hi in self.bounds]
        for i, (m, views) in enumerate(zip(self.members, self._views)):
            for k, view in views.items():
                setattr(m, k, view)
            m.group = self
            m.group_index = i

    def _matmul(self, x: mx.array, kernels: KernelSelection) -> mx.array:
        if len(self.keys) == 1:
            return kernels.linear(x, self.weight)
        m = self.members[0]
        a = self.arrays
        return kernels.quant_linear(x, a["weight"], a["scales"], a["biases"], m.group_size, m.bits)

    def output(self, member: FusedLinear | FusedQuantizedLinear, x: mx.array, kernels: KernelSelection) -> mx.array:
        # Called ~150 times a decode step on SmolLM2: each member checks its own weights only (a slice of an
        # earlier matmul is still right for a member whose weights did not change).
        i = member.group_index
        bit = 1 << i
        views = self._views[i]
        if any(member[k] is not views[k] for k in self.keys):
            self._restack()
            self._x = None
        if self._x is not x or not self._pending & bit:
            self._x, self._y = x, self._matmul(x, kernels)
            self._pending = (1 << len(self.members)) - 1
        assert self._y is not None
        lo, hi = self.bounds[i]
        out = self._y[..., lo:hi]
        self._pending &= ~bit
        if not self._pending:
            self._x = self._y = None
        return out


class FusedLinear(nn.Linear):
    group: ProjectionGroup | None = None  # set when this layer's matmul is shared with its siblings'
    group_index = 0  # its place in the group

    def __call__(self, x: mx.array) -> mx.array:
        if (k := _ACTIVE.get()) is not None:
            y = self.group.output(self, x, k) if self.group is not None else k.linear(x, self.weight)
            return y + self.bias if "bias" in self else y
        out: mx.array = super().__call__(x)
        return out


class FusedEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:  # a tied LM head
        if (k := _ACTIVE.get()) is not None:
            return k.linear(x, self.weight)
        out: mx.array = super().as_linear(x)
        return out


@contextmanager
def dequantized_matmuls() -> Iterator[None]:
    """Outside fused_ops(), in this thread: quantized layers multiply by their weights dequantized to float32
    (`quant_linear_ref`, a slice of output rows at a time) instead of by MLX's quantized matmul, for calls of
    at least DEQUANTIZE_MIN_ROWS rows: the same products to float32 rounding, and MLX's CPU quantized matmul
    grows with the rows (the load-time probe's mlx-lm forwards on the default model's Q4_1 weights: 9.2 s)."""
    token = _DEQUANTIZED.set(True)
    try:
        yield
    finally:
        _DEQUANTIZED.reset(token)


def _dequantized_matmul(layer: nn.Module, x: mx.array) -> mx.array | None:
    """x times `layer`'s weight as dequantized_matmuls() computes it; None outside it or for a layout other
    than MLX's affine one (which then runs MLX's own)."""
    if (not _DEQUANTIZED.get() or layer.mode != "affine" or "biases" not in layer
            or x.size // max(x.shape[-1], 1) < DEQUANTIZE_MIN_ROWS):  # fmt: skip
        return None
    w, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    rows = max(1, DEQUANTIZE_ELEMENTS // (scales.shape[-1] * layer.group_size))
    parts = [quant_linear_ref(x, w[i : i + rows], scales[i : i + rows], biases[i : i + rows], layer.group_size,
                              layer.bits) for i in range(0, w.shape[0], rows)]  # fmt: skip
    out = (parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)).astype(x.dtype)
    # Now, not in the caller's graph: evaluated lazily, a forward's dequantized weights would all be alive at
    # once (the default model's probe: a start-up peak of +440 MiB, about every weight in float32).
    mx.eval(out)
    return out


class FusedQuantizedLinear(nn.QuantizedLinear):
    """A linear layer on weights kept quantized (MLX's affine layout), through `quant_linear`."""

    group: ProjectionGroup | None = None  # set when this layer's matmul is shared with its siblings'
    group_index = 0  # its place in the group

    def __call__(self, x: mx.array) -> mx.array:
        if (k := _ACTIVE.get()) is not None and self.mode == "affine" and "biases" in self:
            if self.group is not None:
                y = self.group.output(self, x, k)
            else:
                y = k.quant_linear(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
            return y + self["bias"] if "bias" in self else y
        if (d := _dequantized_matmul(self, x)) is not None:
            return d + self["bias"] if "bias" in self else d
        out: mx.array = super().__call__(x)
        return out


class FusedQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding: lookups dequantize their rows (as mlx-lm's), a tied LM head runs `quant_linear`."""

    def as_linear(self, x: mx.array) -> mx.array:
        if (k := _ACTIVE.get()) is not None and self.mode == "affine" and "biases" in self:
            out: mx.array = k.quant_linear(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
            return out
        if (d := _dequantized_matmul(self, x)) is not None:
            return d
        out = super().as_linear(x)
        return out


def quantization_formats(model: nn.Module) -> tuple[tuple[int, int, str], ...]:
    """(bits, group_size, scales dtype) of every affine-quantized linear layer and embedding in `model`."""
    formats = {
        (int(m.bits), int(m.group_size), str(m["scales"].dtype).rsplit(".", 1)[-1])
        for _, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.mode == "affine" and "biases" in m
    }
    return tuple(sorted(formats))


class FusedRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        if (k := _ACTIVE.get()) is not None:
            if (kicks := _KICKS.get()) is not None:
                kicks.norm_input(x)
            return k.rms_norm(x, self.weight, self.eps)
        out: mx.array = super().__call__(x)
        return out


class FusedRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if (k := _ACTIVE.get()) is not None:
            return k.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)
        # mx.fast.rope takes an array offset too (per-row positions); nn.RoPE only annotates int.
        out: mx.array = super().__call__(x, offset)
        return out


def is_depthwise(conv: nn.Conv1d) -> bool:
    """A causal mixer's short convolution: one filter per channel, unpadded, stride and dilation 1."""
    w = conv.weight
    return bool(w.ndim == 3 and w.shape[2] == 1 and conv.groups == w.shape[0] and conv.padding == 0
                and conv.stride == 1 and conv.dilation == 1)  # fmt: skip


def depthwise_conv_shape(model: nn.Module) -> tuple[int, ...]:
    """(channels, kernel width) of the model's first depthwise `nn.Conv1d`; () when it has none."""
    return next(((int(m.weight.shape[0]), int(m.weight.shape[1])) for _, m in model.named_modules()
                 if isinstance(m, nn.Conv1d) and is_depthwise(m)), ())


class FusedConv1d(nn.Conv1d):
    """A depthwise `nn.Conv1d` (see `is_depthwise`), through `depthwise_conv1d`."""

    def __call__(self, x: mx.array) -> mx.array:
        if (k := _ACTIVE.get()) is not None:
            return k.depthwise_conv1d(x, self.weight, self["bias"] if "bias" in self else None)
        out: mx.array = super().__call__(x)
        return out


def _fused_swiglu(original: Callable[[mx.array, mx.array], mx.array]) -> Callable[[mx.array, mx.array], mx.array]:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        k = _ACTIVE.get()
        return k.silu_mul(gate, x) if k is not None else original(gate, x)

    swiglu.__trillm_original__ = original  # type: ignore[attr-defined]
    return swiglu


class FusedNn(types.ModuleType):
    """mlx.nn as a model's own module sees it: every name mlx.nn's, but `silu` runs the selection's
    `silu_mul` (against ones) inside fused_ops(). MLX's `nn.silu` on CPU is a scalar exp on one thread: 76 ms
    on a Mamba-2 mixer's [16, 44, 6144] prefill conv output, 1.6 ms on a batch-16 decode's, against 2 ms
    and 0.05 ms through the primitive."""

    def __init__(self, original: types.ModuleType) -> None:
        super().__init__(original.__name__, original.__doc__)
        self.__trillm_original__ = original

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__trillm_original__, name)

    def silu(self, x: mx.array) -> mx.array:
        k = _ACTIVE.get()
        if k is None or k.silu_mul is silu_mul_ref or not mx.issubdtype(x.dtype, mx.floating):
            out: mx.array = self.__trillm_original__.silu(x)
            return out
        return k.silu_mul(x, mx.ones_like(x))


_FUSED_NN = FusedNn(nn)


# Argument values are whatever the caller passed (Signature.bind's are Any too); the wrappers check the arrays.
_Arguments = Callable[[tuple[object, ...], dict[str, object]], dict[str, Any]]


def _binder(sig: inspect.Signature) -> _Arguments:
    """A function from a call's (args, kwargs) to its arguments by parameter name, defaults filled in, as
    `sig.bind` + `apply_defaults` give them. A call that passes positional parameters by position and
    keyword-only ones by name (how mlx-lm's models call these, per layer per decode step) is mapped directly;
    any other call goes through `sig.bind`, which also raises what the original would."""
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    required = sum(1 for p in params if p.name in positional and p.default is p.empty)
    direct = all(p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD for p in params) and all(
        p.default is not p.empty for p in params if p.kind is p.KEYWORD_ONLY)

    def arguments(args: tuple[object, ...], kwargs: dict[str, object]) -> dict[str, Any]:
        if direct and required <= len(args) <= len(positional) and kwargs.keys() <= keyword:
            p: dict[str, Any] = dict(defaults)
            p.update(zip(positional, args))
            p.update(kwargs)
            return p
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    return arguments


def _fused_gated_delta(original: Callable[..., tuple[mx.array, mx.array]]) -> Callable[..., tuple[mx.array, mx.array]]:
    """mlx-lm's gated_delta_update with its recurrence run by the selection's `gated_delta` (the CPU primitive):
    g and beta computed by mlx-lm's own helpers, as it computes them. Outside fused_ops(), where the
    selection runs mlx-lm's own (None: on Metal, or the kernel lost its check), with use_kernel=False (mlx-lm's
    training path) or parameters this version does not know: the original."""
    sig = inspect.signature(original)
    helpers = sys.modules.get(original.__module__)
    known = set(sig.parameters) <= _GATED_DELTA_PARAMS
    arguments = _binder(sig)

    def gated_delta_update(*args: object, **kwargs: object) -> tuple[mx.array, mx.array]:
        k = _ACTIVE.get()
        run = k.gated_delta if k is not None else None
        if run is None or not known or helpers is None:
            return original(*args, **kwargs)
        p = arguments(args, kwargs)
        if not p.get("use_kernel", True):
            return original(*args, **kwargs)
        q, key, v, a, b = (p[n] for n in ("q", "k", "v", "a", "b"))
        assert isinstance(q, mx.array) and isinstance(key, mx.array) and isinstance(v, mx.array)
        beta = mx.sigmoid(b)
        if p.get("allow_neg_eigval"):
            beta = beta * 2.0
        lower_bound = p.get("lower_bound")
        g = (helpers.compute_g(p["A_log"], a, p["dt_bias"]) if lower_bound is None
             else helpers.compute_lower_bound_g(p["A_log"], a, p["dt_bias"], lower_bound))  # fmt: skip
        state = p.get("state")
        if state is None:
            B, _, _, dk = q.shape
            state = mx.zeros((B, v.shape[2], v.shape[3], dk), dtype=mx.float32)
        mask = p.get("mask")
        assert isinstance(state, mx.array) and (mask is None or isinstance(mask, mx.array))
        return run(q, key, v, g, beta, state, mask)

    gated_delta_update.__trillm_original__ = original  # type: ignore[attr-defined]
    return gated_delta_update


def _fused_ssm_update(original: Callable[..., tuple[mx.array, mx.array]]) -> Callable[..., tuple[mx.array, mx.array]]:
    """mlx-lm's ssm_update run by the selection's `ssm_update`: decode and prefill, with or without a state (the
    CPU primitive's scan, or the Metal/CUDA body the self-check chose). Where the selection runs mlx-lm's own
    (None: no kernel was chosen): the original; outside fused_ops() or with parameters this version does not
    know: the original as called.

    Inside fused_ops() a call with a mask and no lengths gets the lengths the mask says (its True count per
    row): the engine's rows are right-padded and its mask is True at each row's real tokens, so this is what
    mlx-lm's batched path would pass. Nemotron-H's mixer passes the mask alone; without the lengths its scan
    reads the state's decay at the padding's end and drops a padded row's prompt from its state."""
    sig = inspect.signature(original)
    known = set(sig.parameters) <= _SSM_UPDATE_PARAMS
    arguments = _binder(sig)
    takes_lengths = "lengths" in sig.parameters

    def ssm_update(*args: object, **kwargs: object) -> tuple[mx.array, mx.array]:
        k = _ACTIVE.get()
        if k is None or not known:
            return original(*args, **kwargs)
        p = arguments(args, kwargs)
        mask = p.get("mask")
        if takes_lengths and isinstance(mask, mx.array) and p.get("lengths") is None:
            p["lengths"] = mask.reshape(mask.shape[0], -1).astype(mx.int32).sum(axis=-1)
        x, state, run = p["hidden_states"], p.get("state"), k.ssm_update
        if run is None or not isinstance(x, mx.array) or not (state is None or isinstance(state, mx.array)):
            return original(**p)
        return run(x, p["A_log"], p["B"], p["C"], p["D"], p["dt"], p["dt_bias"], state,
                   p["time_step_limit"], mask, p.get("lengths"))

    ssm_update.__trillm_original__ = original  # type: ignore[attr-defined]
    return ssm_update


def _replacement(child: object) -> nn.Module | None:
    if not isinstance(child, nn.Module):
        return None
    if type(child) in (nn.QuantizedLinear, nn.QuantizedEmbedding):
        # The same object, its class swapped for the subclass: no attribute to copy, nothing re-quantized.
        child.__class__ = FusedQuantizedLinear if type(child) is nn.QuantizedLinear else FusedQuantizedEmbedding
        return child
    if type(child) is nn.Linear:
        out_dims, in_dims = child.weight.shape
        lin = FusedLinear(in_dims, out_dims, bias="bias" in child)
        lin.update(dict(child.parameters()))
        return lin
    if type(child) is nn.Embedding:
        emb = FusedEmbedding(*child.weight.shape)
        emb.weight = child.weight
        return emb
    if type(child) is nn.RMSNorm:
        norm = FusedRMSNorm(child.weight.shape[0], eps=child.eps)
        norm.weight = child.weight
        return norm
    if type(child) is nn.RoPE:
        return FusedRoPE(child.dims, traditional=child.traditional, base=child.base, scale=child.scale)
    if type(child) is nn.Conv1d and is_depthwise(child):
        # The same object, its class swapped (as quantized layers): parameters and attributes stay.
        child.__class__ = FusedConv1d
        return child
    return None


def _group_projections(model: nn.Module, counts: dict[str, int]) -> None:
    for _, module in model.named_modules():
        for names in PROJECTION_GROUPS:
            members = [module.get(name) for name in names]
            lins: list[FusedLinear | FusedQuantizedLinear]
            if all(type(m) is FusedLinear for m in members):
                lins = [m for m in members if isinstance(m, FusedLinear)]
            elif all(type(m) is FusedQuantizedLinear for m in members):
                lins = [m for m in members if isinstance(m, FusedQuantizedLinear)]
                first = lins[0]
                if any(m.mode != "affine" or "biases" not in m or (m.group_size, m.bits) != (first.group_size, first.bits)
                       or m["scales"].dtype != first["scales"].dtype for m in lins):  # fmt: skip
                    continue
            else:
                continue
            if any(m.group is not None for m in lins):
                continue  # already grouped (install_fused_ops is idempotent)
            w0 = lins[0].weight
            if any(m.weight.ndim != 2 or m.weight.shape[1] != w0.shape[1] or m.weight.dtype != w0.dtype for m in lins):
                continue
            group = ProjectionGroup(lins)
            mx.eval(*group.arrays.values())  # now, so each group's originals go before the next one stacks
            key = "+".join(names)
            counts[key] = counts.get(key, 0) + 1


PACK_CHUNK_BYTES = 128 << 20  # weights per huge-page buffer: start-up holds the originals of one chunk only


def _pack_weights(model: nn.Module) -> hugepages.Advice | None:
    """Every linear weight (a group's stacked one for its members) and embedding in huge-page buffers of about
    PACK_CHUNK_BYTES each. One buffer for the whole model would hold every original beside its copy (a start-up
    peak of twice the weights); per chunk, each original is dropped once its owner holds the copy, and at most
    two partial 2 MiB pages per buffer go without huge pages."""
    targets: list[tuple[object, mx.array]] = []
    seen: set[int] = set()
    for _, m in model.named_modules():
        owner: object = m
        if isinstance(m, FusedLinear) and m.group is not None:
            owner = m.group
            weight = m.group.weight
        elif isinstance(m, (FusedLinear, FusedEmbedding)):
            weight = m.weight
        else:
            continue
        if id(owner) not in seen:
            seen.add(id(owner))
            targets.append((owner, weight))
    dtypes = {w.dtype for _, w in targets}
    if len(dtypes) != 1 or not targets:
        return None
    chunks: list[list[object]] = [[]]
    size = 0
    for owner, weight in targets:
        if size and size + weight.nbytes > PACK_CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(owner)
        size += weight.nbytes
    del targets, weight  # only the owners hold the originals now
    nbytes = advised = collapsed = 0
    errors: list[str] = []
    for owners in chunks:
        views, advice = hugepages.pack([o.weight for o in owners])  # type: ignore[attr-defined]
        for owner, view in zip(owners, views):
            if isinstance(owner, ProjectionGroup):
                owner.set_weight(view)
            else:
                assert isinstance(owner, nn.Module)
                owner.weight = view
        del views
        release_freed_heap()  # this chunk's originals
        nbytes, advised, collapsed = nbytes + advice.nbytes, advised + advice.advised, collapsed + advice.collapsed
        if advice.error and advice.error not in errors:
            errors.append(advice.error)
    return hugepages.Advice(nbytes, advised, collapsed, "; ".join(errors))


def install_fused_ops(model: nn.Module) -> list[str]:
    """Install the fused ops in `model` (idempotent). Returns what was replaced, e.g. ["RMSNorm x61", ...]."""
    counts: dict[str, int] = {}
    for _, module in model.named_modules():
        for key, child in list(module.items()):
            new = _replacement(child)
            if new is not None:
                setattr(module, key, new)
                counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    grouped_before = any(isinstance(m, FusedLinear) and m.group is not None for _, m in model.named_modules())
    _group_projections(model, counts)
    notes = []
    if hugepages.available() and not grouped_before and not getattr(model, _PACKED, False):
        release_freed_heap()  # the grouped originals' pages, before the packed copies take new ones
        advice = _pack_weights(model)
        if advice is not None:
            setattr(model, _PACKED, True)
            notes.append(f"weights packed: {advice.collapsed >> 20} of {advice.nbytes >> 20} MiB on huge pages"
                         + (f" ({advice.error})" if advice.error else ""))
    # The model's own module functions rebound once (the wrapper keeps the original as __trillm_original__).
    rebinds: tuple[tuple[str, Callable[..., Callable[..., object]], str], ...] = (
        (_SWIGLU, _fused_swiglu, "swiglu"), (_GATED_DELTA, _fused_gated_delta, "gated_delta"),
        (_SSM_UPDATE, _fused_ssm_update, "ssm_update"))
    for attr, wrap, label in rebinds:
        for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
            mod = sys.modules.get(name)
            fn = getattr(mod, attr, None)
            if fn is None or not callable(fn):
                continue
            if not hasattr(fn, "__trillm_original__"):
                setattr(mod, attr, wrap(fn))
            counts[label] = counts.get(label, 0) + 1
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "nn", None) in (nn, _FUSED_NN) and name.startswith("mlx_lm."):
            setattr(mod, "nn", _FUSED_NN)
            counts["nn.silu"] = counts.get("nn.silu", 0) + 1
    return [f"{name} x{n}" for name, n in sorted(counts.items())] + notes
