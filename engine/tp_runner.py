"""Tensor parallelism over mx.distributed: rank 0's runner, the plan channel to the other ranks, and loading
a model's shard with mlx-lm's own `model.shard(group)`.

Rank 0 runs the whole engine (scheduler, block manager, sampler). Its runner is the ordinary ModelRunner
with one addition: before each forward, `PlanChannel.send_forward` sends that forward's inputs (token ids,
block tables, slot mapping, positions; the same `ForwardInputs` the forward runs on) to every rank in one
collective. Each worker (tp_worker.py) replays exactly those forwards with `ModelRunner.forward` on its own
shard and KV pool, so the grouping of a step into forwards is decided once, by rank 0, and never re-derived.
A decode step is one forward, hence one plan collective; a step with prefill chunks has one per forward.
Only rank 0 samples, so the ranks cannot disagree about a token; a launched-ahead decode's plan carries the
previous step's unread samples as a lazy array, so launch-ahead decode needs no host sync.

Collectives must pair up in the same order on every rank. MLX runs them in the order they are queued on the
(one) CPU stream, so rank 0 queues each plan before its forward, and every rank evaluates each forward in
full as soon as it is built, whatever parts of it the runner later reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from functools import partial
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from trillm.engine.config import EngineConfig
from trillm.engine.distributed import TensorParallelError, TensorParallelGroup
from trillm.engine.kv_cache import BatchLayout, KVLayout, KVPool
from trillm.engine.llm_engine import LLMEngine, make_kv_pool, with_kv_dtype
from trillm.engine.loader import LoadedModel, load_model
from trillm.engine.model_runner import ForwardInputs, ModelRunner
from trillm.engine.runner import Launch, RowsFn, Runner
from trillm.engine.sampler import Sampler
from trillm.engine.scheduler import SampledToken, ScheduledBatch

log = logging.getLogger("trillm.engine.tp")

PROTOCOL_VERSION = 1
HEADER = 8  # kind, B, L, W (block-table width), max_context_len, uniform_offset (-1: none), 0, 0
FORWARD, STOP = 1, 2
MIN_CAPACITY = 4096  # int32s per plan collective; a decode plan of 16 rows at 1k context fits
MAX_CAPACITY = 1 << 20
SHRINK_AFTER = 256  # plans in a row that used under a quarter of the capacity
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


# ---- the plan: one forward's inputs as one int32 vector -----------------------------------------------------

def forward_message_size(B: int, L: int, W: int) -> int:
    return HEADER + B * L + B * W + B + B * L + B + B


def encode_forward(inputs: ForwardInputs) -> mx.array:
    """[header, tokens, block_tables, context_lens, slot_mapping, offsets, last_index] (lazy: the tokens of a
    launched-ahead decode are still being sampled)."""
    lay = inputs.layout
    B, L = inputs.tokens.shape
    W = lay.block_tables.shape[1]
    uniform = -1 if lay.uniform_offset is None else lay.uniform_offset
    header = mx.array([FORWARD, B, L, W, lay.max_context_len, uniform, 0, 0], mx.int32)
    parts = [inputs.tokens, lay.block_tables, lay.context_lens, lay.slot_mapping, lay.offsets, inputs.last_index]
    return mx.concatenate([header] + [p.reshape(-1).astype(mx.int32) for p in parts])


def decode_forward(header: list[int], flat: mx.array) -> ForwardInputs:
    """The inverse of encode_forward; `flat` holds at least the whole message."""
    _, B, L, W, max_context_len, uniform, _, _ = header
    sizes = [B * L, B * W, B, B * L, B, B]
    parts = []
    at = HEADER
    for n in sizes:
        parts.append(flat[at : at + n])
        at += n
    tokens, tables, ctx, slots, offsets, last = parts
    layout = BatchLayout(
        block_tables=tables.reshape(B, W), context_lens=ctx, slot_mapping=slots, offsets=offsets,
        max_context_len=max_context_len, uniform_offset=None if uniform < 0 else uniform, num_new_tokens=L)
    return ForwardInputs(tokens.reshape(B, L), layout, last)


class PlanChannel:
    """Rank 0 -> every rank, over the group's own collectives: rank 0 all_sums its message, the others zeros.

    Messages have a fixed size both sides agree on (`capacity`), so a message is one collective; a larger one
    sends the rest in a second. Both sides then adapt the capacity to the sizes they saw, by the same rule, so
    they stay in step: it doubles past the largest message and halves after a long run of small ones.
    """

    def __init__(self, tp: TensorParallelGroup, capacity: int = MIN_CAPACITY) -> None:
        self.tp = tp
        self.capacity = capacity
        self.num_messages = 0
        self.num_overflows = 0
        self._small_run = 0
        self._in_flight: list[mx.array] = []

    def _all_sum(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=self.tp.group)

    def _wait_for_rank0(self) -> bool:
        return self.tp.doorbell is None or self.tp.doorbell.wait()

    def _ring(self) -> None:
        if self.tp.doorbell is not None:
            self.tp.doorbell.ring()

    # -- rank 0
    def send_forward(self, inputs: ForwardInputs) -> None:
        """Queue this forward's plan ahead of the forward itself (nothing waits for it)."""
        flat = encode_forward(inputs)
        total = int(flat.shape[0])
        self._ring()
        cap = self.capacity
        if total < cap:
            parts = [mx.concatenate([flat, mx.zeros((cap - total,), mx.int32)])]
        elif total == cap:
            parts = [flat]
        else:
            parts = [flat[:cap], flat[cap:]]
        self._in_flight = [self._all_sum(p) for p in parts]  # kept until the next plan: nothing reads them
        for sent in self._in_flight:  # one call each: within one call MLX may pick either order
            mx.async_eval(sent)
        self._observe(total)

    def send_stop(self) -> None:
        """Tell workers that have no doorbell to exit (workers with one are told by closing it)."""
        stop = mx.zeros((self.capacity,), mx.int32).at[0].add(STOP)
        mx.eval(self._all_sum(stop))

    # -- workers
    def receive(self) -> ForwardInputs | None:
        """The next forward's inputs; None when rank 0 says stop (or closed the doorbell)."""
        if not self._wait_for_rank0():
            return None
        buf = self._all_sum(mx.zeros((self.capacity,), mx.int32))
        header = cast("list[int]", buf[:HEADER].tolist())
        kind, B, L, W = header[:4]
        if kind == STOP:
            return None
        if kind != FORWARD:
            raise TensorParallelError(f"unexpected plan kind {kind} from rank 0")
        total = forward_message_size(B, L, W)
        flat = buf
        if total > self.capacity:
            rest = self._all_sum(mx.zeros((total - self.capacity,), mx.int32))
            mx.eval(rest)  # now, before any collective of the forward
            flat = mx.concatenate([buf, rest])
        self._observe(total)
        return decode_forward(header, flat)

    def _observe(self, total: int) -> None:
        self.num_messages += 1
        if total > self.capacity:
            self.num_overflows += 1
            self.capacity = min(MAX_CAPACITY, 1 << (total - 1).bit_length())
            self._small_run = 0
        elif 4 * total <= self.capacity and self.capacity > MIN_CAPACITY:
            self._small_run += 1
            if self._small_run >= SHRINK_AFTER:
                self.capacity //= 2
                self._small_run = 0
        else:
            self._small_run = 0

    # -- start-up (every rank)
    def share_bytes(self, data: bytes | None) -> bytes | None:
        """Rank 0 passes `data`; every rank gets it back (None: rank 0 quit before sending)."""
        if self.tp.rank == 0:
            assert data is not None
            self._ring()
        elif not self._wait_for_rank0():
            return None
        size = cast("list[int]", self._all_sum(mx.array([len(data) if data is not None else 0], mx.int32)).tolist())[0]
        payload = np.frombuffer(data, np.uint8) if data is not None else np.zeros(size, np.uint8)
        out = self._all_sum(mx.array(payload))
        mx.eval(out)  # on every rank: an unevaluated collective would pair with the next one instead
        return np.array(out).tobytes()

    def gather(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's `values` (all the same length), by rank (None: rank 0 quit)."""
        if self.tp.rank == 0:
            self._ring()
        elif not self._wait_for_rank0():
            return None
        table = mx.distributed.all_gather(mx.array([values], mx.int32), group=self.tp.group)
        return cast("list[list[int]]", table.tolist())


# ---- the shard ----------------------------------------------------------------------------------------------

def check_shardable(model: nn.Module, name: str, size: int) -> None:
    """Refuse, with the reason, a model that mlx-lm cannot shard over `size` ranks."""
    if not callable(getattr(model, "shard", None)):
        raise TensorParallelError(f"{name}: mlx-lm's {type(model).__module__} implements no shard(group), so it "
                                  "cannot run tensor-parallel (llama, qwen2, qwen3 and others can)")
    # Every rank's pool is laid out from the shard's facts (one K/V shape for every layer) and no rank can run
    # the load-time probe alone: only models whose every layer has a plain KV cache, through the plain seam.
    from trillm.engine.attention_variants import variant_classes
    from trillm.engine.paged_model import make_model_cache

    kinds = {type(c).__name__ for c in make_model_cache(model, name)}
    if kinds != {"KVCache"} or variant_classes(model):
        what = ", ".join(sorted(kinds - {"KVCache"}) + variant_classes(model))
        raise TensorParallelError(f"{name}: tensor parallelism serves models whose every layer has a plain KV "
                                  f"cache and attention; this one has {what}")
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    ffn = getattr(args, "intermediate_size", None)
    counts = [(n, what) for n, what in ((heads, "query heads"), (kv_heads, "KV heads"), (ffn, "MLP features"))
              if isinstance(n, int)]
    bad = [f"{n} {what}" for n, what in counts if n % size]
    if not bad:
        return
    fits = [k for k in range(2, 65) if all(n % k == 0 for n, _ in counts)][:4]
    hint = f" (--tensor-parallel {' or '.join(map(str, fits))} would)" if fits else ""
    listed = " and ".join(bad)
    raise TensorParallelError(f"{name} cannot be split over {size} ranks: its {listed} do not divide by {size}"
                              f"{hint}")


def load_shard(config: EngineConfig, tp: TensorParallelGroup) -> LoadedModel:
    """Load config.model lazily, shard it with mlx-lm's `model.shard(group)`, then read in only this shard.
    The pool of each rank holds its share of the KV heads."""
    loaded = load_model(config.model, dtype=config.dtype, lazy=True)
    check_shardable(loaded.model, loaded.name, tp.size)
    loaded.model.shard(tp.group)
    mx.eval(loaded.model.parameters())
    return dataclasses.replace(loaded, num_attention_heads=loaded.num_attention_heads // tp.size,
                               num_kv_heads=loaded.num_kv_heads // tp.size)


def shard_facts(loaded: LoadedModel | None) -> list[int]:
    """What every rank must agree on, as ints (all zeros with a 0 status: this rank failed to load)."""
    if loaded is None:
        return [0] * 11
    digest = hashlib.blake2b(loaded.model_id.encode(), digest_size=16).digest()
    fingerprint = [int.from_bytes(digest[i : i + 4], "little", signed=True) for i in range(0, 16, 4)]
    dtype = _DTYPES.index(loaded.dtype) if loaded.dtype in _DTYPES else len(_DTYPES)
    return [1, PROTOCOL_VERSION, *fingerprint, loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, dtype,
            loaded.tokenizer.vocab_size]


def check_facts(table: list[list[int]]) -> None:
    for rank, row in enumerate(table):
        if row[0] != 1:
            raise TensorParallelError(f"tensor-parallel rank {rank} could not load the model (its log says why)")
    for rank, row in enumerate(table[1:], start=1):
        if row[1] != table[0][1]:
            raise TensorParallelError(f"tensor-parallel rank {rank} speaks plan protocol {row[1]}, rank 0 "
                                      f"{table[0][1]}: run one trillm version everywhere")
        if row != table[0]:
            raise TensorParallelError(f"tensor-parallel rank {rank} loaded a different model (or shard shape) "
                                      "than rank 0: give every host the same checkpoint")


def config_to_json(config: EngineConfig) -> bytes:
    return json.dumps(dataclasses.asdict(config)).encode()


def config_from_json(data: bytes) -> EngineConfig:
    return EngineConfig(**json.loads(data))


# ---- rank 0 -------------------------------------------------------------------------------------------------

class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: a ModelRunner whose every forward first sends its inputs to the other ranks.

    While it waits on them (launch and collect) `tp.waiting_since` is set for the watchdog. Any failure inside
    a step leaves the ranks at different points of the step, so it fails the group for good.
    """

    # A verification runs the model's tail on rank 0 alone (ModelRunner.verify_logits); the workers would not.
    supports_speculation = False

    def __init__(self, model: nn.Module, pool: KVPool, sampler: Sampler, channel: PlanChannel) -> None:
        super().__init__(model, pool, sampler)
        self.channel = channel
        self.tp = channel.tp

    def forward(self, inputs: ForwardInputs) -> mx.array:
        self.tp.check()  # never queue collectives on a failed group: after a lost peer they wait forever
        self.channel.send_forward(inputs)
        out = super().forward(inputs)
        # Queue all of it now: the workers evaluate all of every forward, so rank 0 must too, even when the
        # runner later reads nothing of it (a prefill chunk that does not end its prompt).
        mx.async_eval(out)
        return out

    def launch(self, batch: ScheduledBatch, rows: RowsFn, check_abort: Callable[[], None] | None = None, *,
               after: Launch | None = None) -> Launch:
        self.tp.check()
        with self.tp.waiting():
            try:
                return super().launch(batch, rows, check_abort, after=after)
            except Exception as exc:
                raise self.tp.error(exc) from exc

    def collect(self, launch: Launch) -> list[SampledToken]:
        with self.tp.waiting():
            try:
                return super().collect(launch)
            except Exception as exc:
                raise self.tp.error(exc) from exc


class TensorParallelEngine:
    """Rank 0's engine factory (an EngineService factory): the first call shares the config with the other
    ranks, loads this rank's shard and agrees on the KV pool; a call after an engine failure rebuilds the
    engine on the same shard, pool and group, unless the group itself failed."""

    def __init__(self, config: EngineConfig, tp: TensorParallelGroup) -> None:
        if tp.rank != 0:
            raise ValueError("the engine runs on rank 0; other ranks run tp_worker.run_worker")
        self.config = config
        self.tp = tp
        self.channel = PlanChannel(tp)
        self._loaded: LoadedModel | None = None
        self._pool: KVPool | None = None

    def __call__(self) -> LLMEngine:
        self.tp.check()
        if self._loaded is None:
            self._loaded = self._load()
        engine = LLMEngine(self.config, loaded=self._loaded, runner_factory=partial(self._runner, self._loaded))
        assert self._pool is not None
        engine.kernel_report = self._pool.kernels.report  # rank 0's; every rank checks its own shard's shapes
        return engine

    def _load(self) -> LoadedModel:
        loaded: LoadedModel | None = None
        try:
            self.channel.share_bytes(config_to_json(self.config))
            failure: Exception | None = None
            try:
                loaded = load_shard(self.config, self.tp)
            except Exception as exc:  # the other ranks hear of it through the facts, then stop
                failure = exc
            table = self.channel.gather(shard_facts(loaded))
        except RuntimeError as exc:  # a collective failed: a rank is gone
            raise self.tp.error(exc) from exc
        if failure is not None:
            raise failure
        assert table is not None and loaded is not None
        check_facts(table)
        log.info("rank 0 of %d: %s sharded (%d of %d KV heads per rank)", self.tp.size, loaded.name,
                 loaded.num_kv_heads, loaded.num_kv_heads * self.tp.size)
        return loaded

    def _runner(self, lm: LoadedModel, num_blocks: int) -> Runner:
        if self._pool is None:
            max_model_len = min(self.config.max_model_len or lm.max_model_len, lm.max_model_len)
            try:
                self.channel.gather([num_blocks, max_model_len])
            except RuntimeError as exc:
                raise self.tp.error(exc) from exc
            # Every rank's layout from its shard's facts: asking the model would run its collectives alone.
            layout = with_kv_dtype(KVLayout.uniform(lm.num_layers, lm.num_kv_heads, lm.head_dim), self.config, lm)
            self._pool = make_kv_pool(lm, self.config, num_blocks, max_model_len, layout)
        sampler = Sampler(self.config.seed, vocab_size=lm.tokenizer.vocab_size)  # never an id past the vocabulary
        return TensorParallelRunner(lm.model, self._pool, sampler, self.channel)

    def close(self) -> None:
        """Tell the other ranks to exit (once the engine has stopped): through their doorbell, or, for ranks
        that wait inside the collective (started by mlx.launch), a stop plan."""
        if self.tp.doorbell is not None:
            self.tp.doorbell.close()
        elif self.tp.failure is None:
            try:
                self.channel.send_stop()
            except RuntimeError as exc:
                log.warning("could not tell the other ranks to stop: %s", exc)
