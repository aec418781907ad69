"""What LLMEngine needs from a model's facts and from a runner (the MLX ModelRunner, or the mock's
timing-model runner).

A step is launched, then collected: `launch` queues the step's work and returns at once; `collect` waits for
it (the step's one host sync) and reads its tokens back. A runner that `supports_launch_ahead` may be handed
the next decode step while the previous one is still unread: `launch(..., after=previous)` feeds each
decode row the token `previous` sampled for it, without reading it back first. Prompt logprobs (prefill
chunks of requests that ask for them) are read after `collect`, by `collect_prompt_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from trillm.engine.scheduler import SampledToken, ScheduledBatch
from trillm.engine.sequence import Sequence

if TYPE_CHECKING:
    from trillm.engine.kv_cache import DTypeLike
    from trillm.engine.prompt_logprobs import ScoredSpan
    from trillm.engine.sampler import SampleRow
    from trillm.engine.tokenizer import TokenizerLike

RowsFn = Callable[[Sequence], "SampleRow"]


class ModelFacts(Protocol):
    """What LLMEngine sizes itself by: a LoadedModel (engine/loader.py) or weightless facts (the mock's)."""

    @property
    def tokenizer(self) -> TokenizerLike: ...
    @property
    def model_id(self) -> str: ...  # stable across processes; seeds prefix-cache block hashes
    @property
    def name(self) -> str: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> DTypeLike: ...
    @property
    def vocab_size(self) -> int: ...  # rows of the logits; 0: unknown (the tokenizer's size is used)


@dataclass(slots=True)
class Launch:
    """A step queued on the device and not read back yet."""

    batch: ScheduledBatch
    seqs: list[Sequence]  # the sampled rows, in the runner's order (decodes first)
    pending: object  # the runner's own handle on the unread results
    virtual_seconds: float | None = None  # a simulated step's duration; None: its wall time is its duration
    prompt_logprobs: object = None  # the runner's own handle on the step's unread prompt logprobs, if any


class Runner(Protocol):
    supports_launch_ahead: bool

    def launch(self, batch: ScheduledBatch, rows: RowsFn, check_abort: Callable[[], None] | None = None, *,
               after: Launch | None = None) -> Launch: ...

    def collect(self, launch: Launch) -> list[SampledToken]: ...

    def collect_prompt_logprobs(self, launch: Launch) -> list[ScoredSpan]:
        """The prompt logprobs the collected step computed, one span per scored prefill chunk."""
        ...


RunnerFactory = Callable[[int], Runner]  # num_blocks -> the runner over a pool of that many blocks
