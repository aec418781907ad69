"""Attention layers that write their scores out themselves instead of calling `scaled_dot_product_attention`,
so the seam (engine/kv_cache.py) never sees them: each such mlx-lm class gets a subclass whose call, on a paged
cache, sends the same attention to the paged kernel with the layer's variant (soft-capping, ...). On any other
cache the model's own code runs unchanged. One entry per class; everything else is the model's code.
"""

from __future__ import annotations

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
            paged, window = cache.paged_window(*fetched, mask)
            if not paged:
                raise NotImplementedError("Gemma 2 attention with a mask of the model's own on a paged cache")
            out = cache.attend(queries, scale=self.scale, window=window, softcap=float(self.attn_logit_softcapping))
            projected: mx.array = self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
            return projected

    return PagedGemma2Attention


# (module, class name) -> the subclass factory
_VARIANTS = {("mlx_lm.models.gemma2", "Attention"): _gemma2_attention}


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
