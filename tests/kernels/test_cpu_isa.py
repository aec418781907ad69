"""The CPU kernels per instruction set: the ISA choice, the kernel bodies built for every x86 ISA this machine
runs against scalar references (cpu_bodies.cpp; NEON's under qemu: test_neon_cross.py), and the AVX2 build of
the extension, forced on a wider CPU, against the pure-mx references."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import background_builds
from trillm.kernels import cpu_ext

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "cpu_bodies.cpp"
CXX = os.environ.get("CXX", "g++")


def _build_and_run(compiler: str, flags: list[str], out: Path) -> str:
    cmd = [compiler, "-std=c++20", "-O2", "-fno-math-errno", *flags, f"-I{cpu_ext.SOURCE_DIR}", str(DRIVER), "-o",
           str(out), "-lpthread"]  # fmt: skip
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, f"{' '.join(cmd)} failed:\n{build.stderr[-3000:]}"
    run = subprocess.run([str(out)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TRILLM_CPU_THREADS="2"))  # fmt: skip
    assert run.returncode == 0 and "all checks passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout


def _x86_isas() -> list[str]:
    native = cpu_ext.native_isa()
    return list(cpu_ext.X86_ISAS[cpu_ext.X86_ISAS.index(native):]) if native in cpu_ext.X86_ISAS else []


@pytest.mark.skipif(shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX})")
@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_kernel_bodies_match_scalar_references_per_x86_isa(isa: str, tmp_path: Path) -> None:
    if isa not in _x86_isas():
        pytest.skip(f"this CPU does not run {isa} (native: {cpu_ext.native_isa()})")
    out = _build_and_run(CXX, [cpu_ext.ISA_FLAGS[isa]], tmp_path / f"bodies-{isa}")
    lanes = {"avx512": 16, "avx2": 8, "generic": 4}[isa]
    assert out.startswith(f"ISA {isa}: {lanes} floats per vector"), out.splitlines()[0]


def test_isa_follows_the_cpu_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ext.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: "fpu sse2 avx avx2 fma avx512f avx512bw avx512dq avx512vl")
    monkeypatch.delenv(cpu_ext.ISA_ENV, raising=False)
    assert cpu_ext.requested_isa() == "avx512"
    keys = {cpu_ext.cache_key(isa=isa) for isa in ("avx512", "avx2")}
    assert len(keys) == 2  # each ISA is its own build
    monkeypatch.setenv(cpu_ext.ISA_ENV, "avx2")
    assert cpu_ext.requested_isa() == "avx2"
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: "fpu sse2 avx avx2 fma")
    assert cpu_ext.requested_isa() == "avx2"
    monkeypatch.setenv(cpu_ext.ISA_ENV, "avx512")
    with pytest.raises(cpu_ext.BuildError, match="runs avx2, generic only"):
        cpu_ext.requested_isa()
    monkeypatch.setenv(cpu_ext.ISA_ENV, "sse9")
    with pytest.raises(cpu_ext.BuildError, match="not one of"):
        cpu_ext.requested_isa()
    monkeypatch.setattr(cpu_ext.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv(cpu_ext.ISA_ENV)
    assert cpu_ext.requested_isa() == "neon"


# Every CPU primitive of the AVX2 build against its pure-mx reference, on shapes that cover each register
# tile and remainder path (1-8 dot-product rows, 9-32 broadcast rows, a head_dim other than 64/128).
_AVX2_SCRIPT = textwrap.dedent("""
    from trillm.kernels import cpu_ext  # before mlx: BLAS
    import mlx.core as mx
    from trillm.kernels.linear import linear_cpu, linear_ref
    from trillm.kernels.rms_norm import rms_norm_cpu, rms_norm_ref
    from trillm.kernels.rope import rope_cpu, rope_ref
    from trillm.kernels.silu_mul import silu_mul_cpu, silu_mul_ref
    from trillm.kernels.paged_attention import paged_attention_cpu, paged_attention_ref

    ext = cpu_ext.load()
    assert ext is not None, cpu_ext.status().reason
    assert (ext.SIMD, ext.LANES, ext.VECTOR_REGISTERS) == ("avx2", 8, 16), (ext.SIMD, ext.LANES)
    mx.random.seed(0)

    def close(name, got, want, tol=1e-4):
        assert mx.allclose(got, want, rtol=tol, atol=tol).item(), (name, mx.abs(got - want).max().item())

    w = mx.random.normal((200, 1552)) * 0.03
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 32):
        x = mx.random.normal((rows, 1, 576))
        close(f"linear {rows}", linear_cpu(x, w[:150, :576]), linear_ref(x, w[:150, :576]))
        x = mx.random.normal((rows, 1536))
        close(f"linear K=1536 {rows}", linear_cpu(x, w[:, :1536]), linear_ref(x, w[:, :1536]))
    x, g = mx.random.normal((5, 3, 576)), mx.random.normal((576,))
    close("rms_norm", rms_norm_cpu(x, g, 1e-5), rms_norm_ref(x, g, 1e-5))
    a, b = mx.random.normal((3, 1537)) * 3, mx.random.normal((3, 1537))
    close("silu_mul", silu_mul_cpu(a, b), silu_mul_ref(a, b))
    q = mx.random.normal((2, 9, 7, 64))
    off = mx.array([3, 40], dtype=mx.int32)
    for trad in (False, True):
        close(f"rope {trad}", rope_cpu(q, 64, traditional=trad, base=1e5, scale=1.0, offset=off),
              rope_ref(q, 64, traditional=trad, base=1e5, scale=1.0, offset=off))
    for hq, hkv, d, L, ctx in ((9, 3, 64, 1, 45), (8, 2, 128, 1, 700), (4, 2, 64, 6, 60), (4, 4, 80, 3, 33)):
        bs, nb = 16, 2 * (-(-ctx // 16)) + 1
        k, v = mx.random.normal((nb, bs, hkv, d)), mx.random.normal((nb, bs, hkv, d))
        tables = mx.array([[1 + 2 * i for i in range(nb // 2)], [2 + 2 * i for i in range(nb // 2)]], dtype=mx.int32)
        lens = mx.array([ctx, ctx - 5], dtype=mx.int32)
        qh = mx.random.normal((2, hq, L, d))
        close(f"paged_attention {hq} {hkv} {d} {L}",
              paged_attention_cpu(qh, k, v, tables, lens, scale=d ** -0.5),
              paged_attention_ref(qh, k, v, tables, lens, scale=d ** -0.5))
    print("avx2 primitives match the references")
""")


@pytest.mark.skipif("avx2" not in _x86_isas(), reason="this CPU does not run AVX2")
def test_avx2_build_matches_the_references_on_a_wider_cpu() -> None:
    """Forced with TRILLM_CPU_ISA=avx2 (on an AVX2-only CPU this is its native build): the extension built
    for AVX2's 8-lane vectors and 16 registers, in a child so this process keeps its own build."""
    background_builds.wait(background_builds.AVX2_EXTENSION)  # started at collection; the child loads it cached
    env = dict(os.environ, TRILLM_CPU_ISA="avx2")
    env.pop("TRILLM_CPU_EXT", None)
    env.pop("TRILLM_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "avx2 primitives match the references" in proc.stdout
