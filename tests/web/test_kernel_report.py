"""/health and /metrics say which implementation each kernel op runs, as the engine's self-check decided."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from conftest import running_server
from test_real_engine import RealFactory, stream_text
from trillm.kernels.backend import Kernel
from trillm.kernels.paged_attention import KERNELS
from trillm.kernels.selfcheck import CACHE_ENV, KernelFallbackWarning


def raising(*args: Any, **kwargs: Any) -> mx.array:
    raise RuntimeError("[metal::Device] Unable to build metal library from source")


async def test_health_and_metrics_name_each_ops_implementation(tiny_model_path: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setitem(KERNELS, "cpu", Kernel(raising))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        async with running_server(RealFactory(tiny_model_path)) as serving:
            async with httpx.AsyncClient(base_url=serving.url, timeout=60) as client:
                text = await stream_text(client, {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
                health = (await client.get("/health")).json()
                metrics = (await client.get("/metrics")).text
    assert text
    (model,) = health["models"].values()
    kernels = model["kernels"]
    assert kernels["mode"] == "auto" and kernels["backend"] == "cpu"
    attention = kernels["ops"]["paged_attention"]
    assert attention["implementation"] == "reference" and "Unable to build metal library" in attention["reason"]
    assert kernels["ops"]["kv_gather"]["implementation"] == "reference"
    assert 'op="paged_attention",implementation="reference"} 1' in metrics
    assert "# TYPE trillm_kernel_implementation gauge" in metrics
