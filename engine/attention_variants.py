"""Attention layers that write their scores out themselves instead of calling `scaled_dot_product_attention`,
so the seam (engine/kv_cache.py) never sees them: each such mlx-lm class gets a subclass whose call, on a paged
cache, sends the same attention to the paged kernel with the layer's variant (soft-capping, ...). On any other
cache the model's own code runs unchanged. One entry per class; everything else is the model's code.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from trillm.engine.kv_cache import PagedKVCache


def _gemma2_attention(base: type) -> type:
    class PagedGemma2Attention(base):
        """Gemma 2: scores soft-capped (tanh(s / cap) * cap) before the mask; its code writes them out."""

        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            if not isinstance(cache, PagedKVCache):
                original: mx.array = super().__call__(x, mask, cache)
                return original
            B, L, _ = x.shape
            queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            fetched = cache.update_and_fetch(keys, values)
            paged, window, chunk = cache.paged_window(*fetched, mask)
            if not paged:
                raise NotImplementedError("Gemma 2 attention with a mask of the model's own on a paged cache")
            out = cache.attend(queries, scale=self.scale, window=window, chunk=chunk,
                               softcap=float(self.attn_logit_softcapping))
            projected: mx.array = self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
            return projected

    return PagedGemma2Attention


def _mla_attention(base: type) -> type:
    class PagedMLAAttention(base):
        """DeepSeek V3 style MLA with mlx-lm's latent cache: its code adds the RoPE scores as a mask of its own
        (which the seam cannot pass to a kernel) and expands the latent per head for prefill. On a paged cache
        both phases run the paged MLA kernel in latent space: scale * (q_nope W . latent + q_pe . k_pe), the
        weights times the latent, then `unembed_out`, as mlx-lm's own decode does."""

        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            plain, window, chunk = cache.known_mask(mask) if isinstance(cache, PagedKVCache) else (False, None, None)
            if not plain or window is not None or chunk is not None:
                original: mx.array = super().__call__(x, mask, cache)
                return original
            B, L, _ = x.shape
            q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
            q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
            compressed_kv, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
            k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
            kv_latent = mx.expand_dims(self.kv_a_layernorm(compressed_kv), axis=1)
            q_pe = self.rope(q_pe, cache.offset)
            k_pe = self.rope(k_pe, cache.offset)
            cache.update_and_fetch(kv_latent, k_pe)  # writes the pools; the dense view stays unevaluated
            out = cache.attend_mla(self.embed_q(q_nope), q_pe, scale=self.scale)
            out = self.unembed_out(out).transpose(0, 2, 1, 3).reshape(B, L, -1)
            projected: mx.array = self.o_proj(out)
            return projected

    return PagedMLAAttention


def _llama4_attention(base: type) -> type:
    class PagedLlama4Attention(base):
        """Llama 4: its no-RoPE layers scale queries by position (attention temperature tuning) from an int
        offset; a ragged batch has one offset per row."""

        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            offset = cache.offset if isinstance(cache, PagedKVCache) else None
            if not isinstance(offset, mx.array) or self.use_rope or not self.attn_temperature_tuning:
                original: mx.array = super().__call__(x, mask, cache)
                return original
            B, L, _ = x.shape
            queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            positions = offset[:, None] + mx.arange(1, L + 1)[None, :]  # [B, L], 1-based as mlx-lm's
            scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
            queries = (queries * scales[:, None, :, None]).astype(queries.dtype)
            keys, values = cache.update_and_fetch(keys, values)
            out = scaled_dot_product(base, queries, keys, values, cache, self.scale, mask)
            projected: mx.array = self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
            return projected

    return PagedLlama4Attention


def _llama4_stack(base: type) -> type:
    class PagedLlama4Model(base):
        """Llama 4's decoder stack builds its chunk mask from one int offset and trims its chunked caches; on
        paged caches the masks come from the pool (per-row positions, aligned chunks) and nothing is trimmed."""

        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            if not cache or not isinstance(cache[0], PagedKVCache):
                original: mx.array = super().__call__(inputs, cache)
                return original
            h = self.embed_tokens(inputs)
            N = h.shape[1]
            chunked = cache[0].make_mask(N, chunk_size=self.attention_chunk_size)
            full = cache[0].make_mask(N)
            for idx, (layer, c) in enumerate(zip(self.layers, cache)):
                h = layer(h, chunked if (idx + 1) % 4 != 0 else full, cache=c)
            normed: mx.array = self.norm(h)
            return normed

    return PagedLlama4Model


def scaled_dot_product(base: type, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                       mask: Any) -> mx.array:
    """The attention `base`'s own module calls (the seam's, once installed), for an adapter's call."""
    fn = getattr(sys.modules[base.__module__], "scaled_dot_product_attention")
    out: mx.array = fn(queries, keys, values, cache=cache, scale=scale, mask=mask)
    return out


# Models whose caches the paged pool stands in for only through an adapter of their stack (kv_layout asks).
CHUNKED_STACKS = {("mlx_lm.models.llama4", "LlamaModel")}

# (module, class name) -> the subclass factory
_VARIANTS = {
    ("mlx_lm.models.llama4", "Attention"): _llama4_attention,
    ("mlx_lm.models.llama4", "LlamaModel"): _llama4_stack,
    ("mlx_lm.models.gemma2", "Attention"): _gemma2_attention,
    ("mlx_lm.models.deepseek_v3", "DeepseekV3Attention"): _mla_attention,
}


def install_attention_variants(model: nn.Module) -> list[str]:
    """Swap the class of every attention layer listed above for its paged subclass (idempotent). Returns
    "module.Class xN" for each kind swapped."""
    made: dict[type, type] = {}
    counts: dict[str, int] = {}
    for _, m in model.named_modules():
        cls = type(m)
        factory = _VARIANTS.get((cls.__module__, cls.__name__))
        if factory is None or getattr(cls, "__trillm_variant__", False):
            continue
        if cls not in made:
            made[cls] = factory(cls)
            made[cls].__trillm_variant__ = True  # type: ignore[attr-defined]
        m.__class__ = made[cls]
        key = f"{cls.__module__}.{cls.__name__}"
        counts[key] = counts.get(key, 0) + 1
    return [f"{k} x{n}" for k, n in sorted(counts.items())]


def variant_classes(model: nn.Module) -> list[str]:
    """The model's attention classes listed above ("module.Class"), whether swapped yet or not."""
    found = {f"{c.__module__}.{c.__name__}" for _, m in model.named_modules() for c in type(m).__mro__
             if (c.__module__, c.__name__) in _VARIANTS}
    return sorted(found)
