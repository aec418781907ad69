"""The kernel variants that model shapes launch, recorded from the real launch code (nothing runs).

`record(target, shapes)` installs a recording back-end that follows `target`'s launch policy, runs every op's
self-check cases through the ops' launchers (the same calls the start-up self-check makes, so the same
variants serving compiles) and returns each distinct variant: spec, input dtypes and sizes, template
arguments, outputs. The compile checks turn a variant into MLX's generated source for Metal or CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from trillm.kernels import backend as kb
from trillm.kernels.conv1d import OP as DEPTHWISE_CONV1D
from trillm.kernels.conv1d import depthwise_conv1d_kernel
from trillm.kernels.gated_delta import OP as GATED_DELTA
from trillm.kernels.gated_delta import gated_delta_kernel
from trillm.kernels.kv_gather import OP as KV_GATHER
from trillm.kernels.kv_gather import kv_gather_kernel
from trillm.kernels.kv_quantize import OP as KV_WRITE_INT8
from trillm.kernels.kv_quantize import kv_write_int8_kernel
from trillm.kernels.paged_attention import DEFAULT_SPLIT, SPLIT_POLICIES, paged_attention_kernel
from trillm.kernels.paged_attention import OP as PAGED_ATTENTION
from trillm.kernels.layout import ModelShapes
from trillm.kernels.ssm_update import OP as SSM_UPDATE
from trillm.kernels.ssm_update import ssm_update_on

TemplateArg = tuple[str, "int | bool | mx.Dtype"]
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX's Metal wrapper passes inputs under this many elements as `constant`

OPS = (PAGED_ATTENTION, KV_GATHER, GATED_DELTA, KV_WRITE_INT8, SSM_UPDATE, DEPTHWISE_CONV1D)
# Each op's launcher: (backend, *case.args, **case.kwargs) -> outputs.
LAUNCHERS: dict[str, Callable[..., Any]] = {
    PAGED_ATTENTION.name: paged_attention_kernel,
    KV_GATHER.name: kv_gather_kernel,
    GATED_DELTA.name: gated_delta_kernel,
    KV_WRITE_INT8.name: kv_write_int8_kernel,
    SSM_UPDATE.name: ssm_update_on,
    DEPTHWISE_CONV1D.name: depthwise_conv1d_kernel,
}


@dataclass(frozen=True, slots=True)
class Variant:
    """One instantiation of a kernel, as MLX compiles it."""

    spec: kb.KernelSpec
    input_dtypes: tuple[mx.Dtype, ...]
    input_sizes: tuple[int, ...]  # elements per input
    input_ndims: tuple[int, ...]
    output_dtypes: tuple[mx.Dtype, ...]
    template: tuple[TemplateArg, ...]

    @property
    def constant_inputs(self) -> tuple[bool, ...]:
        return tuple(n < MAX_CONSTANT_ARRAY_SIZE for n in self.input_sizes)

    @property
    def key(self) -> tuple[Any, ...]:
        """What decides the generated source (sizes only through the address space)."""
        return (self.spec, self.input_dtypes, self.constant_inputs, self.input_ndims, self.output_dtypes, self.template)


def template_decls(template: Iterable[TemplateArg], types: dict[Any, str]) -> list[str]:
    """MLX's CUDA template arguments as C++ declarations: bools/ints become constexprs, dtypes usings."""
    decls = []
    for name, arg in template:
        if isinstance(arg, bool):
            decls.append(f"  constexpr bool {name} = {'true' if arg else 'false'};")
        elif isinstance(arg, int):
            decls.append(f"  constexpr int {name} = {arg};")
        else:
            decls.append(f"  using {name} = {types[arg]};")
    return decls


def _recording_factory(sink: list[Variant]) -> Callable[..., Any]:
    def factory(*, name: str, input_names: list[str], output_names: list[str], source: str, header: str) -> Any:
        spec = kb.KernelSpec(name.removeprefix("trillm_"), tuple(input_names), tuple(output_names), source, header)

        def call(*, inputs: list[mx.array], template: list[TemplateArg], output_shapes: list[Any],
                 output_dtypes: list[mx.Dtype], **_: Any) -> list[mx.array]:  # fmt: skip
            sink.append(Variant(spec, tuple(x.dtype for x in inputs), tuple(x.size for x in inputs),
                                tuple(x.ndim for x in inputs), tuple(output_dtypes), tuple(template)))  # fmt: skip
            return [mx.zeros(tuple(s), dtype=dt) for s, dt in zip(output_shapes, output_dtypes)]

        return call

    return factory


