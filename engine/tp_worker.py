"""A tensor-parallel worker rank: receive each forward's inputs from rank 0 and run it on this rank's shard.

`python -m trillm.engine.tp_worker` is what `LocalRanks` starts on one host; under `mlx.launch`, `trillm serve`
calls `run_worker` on every rank but 0. A worker has no scheduler, sampler or HTTP: it learns the engine
config from rank 0, loads its shard, agrees on the KV pool, then replays rank 0's forwards until told to stop.
"""

from __future__ import annotations

import trillm.kernels  # noqa: F401, I001  (BLAS before mlx)

import logging
import sys

import mlx.core as mx
import mlx.nn as nn

from trillm.engine.distributed import TensorParallelError, TensorParallelGroup, die_with_parent, worker_doorbell
from trillm.engine.kv_cache import KVLayout
from trillm.engine.llm_engine import make_kv_pool, with_kv_dtype
from trillm.engine.loader import LoadedModel
from trillm.engine.model_runner import ModelRunner
from trillm.engine.sampler import Sampler
from trillm.engine.tp_runner import PlanChannel, check_facts, config_from_json, load_shard, shard_facts

log = logging.getLogger("trillm.engine.tp_worker")


def run_worker(tp: TensorParallelGroup) -> int:
    """Serve rank 0 until it says stop (0) or the group fails (1)."""
    channel = PlanChannel(tp)
    try:
        data = channel.share_bytes(None)
        if data is None:
            return 0
        config = config_from_json(data)
        loaded: LoadedModel | None = None
        try:
            loaded = load_shard(config, tp)
        except Exception as exc:  # rank 0 hears of it through the facts and reports it
            log.error("rank %d: cannot load the model: %s", tp.rank, exc)
        table = channel.gather(shard_facts(loaded))
        if table is None or loaded is None:
            return 0 if table is None else 1
        check_facts(table)
        pool_table = channel.gather([0, 0])
        if pool_table is None:
            return 0
        num_blocks, max_model_len = pool_table[0]
        # the same layout rank 0 builds (tp_runner), from the shard's facts
        layout = KVLayout.uniform(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim)
        pool = make_kv_pool(loaded, config, num_blocks, max_model_len, with_kv_dtype(layout, config, loaded))
        # Only rank 0 needs logits: with an identity head, ModelRunner.forward returns the last hidden states,
        # which still depend on every collective of the forward (and an untied head's weights are freed).
        loaded.model.lm_head = nn.Identity()
        runner = ModelRunner(loaded.model, pool, Sampler(config.seed))
        log.info("rank %d of %d ready: %s shard, %d KV blocks", tp.rank, tp.size, loaded.name, num_blocks)
        while (inputs := channel.receive()) is not None:
            mx.async_eval(runner.forward(inputs))
        mx.synchronize()
        log.info("rank %d: stopped by rank 0", tp.rank)
        return 0
    except TensorParallelError as exc:
        log.error("rank %d: %s", tp.rank, exc)
        return 1
    except RuntimeError as exc:  # a collective failed: rank 0 (or a neighbour) is gone
        log.error("rank %d: the group failed (%s); exiting", tp.rank, exc)
        return 1


def main() -> int:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tp = TensorParallelGroup.connect("ring", doorbell=worker_doorbell())
    except TensorParallelError as exc:
        log.error("%s", exc)
        return 1
    return run_worker(tp)


if __name__ == "__main__":
    sys.exit(main())
