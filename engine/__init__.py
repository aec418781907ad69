"""trillm.engine: a synchronous, single-thread continuous-batching engine for MLX models.

Owns: requests and their sampling parameters, the scheduler and the paged KV block manager (with the prefix
cache and its KV events), the model runner and sampler, model loading (GGUF, MLX folders), tokenizers and
detokenizing, and the EngineDriver, the synchronous step loop the web layer's shells drive; plus the mock
engine (`trillm.engine.mock`). Imports trillm.kernels, mlx, mlx-lm and the standard library; never trio,
quart, hypercorn, trillm.web or trillm.bench (a test checks). Drive it from one thread: MLX streams are
bound to the thread that made them.
"""

import trillm.kernels  # noqa: F401  (loads the optimized BLAS before mlx)