@contextmanager
def backend_installed(name: str, factory: Callable[..., Any], prelude: str, like: str) -> Iterator[None]:
    """Register back-end `name` (a kernel factory and prelude, `like`'s launch policy) for the block's duration."""
    kb.FACTORIES[name] = factory
    kb.PRELUDES[name] = prelude
    SPLIT_POLICIES[name] = SPLIT_POLICIES.get(like, DEFAULT_SPLIT)
    try:
        yield
    finally:
        del kb.FACTORIES[name], kb.PRELUDES[name], SPLIT_POLICIES[name]
        kb.build.cache_clear()  # kernels built for `name` hold this factory's state


def launch_check_cases(name: str, target: str, shapes: Iterable[ModelShapes]) -> None:
    """Launch (never evaluate) every op's self-check cases on back-end `name`, as `target` would run them."""
    for s in shapes:
        for op in OPS:
            if op.applies(s) and op.kernels[target].supports(s) is None:
                for case in op.check_cases(s):
                    LAUNCHERS[op.name](name, *case.args, **case.kwargs)


def record(target: str, shapes: Iterable[ModelShapes]) -> list[Variant]:
    """Every distinct variant the self-check cases of `shapes` launch on back-end `target` ("metal", "cuda")."""
    sink: list[Variant] = []
    name = f"record:{target}"
    with backend_installed(name, _recording_factory(sink), "", target):  # no prelude: the spec keeps its own header
        launch_check_cases(name, target, shapes)
    seen: dict[tuple[Any, ...], Variant] = {}
    for v in sink:
        seen.setdefault(v.key, v)
    return list(seen.values())


# Shapes the compile checks cover by default: GQA 3 (SmolLM2) in f32, GQA 7 in f16, GQA 4 with D = 128 in
# bf16, and sinks + a sliding window in f16; block sizes 16 and 32. Delta-net layers beside the first and the
# third: Qwen3.5's heads (2 value heads per key head, 128 wide), and a GQA 3 with 64-wide keys. The int8 KV
# cache (its attention pair, the gather of int8 pools, the quantize-on-write): GQA 3 in f16, and GQA 4 with
# D = 128, sinks and a window in bf16. Mamba-2 mixers beside the second and the third: Mamba-2 2.7B's (80
# heads of 64, one group, state 128), and Nemotron-H's 128 heads in 8 groups with a state of 64 (two floats
# a lane, where 128 holds four), each with its depthwise convolution (width 4).
DEFAULT_SHAPES = (
    ModelShapes(9, 3, 64, 16, mx.float32, chunk=64, max_batch=9, delta_net=(2, 6, 64, 32)),
    ModelShapes(14, 2, 64, 32, mx.float16, chunk=64, max_batch=9, ssm=(80, 1, 64, 128), conv=(5376, 4)),
    ModelShapes(32, 8, 128, 16, mx.bfloat16, chunk=64, max_batch=9, delta_net=(16, 32, 128, 128),
                ssm=(128, 8, 64, 64), conv=(9216, 4)),
    ModelShapes(16, 2, 64, 16, mx.float16, window=128, sinks=True, chunk=64, max_batch=9),
    ModelShapes(9, 3, 64, 16, mx.float16, chunk=64, max_batch=9, kv_dtype="int8"),
    ModelShapes(32, 8, 128, 32, mx.bfloat16, window=128, sinks=True, chunk=64, max_batch=9, kv_dtype="int8"),
)


def default_variants(target: str) -> list[Variant]:
    return record(target, DEFAULT_SHAPES)


def all_dtypes(shapes: Iterable[ModelShapes]) -> list[ModelShapes]:
    """Each of `shapes` in float32, float16 and bfloat16."""
    return [replace(s, dtype=dt) for s in shapes for dt in (mx.float32, mx.float16, mx.bfloat16)]
