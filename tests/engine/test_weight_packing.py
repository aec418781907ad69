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
