"""trillm's ops inside an mlx-lm model: linear layers (and a tied LM head), RMSNorm, RoPE and the SwiGLU
activation, through trillm.kernels.

`install_fused_ops(model)` swaps the model's `nn.Linear`, `nn.Embedding`, `nn.RMSNorm` and `nn.RoPE` modules
for subclasses (same
parameters, same attributes) and rebinds `swiglu` in the model's own mlx-lm modules, the way
`install_paged_attention` rebinds attention. They run trillm's ops (the CPU primitives on CPU, the
references elsewhere) only inside `fused_ops()`, which ModelRunner.forward enters: anything else that runs
the same model object or module (mlx-lm's own generate, a benchmark's peer) keeps mlx-lm's behaviour.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn

from trillm.kernels.linear import linear
from trillm.kernels.rms_norm import rms_norm
from trillm.kernels.rope import rope
from trillm.kernels.silu_mul import silu_mul

_ACTIVE: ContextVar[bool] = ContextVar("trillm_fused_ops", default=False)
_SWIGLU = "swiglu"


@contextmanager
def fused_ops() -> Iterator[None]:
    """Within this block the installed modules run trillm's ops."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class FusedLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if _ACTIVE.get():
            y = linear(x, self.weight)
            return y + self.bias if "bias" in self else y
        out: mx.array = super().__call__(x)
        return out


class FusedEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:  # a tied LM head
        if _ACTIVE.get():
            return linear(x, self.weight)
        out: mx.array = super().as_linear(x)
        return out


class FusedRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        if _ACTIVE.get():
            return rms_norm(x, self.weight, self.eps)
        out: mx.array = super().__call__(x)
        return out


class FusedRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if _ACTIVE.get():
            return rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)
        # mx.fast.rope takes an array offset too (per-row positions); nn.RoPE only annotates int.
        out: mx.array = super().__call__(x, offset)
        return out


def _fused_swiglu(original: Callable[[mx.array, mx.array], mx.array]) -> Callable[[mx.array, mx.array], mx.array]:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        return silu_mul(gate, x) if _ACTIVE.get() else original(gate, x)

    swiglu.__trillm_original__ = original  # type: ignore[attr-defined]
    return swiglu


def _replacement(child: object) -> nn.Module | None:
    if not isinstance(child, nn.Module):
        return None
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
    return None


def install_fused_ops(model: nn.Module) -> list[str]:
    """Install the fused ops in `model` (idempotent). Returns what was replaced, e.g. ["RMSNorm x61", ...]."""
    counts: dict[str, int] = {}
    for _, module in model.named_modules():
        for key, child in list(module.items()):
            new = _replacement(child)
            if new is not None:
                setattr(module, key, new)
                counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        mod = sys.modules.get(name)
        fn = getattr(mod, _SWIGLU, None)
        if fn is None or not callable(fn):
            continue
        if not hasattr(fn, "__trillm_original__"):
            setattr(mod, _SWIGLU, _fused_swiglu(fn))
        counts["swiglu"] = counts.get("swiglu", 0) + 1
    return [f"{name} x{n}" for name, n in sorted(counts.items())]
