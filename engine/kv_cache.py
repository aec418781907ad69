"""A paged KV cache that mlx-lm's model code drives unmodified, backed by the shared block pool.

mlx-lm's attention layers call `cache.update_and_fetch(keys, values)`, read `cache.offset` for RoPE and ask
`cache.make_mask(...)` (through `create_attention_mask`). `PagedKVCache` answers all three for a ragged
batch: per-row offsets, writes through `trillm.kernels.kv_write`, and a dense view through `kv_gather`.

THE attention seam (the only one): `install_paged_attention(model)` rebinds `scaled_dot_product_attention`
in the model's own modules to `paged_sdpa`, which sends paged caches to paged attention (the implementation
the engine's start-up kernel self-check chose: a kernel, or the pure-mx reference) and everything else to
mlx-lm's original. The paged path is taken only when the call is provably plain attention over this layer's
cache: the keys and values are the ones `update_and_fetch` returned, and the mask is one `make_mask` built (its
sliding window or attention chunk, if any, is passed to the kernel with the layer's sinks). Any other call (a
mask the model built itself, as MLA's RoPE scores; keys the model transformed after the fetch) runs
mlx-lm's original on the dense gathered K/V with the model's own mask: slower, never wrong. MLX's laziness
means the unused gather costs nothing when the paged path is taken.

A hybrid model's recurrent layers (linear attention, state-space mixers, short convolutions) keep no K/V: the
pool's `states` (engine/state_pool.py) holds their per-sequence state, and `caches()` hands the model a list
shaped as its own `make_cache()`, paged caches and recurrent-state caches where the model has each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from trillm.engine.state_pool import CacheNode, LayerState, StatePool, StateRows, StateSlots, bytes_per_slot
from trillm.kernels import kv_write
from trillm.kernels.kv_gather import kv_gather_ref
from trillm.kernels.kv_write import dequantize_int4, int4_groups, kv_write_int4
from trillm.kernels.selfcheck import KernelSelection, unchecked


class DTypeLike(Protocol):
    """What sizing reads of a dtype: an mx.Dtype, or a weightless model's stand-in (engine/mock)."""

    @property
    def size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where one forward's new tokens go and what they attend to. Shapes per kernels/layout.py."""

    block_tables: mx.array  # int32 [B, max_blocks]
    context_lens: mx.array  # int32 [B], including this forward's tokens
    slot_mapping: mx.array  # int32 [B * L]
    offsets: mx.array  # int32 [B]: absolute position of each row's first new token (RoPE offset)
    max_context_len: int  # host copy of max(context_lens)
    uniform_offset: int | None  # the rows' common first position, if they share one
    num_new_tokens: int  # L
    states: StateRows | None = None  # the rows' recurrent-state slots (hybrid models only)


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One cached layer's K and V per token: heads x dims (MLA: one "head" of latent and one of RoPE keys)."""

    num_kv_heads: int
    k_dim: int
    v_dim: int
    window: int | None = None  # the layer's sliding window, where the model's own cache says so
    chunk: int | None = None  # chunked attention's chunk (Llama 4): keys of the query's own aligned chunk only

    @property
    def elements_per_token(self) -> int:
        return self.num_kv_heads * (self.k_dim + self.v_dim)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What the pool holds per token: one `LayerKV` per cache the model makes (layers that share another
    layer's K/V, as Gemma 4's, have none)."""

    layers: tuple[LayerKV, ...]
    # Hybrid models: each recurrent layer's per-sequence state (engine/state_pool.py), and where each of the
    # model's caches comes from (None: cache i is pool layer i, the plain case).
    states: tuple[LayerState, ...] = ()
    plan: tuple[CacheNode, ...] | None = None
    # The pool's dtype by name ("float32", "float16", "bfloat16", or "int8": int8 values beside a float32 scale
    # per token and KV head); None: the model's dtype, whatever sizing is given (the mock's weightless models).
    # Part of what a stored block means: a block of one KV dtype is no block of another.
    kv_dtype: str | None = None

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVLayout:
        return cls((LayerKV(num_kv_heads, head_dim, head_dim),) * num_layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's attention span limit (a sliding window or a chunk; None: the whole context)."""
        return tuple(layer.window or layer.chunk for layer in self.layers)

    def bytes_per_block(self, block_size: int, dtype: DTypeLike) -> int:
        """One block's bytes over every layer: K and V at the pool's dtype (`dtype`, the model's, when
        kv_dtype is None), and for int8 a float32 scale per token, KV head, K and V."""
        elements = block_size * sum(layer.elements_per_token for layer in self.layers)
        if self.kv_dtype is None:
            return elements * dtype.size
        if self.kv_dtype == "int8":
            return elements + block_size * sum(2 * layer.num_kv_heads for layer in self.layers) * 4
        if self.kv_dtype == "int4":  # half a byte a value, a float32 (scale, min) per group, K and V
            groups = sum(layer.num_kv_heads * (int4_groups(layer.k_dim) + int4_groups(layer.v_dim))
                         for layer in self.layers)
            return elements // 2 + block_size * groups * 8
        return elements * {"float32": 4, "float16": 2, "bfloat16": 2}[self.kv_dtype]

    @property
    def int8(self) -> bool:
        return self.kv_dtype == "int8"

    @property
    def int4(self) -> bool:
        return self.kv_dtype == "int4"

    @property
    def state_bytes_per_sequence(self) -> int:
        """What one running sequence's recurrent state costs (0 without recurrent layers)."""
        return bytes_per_slot(self.states)


