"""A request's state as it moves through the scheduler: pure Python, no MLX."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count

from typing import TYPE_CHECKING

from trillm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trillm.engine.grammar import GrammarMatcher
    from trillm.engine.ngram import SpecState

_arrival_counter = count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request. `token_ids` is prompt + output; KV exists for the first `num_computed_tokens` of them.

    A running sequence has `num_pending_tokens` tokens still to feed through the model: the rest of its
    prompt while prefilling, exactly one (the last sampled token) while decoding.
    """

    __slots__ = (
        "request_id", "params", "priority", "arrival", "token_ids", "num_prompt_tokens",
        "num_computed_tokens", "num_cached_tokens", "block_table", "num_hashed_blocks", "block_hashes",
        "status", "num_preemptions", "grammar", "group", "tag", "rank", "spec",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
                 group: str | None = None) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival = next(_arrival_counter)  # FCFS order within a priority
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading full blocks already registered in the prefix cache
        self.block_hashes: list[bytes] = []  # chained hash of each full block of token_ids
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.grammar: GrammarMatcher | None = None  # set by the engine when params.grammar is given
        # Fair admission (Scheduler.add): the sequences of one client request share a group, and each gets a
        # fair-queueing tag, so one request's later prompts and choices queue behind other groups' first.
        self.group = group
        self.tag = 0
        # The scheduling policy's class (Scheduler.add): 0 for every sequence under fcfs and aged priority
        # (where the priority is folded into the tag instead), the priority itself under strict priority.
        self.rank = priority
        self.spec: SpecState | None = None  # set by the engine when this sequence may speculate

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, int, int]:
        return (self.rank, self.tag, self.arrival)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
