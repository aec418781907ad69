"""A fake LLMEngine with the real one's interface: deterministic tokens, no model, a block pool to count.

Tokens are bytes (id = byte + 3; 0 pad, 1 bos, 2 eos). Greedy output is a pure function of the prompt, so
"concurrent == sequential" can be checked; sampled output is a function of (prompt, seed).
"""

from __future__ import annotations

import random
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trillm.engine.config import EngineConfig
from trillm.engine.errors import InvalidRequest, Overloaded, UnknownRequest
from trillm.engine.outputs import EngineStatistics, FinishReason, RequestOutput, TokenLogprob, Usage
from trillm.engine.sampling_params import SamplingParams

ALPHABET = b"abcdefghij klmnopqrstuvwxyz"
EOS = 2


class FakeTokenizer:
    eos_token_ids = (EOS,)
    vocab_size = 259

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return ([1] if add_special_tokens else []) + [b + 3 for b in text.encode()]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - 3]) if token_id >= 3 else b""

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        if tools:
            text = f"<tools>{len(tools)}\n" + text
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text, add_special_tokens=False)


@dataclass(slots=True)
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    rng: random.Random
    output: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    num_cached: int = 0
    blocks: int = 0
    text: str = ""


class FakeEngine:
    """Duck-types trillm.engine.llm_engine.LLMEngine."""

    def __init__(self, config: EngineConfig | None = None, *, step_delay: float = 0.0,
                 eos_after: int | None = None, load_delay: float = 0.0, max_model_len: int = 2048,
                 fail_at_step: int | None = None, script: str | None = None) -> None:
        time.sleep(load_delay)
        self.config = config or EngineConfig(num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=64)
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.eos_after = eos_after
        self.fail_at_step = fail_at_step  # raise on that step (tests set it, any thread)
        self.script = None if script is None else script.encode()  # every answer: these bytes, then EOS
        self.num_blocks_total = self.config.num_kv_blocks or 256
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._cached_blocks: set[int] = set()
        self._num_steps = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_prompt = 0
        self._num_gen = 0

    # ---- the LLMEngine interface ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0) -> None:
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_token_ids)} tokens; the context is {self.max_model_len}")
        if request_id in self._running or any(s.request_id == request_id for s in self._waiting):
            raise InvalidRequest(f"duplicate request id {request_id}")
        if len(self._waiting) >= self.config.max_waiting:
            raise Overloaded("the waiting queue is full")
        seed = params.seed if params.seed is not None else zlib.crc32(bytes(request_id, "utf-8"))
        self._waiting.append(_Seq(request_id, list(prompt_token_ids), params, random.Random(seed)))

    def abort(self, request_id: str) -> None:
        if request_id in self._running:
            del self._running[request_id]
            return
        for seq in self._waiting:
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                return
        raise UnknownRequest(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self, *, check_abort: Callable[[], None] | None = None) -> list[RequestOutput]:
        self._num_steps += 1
        if self.fail_at_step is not None and self._num_steps >= self.fail_at_step:
            raise RuntimeError("injected engine failure")
        self._admit()
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs = []
        budget = self.config.max_num_batched_tokens
        for seq in list(self._running.values()):
            if seq.num_prefilled < len(seq.prompt):
                if budget <= 0:
                    continue
                if check_abort is not None:
                    check_abort()  # between prefill chunks, like the real engine
                chunk = min(budget, len(seq.prompt) - seq.num_prefilled)
                seq.num_prefilled += chunk
                budget -= chunk
                self._num_prompt += chunk
                if seq.num_prefilled < len(seq.prompt):
                    continue
            outputs.append(self._decode(seq))
        return outputs

    def statistics(self) -> EngineStatistics:
        used = sum(s.blocks for s in self._running.values())
        return EngineStatistics(
            num_running=len(self._running), num_waiting=len(self._waiting),
            num_blocks_total=self.num_blocks_total, num_blocks_used=used,
            num_blocks_free=self.num_blocks_total - used, num_blocks_cached=0,
            prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits,
            num_prompt_tokens=self._num_prompt, num_generation_tokens=self._num_gen,
            num_preemptions=0, num_steps=self._num_steps, prompt_tokens_per_s=0.0,
            generation_tokens_per_s=0.0,
        )

    # ---- internals ----

    def _blocks_for(self, n: int) -> int:
        return -(-n // self.config.block_size)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            need = self._blocks_for(len(seq.prompt) + seq.params.max_tokens)
            used = sum(s.blocks for s in self._running.values())
            if used + need > self.num_blocks_total:
                break
            self._waiting.popleft()
            seq.blocks = need
            bs = self.config.block_size
            if self.config.enable_prefix_caching:
                hashes = [hash(tuple(seq.prompt[: (i + 1) * bs])) for i in range(len(seq.prompt) // bs)]
                hit = 0
                for h in hashes:
                    if h not in self._cached_blocks:
                        break
                    hit += 1
                seq.num_cached = min(hit * bs, len(seq.prompt) - 1)
                self._cached_blocks.update(hashes)
                self._prefix_queries += len(seq.prompt)
                self._prefix_hits += seq.num_cached
            seq.num_prefilled = seq.num_cached
            self._running[seq.request_id] = seq

    def _next_token(self, seq: _Seq) -> int:
        n = len(seq.output)
        if self.script is not None:
            return self.script[n] + 3 if n < len(self.script) else EOS
        if self.eos_after is not None and n >= self.eos_after and not seq.params.ignore_eos:
            return EOS
        if seq.params.greedy:
            return ALPHABET[(sum(seq.prompt) + 7 * n) % len(ALPHABET)] + 3
        return seq.rng.choice(ALPHABET) + 3

    def _decode(self, seq: _Seq) -> RequestOutput:
        token = self._next_token(seq)
        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        new_ids: tuple[int, ...] = (token,)
        new_text = ""
        if token == EOS:
            finish, stop_reason, new_ids = FinishReason.STOP, EOS, ()
        else:
            seq.output.append(token)
            self._num_gen += 1
            new_text = self.tokenizer.decode([token])
            for stop in seq.params.stop:
                full = seq.text + new_text
                if full.endswith(stop):
                    finish, stop_reason = FinishReason.STOP, stop
                    if not seq.params.include_stop_str_in_output:
                        new_text = new_text[: max(0, len(new_text) - len(stop))]
                    break
            seq.text += new_text
            if finish is None and len(seq.output) >= seq.params.max_tokens:
                finish = FinishReason.LENGTH
        logprobs = None
        if seq.params.logprobs and new_ids:
            top = tuple((token + k, -0.5 - k) for k in range(seq.params.top_logprobs))
            logprobs = (TokenLogprob(token, -0.5, top),)
        if finish is not None:
            del self._running[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=new_text, finish_reason=finish,
            usage=Usage(len(seq.prompt), len(seq.output), seq.num_cached), logprobs=logprobs,
            stop_reason=stop_reason,
        )


def reference_greedy_text(prompt_ids: list[int], max_tokens: int) -> str:
    """The independent truth for the fake's greedy output."""
    return bytes(ALPHABET[(sum(prompt_ids) + 7 * n) % len(ALPHABET)] for n in range(max_tokens)).decode()
