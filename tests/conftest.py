import trillm.kernels  # BLAS first  # noqa: F401, I001

"""Shared session fixtures: a tiny random llama folder, it loaded, and the real default model (SmolLM2)."""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import background_builds
from tiny_model import build_tiny_model
from trillm.engine.errors import ModelNotFound
from trillm.engine.loader import LoadedModel, default_model_path, load_model
from trillm.kernels import cpu_ext
from trillm.kernels.selfcheck import CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Engines' kernel self-check decisions go to a temporary folder, never the user's ~/.cache."""
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("kernel-cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-style MLX llama folder (2 layers, hidden 128, GQA 4/2, vocab ~512, fp32), built once."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_q4_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny folder quantized by mlx-lm (4 bits, groups of 64: MLX's affine layout), built once."""
    import json

    from mlx_lm.utils import load_model as mlx_load_model, quantize_model, save_model

    model, config = mlx_load_model(tiny_model_path)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    folder = Path(shutil.copytree(tiny_model_path, tmp_path_factory.mktemp("models") / "tiny-q4",
                                  ignore=shutil.ignore_patterns("*.safetensors")))  # fmt: skip
    save_model(folder, model)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path: Path) -> LoadedModel:
    """The tiny model loaded through trillm's loader (float32 on CPU)."""
    return load_model(str(tiny_model_path))


@pytest.fixture(scope="session")
def default_model() -> Iterator[LoadedModel]:
    """The real SmolLM2-135M-Instruct (fp32 on CPU), loaded once per session; skipped if not installed."""
    try:
        path = default_model_path()
    except ModelNotFound as exc:
        pytest.skip(f"default model unavailable: {exc}")
    yield load_model(path)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start, at low priority, the builds the collected tests will wait for (tests/background_builds.py)."""
    wider = cpu_ext.native_isa() == "avx512"  # elsewhere the AVX2 build is the native one, or none runs
    names = {item.name for item in session.items}
    if wider and "test_avx2_build_matches_the_references_on_a_wider_cpu" in names:
        background_builds.start(background_builds.AVX2_EXTENSION)
    if "test_mypy_clean" in names:
        background_builds.start(background_builds.MYPY)
    if shutil.which("aarch64-linux-gnu-g++") is None:  # test_neon_cross skips
        return
    for item in session.items:
        original = getattr(item, "originalname", item.name)
        if original == "test_extension_sources_compile_for_aarch64":
            background_builds.start(background_builds.NEON_SOURCES)
        elif original == "test_neon_kernel_bodies_match_scalar_references_under_qemu":
            background_builds.start(background_builds.neon_bodies(item.callspec.indices["march"]))


def pytest_sessionfinish(session: pytest.Session) -> None:
    background_builds.stop_all()
