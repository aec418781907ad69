"""mypy (strict for trillm.engine, trillm.kernels, trillm.web; see [tool.mypy] in pyproject.toml)."""

from __future__ import annotations

import subprocess

import pytest

import background_builds


def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    # Started at collection (tests/conftest.py), at low priority, when the suite runs this test.
    result = background_builds.wait(background_builds.MYPY)
    if result is None:
        cmd, cwd = background_builds.mypy_command()
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        result = proc.returncode, proc.stdout + proc.stderr
    status, out = result
    assert status == 0, out[-8000:]
