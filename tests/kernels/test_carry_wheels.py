"""kernels/tools/carry_wheels.py: what a bare GPU machine gets, in transfers of at most 64 MiB, offline.

No network here: fake wheels stand in (the real download, split and install were dry-run by
kernels/tools/carry_wheels_dryrun.sh; docs/gpu-check.md has its numbers).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("carry_wheels_file", ROOT / "kernels" / "tools" / "carry_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cw = _load()


def _wheel(folder: Path, project: str, payload: bytes = b"", version: str = "1.0") -> Path:
    """A minimal installable wheel: one module `<project>_mod` holding `payload` as an incompressible blob."""
    folder.mkdir(parents=True, exist_ok=True)
    name = project.replace("-", "_")
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}_mod/__init__.py": b"VALUE = 42\n",
        f"{name}_mod/blob.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for n, data in files.items():
            zf.writestr(n, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


def test_what_is_carried() -> None:
    names = ["mlx-0.32.4-cp312-cp312-manylinux_2_35_x86_64.whl", "mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl",
             "nvidia_cublas-13.1-py3-none-manylinux1_x86_64.whl", "numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl",
             "trio-0.35.0-py3-none-any.whl", "Quart_Trio-0.12.0-py3-none-any.whl", "pytest-9.2.0-py3-none-any.whl"]  # fmt: skip
    kept = cw.carried(names)
    assert kept == sorted([names[0], names[1], names[4], names[5]])  # the device has numpy, pytest, the CUDA libs


def test_split_bundles_and_reassembly_round_trip(tmp_path: Path) -> None:
    dest = tmp_path / "carry"
    big = _wheel(dest / "wheels", "big-one", bytes(range(256)) * 4000)  # ~1 MiB: split at 0.4 MiB
    small = [_wheel(dest / "wheels", f"small-{i}", b"x" * 50_000) for i in range(3)]
    max_mib = 0.4
    bundles = cw.split(dest, max_mib)
    assert len(bundles) >= 3
    for b in bundles:
        assert cw.folder_bytes(b) <= max_mib * cw.MIB  # a bundle never exceeds its transfer's share
        assert (b / "manifest.json").is_file()
    manifest = json.loads((bundles[0] / "manifest.json").read_text())["wheels"]
    assert len(manifest[big.name]["parts"]) == 3 and not manifest[small[0].name]["parts"]
    stash = tmp_path / "stash"
    for b in bundles[:-1]:
        cw.stash(b, stash)
    with pytest.raises(SystemExit, match="not carried yet"):  # a bundle short: say which files are missing
        cw.reassemble(stash)
    cw.stash(bundles[-1], stash)
    wheels = cw.reassemble(stash)
    assert sorted(w.name for w in wheels) == sorted(p.name for p in [big, *small])
    assert all((stash / "wheels" / w.name).read_bytes() == (dest / "wheels" / w.name).read_bytes() for w in wheels)


def test_a_damaged_part_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "carry"
    big = _wheel(dest / "wheels", "big-one", bytes(range(256)) * 4000)
    stash = tmp_path / "stash"
    for b in cw.split(dest, 0.4):
        cw.stash(b, stash)
    part = stash / f"{big.name}.part01"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="damaged"):
        cw.reassemble(stash)


def test_the_offline_install_command_installs(tmp_path: Path) -> None:
    """pip install --no-index --no-deps of a reassembled wheel; the module imports from the target."""
    dest = tmp_path / "carry"
    _wheel(dest / "wheels", "tiny-pkg", b"y" * 300_000)
    stash = tmp_path / "stash"
    for b in cw.split(dest, 0.2):
        cw.stash(b, stash)
    wheels = cw.reassemble(stash)
    cmd = cw.install_cmd(sys.executable, wheels, tmp_path / "site")
    assert {"--no-index", "--no-deps"} <= set(cmd)
    subprocess.run(cmd, check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", "import tiny_pkg_mod; print(tiny_pkg_mod.VALUE)"],
                         env={"PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)  # fmt: skip
    assert out.stdout.strip() == "42", out.stderr


def test_trillm_imports_from_a_checkout_through_links(tmp_path: Path) -> None:
    """No build, no install of trillm on the device: trillm/<package> links to the checkout's folders."""
    checkout = tmp_path / "checkout"
    for name in ("engine", "kernels", "web", "bench"):
        (checkout / name).mkdir(parents=True)
        (checkout / name / "__init__.py").write_text("")
    (checkout / "kernels" / "marker.py").write_text("WHERE = 'checkout'\n")
    path = cw.link_trillm(tmp_path / "tp", checkout)
    code = "import trillm.kernels.marker as m; print(m.WHERE)"  # -S: no site, so no editable install interferes
    out = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": str(path)}, capture_output=True, text=True)
    assert out.stdout.strip() == "checkout", out.stderr


def test_wheels_never_reach_git() -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu-wheels/bundle-1/x.whl"], cwd=ROOT)
    assert ignored.returncode == 0
    tracked = subprocess.run(["git", "ls-files", "*.whl", "*.part[0-9][0-9]"], cwd=ROOT, capture_output=True, text=True)
    assert tracked.stdout == ""
