"""LLMEngine: add requests, step, read per-request deltas. Synchronous; drive it from ONE thread."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from functools import partial
from dataclasses import dataclass

import mlx.core as mx

from trillm.engine.block_manager import BlockManager
from trillm.engine.config import EngineConfig
from trillm.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from trillm.engine.errors import InvalidRequest, UnknownRequest
from trillm.engine.kv_cache import KVPool
from trillm.engine.loader import LoadedModel, load_model
from trillm.engine.model_runner import Launch, ModelRunner, Runner, SampledToken
from trillm.engine.outputs import EngineStatistics, FinishReason, RequestOutput, TokenLogprob, Usage
from trillm.engine.sampler import SampleRow, Sampler
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduler import ScheduledBatch, Scheduler
from trillm.engine.sequence import Sequence, SequenceStatus

_RATE_WINDOW_S = 10.0


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    stop_ids: frozenset[int]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None,
                 runner_factory: Callable[[int], Runner] | None = None) -> None:
        """Load config.model (unless `loaded` is given) and size the KV pool.

        runner_factory(num_blocks) replaces the MLX ModelRunner (the mock engine's timing-model runner);
        `loaded` then only needs the tokenizer and the model's facts, not weights.
        """
        self.config = config = config or EngineConfig()
        self.loaded = loaded or load_model(config.model, dtype=config.dtype)
        lm = self.loaded
        self.tokenizer = lm.tokenizer
        self.model_name = lm.name
        self.max_model_len = min(config.max_model_len or lm.max_model_len, lm.max_model_len)
        self.eos_token_ids = lm.eos_token_ids

        bs = config.block_size
        per_block = KVPool.bytes_per_block(lm.num_layers, bs, lm.num_kv_heads, lm.head_dim, lm.dtype)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            budget = int(config.kv_cache_memory_gb * 1e9) // per_block
            useful = config.max_num_seqs * -(-self.max_model_len // bs) + 1
            num_blocks = max(2, min(budget, useful))
        self.block_manager = BlockManager(num_blocks, bs, model_id=lm.model_id,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        if runner_factory is not None:
            self.runner: Runner = runner_factory(num_blocks)
        else:
            pool = KVPool(lm.num_layers, num_blocks, bs, lm.num_kv_heads, lm.head_dim, lm.dtype)
            self.runner = ModelRunner(lm.model, pool, Sampler(config.seed))
        self._pipelined = isinstance(self.runner, ModelRunner) and config.pipeline_decode
        self._inflight: Launch | None = None  # a decode step launched ahead, not read back yet
        self._requests: dict[str, _Request] = {}
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)
        self._recent_sums = [0, 0]  # running sums over _recent, so statistics() is O(1)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0) -> None:
        if request_id in self._requests:
            raise InvalidRequest(f"a request with id {request_id!r} is already running")
        vocab = self.tokenizer.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        seq = Sequence(request_id, prompt_token_ids, params, priority=priority)
        self.scheduler.add(seq)  # raises InvalidRequest / Overloaded
        self._requests[request_id] = _Request(
            seq,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens),
            StopStringMatcher(params.stop, include_stop=params.include_stop_str_in_output),
            frozenset(params.stop_token_ids),
        )

    def abort(self, request_id: str) -> None:
        """Drop a live request now and free every block it holds."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise UnknownRequest(f"no live request with id {request_id!r}")
        self.scheduler.remove(req.seq)
        if self._pipelined:
            self._settle_if_idle()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- stepping ----------------------------------------------------------------------------------------
    def step(self, *, check_abort: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One scheduling step: decodes, then prefill chunks. Returns a delta per request that progressed.

        With the MLX runner, a decode-only step queues the *next* decode step (fed the samples not yet read
        back) before reading this one, so the host builds step n+1 while the device finishes step n: the host
        waits once per step. A sequence that finishes meanwhile just drops its speculative token.
        """
        if not self._pipelined:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return []
            sampled = self.runner.run(batch, self._sample_row, check_abort)
            self.scheduler.postprocess(batch)
            return self._outputs(batch, sampled)
        launch, self._inflight = self._inflight, None
        if launch is not None and not any(s.status is SequenceStatus.RUNNING for s in launch.seqs):
            self.runner.collect(launch)  # everything it computed was aborted meanwhile
            launch = None
        if launch is None:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return []
            launch = self.runner.launch(batch, self._sample_row, check_abort)
            self.scheduler.postprocess(batch)
        self._inflight = self._launch_ahead(launch)
        live = [x for x in self.runner.collect(launch) if x[0].status is SequenceStatus.RUNNING]
        outputs = self._outputs(launch.batch, live)
        self._settle_if_idle()
        return outputs

    def _settle_if_idle(self) -> None:
        # An unread launch holds old pool versions, which would turn the next in-place KV write into a copy.
        if self._inflight is not None and not self._requests:
            self.runner.collect(self._inflight)
            self._inflight = None

    def _launch_ahead(self, launch: Launch) -> Launch | None:
        """Queue the next decode step of the same sequences, if nothing else could want the step."""
        batch, sch, bm = launch.batch, self.scheduler, self.block_manager
        if batch.prefills or not batch.decodes or sch.waiting or len(sch.running) != len(batch.decodes):
            return None
        if any(s.status is not SequenceStatus.RUNNING or s.params.needs_penalties for s in batch.decodes):
            return None  # penalties need the unread tokens themselves
        # This step's token is output number num_output_tokens + 1; length-finished sequences stop here.
        nxt = [i for i, s in enumerate(batch.decodes)
               if s.num_output_tokens + 1 < s.params.max_tokens and s.num_tokens + 1 < self.max_model_len]
        if not nxt:
            return None
        seqs = [batch.decodes[i] for i in nxt]
        if sum(bm.blocks_needed(s.num_computed_tokens + 1) - len(s.block_table) for s in seqs) > bm.num_free_blocks:
            return None
        for s in seqs:
            bm.may_append(s)
        assert launch.sample is not None
        tokens = launch.sample.tokens if len(nxt) == len(batch.decodes) else launch.sample.tokens[mx.array(nxt)]
        ahead = ScheduledBatch(decodes=seqs)
        queued = self.runner.launch(ahead, partial(self._sample_row, ahead=1), decode_tokens=tokens)
        sch.postprocess(ahead)
        return queued

    def _outputs(self, batch: ScheduledBatch, sampled: list[SampledToken]) -> list[RequestOutput]:
        self._num_steps += 1
        prompt_tokens = sum(c.num_tokens for c in batch.prefills)
        self._num_prompt_tokens += prompt_tokens
        self._num_generation_tokens += len(sampled)
        now = time.monotonic()
        self._recent.append((now, prompt_tokens, len(sampled)))
        self._recent_sums[0] += prompt_tokens
        self._recent_sums[1] += len(sampled)
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
            _, p_old, g_old = self._recent.popleft()
            self._recent_sums[0] -= p_old
            self._recent_sums[1] -= g_old

        outputs = []
        for seq, token, result, row in sampled:
            req = self._requests[seq.request_id]
            lp = None
            if result.logprobs is not None and (seq.params.logprobs or seq.params.top_logprobs):
                lp = TokenLogprob(token, result.logprobs[row], tuple(result.top_logprobs[row]) if result.top_logprobs else ())
            outputs.append(self._append_token(req, token, lp))
        return outputs

    def _sample_row(self, seq: Sequence, ahead: int = 0) -> SampleRow:
        """ahead: tokens sampled for seq but not yet appended (1 while a step is launched ahead)."""
        p = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens + ahead < p.min_tokens:
            banned = tuple(self._requests[seq.request_id].stop_ids | (frozenset() if p.ignore_eos else self.eos_token_ids))
        return SampleRow(p, seq.num_output_tokens + ahead, seq.token_ids[: seq.num_prompt_tokens],
                         seq.output_token_ids if p.needs_penalties else [], banned)

    def _append_token(self, req: _Request, token: int, lp: TokenLogprob | None) -> RequestOutput:
        seq, p = req.seq, req.seq.params
        seq.token_ids.append(token)
        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        text = ""
        if token in req.stop_ids:
            finish, stop_reason = FinishReason.STOP, token
        elif not p.ignore_eos and token in self.eos_token_ids:
            finish = FinishReason.STOP
        else:
            text, matched = req.stops.feed(req.detok.add(token))
            if matched is not None:
                finish, stop_reason = FinishReason.STOP, matched
        if finish is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            finish = FinishReason.LENGTH
        if finish is not None and not isinstance(stop_reason, str):
            # Release what was held back for a possible stop string or an incomplete character.
            tail, matched = req.stops.feed(req.detok.flush())
            text += tail if matched is not None else tail + req.stops.flush()
            if matched is not None:
                finish, stop_reason = FinishReason.STOP, matched
        if finish is not None:
            self._requests.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=(token,),
            new_text=text,
            finish_reason=finish,
            usage=Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens),
            logprobs=(lp,) if lp is not None else None,
            stop_reason=stop_reason,
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
        return [merge_outputs(merged[rid]) for rid in ids]

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
        )


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Concatenate one request's deltas into a single output."""
    last = outs[-1]
    lps = [lp for o in outs if o.logprobs for lp in o.logprobs]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=tuple(t for o in outs for t in o.new_token_ids),
        new_text="".join(o.new_text for o in outs),
        finish_reason=last.finish_reason,
        usage=last.usage,
        logprobs=tuple(lps) if lps else None,
        stop_reason=last.stop_reason,
    )
