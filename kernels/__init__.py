"""trillm.kernels: the paged KV pool's hot paths, as `mx.fast` kernels (Metal, CUDA) plus pure-mx references.

Importing this package first loads an optimized BLAS (see `_blas.py`), so it must happen before `mlx`.
The pool layout all kernels implement is documented in `layout.py`.
"""

from trillm.kernels._blas import BLAS as BLAS  # noqa: F401  (must run before mlx is imported)
from trillm.kernels.kv_cache import copy_blocks as copy_blocks  # noqa: E402
from trillm.kernels.kv_cache import kv_gather as kv_gather  # noqa: E402
from trillm.kernels.kv_cache import kv_write as kv_write  # noqa: E402
from trillm.kernels.paged_attention import paged_attention as paged_attention  # noqa: E402
