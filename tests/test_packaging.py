"""A built wheel installs everything under `trillm.*` and nothing at the top level."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_every_package_under_trillm(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("trillm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"trillm", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for folder in ("engine", "kernels", "web", "bench"):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT).as_posix()
            assert f"trillm/{rel}" in names, f"{rel} is missing from the wheel: list it in pyproject packages"
    assert "trillm/kernels/tools/gpu_check.sh" in names
    for name in ("playground.html", "playground.js", "playground.css"):  # the page at GET /
        assert f"trillm/web/static/{name}" in names
    assert "trillm/kernels/cpu/CMakeLists.txt" in names and "trillm/kernels/cpu/paged_attention.cpp" in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "trillm = trillm.web.cli:main" in entry
