"""LLMEngine: add requests, step, read per-request deltas. Synchronous; drive it from ONE thread."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from trillm.engine.admission import RequestLimits
from trillm.engine.block_manager import BlockManager
from trillm.engine.config import KV_CACHE_DTYPES, EngineConfig
from trillm.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from trillm.engine.errors import InvalidRequest, ModelLoadError, UnknownRequest, UnverifiedModel
from trillm.engine.grammar import grammar_compiler
from trillm.engine.kv_cache import KVLayout
from trillm.engine.kv_slabs import check_memory, memory_statistics, pool_capacity_for, resize_pool
from trillm.engine.memory import MemoryBudget, default_memory_limit, release_freed_heap
from trillm.engine.loader import LoadedModel
from trillm.engine.outputs import EngineStatistics, FinishReason, RequestOutput, TokenLogprob, Usage
from trillm.engine.prompt_logprobs import PromptLogprobsBuffer, ScoredSpan
from trillm.engine.runner import Launch, ModelFacts, RowsFn, Runner, RunnerFactory
from trillm.engine.sampler import SampleRow
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduler import Finish, SampledToken, ScheduledBatch, Scheduler
from trillm.engine.sequence import Sequence, SequenceStatus
from trillm.engine.spec_decode import Proposer, SpecCounters, make_speculator, merge_deltas, token_rounds

if TYPE_CHECKING:
    from trillm.engine.kv_cache import KVPool
    from trillm.engine.kv_slabs import ResizeHook
    from trillm.engine.spec_draft import DraftProposer
    from trillm.engine.kv_disk import PooledDiskTier
    from trillm.engine.model_probe import ProbeResult
    from trillm.engine.state_pool import StateSlots
    from trillm.kernels.selfcheck import KernelReport

_RATE_WINDOW_S = 10.0
# Past this long between reading back one step and starting the next, the engine sat idle: a step's cost is then
# timed from its own start (see `_step`).
MAX_STEP_GAP_S = 0.25
# (phase, seconds, its batch): "launch" (a batch queued on the device; its counts are the launched ones),
# "masks" (the grammar bitmasks of a step's constrained rows), "step" (one step(); None: nothing to run).
PhaseHook = Callable[[str, float, "ScheduledBatch | None"], None]
REQUEST_FAILED = "this request failed while its output was produced; other requests are unaffected"

log = logging.getLogger("trillm.engine")


def _both(first: ResizeHook | None, second: ResizeHook) -> ResizeHook:
    def resize(num_blocks: int, kept: Sequence_[int] | None) -> None:
        if first is not None:
            first(num_blocks, kept)
        second(num_blocks, kept)

    return resize


class _DiskStatistics(TypedDict, total=False):
    """The disk tier's fields of EngineStatistics (none without one)."""

    kv_disk_hit_tokens: int
    kv_disk_hit_blocks: int
    kv_disk_miss_blocks: int
    kv_disk_blocks: int
    kv_disk_bytes: int
    kv_disk_writes: int
    kv_disk_dropped_writes: int
    kv_disk_corrupt_blocks: int
    kv_disk_read_seconds: float
    kv_disk_write_seconds: float


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    prompt_logprobs: PromptLogprobsBuffer | None = None  # when asked for; delivered with the first output

    def take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt logprobs, the first time they are asked for once the prompt is computed; else None."""
        buf = self.prompt_logprobs
        if buf is None or buf.delivered:
            return None
        buf.delivered = True
        return buf.result()


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What the latest `step()` read back."""

    batch: ScheduledBatch
    virtual_seconds: float | None  # a simulated runner's duration for it; None: the step's wall time


def with_kv_dtype(layout: KVLayout, config: EngineConfig, lm: LoadedModel) -> KVLayout:
    """`layout` with the pool's dtype by name (--kv-cache-dtype; auto: the model's). ModelLoadError for what
    no kernel serves: int8/int4 with MLA's latent caches, or off the CPU, Metal and CUDA back-ends."""
    from trillm.engine.config import KV_CACHE_DTYPES
    from trillm.kernels.backend import kernel_backend

    kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or str(lm.dtype).rsplit(".", 1)[-1]
    if kv_dtype in ("int8", "int4"):
        # Both have Metal/CUDA attention variants (int8 also its gather and quantize-on-write kernels; int4
        # writes and gathers through MLX's own ops), checked at start as any kernel
        if (backend := kernel_backend()) not in ("cpu", "metal", "cuda"):
            raise ModelLoadError(f"--kv-cache-dtype {kv_dtype} runs on CPU, Metal and CUDA only: the {backend} "
                                 f"attention kernels have no {kv_dtype} variant (use fp16, bf16 or auto)")
        if any(layer.k_dim != layer.v_dim for layer in layout.layers):
            raise ModelLoadError(f"{lm.name}: --kv-cache-dtype {kv_dtype} does not cover MLA's latent caches yet")
        if kv_dtype == "int4" and any(layer.k_dim % 2 for layer in layout.layers):
            raise ModelLoadError(f"{lm.name}: --kv-cache-dtype int4 needs an even head_dim")
    return dataclasses.replace(layout, kv_dtype=kv_dtype)


