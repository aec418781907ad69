"""Kernel sources and wrappers for `paged_attention` (filled in by phase 2)."""

from __future__ import annotations

import mlx.core as mx

from trillm.kernels._dispatch import Backend


def paged_attention_kernel(
    backend: Backend,
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None,
    sinks: mx.array | None,
) -> mx.array:
    raise NotImplementedError(f"paged_attention {backend} kernel")
