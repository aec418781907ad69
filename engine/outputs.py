"""What the engine hands back each step: one frozen delta per request that made progress."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the engine failed while serving it
    GRAMMAR = "grammar"  # its grammar could not be continued (RequestOutput.error says why); the text stops there
    TIMEOUT = "timeout"  # its deadline passed (decided by the web layer, which aborted it: its blocks are freed)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs carry it, as vLLM's do)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens and text of one request since the previous step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: FinishReason | None
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per new token, when asked for
    # One per prompt token (None for the first, which nothing predicts), in the request's first delta only.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def concat(cls, outs: Sequence[RequestOutput]) -> RequestOutput:
        """Consecutive deltas of one request as one delta: tokens, text and logprobs joined, the last's state."""
        last = outs[-1]
        lps = tuple(lp for o in outs if o.logprobs for lp in o.logprobs)
        return cls(
            request_id=last.request_id,
            new_token_ids=tuple(t for o in outs for t in o.new_token_ids),
            new_text="".join(o.new_text for o in outs),
            finish_reason=last.finish_reason,
            usage=last.usage,
            logprobs=lps if any(o.logprobs is not None for o in outs) else None,
            prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
            stop_reason=last.stop_reason,
            error=last.error,
        )


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int  # free blocks still holding a matchable prefix
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_prompt_tokens: int  # prompt tokens computed so far (cache hits excluded)
    num_generation_tokens: int
    num_preemptions: int
    num_steps: int
    prompt_tokens_per_s: float  # over the recent window
    generation_tokens_per_s: float
    # Speculative decoding (engine/spec_decode.py): proposed tokens verified, those accepted, and the row-steps
    # that verified a proposal (each yields its accepted tokens + 1).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifies: int = 0
    # Memory (engine/memory.py): the process's resident bytes now and at its peak, its limit (0: none), and the
    # KV pool's bytes allocated and in use (engine/kv_slabs.py).
    memory_rss_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    kv_pool_bytes: int = 0
    kv_pool_used_bytes: int = 0
    # The prefix cache's disk tier (engine/kv_disk.py): prompt tokens loaded from it (also in prefix_cache_hits);
    # of the blocks past its memory hits that admission looked up there, those loaded and those not; the blocks
    # and bytes it holds, blocks written, writes dropped (its queue was full), bad files found (deleted, their
    # blocks recomputed), and the seconds its threads spent reading (with the check) and writing files.
    kv_disk_hit_tokens: int = 0
    kv_disk_hit_blocks: int = 0
    kv_disk_miss_blocks: int = 0
    kv_disk_blocks: int = 0
    kv_disk_bytes: int = 0
    kv_disk_writes: int = 0
    kv_disk_dropped_writes: int = 0
    kv_disk_corrupt_blocks: int = 0
    kv_disk_read_seconds: float = 0.0
    kv_disk_write_seconds: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_tokens_per_verify(self) -> float:
        """Tokens a speculating row got per forward it ran (1.0 without speculation)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_verifies if self.spec_verifies else 1.0
