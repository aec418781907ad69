"""Per-request generation parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np

from trillm.engine.errors import InvalidRequest
from trillm.engine.grammar import GrammarSpec

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What one request asks of the sampler and the stop logic.

    temperature 0 means greedy. top_k <= 0 and top_p = 1 disable those filters. Penalties follow OpenAI
    (presence/frequency, over generated tokens) and vLLM (repetition, over prompt and generated tokens).
    prompt_logprobs (vLLM's name): the logprob of every prompt token after the first, with this many top
    alternatives per position (0: the prompt token's own only); None: not computed. max_tokens 0 generates
    nothing: the request ends after its prompt is computed (pure scoring).
    """

    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # isolates this request's prefix-cache entries (vLLM's cache_salt)
    grammar: GrammarSpec | None = None  # the output must match it (constrained decoding, engine/grammar.py)
    speculative: bool = True  # False: never speculate for this request, even when the engine does (--speculative)
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
    # logit_bias as arrays, built once here rather than in the sampler at every step
    _bias_ids: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _bias_values: np.ndarray = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequest(msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            bad(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            bad(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        for tok, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                bad(f"logit_bias values must be in [-100, 100], got {bias!r}")
            if not 0 <= tok < 2**31:
                bad(f"logit_bias keys must be token ids, got {tok!r}")
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            bad("stop_token_ids must be token ids")
        if self.seed is not None and not -(2**63) < self.seed < 2**63:
            bad("seed must fit in 64 bits")
        if not isinstance(cast(object, self.speculative), bool):  # the engine's callers are not all typed
            bad(f"speculative must be true or false, got {self.speculative!r}")
        object.__setattr__(self, "_bias_ids", np.fromiter((t for t, _ in self.logit_bias), np.int32, len(self.logit_bias)))
        object.__setattr__(self, "_bias_values",
                           np.fromiter((b for _, b in self.logit_bias), np.float32, len(self.logit_bias)))

    @property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32 [K], biases float32 [K])."""
        return self._bias_ids, self._bias_values

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
