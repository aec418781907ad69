"""trillm.kernels: the paged KV pool's ops, each a custom kernel per back-end plus its pure-mx reference.

Owns: the pool layout contract (`layout`), one file per op (`paged_attention`, `kv_gather`, `kv_write`, `kv_quantize`: its
kernel source, `<op>_ref`, per-back-end entry points and the dispatcher), what the back-ends share
(`backend`), the start-up self-check that picks each op's implementation (`selfcheck`), and developer tools
(`tools`: offline compile checks, the GPU check script). Imports only mlx and the standard library,
never trillm.engine, web or bench.

Importing this package first loads an optimized BLAS (see `_blas.py`), so it must happen before `mlx`.
"""

from trillm.kernels._blas import BLAS as BLAS  # noqa: F401  (must run before mlx is imported)
from trillm.kernels.kv_gather import kv_gather as kv_gather  # noqa: E402
from trillm.kernels.kv_write import kv_write as kv_write  # noqa: E402
from trillm.kernels.paged_attention import paged_attention as paged_attention  # noqa: E402
