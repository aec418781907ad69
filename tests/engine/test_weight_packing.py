"""Installing the fused ops stacks each layer's q/k/v and gate/up weights and copies every float weight into
huge-page buffers of about PACK_CHUNK_BYTES each, so start-up holds one chunk's originals beside their copies,
not every weight twice: the buffers hold the same values, and the forward is the same."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from trillm.engine import fused_ops as fo
from trillm.engine.loader import load_model
from trillm.kernels import hugepages


@pytest.mark.skipif(not hugepages.available(), reason="packing needs trillm's CPU extension on Linux")
def test_weights_packed_in_chunks_keep_their_values(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = mx.array([[5, 9, 17, 33, 65, 129]])
    plain = load_model(str(tiny_model_path)).model
    want = plain(tokens)
    mx.eval(want)
    sizes: list[int] = []
    real = hugepages.pack
    monkeypatch.setattr(hugepages, "pack", lambda arrays: (sizes.append(sum(a.nbytes for a in arrays)), real(arrays))[1])
    monkeypatch.setattr(fo, "PACK_CHUNK_BYTES", 1 << 18)
    model = load_model(str(tiny_model_path)).model
    notes = fo.install_fused_ops(model)
    assert any(n.startswith("weights packed") for n in notes)
    total = sum(sizes)
    assert len(sizes) > 2 and max(sizes) < total / 2  # several buffers, none of them the whole model
    with fo.fused_ops():
        got = model(tokens)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


def test_a_projection_group_slices_one_matmul_and_restacks_after_a_weight_update(tiny_model_path: Path) -> None:
    model = load_model(str(tiny_model_path)).model
    fo.install_fused_ops(model)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj.group
    assert group is not None and group is attn.k_proj.group is attn.v_proj.group
    x, x2 = mx.random.normal((1, 3, 128), key=mx.random.key(1)), mx.random.normal((1, 3, 128), key=mx.random.key(2))
    with fo.fused_ops():
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q2 = attn.q_proj(x2)  # another input: its own matmul
        q_again = attn.q_proj(x)  # asked twice of one input: a new matmul, not a stale slice
    for got, lin in ((q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj)):
        np.testing.assert_allclose(np.array(got), np.array(x @ lin.weight.T), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(q2), np.array(x2 @ attn.q_proj.weight.T), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(q_again), np.array(q), atol=1e-6)
    attn.k_proj.weight = attn.k_proj.weight * 2.0  # a weight update: the group restacks before its next matmul
    with fo.fused_ops():
        k2 = attn.k_proj(x)
        q3 = attn.q_proj(x)
    np.testing.assert_allclose(np.array(k2), np.array(k) * 2.0, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(q3), np.array(q), atol=1e-5, rtol=1e-5)
