"""What the engine needs of a real mlx-lm model, asked of the model itself rather than re-implemented per family.

- `kv_layout(model)`: the caches the model makes (`make_cache`, as mlx-lm's generate uses) and the K/V shape
  each holds per token, read off one token run through the model with its own caches; for a hybrid model's
  recurrent layers (`ArraysCache`, alone or in a `CacheList` with the layer's KVCache), the per-sequence state
  each holds, read off the same run (engine/state_pool.py); a pure state-space model (Mamba-2) has states only.
  Cache kinds the paged pool cannot stand in for (quantized caches) refuse the model in one line.
- `ModelHead`: runs the model's own `__call__` with its decoder stack (the module holding `layers`) wrapped,
  so that only the positions the engine needs reach the model's own tail: whatever head it has (`lm_head`,
  `output`, a tied embedding) and whatever it applies to the final logits (soft-capping, logit scaling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from trillm.engine.errors import UnsupportedModel
from trillm.engine.kv_cache import KVLayout, LayerKV
from trillm.engine.state_pool import CacheNode, LayerState, StateEntry

# Where mlx-lm's Model classes keep their decoder stack (Gemma 3's multimodal wrapper nests a text Model).
_STACK_NAMES = ("model", "language_model", "transformer", "backbone")


@dataclass(frozen=True, slots=True)
class DecoderStack:
    parent: nn.Module
    key: str
    stack: nn.Module


def decoder_stack(model: nn.Module) -> DecoderStack | None:
    """The module holding the decoder `layers` that `model.__call__` runs, and where it hangs."""
    parent = model
    for _ in range(3):
        child = next((parent[k] for k in _STACK_NAMES if isinstance(parent.get(k), nn.Module)), None)
        if child is None:
            return None
        key = next(k for k in _STACK_NAMES if parent.get(k) is child)
        if "layers" in child:
            return DecoderStack(parent, key, child)
        parent = child
    return None


class _StackProxy(nn.Module):
    """Stands in for the decoder stack during one call of the model: runs it (or returns given hidden states)
    and hands the model's tail only the positions asked for. Attributes fall through to the real stack (a tied
    head reads `embed_tokens`)."""

    def __init__(self, stack: nn.Module, select: Any = None, given: mx.array | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "_stack", stack)
        object.__setattr__(self, "_select", select)  # callable h -> h at the positions the engine needs
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "hidden", None)  # the stack's whole output, after the call

    def __getattr__(self, key: str) -> Any:
        return getattr(object.__getattribute__(self, "_stack"), key)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given = object.__getattribute__(self, "_given")
        h = given if given is not None else object.__getattribute__(self, "_stack")(*args, **kwargs)
        object.__setattr__(self, "hidden", h)
        select = object.__getattribute__(self, "_select")
        return select(h) if select is not None and isinstance(h, mx.array) else h


class ModelHead:
    """The model's forward with its own tail applied to selected positions only (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack = decoder_stack(model)

    def forward(self, tokens: mx.array, caches: list[Any], last_index: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """(logits [B, V] at each row's `last_index` (decode: the only position), and what `logits` turns into
        every position's logits: the stack's whole output [B, L, D], or, for a model whose stack the engine cannot
        find, those logits [B, L, V] themselves)."""
        B, L = tokens.shape
        rows = mx.arange(B)

        def last(h: mx.array) -> mx.array:
            return h if h.shape[1] == 1 else h[rows, last_index][:, None]

        if self.stack is not None:
            proxy = _StackProxy(self.stack.stack, select=last)
            out = self._call(proxy, tokens, caches)
            if proxy.hidden is not None:
                return out.reshape(B, out.shape[-1]), proxy.hidden
            self.stack = None  # the model's call never went through the stack's attribute: logits of every position
        else:
            out = self.model(tokens, cache=caches)
        return (out[:, -1] if L == 1 else out[rows, last_index]), out

    def logits(self, hidden: mx.array) -> mx.array:
        """The model's tail on hidden states the stack produced ([..., L, D] -> [..., L, V])."""
        if self.stack is None:
            return hidden  # a model without a separable stack left its logits there (see `forward`)
        shape = hidden.shape
        h = hidden.reshape(-1, shape[-2], shape[-1])
        proxy = _StackProxy(self.stack.stack, given=h)
        out = self._call(proxy, mx.zeros(h.shape[:2], mx.int32), None)
        return out.reshape(*shape[:-1], out.shape[-1])

    def _call(self, proxy: _StackProxy, tokens: mx.array, caches: list[Any] | None) -> mx.array:
        parent, key = self.stack.parent, self.stack.key  # type: ignore[union-attr]
        real = parent[key]
        parent[key] = proxy
        try:
            out: mx.array = self.model(tokens, cache=caches)
        finally:
            parent[key] = real
        return out


# ---- the KV layout -------------------------------------------------------------------------------------------

_PAGEABLE = ("KVCache", "RotatingKVCache")
_RECURRENT = ("ArraysCache", "MambaCache")  # per-sequence state, held by the state pool
# Hybrid families the test matrix checks against mlx-lm (ragged rows, chunked prefill, preemption, abort); any
# other model with recurrent layers is refused by name, not left to the probe alone.
VERIFIED_RECURRENT = frozenset({"qwen3_next", "qwen3_5", "lfm2", "nemotron_h", "falcon_h1", "mamba2"})
_WHY = {
    "ChunkedKVCache": "chunked attention (Llama 4 style)",
    "QuantizedKVCache": "a quantized KV cache",
    "CacheList": "layers with several caches each (hybrid or compressed attention)",
}


def make_model_cache(model: nn.Module, name: str = "model") -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    try:
        return list(make_prompt_cache(model))
    except Exception as exc:  # no `layers`, a make_cache that needs what the engine cannot give
        raise UnsupportedModel(f"{name}: not supported: mlx-lm cannot make its caches ({type(exc).__name__}: "
                               f"{exc})") from exc


def check_supported(model: nn.Module, name: str = "model") -> None:
    """Refuse, in one line, a model whose caches the paged pool cannot stand in for."""
    _check_caches(make_model_cache(model, name), name, model)


def describe(layout: KVLayout) -> str:
    """The layers' attention kinds in a few words, for messages: "2 x full attention, 2 x sliding window 8"."""
    kinds: dict[str, int] = {}
    for layer in layout.layers:
        kind = (f"sliding window {layer.window}" if layer.window else f"chunked attention {layer.chunk}"
                if layer.chunk else "full attention")
        if layer.k_dim != layer.v_dim:
            kind += f" (K {layer.k_dim} / V {layer.v_dim} wide)"
        kinds[kind] = kinds.get(kind, 0) + 1
    for state in layout.states:
        kind = f"recurrent state ({state.nbytes} bytes per sequence)"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{n} x {kind}" for kind, n in kinds.items())


def kv_layout(model: nn.Module, name: str = "model") -> KVLayout:
    """One `LayerKV` per cache the model makes, from one token run with the model's own caches."""
    caches = make_model_cache(model, name)
    _check_caches(caches, name, model)
    model(mx.zeros((1, 1), mx.int32), cache=caches)
    layers: list[LayerKV] = []
    states: list[LayerState] = []

    def node(c: Any, i: int) -> CacheNode:
        kind = type(c).__name__
        if kind == "CacheList":
            return CacheNode("list", children=tuple(node(child, i) for child in c.caches))
        if kind in _RECURRENT:
            if any(a is None for a in c.cache):
                raise UnsupportedModel(f"{name}: not supported yet: the recurrent state of cache {i} is never written")
            states.append(LayerState(tuple(StateEntry(tuple(int(d) for d in a.shape[1:]), a.dtype) for a in c.cache),
                                     kind))
            return CacheNode("state", len(states) - 1)
        if c.keys is None:
            raise UnsupportedModel(f"{name}: not supported yet: cache {i} is never written")
        _, h, _, dk = c.keys.shape
        window = int(c.max_size) if kind == "RotatingKVCache" else None
        chunk = int(c.chunk_size) if kind == "ChunkedKVCache" else None
        layers.append(LayerKV(int(h), int(dk), int(c.values.shape[-1]), window, chunk))
        return CacheNode("kv", len(layers) - 1)

    plan = tuple(node(c, i) for i, c in enumerate(caches))
    if not states:
        return KVLayout(tuple(layers))
    return KVLayout(tuple(layers), states=tuple(states), plan=plan)


def _check_caches(caches: list[Any], name: str, model: nn.Module) -> None:
    if not caches:
        raise UnsupportedModel(f"{name}: not supported yet: the model makes no KV cache")
    from trillm.engine.attention_variants import CHUNKED_STACKS

    chunked_ok = any((c.__module__, c.__name__) in CHUNKED_STACKS  # (the adapter subclasses the stack's class)
                     for _, m in model.named_modules() for c in type(m).__mro__)
    flat = [(i, child) for i, c in enumerate(caches) for child in _children(c)]
    family = type(model).__module__.rsplit(".", 1)[-1]
    if any(type(c).__name__ in _RECURRENT for _, c in flat) and family not in VERIFIED_RECURRENT:
        raise UnsupportedModel(f"{name}: not supported yet: {family} has recurrent layers, and only "
                               f"{', '.join(sorted(VERIFIED_RECURRENT))} are checked against mlx-lm in the continuous "
                               f"batch")
    for i, c in flat:
        kind = type(c).__name__
        if (kind == "ChunkedKVCache" and chunked_ok) or kind in _RECURRENT:
            continue
        if kind not in _PAGEABLE:
            why = _WHY.get(kind, f"its {kind} caches")
            raise UnsupportedModel(f"{name}: not supported yet: layer {i} uses {why}, which the paged engine does "
                                   f"not serve")
        if kind == "RotatingKVCache" and (getattr(c, "keep", None) or 0) > 0:
            raise UnsupportedModel(f"{name}: not supported yet: layer {i} keeps {c.keep} sink tokens in a rotating "
                                   f"cache")


def _children(c: Any) -> list[Any]:
    """A layer's caches: a CacheList's own (one level: Falcon-H1's mixer state and attention), else itself. A
    CacheList without recurrent state (indexer keys beside the KV) is refused as a whole, as before."""
    if type(c).__name__ != "CacheList":
        return [c]
    children = list(c.caches)
    if not any(type(x).__name__ in _RECURRENT for x in children):
        return [c]
    return children