class KVPool:
    """Per-layer K and V pools, [num_blocks, block_size, num_kv_heads, k_dim | v_dim] each, in the layout's
    kv_dtype (else `dtype`, the model's); the int8 cache adds per-layer K and V scales, float32
    [num_blocks, block_size, num_kv_heads] (trillm.kernels.layout)."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, dtype: mx.Dtype, *,
                 kernels: KernelSelection | None = None,
                 layer_kernels: list[KernelSelection] | None = None, state_slots: StateSlots | None = None) -> None:
        self.block_size = block_size
        self.kv_layout = layout
        # The attention and gather implementations the engine's self-check chose; else the dispatchers.
        # `kernels` is the first layer's selection (its report is the engine's); layers of other shapes may
        # have their own.
        self.kernels = kernels or unchecked()
        self.layer_kernels = layer_kernels or [self.kernels] * len(layout.layers)
        if layout.int4:  # two values a byte, (scale, min) per group of 32 (trillm.kernels.kv_write)
            def zeros(lay: LayerKV, dim: int) -> mx.array:
                return mx.zeros((num_blocks, block_size, lay.num_kv_heads, dim // 2), mx.uint8)

            def scale_zeros(lay: LayerKV, dim: int) -> mx.array:
                return mx.zeros((num_blocks, block_size, lay.num_kv_heads, int4_groups(dim), 2), mx.float32)
        else:
            kv_dtype = getattr(mx, layout.kv_dtype) if layout.kv_dtype is not None else dtype

            def zeros(lay: LayerKV, dim: int) -> mx.array:
                return mx.zeros((num_blocks, block_size, lay.num_kv_heads, dim), kv_dtype)

            def scale_zeros(lay: LayerKV, dim: int) -> mx.array:
                return mx.zeros((num_blocks, block_size, lay.num_kv_heads), mx.float32)
        self.keys = [zeros(lay, lay.k_dim) for lay in layout.layers]
        self.values = [zeros(lay, lay.v_dim) for lay in layout.layers]
        scales = layout.layers if layout.int8 or layout.int4 else ()
        self.key_scales = [scale_zeros(lay, lay.k_dim) for lay in scales]
        self.value_scales = [scale_zeros(lay, lay.v_dim) for lay in scales]
        mx.eval(self.keys, self.values, self.key_scales, self.value_scales)
        # The recurrent layers' states, one slot per running sequence (state_slots: the block manager's).
        self.states: StatePool | None = None
        if layout.states:
            assert state_slots is not None, "a model with recurrent layers needs state slots"
            self.states = StatePool(layout.states, state_slots)
        self.layout: BatchLayout | None = None
        # The masks `make_mask` built for the current forward, by id, with their sliding window and attention
        # chunk: the seam's proof that a mask is a plain causal (windowed, chunked) one. Cleared with the layout.
        self.masks: dict[int, tuple[mx.array, int | None, int | None]] = {}

    @property
    def nbytes(self) -> int:
        return (sum(a.nbytes for a in self.keys + self.values + self.key_scales + self.value_scales)
                + (self.states.nbytes if self.states is not None else 0))

    def caches(self) -> list[Any]:
        """The caches the model's own code drives, shaped as its `make_cache()` (see KVLayout.plan)."""
        paged = [PagedKVCache(self, i) for i in range(len(self.keys))]
        plan = self.kv_layout.plan
        if plan is None:
            return list(paged)
        from mlx_lm.models.cache import CacheList

        states = self.states.caches() if self.states is not None else []

        def build(node: CacheNode) -> Any:
            if node.kind == "list":
                return CacheList(*(build(child) for child in node.children))
            return paged[node.index] if node.kind == "kv" else states[node.index]

        return [build(node) for node in plan]

    def arrays(self) -> list[mx.array]:
        return (self.keys + self.values + self.key_scales + self.value_scales
                + (self.states.arrays() if self.states is not None else []))

    def scales(self, layer: int) -> tuple[mx.array | None, mx.array | None]:
        """A layer's int8 K and V scales, the kernels' k_scale and v_scale (None for a float cache)."""
        if not self.key_scales:
            return None, None
        return self.key_scales[layer], self.value_scales[layer]

    def begin(self, layout: BatchLayout) -> None:
        """Describe the next forward (call `commit`, if it succeeded, then `end` after it)."""
        self.layout = layout
        if self.states is not None:
            self.states.begin(layout.states)

    def commit(self) -> None:
        """Keep what the forward wrote outside the K/V pools (the recurrent layers' new states)."""
        if self.states is not None:
            self.states.commit()

    def end(self) -> None:
        self.layout = None
        self.masks.clear()
        if self.states is not None:
            self.states.end()