def make_kv_pool(lm: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int,
                 layout: KVLayout | None = None, state_slots: StateSlots | None = None) -> KVPool:
    """The paged KV pool for `lm` (its `kv_layout` unless given), with the kernels the start-up self-check
    picks for each distinct layer shape; for a hybrid model, its recurrent-state pool over `state_slots`.

    Call it on the engine thread: the kernels compile (and their check runs) on the stream serving uses.
    """
    import mlx.core as mx

    from trillm.engine.kv_cache import KVPool, LayerKV
    from trillm.engine.paged_model import kv_layout
    from trillm.kernels.layout import ModelShapes
    from trillm.kernels.kv_gather import OP as KV_GATHER
    from trillm.kernels.kv_quantize import OP as KV_WRITE_INT8
    from trillm.kernels.mla_attention import OP as MLA_ATTENTION
    from trillm.kernels.paged_attention import OP as PAGED_ATTENTION
    from trillm.kernels.selfcheck import KernelCheckError, KernelSelection, select_kernels
    from trillm.engine.fused_ops import depthwise_conv_shape, quantization_formats

    layout = layout or with_kv_dtype(kv_layout(lm.model, lm.name), config, lm)
    # The check runs each kernel on the pool's dtype where it is not the model's (kernels.layout).
    kv_dtype = None if layout.kv_dtype in (None, str(lm.dtype).rsplit(".", 1)[-1]) else layout.kv_dtype
    sinks = any(isinstance(getattr(m, "sinks", None), mx.array) for _, m in lm.model.named_modules())
    # Gemma 2's attention soft-capping (engine/attention_variants.py): the check runs the kernel's variant too.
    caps = {float(c) for _, m in lm.model.named_modules() if (c := getattr(m, "attn_logit_softcapping", None))}
    softcap = max(caps) if caps else None
    # MLA with mlx-lm's latent cache (engine/attention_variants.py): the latent's and the RoPE keys' widths.
    mla_ranks = next(((int(m.kv_lora_rank), int(m.qk_rope_head_dim)) for _, m in lm.model.named_modules()
                      if type(m).__name__ == "DeepseekV3Attention"), None)
    args = getattr(lm.model, "args", None)  # mlx-lm's ModelArgs; 0: the kernels derive a size
    # Gated delta-net layers (mlx-lm's GatedDeltaNet: Qwen3-Next, Qwen3.5): their heads, for the recurrence's kernel.
    delta_net = next(((int(m.num_k_heads), int(m.num_v_heads), int(m.head_k_dim), int(m.head_v_dim))
                      for _, m in lm.model.named_modules() if type(m).__name__.endswith("GatedDeltaNet")
                      and all(hasattr(m, a) for a in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))),
                     ())  # fmt: skip
    # Mamba-2 mixers (Mamba-2, Nemotron-H, Falcon-H1): their heads and state, for the decode step's kernel.
    mixers = (m for _, m in lm.model.named_modules()
              if all(hasattr(m, a) for a in ("num_heads", "n_groups", "head_dim", "ssm_state_size")))
    ssm = next(((int(m.num_heads), int(m.n_groups), int(m.head_dim), int(m.ssm_state_size)) for m in mixers), ())
    # Depthwise causal convolutions (the recurrent mixers' short conv): channels and width, for their kernel.
    conv = depthwise_conv_shape(lm.model)
    selections: dict[tuple[int, int, int | None, int | None], KernelSelection] = {}
    primary: KernelSelection | None = None
    per_layer = []
    # A model without attention layers (Mamba-2) checks the ops outside attention on one nominal layer's shapes.
    for layer in layout.layers or (LayerKV(lm.num_kv_heads, lm.head_dim, lm.head_dim),):
        # Layers whose V differs from K (MLA's latent and RoPE keys) never take the paged kernel (see
        # kv_cache); they get the dispatchers, checked on layer 0's shapes like the rest. A sliding window and
        # an attention chunk (Llama 4) are kernel variants of their own: each is checked on its layers' shapes.
        key = ((layer.num_kv_heads, layer.k_dim, layer.window, layer.chunk) if layer.k_dim == layer.v_dim
               else (0, 0, None, None))
        if key not in selections:
            mla = mla_ranks if layer.k_dim != layer.v_dim and mla_ranks else (0, 0)
            shapes = ModelShapes(lm.num_attention_heads, key[0] or lm.num_kv_heads, key[1] or lm.head_dim,
                                 config.block_size, lm.dtype, window=key[2], attention_chunk=key[3], sinks=sinks,
                                 softcap=softcap, kv_lora_rank=mla[0], qk_rope_head_dim=mla[1],
                                 max_batch=config.max_num_seqs, chunk=config.max_num_batched_tokens,
                                 max_context=max_model_len, hidden_size=int(getattr(args, "hidden_size", 0) or 0),
                                 intermediate_size=int(getattr(args, "intermediate_size", 0) or 0),
                                 vocab_size=int(getattr(args, "vocab_size", 0) or 0),
                                 quantization=quantization_formats(lm.model), delta_net=delta_net, ssm=ssm, conv=conv,
                                 kv_dtype=kv_dtype)  # fmt: skip
            try:
                if primary is None:
                    selections[key] = primary = select_kernels(shapes, config.kernels)
                else:  # the ops outside attention are checked once, on the first layer's shapes
                    attn = select_kernels(shapes, config.kernels,
                                          ops=[PAGED_ATTENTION, MLA_ATTENTION, KV_GATHER, KV_WRITE_INT8])
                    selections[key] = dataclasses.replace(primary, paged_attention=attn.paged_attention,
                                                          mla_attention=attn.mla_attention, kv_gather=attn.kv_gather,
                                                          kv_write_int8=attn.kv_write_int8)  # fmt: skip
            except KernelCheckError as exc:
                raise ModelLoadError(f"--kernels strict: {exc}") from exc
        per_layer.append(selections[key])
    return KVPool(layout, num_blocks, config.block_size, lm.dtype, kernels=primary,
                  layer_kernels=per_layer[: len(layout.layers)], state_slots=state_slots)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: ModelFacts | None = None,
                 runner_factory: RunnerFactory | None = None, draft: LoadedModel | None = None) -> None:
        """Load config.model (unless `loaded` is given), size the KV pool by the model's facts, build the runner.

        draft: --speculative draft:PATH's model already loaded (else it is loaded from PATH).
        runner_factory(num_blocks) replaces the MLX ModelRunner (the mock's timing-model runner, a tensor-parallel
        group's); `loaded` then only needs the model's facts. Without one, `loaded` must be a LoadedModel: the
        pool's layout is asked of its model.
        """
        self.config = config = config or EngineConfig()
        if loaded is None:
            from trillm.engine.loader import load_model

            loaded = load_model(config.model, dtype=config.dtype)
        self.loaded = lm = loaded
        self.tokenizer = lm.tokenizer
        self.model_name = lm.name
        self.max_model_len = min(config.max_model_len or lm.max_model_len, lm.max_model_len)
        self.eos_token_ids = lm.eos_token_ids

        bs = config.block_size
        self.kv_layout: KVLayout | None = None  # the MLX runner's caches, asked of the model
        # A hybrid model's recurrent layers: one state slot per running sequence (engine/state_pool.py).
        self.state_slots: StateSlots | None = None
        state_bytes = 0
        # Other runners (the mock's, a tensor-parallel group's) size their blocks by the flag's dtype too.
        layout = KVLayout(KVLayout.uniform(lm.num_layers, lm.num_kv_heads, lm.head_dim).layers,
                          kv_dtype=KV_CACHE_DTYPES[config.kv_cache_dtype])
        if runner_factory is None:
            from trillm.engine.paged_model import kv_layout

            if not isinstance(lm, LoadedModel):
                raise TypeError(f"{lm.name}: the MLX runner needs a LoadedModel (other facts need a runner_factory)")
            self.kv_layout = layout = with_kv_dtype(kv_layout(lm.model, lm.name), config, lm)
            if layout.states:
                from trillm.engine.state_checkpoints import checkpoints_for
                from trillm.engine.state_pool import StateSlots

                checkpoints = checkpoints_for(config, layout.state_bytes_per_sequence)
                self.state_slots = StateSlots(config.max_num_seqs, checkpoints)
                state_bytes = ((config.max_num_seqs + (checkpoints.capacity if checkpoints else 0))
                               * layout.state_bytes_per_sequence)
            runner_factory = partial(self._mlx_runner, lm)
        per_block = layout.bytes_per_block(bs, lm.dtype)
        speculates_with_draft = (config.speculative_method == "draft" and self.kv_layout is not None
                                 and self.state_slots is None)
        if speculates_with_draft:
            from trillm.engine.paged_model import kv_layout

            assert isinstance(lm, LoadedModel)
            draft = draft or self._load_draft(lm)
            # The draft's pool holds the target's block ids: a block costs both models' bytes, in one budget.
            per_block += with_kv_dtype(kv_layout(draft.model, draft.name), config, draft).bytes_per_block(bs, draft.dtype)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            # The state pool comes out of the same memory budget as the KV blocks.
            memory = int(config.kv_cache_memory_gb * 1e9)
            if state_bytes >= memory:
                raise ModelLoadError(f"{lm.name}: the recurrent state of --max-num-seqs {config.max_num_seqs} "
                                     f"sequences (and its prefix-cache checkpoints) takes {state_bytes / 1e9:.2f} GB, more than --kv-cache-memory-gb "
                                     f"{config.kv_cache_memory_gb}; lower the first or raise the second")
            budget = (memory - state_bytes) // max(per_block, 1)
            useful = config.max_num_seqs * -(-self.max_model_len // bs) + 1
            num_blocks = max(2, min(budget, useful))
        # Recurrent state cannot be rebuilt from a shared KV prefix: a hybrid model's sequences hit the prefix
        # cache only where a state checkpoint was saved (engine/state_checkpoints.py), and without any never.
        prefix_caching = config.enable_prefix_caching and (self.state_slots is None or
                                                           self.state_slots.checkpoints is not None)
        if config.enable_prefix_caching and not prefix_caching:
            log.info("%s has recurrent layers and no room for state checkpoints: prefix caching is off for it",
                     lm.name)
        # The MLX pool grows with the load within the process's memory budget (engine/kv_slabs.py).
        self.memory = MemoryBudget(config.memory_limit or default_memory_limit())
        self.pool_capacity = (pool_capacity_for(config, num_blocks, per_block, 2 * len(layout.layers), self.memory)
                              if self.kv_layout is not None and per_block else None)
        self._bytes_per_block = per_block
        self.block_manager = BlockManager(num_blocks, bs, model_id=lm.model_id, enable_prefix_caching=prefix_caching,
                                          state_slots=self.state_slots, capacity=self.pool_capacity)
        # Token ids must index both the tokenizer and the logits: a tokenizer with added tokens and no resize
        # of the embedding has more ids than the LM head has rows.
        rows = lm.vocab_size or self.tokenizer.vocab_size
        self.limits = RequestLimits(self.max_model_len, bs, self.block_manager.num_usable_blocks,
                                    min(self.tokenizer.vocab_size, rows), config.max_waiting)
        self.scheduler = Scheduler(config, self.block_manager, self.limits, self.eos_token_ids)
        self.grammars = grammar_compiler(self.tokenizer)  # llguidance's view of the tokenizer is built on first use
        self.kernel_report: KernelReport | None = None  # which implementation each kernel op runs (MLX runner)
        self._pool: KVPool | None = None  # the MLX runner's
        self.kv_disk: PooledDiskTier | None = None  # the prefix cache's disk tier (engine/kv_disk.py)
        self.runner: Runner = runner_factory(num_blocks if self.pool_capacity is None else self.pool_capacity.capacity)
        self._idle_since: float | None = time.monotonic()  # when the engine last ran out of requests
        self._collected_at: float | None = None  # perf_counter time the last step was read back
        self._pipelined = config.pipeline_decode and self.runner.supports_launch_ahead
        self.draft: LoadedModel | None = None  # --speculative draft:PATH's model
        # A runner may bring its own proposer (the mock's stands in for any method with an acceptance rate).
        proposer: Proposer | None = getattr(self.runner, "proposer", None)
        if speculates_with_draft and draft is not None and getattr(self.runner, "supports_speculation", False):
            proposer = self._draft_proposer(lm, draft, num_blocks)
        self.speculator = make_speculator(config, self.block_manager, self.max_model_len, self.runner,
                                          hybrid=self.state_slots is not None, proposer=proposer)
        self._inflight: Launch | None = None  # a decode step launched ahead, not read back yet
        self._requests: dict[str, _Request] = {}
        self.last_step: StepInfo | None = None
        self.on_phase: PhaseHook | None = None  # how benchmarks time the engine
        self._reset_statistics()
        self.probe_result: ProbeResult | None = None  # the load-time check of the paged forward (MLX runner)
        if self.kv_layout is not None and config.verify_model:
            self._verify_model()
            self.release_idle_memory()  # the probe's blocks are nobody's: start from the smallest pool
        release_freed_heap()  # what the kernel self-check and the probe freed goes back to the system
        if config.kv_cache_dir is not None:
            self._attach_disk_tier(config.kv_cache_dir)  # after the probe: its blocks are nobody's to keep

    def _attach_disk_tier(self, directory: str) -> None:
        from pathlib import Path

        from trillm.engine.kv_disk import DiskTier, DiskTierConfig, PooledDiskTier, pool_identity

        why = ("the tensor-parallel and mock runners keep no MLX pool here" if self._pool is None
               else "its recurrent state is not in KV blocks" if self.state_slots is not None
               else "prefix caching is off" if not self.block_manager.enable_prefix_caching else None)
        if why is not None or self._pool is None:
            log.warning("%s: --kv-cache-dir ignored: %s", self.model_name, why)
            return
        identity, block_bytes = pool_identity(self.loaded.model_id, self._pool)
        disk = DiskTier(DiskTierConfig(Path(directory).expanduser(), int(self.config.kv_cache_dir_gb * 1e9),
                                       identity, block_bytes))
        self.kv_disk = PooledDiskTier(disk, self._pool)
        self.block_manager.lower = self.kv_disk
        log.info("%s: disk tier for the prefix cache in %s (%d blocks, %.2f GB found)", self.model_name, disk.folder,
                 disk.num_blocks, disk.nbytes / 1e9)

    def close(self) -> None:
        """Write the prefix cache's blocks to the disk tier, so a restart finds them, and stop its threads (no
        disk tier: nothing). The engine serves no request after it."""
        tier, self.kv_disk = self.kv_disk, None
        if tier is None:
            return
        if self._inflight is not None:
            self.runner.collect(self._inflight)
            self._inflight = None
        self.block_manager.lower = None
        tier.close(self.block_manager.cached_blocks())
        self.block_manager.lower_events(tier.take_events())

    def _verify_model(self) -> None:
        from trillm.engine.model_probe import probe

        result = probe(self)
        self._reset_statistics()  # the probe's requests are nobody's traffic
        if not result.verified:
            from trillm.engine.paged_model import describe

            assert self.kv_layout is not None
            message = (f"{self.model_name} ({describe(self.kv_layout)}): the paged forward disagrees with mlx-lm's "
                       f"own forward: {result.detail}")
            if not self.config.allow_unverified_model:
                raise UnverifiedModel(message + " (--allow-unverified-model serves it anyway)")
            result = dataclasses.replace(result, allowed_anyway=True)
            log.warning("%s; serving it anyway (--allow-unverified-model): its output may be wrong", message)
        else:
            log.info("%s: paged forward verified against mlx-lm's own (%s, %.2f s)", self.model_name, result.detail,
                     result.seconds)
        self.probe_result = result

    def _reset_statistics(self) -> None:
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)
        self._recent_sums = [0, 0]  # running sums over _recent, so statistics() is O(1)
        self.block_manager.num_queried_tokens = self.block_manager.num_hit_tokens = 0
        self.block_manager.num_lower_hit_tokens = self.block_manager.num_lower_queried_blocks = 0
        if self.speculator is not None:
            self.speculator.counters = SpecCounters()

    def _mlx_runner(self, lm: LoadedModel, num_blocks: int) -> Runner:
        from trillm.engine.model_runner import ModelRunner
        from trillm.engine.sampler import Sampler

        self._pool = pool = make_kv_pool(lm, self.config, num_blocks, self.max_model_len, self.kv_layout,
                                         self.state_slots)
        if self.pool_capacity is not None:
            self.pool_capacity.on_resize = partial(resize_pool, pool)
        self.kernel_report = pool.kernels.report
        # Padded embeddings (more logits than tokens) must never yield an id the tokenizer cannot decode.
        return ModelRunner(lm.model, pool, Sampler(self.config.seed, vocab_size=self.tokenizer.vocab_size))

    def _load_draft(self, lm: LoadedModel) -> LoadedModel:
        """--speculative draft:PATH's model, refused unless it shares the target's vocabulary."""
        from trillm.engine.loader import load_model
        from trillm.engine.spec_draft import check_draft_vocabulary

        assert self.config.draft_model is not None
        draft = load_model(self.config.draft_model, dtype=self.config.dtype)
        check_draft_vocabulary(lm, draft)
        return draft

    def _draft_proposer(self, lm: ModelFacts, draft: LoadedModel, num_blocks: int) -> DraftProposer:
        """The draft model's proposer over a pool of the target's block ids (engine/spec_draft.py)."""
        from trillm.engine.model_runner import ModelRunner
        from trillm.engine.sampler import Sampler
        from trillm.engine.spec_draft import DraftProposer, check_draft_vocabulary

        assert isinstance(lm, LoadedModel)
        check_draft_vocabulary(lm, draft)  # a draft handed in is checked too
        cap = self.pool_capacity
        pool = make_kv_pool(draft, self.config, num_blocks if cap is None else cap.capacity, self.max_model_len)
        if cap is not None:  # the draft's pool follows the target's: same ids, same renames
            cap.on_resize = _both(cap.on_resize, partial(resize_pool, pool))
        self.draft = draft
        runner = ModelRunner(draft.model, pool, Sampler(self.config.seed, vocab_size=self.tokenizer.vocab_size))
        log.info("--speculative: draft model %s (%d layers) proposes for %s", draft.name, draft.num_layers, lm.name)
        return DraftProposer(runner, self.config.max_num_batched_tokens)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
                    group: str | None = None) -> None:
        """group: shared by the requests of one client request (its prompts x n), for fair admission."""
        if request_id in self._requests:
            raise InvalidRequest(f"a request with id {request_id!r} is already running")
        self.limits.check_token_ids(prompt_token_ids)
        seq = Sequence(request_id, prompt_token_ids, params, priority=priority, group=group)
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar)  # compiled (and validated) once per grammar
        req = _Request(
            seq,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens),
            StopStringMatcher(params.stop, include_stop=params.include_stop_str_in_output),
            None if params.prompt_logprobs is None else PromptLogprobsBuffer(len(prompt_token_ids)),
        )
        if self.pool_capacity is not None:
            check_memory(self.pool_capacity, self.block_manager, self.scheduler.waiting, seq)  # Overloaded
        if self.speculator is not None:
            self.speculator.track(seq)
        self.scheduler.add(seq)  # raises InvalidRequest / Overloaded; the last thing that may fail
        self._requests[request_id] = req
        if self.kv_disk is not None:  # read at admission's pace, on the tier's own threads
            self.kv_disk.prefetch(self.block_manager.lower_candidates(seq))

    def abort(self, request_id: str) -> None:
        """Drop a live request now and free every block it holds."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise UnknownRequest(f"no live request with id {request_id!r}")
        self.scheduler.finish(req.seq)
        self._settle_if_idle()

    def live_request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def has_step_in_flight(self) -> bool:
        """A decode step was launched ahead and is not read back yet."""
        return self._inflight is not None

    # ---- stepping ----------------------------------------------------------------------------------------
    def step(self, *, check_abort: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One scheduling step: decodes, then prefill chunks. Returns a delta per request that progressed.

        When the runner can, a decode-only step queues the *next* decode step (fed the samples not yet read
        back) before reading this one, so the host builds step n+1 while the device finishes step n: the host
        waits once per step. A sequence that finishes meanwhile just drops its speculative token.
        """
        t0 = time.perf_counter()
        outputs = self._step(check_abort)
        self._sync_disk_tier()
        if self.on_phase is not None:
            self.on_phase("step", time.perf_counter() - t0, self.last_step.batch if self.last_step else None)
        return outputs

    def _launch(self, batch: ScheduledBatch, rows: RowsFn, check_abort: Callable[[], None] | None = None, *,
                after: Launch | None = None) -> Launch:
        t0 = time.perf_counter()
        launch = self.runner.launch(batch, rows, check_abort, after=after)
        if self.on_phase is not None:
            self.on_phase("launch", time.perf_counter() - t0, batch)
        return launch

    def _step(self, check_abort: Callable[[], None] | None) -> list[RequestOutput]:
        t0 = time.perf_counter()
        launch, self._inflight = self._inflight, None
        if launch is not None and not any(s.status is SequenceStatus.RUNNING for s in launch.seqs):
            self.runner.collect(launch)  # everything it computed was aborted meanwhile
            launch = None
        if launch is None:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                self.last_step = None
                return []
            if self.speculator is not None:
                self.speculator.plan(batch, self._sample_row)  # proposals for decode rows, verified in this step
            launch = self._launch(batch, partial(self._sample_row, masks=self._token_masks(batch)), check_abort)
        # schedule_ahead never takes a constrained row: its next mask needs the token this step samples; nor is
        # a step launched ahead that could speculate: its proposal needs that token too.
        if (self._pipelined and (self.speculator is None or not self.speculator.holds_pipeline(launch.batch))
                and (ahead := self.scheduler.schedule_ahead(launch.batch)) is not None):
            self._inflight = self._launch(ahead, partial(self._sample_row, ahead=1), after=launch)
        sampled = self.runner.collect(launch)
        now, last = time.perf_counter(), self._collected_at
        self._collected_at = now
        if self.speculator is not None:
            self.speculator.commit(launch.batch, sampled)  # accepted tokens' KV kept, the rest given back
            # A step's cost is the time since the last one was read back, the host's work between steps included:
            # a pipelined step runs on during it, so timing from this call's start would flatter plain decoding
            # against a verify step (never pipelined) by that gap. After a pause, this call's own time.
            wall = now - (last if last is not None and t0 - last <= MAX_STEP_GAP_S else t0)
            seconds = launch.virtual_seconds if launch.virtual_seconds is not None else wall
            self.speculator.observe(launch.batch, seconds, len(sampled))
        scored = self.runner.collect_prompt_logprobs(launch)
        self.last_step = StepInfo(launch.batch, launch.virtual_seconds)
        outputs = self._outputs(launch.batch, sampled, scored)
        self._settle_if_idle()
        return outputs

    def _sync_disk_tier(self) -> None:
        """Hand the blocks evicted in this step (computed by now) to the disk tier's writer; report its events."""
        if self.kv_disk is not None:
            self.kv_disk.materialize()
            self.block_manager.lower_events(self.kv_disk.take_events())

    def _settle_if_idle(self) -> None:
        # An unread launch holds old pool versions, which would turn the next in-place KV write into a copy.
        if self._inflight is not None and not self._requests:
            self.runner.collect(self._inflight)
            self._inflight = None
        if not self._requests:
            self._idle_since = self._idle_since or time.monotonic()
        else:
            self._idle_since = None

    @property
    def idle_release_in(self) -> float | None:
        """Seconds until the idle pool may shrink (0: now); None while busy or with nothing to release."""
        cap = self.pool_capacity
        if cap is None or self._idle_since is None or self._requests or cap.capacity <= cap.idle_floor:
            return None
        return max(0.0, self._idle_since + self.config.kv_idle_release_s - time.monotonic())

    def release_idle_memory(self) -> int:
        """Shrink an idle pool to the slabs of its most recently used cached blocks; returns the bytes freed."""
        cap = self.pool_capacity
        if cap is None or self._requests or self._inflight is not None:
            return 0
        before = cap.nbytes
        self.block_manager.shrink()
        self._sync_disk_tier()
        release_freed_heap()
        self._idle_since = None  # released: nothing more until the next request has come and gone
        return before - cap.nbytes

    def _outputs(self, batch: ScheduledBatch, sampled: list[SampledToken],
                 scored: list[ScoredSpan]) -> list[RequestOutput]:
        for span in scored:
            req = self._requests.get(span.seq.request_id)
            if req is not None and req.seq is span.seq and req.prompt_logprobs is not None:
                req.prompt_logprobs.add(span)
        outputs = []
        num_kept = 0
        # A speculating row keeps several tokens: one round per token, so a finish (a stop string) in one round
        # drops its later tokens, as decoding them one step at a time would.
        for part in token_rounds(sampled):
            kept = self.scheduler.postprocess(batch, part)
            num_kept += len(kept)
            for s, finish in kept:
                try:
                    outputs.append(self._output(s, finish))
                except Exception:  # one request's detokenizing or stop handling: it fails alone, the step goes on
                    log.exception("request %s failed while its output was produced", s.seq.request_id)
                    outputs.append(self._fail_request(s.seq))
        done = self.scheduler.finish_scored(batch)
        self._count(sum(c.num_tokens for c in batch.prefills), num_kept)
        return merge_deltas(outputs) + [self._scored_output(seq) for seq in done]

    def _fail_request(self, seq: Sequence) -> RequestOutput:
        """End one request with FinishReason.ERROR and free its blocks; the others are untouched."""
        self._requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq)
        return RequestOutput(request_id=seq.request_id, new_token_ids=(), new_text="",
                             finish_reason=FinishReason.ERROR,
                             usage=Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens),
                             error=REQUEST_FAILED)

    def _scored_output(self, seq: Sequence) -> RequestOutput:
        """The one delta of a request that generates nothing (max_tokens 0): its prompt logprobs, if asked."""
        req = self._requests.pop(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=(), new_text="", finish_reason=FinishReason.LENGTH,
            usage=Usage(seq.num_prompt_tokens, 0, seq.num_cached_tokens),
            prompt_logprobs=req.take_prompt_logprobs(),
        )

    def _count(self, prompt_tokens: int, generated: int) -> None:
        self._num_steps += 1
        self._num_prompt_tokens += prompt_tokens
        self._num_generation_tokens += generated
        now = time.monotonic()
        self._recent.append((now, prompt_tokens, generated))
        self._recent_sums[0] += prompt_tokens
        self._recent_sums[1] += generated
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
            _, p_old, g_old = self._recent.popleft()
            self._recent_sums[0] -= p_old
            self._recent_sums[1] -= g_old

    def _token_masks(self, batch: ScheduledBatch) -> dict[int, np.ndarray]:
        """The bitmask row of every constrained sequence this step samples, filled together (id(seq) -> row)."""
        seqs = [s for s in batch.sampled if s.grammar is not None]
        if not seqs:
            return {}
        t0 = time.perf_counter()
        rows = self.grammars.fill_masks([s.grammar for s in seqs if s.grammar is not None])
        if self.on_phase is not None:
            self.on_phase("masks", time.perf_counter() - t0, batch)
        return {id(s): rows[i] for i, s in enumerate(seqs)}

    def _sample_row(self, seq: Sequence, ahead: int = 0, masks: dict[int, np.ndarray] | None = None) -> SampleRow:
        """ahead: tokens sampled for seq but not yet appended (1 while a step is launched ahead)."""
        p = seq.params
        banned: tuple[int, ...] = ()
        mask = masks.get(id(seq)) if masks else None
        if seq.num_output_tokens + ahead < p.min_tokens:
            banned = tuple(frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids))
        return SampleRow(p, seq.num_output_tokens + ahead, seq.token_ids[: seq.num_prompt_tokens],
                         seq.output_token_ids if p.needs_penalties else [], banned, mask)

    def _output(self, sampled: SampledToken, finish: Finish | None) -> RequestOutput:
        """The request's delta for one token; text-level stops (stop strings) finish it here."""
        seq, token = sampled.seq, sampled.token_id
        req = self._requests[seq.request_id]
        text = ""
        if finish is None or finish.reason is FinishReason.LENGTH or finish.token_is_text:
            text, matched = req.stops.feed(req.detok.add(token))
            if matched is not None:
                finish = Finish(FinishReason.STOP, matched)
        new_token_ids: tuple[int, ...] = (token,)
        if finish is not None and finish.reason is FinishReason.GRAMMAR:
            new_token_ids = ()  # the grammar refused it: it was never appended
        if finish is not None and not isinstance(finish.stop_reason, str):
            # Release what was held back for a possible stop string or an incomplete character.
            tail, matched = req.stops.feed(req.detok.flush())
            text += tail if matched is not None else tail + req.stops.flush()
            if matched is not None:
                finish = Finish(FinishReason.STOP, matched)
        if finish is not None:
            del self._requests[seq.request_id]
            if not seq.is_finished:
                self.scheduler.finish(seq)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            new_text=text,
            finish_reason=None if finish is None else finish.reason,
            usage=Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens),
            logprobs=(sampled.logprob,) if sampled.logprob is not None else None,
            prompt_logprobs=req.take_prompt_logprobs(),
            stop_reason=None if finish is None else finish.stop_reason,
            error=None if finish is None else finish.error,
        )

    # ---- conveniences ------------------------------------------------------------------------------------
    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (blocking) and return one merged output per prompt, in order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        merged: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        while any(rid in self._requests for rid in ids):
            for out in self.step():
                if out.request_id in merged:
                    merged[out.request_id].append(out)
        return [RequestOutput.concat(merged[rid]) for rid in ids]

    def statistics(self) -> EngineStatistics:
        bm = self.block_manager
        span = (self._recent[-1][0] - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        pt, gt = self._recent_sums
        return EngineStatistics(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks_total=bm.num_usable_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=bm.num_cached_free_blocks,
            prefix_cache_queries=bm.num_queried_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            prompt_tokens_per_s=pt / span if span else 0.0,
            generation_tokens_per_s=gt / span if span else 0.0,
            spec_draft_tokens=self._spec_counters.num_draft_tokens,
            spec_accepted_tokens=self._spec_counters.num_accepted_tokens,
            spec_verifies=self._spec_counters.num_verifies,
            **self._disk_statistics(),
            **memory_statistics(self.memory, bm, self._bytes_per_block),
        )

    def _disk_statistics(self) -> _DiskStatistics:
        if self.kv_disk is None:
            return {}
        disk, bm = self.kv_disk.disk, self.block_manager
        hit_blocks = bm.num_lower_hit_tokens // bm.block_size
        return {"kv_disk_hit_tokens": bm.num_lower_hit_tokens, "kv_disk_hit_blocks": hit_blocks,
                "kv_disk_miss_blocks": bm.num_lower_queried_blocks - hit_blocks, "kv_disk_blocks": disk.num_blocks,
                "kv_disk_bytes": disk.nbytes, "kv_disk_writes": disk.num_written,
                "kv_disk_dropped_writes": disk.num_dropped, "kv_disk_corrupt_blocks": disk.num_corrupt,
                "kv_disk_read_seconds": disk.read_seconds, "kv_disk_write_seconds": disk.write_seconds}

    @property
    def _spec_counters(self) -> SpecCounters:
        return self.speculator.counters if self.speculator is not None else SpecCounters()
