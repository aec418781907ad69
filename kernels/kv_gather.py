"""Reading rows of the paged pool through their block tables into dense, head-major K (or V).

Pool layout: `trillm.kernels.layout`. One op, one file: the shared Metal/CUDA kernel source, the reference
`kv_gather_ref`, `kv_gather_gpu` (Metal or CUDA), and the dispatcher `kv_gather`. Back-ends plug in
through `KERNELS` exactly as in `trillm.kernels.paged_attention` (same contract); the self-check requires
exact equality with the reference.

The engine uses it for the dense K/V view that models bypassing the paged attention seam read; with the
seam in place the view is never evaluated (MLX is lazy).
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from trillm.kernels.backend import Case, Kernel, KernelOp, KernelSpec, at_least_8, build, gpu_backend, int32_params, kernel_backend
from trillm.kernels.layout import ModelShapes, random_batch

_THREADS = 256

# Template: T, BS, HKV, D. meta: [max_blocks, max_len]. One thread per output element.
_GATHER_BODY = """
  const int max_blocks = meta[0];
  const int max_len = meta[1];
  const size_t e = thread_position_in_grid.x;
  const int h = thread_position_in_grid.y;
  const int b = thread_position_in_grid.z;
  if (e < (size_t)max_len * D) {
    const int p = (int)(e / D);
    const int d = (int)(e % D);
    const int blk = block_tables[b * max_blocks + p / BS];
    out[((size_t)(b * HKV + h) * max_len + p) * D + d] = pool[(((size_t)blk * BS + p % BS) * HKV + h) * D + d];
  }
"""

GATHER = KernelSpec("kv_gather", ("pool", "block_tables", "meta"), ("out",), _GATHER_BODY)
GPU_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def kv_gather_ref(pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """Pure-mx gather: whole blocks through the table, then one head-major copy.

    Shapes: pool [num_blocks, bs, Hkv, D]; block_tables int32 [B, max_blocks] -> [B, Hkv, max_len, D].
    Position p of row b is slot block_tables[b, p // bs] * bs + p % bs; positions at/after a row's
    context length hold whatever the table points at (callers mask them). On CPU, SDPA on the transposed
    view is ~2x slower than this copy plus SDPA on contiguous K/V (`trillm bench kernels`).
    """
    b = block_tables.shape[0]
    _, bs, hkv, d = pool.shape
    n = -(-max_len // bs)
    if n > block_tables.shape[1]:
        raise ValueError(f"max_len {max_len} needs {n} blocks, block_tables has {block_tables.shape[1]}")
    blocks = pool[block_tables[:, :n]]  # [B, n, bs, Hkv, D]
    dense = mx.contiguous(blocks.reshape(b, n * bs, hkv, d).transpose(0, 2, 1, 3))
    return dense if n * bs == max_len else dense[:, :, :max_len]


def kv_gather_kernel(backend: str, pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """Launch the gather kernel on `backend` (any name in backend.FACTORIES). Shapes as `kv_gather_ref`."""
    _, bs, hkv, d = pool.shape
    b, max_blocks = block_tables.shape
    if -(-max_len // bs) > max_blocks:
        raise ValueError(f"max_len {max_len} needs more than the table's {max_blocks} blocks")
    tables = block_tables if block_tables.dtype == mx.int32 else block_tables.astype(mx.int32)
    outs: list[mx.array] = build(backend, GATHER)(
        inputs=[pool, at_least_8(tables), int32_params(max_blocks, max_len)],
        template=[("T", pool.dtype), ("BS", bs), ("HKV", hkv), ("D", d)],
        grid=(-(-max_len * d // _THREADS) * _THREADS, hkv, b), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(b, hkv, max_len, d)], output_dtypes=[pool.dtype],
    )  # fmt: skip
    return outs[0]


def kv_gather_gpu(pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """`kv_gather` as this GPU's kernel (Metal or CUDA). Shapes as `kv_gather_ref`."""
    return kv_gather_kernel(gpu_backend(), pool, block_tables, max_len)


def gpu_supports(shapes: ModelShapes) -> str | None:
    return None if shapes.dtype in GPU_DTYPES else f"dtype {shapes.dtype} is not float32/float16/bfloat16"


KERNELS: dict[str, Kernel] = {"metal": Kernel(kv_gather_gpu, gpu_supports), "cuda": Kernel(kv_gather_gpu, gpu_supports)}


class KvGatherFn(Protocol):
    def __call__(self, pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array: ...


def kv_gather(pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    """Dense K (or V) [B, Hkv, max_len, D] of each row's first max_len positions, read through its table.

    This back-end's kernel when it has one, else the reference; unchecked (the engine runs what its
    start-up self-check chose).
    """
    _, bs, hkv, d = pool.shape
    kernel = OP.kernel_for(kernel_backend(), ModelShapes(hkv, hkv, d, bs, pool.dtype))
    impl: KvGatherFn = kernel.fn if kernel is not None else kv_gather_ref
    return impl(pool, block_tables, max_len)


# ---------------------------------------------------------------- self-check cases
def _case(shapes: ModelShapes, label: str, lens: list[int], max_len: int, seed: int) -> Case:
    batch = random_batch(shapes, lens, 1, seed)
    return Case(label, (batch.k_pool, batch.block_tables, max_len))


def _check_cases(shapes: ModelShapes) -> list[Case]:
    """B in {1, 9}, ragged rows, lengths at and across block boundaries, up to a long row."""
    bs, top = shapes.block_size, shapes.max_context
    ragged = [1, bs, bs + 1, 3 * bs + 5, 1029, 2, max(bs - 1, 1), 2 * bs, 7]
    cases: list[Case] = []
    for lens in ([min(3 * bs + 5, top)], [min(n, top) for n in ragged]):
        for max_len in sorted({1, bs, bs + 1, max(lens)}):
            cases.append(_case(shapes, f"B={len(lens)} max_len={max_len}", lens, max_len, seed=len(cases)))
    return cases


def _timing_cases(shapes: ModelShapes) -> list[Case]:
    top, big, bs = shapes.max_context, shapes.max_batch, shapes.block_size
    ctx_big = min(512, top, max(1, 65536 // big))
    prefill = min(2 * shapes.chunk, top)
    return [
        _case(shapes, "decode B=1", [min(2048, top)], -(-min(2048, top) // bs) * bs, seed=100),
        _case(shapes, f"decode B={big}", [ctx_big] * big, -(-ctx_big // bs) * bs, seed=101),
        _case(shapes, f"prefill {prefill}", [prefill], -(-prefill // bs) * bs, seed=102),
    ]


OP = KernelOp(
    name="kv_gather", reference=kv_gather_ref, kernels=KERNELS,
    check_cases=_check_cases, timing_cases=_timing_cases, exact=True,
)  # fmt: skip
