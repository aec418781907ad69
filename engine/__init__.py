"""trillm.engine: a synchronous, single-thread continuous-batching engine for MLX models.

It never imports trio, quart or hypercorn; the web layer drives it from one dedicated thread.
"""

import trillm.kernels  # noqa: F401  (loads the optimized BLAS before mlx)
