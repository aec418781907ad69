"""Planted failures: prove, on the real back-end, the assumption the self-check's fallback rests on.

The start-up self-check (`trillm.kernels.selfcheck`) falls back to the reference when a kernel raises or
mismatches. That only protects serving if a broken kernel surfaces as a catchable Python exception (not an
abort, not a fault at some later sync) and a wrong one as a mismatch. Each plant edits the paged-attention
body at one site, builds it as a separate back-end (`variants.backend_installed`: the real factory and
prelude under another name, so the real kernels' cache is untouched) and checks three things:

  1. the planted kernel, launched directly and synchronized, raises (compile) or returns numbers the
     reference disagrees with (wrong), inside this process, as a Python error
  2. `select_kernels` on an op holding only the planted kernel falls back: "reference", failed, one warning
  3. afterwards the real kernel still runs and matches the reference (the device survived)

    python -m trillm.kernels.tools.planted compile|wrong [--emulate]

Exit 0 when all three hold, 1 when one does not (that is a finding: the fallback does not protect serving).
`--emulate` (dry runs without a GPU) runs the bodies through tests/kernels/kernel_emulator.py (g++ on the
CPU) instead of Metal/CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels import backend as kb
from trillm.kernels import selfcheck
from trillm.kernels.layout import ModelShapes
from trillm.kernels.paged_attention import ATTN_FINAL, gpu_supports, paged_attention_kernel, paged_attention_ref
from trillm.kernels.paged_attention import OP as PAGED_ATTENTION
from trillm.kernels.tools.variants import backend_installed

# The one line each plant rewrites (it must exist in the final kernel's body, or the plant proves nothing).
PLANT_SITE = "const float sc = scale[0];"


@dataclass(frozen=True, slots=True)
class Plant:
    name: str
    replacement: str
    raises: bool  # the planted kernel must raise (else: must return wrong numbers)


PLANTS = {
    "compile": Plant("compile", "const float sc = scale[0] + trillm_planted_undeclared_name;", True),
    "wrong": Plant("wrong", "const float sc = scale[0] * 1.5f;", False),
}
# Small: one compile per variant, a few launches. Decode and a 3-token chunk, B = 2, one split row.
SHAPES = ModelShapes(4, 2, 64, 16, mx.float32, max_batch=2, chunk=8, max_context=160)


def planted_factory(real: Callable[..., Any], plant: Plant) -> Callable[..., Any]:
    """`real` with the plant applied to every kernel source holding the site, under a name of its own."""

    def factory(**kwargs: Any) -> Any:
        source = str(kwargs["source"]).replace(PLANT_SITE, plant.replacement)
        return real(**{**kwargs, "name": f"{kwargs['name']}_planted_{plant.name}", "source": source})

    return factory


def _sync() -> None:
    if hasattr(mx, "synchronize"):
        mx.synchronize()


def run_plant(plant: Plant, backend: str, factory: Callable[..., Any], prelude: str, key: str) -> list[str]:
    """The plant's findings: an empty list when all three checks hold. `backend` names the real back-end
    the planted one imitates; `key` is the name select_kernels sees (kernel_backend())."""
    if PLANT_SITE not in ATTN_FINAL.body:
        return [f"the plant site {PLANT_SITE!r} is no longer in the paged-attention body: update PLANT_SITE"]
    problems: list[str] = []
    name = f"planted-{plant.name}"
    # A decode case with a long row (one visible token would hide a wrong scale: softmax of one logit is 1).
    decode = [c for c in PAGED_ATTENTION.check_cases(SHAPES) if c.args[0].shape[2] == 1]
    case = max(decode, key=lambda c: max(c.args[4].tolist()))
    with backend_installed(name, planted_factory(factory, plant), prelude, backend):
        # 1. directly
        try:
            got = paged_attention_kernel(name, *case.args, **case.kwargs)
            mx.eval(got)
            _sync()
        except Exception as exc:  # noqa: BLE001  (the point: any Python exception is catchable)
            print(f"1. direct launch raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if not plant.raises:
                problems.append(f"the wrong-result plant raised instead of returning: {exc!r}")
        else:
            if plant.raises:
                problems.append("the compile-error plant raised nothing: a broken kernel would go unnoticed")
            want = paged_attention_ref(*case.args, **case.kwargs)
            tol = PAGED_ATTENTION.tolerances.get(want.dtype, (0.0, 0.0))
            mismatch = selfcheck.compare(got, want, PAGED_ATTENTION.exact, tol)
            print(f"1. direct launch returned; against the reference: {mismatch or 'MATCHES'}")
            if not plant.raises and mismatch is None:
                problems.append("the wrong-result plant matched the reference: the check cannot see wrong numbers")
        # 2. through the self-check
        kernel = kb.Kernel(lambda *a, **k: paged_attention_kernel(name, *a, **k), gpu_supports)
        op = replace(PAGED_ATTENTION, kernels={key: kernel})
        with tempfile.TemporaryDirectory() as cache, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", selfcheck.KernelFallbackWarning)
            before = os.environ.get(selfcheck.CACHE_ENV)
            os.environ[selfcheck.CACHE_ENV] = cache
            try:
                report = selfcheck.select_kernels(SHAPES, "auto", ops=(op,), timing_iters=1).report
            except Exception as exc:  # noqa: BLE001
                problems.append(f"select_kernels raised instead of falling back: {exc!r}")
                report = None
            finally:
                if before is None:
                    os.environ.pop(selfcheck.CACHE_ENV, None)
                else:
                    os.environ[selfcheck.CACHE_ENV] = before
        if report is not None:
            (r,) = report.ops
            fallbacks = [w for w in caught if issubclass(w.category, selfcheck.KernelFallbackWarning)]
            print(f"2. select_kernels: {r.implementation} ({r.reason}); {len(fallbacks)} fallback warning(s)")
            if r.implementation != selfcheck.REFERENCE or not r.failed or len(fallbacks) != 1:
                problems.append(f"the self-check did not fall back as it should: {r}")
    # 3. the real kernel afterwards
    try:
        with backend_installed("planted-healthy", factory, prelude, backend):
            got = paged_attention_kernel("planted-healthy", *case.args, **case.kwargs)
            mx.eval(got)
            _sync()
        want = paged_attention_ref(*case.args, **case.kwargs)
        mismatch = selfcheck.compare(got, want, False, PAGED_ATTENTION.tolerances.get(want.dtype, (0.0, 0.0)))
        print(f"3. the real kernel afterwards: {mismatch or 'matches the reference'}")
        if mismatch is not None:
            problems.append(f"after the plant, the real kernel mismatches: {mismatch}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"after the plant, the real kernel raised: {exc!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trillm.kernels.tools.planted", description=__doc__.split("\n")[0])
    parser.add_argument("plant", choices=sorted(PLANTS))
    parser.add_argument("--emulate", action="store_true", help="no GPU: the g++ kernel emulator stands in")
    args = parser.parse_args(argv)
    key = kb.kernel_backend()
    if args.emulate:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))
        import kernel_emulator

        backend, factory, prelude = "emulate", kernel_emulator.emulator_factory, kernel_emulator.HOST_PRELUDE
    elif key in ("metal", "cuda"):
        backend, factory, prelude = key, kb.FACTORIES[key], kb.PRELUDES[key]
    else:
        print(f"no GPU back-end here (kernel back-end {key}): nothing to plant into (--emulate for a dry run)",
              file=sys.stderr)  # fmt: skip
        return 2
    if key is None:
        print("TRILLM_KERNELS=ref forces the references: unset it", file=sys.stderr)
        return 2
    print(f"plant {args.plant!r} into paged attention on {backend} (select_kernels sees back-end {key})", flush=True)
    problems = run_plant(PLANTS[args.plant], backend, factory, prelude, key)
    for p in problems:
        print(f"FAIL: {p}")
    print("ok: caught and fallen back" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
