"""What any request must satisfy to be admitted, decided from the engine's fixed facts alone.

`RequestLimits` is immutable and reads no engine state, so the web layer checks a request synchronously on
its own thread before queuing it (a refusal is an immediate error), and the scheduler checks again on add.
"""

from __future__ import annotations

from dataclasses import dataclass

from trillm.engine.errors import InvalidRequest
from trillm.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int  # prompt + generated tokens
    block_size: int
    num_usable_blocks: int  # the whole KV pool but the reserved padding block
    vocab_size: int  # valid token ids: the smaller of the tokenizer's size and the LM head's rows
    max_waiting: int  # waiting-queue bound (Overloaded past it)

    @property
    def max_group_waiting(self) -> int:
        """The most waiting sequences one client request (a group: its prompts x n) may hold: a quarter of the
        queue, so two huge requests cannot fill it and refuse everyone else."""
        return max(1, self.max_waiting // 4)

    def check_group(self, num_sequences: int) -> None:
        """Raise InvalidRequest when one request would take more than its share of the waiting queue."""
        if self.max_waiting and num_sequences > self.max_group_waiting:
            raise InvalidRequest(
                f"the request asks for {num_sequences} generations (prompts x n); one request may queue at most "
                f"{self.max_group_waiting} (a quarter of --max-waiting {self.max_waiting})")

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise InvalidRequest for what could never be served."""
        if num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty")
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {num_prompt_tokens} tokens, but the context length is {self.max_model_len}")
        max_tokens = params.max_tokens
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"{self.max_model_len}; lower max_tokens to at most {self.max_model_len - num_prompt_tokens}")
        # Token-valued parameters index the logits (logit_bias) or are compared with sampled ids.
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias) or any(
                not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequest(f"token ids in logit_bias and stop_token_ids must be in [0, {self.vocab_size})")
        need = self.blocks_needed(num_prompt_tokens + max_tokens)
        if need > self.num_usable_blocks:
            raise InvalidRequest(
                f"the request needs {need} KV blocks but the cache has only {self.num_usable_blocks}")

    def check_token_ids(self, token_ids: list[int]) -> None:
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"token ids must be integers in [0, {self.vocab_size}) (the model's vocabulary), "
                                     f"got {t!r}")