class PagedKVCache:
    """One layer's view of the pool, for the forward described by `pool.layout`."""

    def __init__(self, pool: KVPool, layer: int) -> None:
        self.pool = pool
        self.layer = layer
        self._fetched: tuple[mx.array, mx.array] | None = None  # what update_and_fetch returned this forward

    @property
    def _layout(self) -> BatchLayout:
        assert self.pool.layout is not None, "set pool.layout before the forward"
        return self.pool.layout

    @property
    def offset(self) -> int | mx.array:
        # RoPE takes an int offset much faster than per-row offsets (74 vs 83 ms per SmolLM2 decode step), so
        # a batch whose rows all start at one position gets the int.
        lay = self._layout
        return lay.uniform_offset if lay.uniform_offset is not None else lay.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys [B, Hkv, L, Dk], values [B, Hkv, L, Dv] -> pool slots
        B, H, L, D = keys.shape
        Dv = values.shape[-1]
        lay = self._layout
        if L == 1:  # decode: [B, H, 1, D] is already [B, H, D] in memory; skip the transpose's copy
            flat_k, flat_v = keys.reshape(B, H, D), values.reshape(B, H, Dv)
        else:
            flat_k = keys.transpose(0, 2, 1, 3).reshape(B * L, H, D)
            flat_v = values.transpose(0, 2, 1, 3).reshape(B * L, H, Dv)
        pool, i = self.pool, self.layer
        if pool.key_scales:  # int8 / int4: quantized per token and head (int4: per group) on the write
            write = kv_write_int4 if pool.keys[i].dtype == mx.uint8 else pool.layer_kernels[i].kv_write_int8
            pool.keys[i], pool.values[i], pool.key_scales[i], pool.value_scales[i] = write(
                pool.keys[i], pool.values[i], pool.key_scales[i], pool.value_scales[i], flat_k, flat_v,
                lay.slot_mapping)
        else:
            pool.keys[i], pool.values[i] = kv_write(pool.keys[i], pool.values[i], flat_k, flat_v, lay.slot_mapping)
        # Dense view for calls that leave the paged path (in the model's dtype); lazy, so free when unused.
        max_len = self._padded_len()
        # int4's packed bytes through the reference (the gather kernels serve the float and int8 pools)
        gather = kv_gather_ref if pool.keys[i].dtype == mx.uint8 else pool.layer_kernels[i].kv_gather
        dense_k = gather(pool.keys[i], lay.block_tables, max_len)
        dense_v = gather(pool.values[i], lay.block_tables, max_len)
        if pool.key_scales and pool.keys[i].dtype == mx.uint8:
            def groups(s: mx.array) -> mx.array:  # [num_blocks, bs, Hkv, G, 2] -> [B, Hkv, max_len, G, 2]
                flat = kv_gather_ref(s.reshape(*s.shape[:3], -1), lay.block_tables, max_len)
                return flat.reshape(*flat.shape[:3], *s.shape[3:])

            dense_k = dequantize_int4(dense_k, groups(pool.key_scales[i]), keys.dtype)
            dense_v = dequantize_int4(dense_v, groups(pool.value_scales[i]), values.dtype)
        elif pool.key_scales:
            def scales(s: mx.array) -> mx.array:  # [num_blocks, bs, Hkv] -> [B, Hkv, max_len, 1]
                return kv_gather_ref(s[..., None], lay.block_tables, max_len)

            dense_k = (dense_k.astype(mx.float32) * scales(pool.key_scales[i])).astype(keys.dtype)
            dense_v = (dense_v.astype(mx.float32) * scales(pool.value_scales[i])).astype(values.dtype)
        elif dense_k.dtype != keys.dtype:
            dense_k, dense_v = dense_k.astype(keys.dtype), dense_v.astype(values.dtype)
        self._fetched = (dense_k, dense_v)
        return self._fetched

    def _padded_len(self) -> int:
        bs = self.pool.block_size
        return -(-self._layout.max_context_len // bs) * bs

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  chunk_size: int | None = None, **_: Any) -> mx.array:
        # Bool [B, 1, N, Lk]: query i of row b (position ctx_b - N + i) sees keys at positions <= its own (within
        # its sliding window; or, chunked, within its own aligned chunk of chunk_size positions, Llama 4's).
        lay = self._layout
        k_pos = mx.arange(self._padded_len())[None, None, :]
        q_pos = (lay.context_lens[:, None] - N + mx.arange(N)[None, :])[:, :, None]
        mask = k_pos <= q_pos
        if window_size is not None:
            mask = mask & (k_pos > q_pos - window_size)
        if chunk_size is not None:
            mask = mask & (k_pos // chunk_size == q_pos // chunk_size)
        mask = mask[:, None]
        self.pool.masks[id(mask)] = (mask, window_size, chunk_size)
        return mask

    def paged_window(self, keys: mx.array, values: mx.array, mask: Any) -> tuple[bool, int | None, int | None]:
        """(may the paged kernel answer this call, its sliding window, its attention chunk): only for the K/V
        this layer fetched and no mask or one `make_mask` built."""
        fetched = self._fetched
        if fetched is None or keys is not fetched[0] or values is not fetched[1]:
            return False, None, None
        if keys.shape[-1] != values.shape[-1]:  # K and V of different widths (MLA without a latent cache)
            return False, None, None
        return self.known_mask(mask)

    def known_mask(self, mask: Any) -> tuple[bool, int | None, int | None]:
        """(is `mask` None or one `make_mask` built this forward, its sliding window, its attention chunk)."""
        if mask is None:
            return True, None, None
        known = self.pool.masks.get(id(mask))
        if known is None or known[0] is not mask:
            return False, None, None
        return True, known[1], known[2]

    def attend(self, queries: mx.array, *, scale: float, sinks: mx.array | None = None, window: int | None = None,
               chunk: int | None = None, **variant: Any) -> mx.array:
        """Paged attention of `queries` [B, Hq, L, Dk] over this layer's pool. `variant`: the kernels' other
        options (softcap)."""
        lay = self._layout
        attention = self.pool.layer_kernels[self.layer].paged_attention
        k_scale, v_scale = self.pool.scales(self.layer)
        return attention(queries, self.pool.keys[self.layer], self.pool.values[self.layer], lay.block_tables,
                         lay.context_lens, scale=scale, window=window, sinks=sinks, chunk=chunk, k_scale=k_scale,
                         v_scale=v_scale, **variant)

    def attend_mla(self, q_latent: mx.array, q_pe: mx.array, *, scale: float) -> mx.array:
        """MLA attention over this layer's latent (K pool) and RoPE keys (V pool): [B, H, L, kv_lora_rank]."""
        lay = self._layout
        attention = self.pool.layer_kernels[self.layer].mla_attention
        return attention(q_latent, q_pe, self.pool.keys[self.layer], self.pool.values[self.layer],
                         lay.block_tables, lay.context_lens, scale=scale)

    # mlx-lm's cache protocol, for code that inspects caches.
    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.pool.keys[self.layer], self.pool.values[self.layer]

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        scales = sum(s.nbytes for s in self.pool.scales(self.layer) if s is not None)
        return self.pool.keys[self.layer].nbytes + self.pool.values[self.layer].nbytes + scales


_SDPA = "scaled_dot_product_attention"


class PagedSDPA:
    """What a model module's `scaled_dot_product_attention` becomes: a plain call on a paged cache goes to the
    paged kernel, anything else to mlx-lm's `original` (see the module docstring)."""

    def __init__(self, original: Callable[..., mx.array]) -> None:
        self.original = original

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                 mask: Any = None, sinks: mx.array | None = None, **kwargs: Any) -> mx.array:
        if isinstance(cache, PagedKVCache):
            paged, window, chunk = cache.paged_window(keys, values, mask)
            if paged and not kwargs:
                return cache.attend(queries, scale=scale, sinks=sinks, window=window, chunk=chunk)
        return self.original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kwargs)


def install_paged_attention(model: nn.Module) -> list[str]:
    """Route the model's attention through trillm.kernels.paged_attention. Returns the patched modules.

    Non-paged caches keep mlx-lm's behaviour, so the rebinding is harmless to other users of the module.
    """
    patched = []
    for name in sorted({type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}):
        mod = sys.modules.get(name)
        fn = getattr(mod, _SDPA, None)
        if fn is None:
            continue
        if not isinstance(fn, PagedSDPA):
            setattr(mod, _SDPA, PagedSDPA(fn))
        patched.append(name)
    return patched
