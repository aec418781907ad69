"""Seeded, download-free benchmark workloads.

Prompts are built from a fixed list of common English words. Each word with its leading space is one token
for byte-level BPE tokenizers such as SmolLM2's, so a prompt of N words is about N tokens; the server's usage
reports the exact count. Every prompt starts with words unique to it, so unrelated requests never share a
cacheable prefix by accident. The exceptions are code-edit and chat: real text (harness/prompts.py), for
speculative decoding, whose gain depends on what the text is.
"""

from __future__ import annotations

from collections.abc import Mapping

import math
import random
from dataclasses import dataclass, field

from trillm.bench.harness.prompts import CHAT, RENAMES, code_task

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have are had not but be one "
    "all were which when their there can out we an more time about so up said into would them what some he "
    "other she than then many these may like its only new very first years after two over most also made "
    "world city water music river house people school family state year name small large long great light "
    "little water story paper garden window market winter summer morning evening history science number "
    "system village forest island mountain ocean station library kitchen teacher student doctor letter "
    "picture country animal question answer problem reason moment minute office power money friend"
).split()

# ShareGPT-like lengths: log-normal with the means the vLLM paper reports for ShareGPT (Kwon et al., SOSP'23,
# Fig. 11: mean input 161, mean output 338 tokens). The sigmas are our choice (heavy right tail, median
# about half the mean); no dataset is downloaded. mu = ln(mean) - sigma^2 / 2.
SHAREGPT_INPUT_MEAN, SHAREGPT_INPUT_SIGMA = 161.0, 1.0
SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA = 338.0, 0.9

WORKLOADS = ("random", "short", "long", "multi-turn", "shared-prefix", "sharegpt", "code-edit", "chat")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: a completion prompt or chat messages, and how many tokens to ask for."""

    request_id: str
    max_tokens: int
    prompt: str | None = None  # /v1/completions
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) for /v1/chat/completions
    prompt_words: int = 0  # the prompt's length in words, about its length in tokens
    session: str | None = None  # requests of one session run one after another, in turn order
    turn: int = 0

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in (self.messages or ())]


@dataclass(frozen=True, slots=True)
class Workload:
    """A named list of requests, plus the parameters that made it (recorded with the results)."""

    name: str
    requests: tuple[BenchRequest, ...]
    params: Mapping[str, object] = field(default_factory=dict)

    def sessions(self) -> list[list[BenchRequest]]:
        """Units of work: each session's requests in turn order; a request without a session is its own unit."""
        units: dict[str, list[BenchRequest]] = {}
        for req in self.requests:
            units.setdefault(req.session or req.request_id, []).append(req)
        return [sorted(u, key=lambda r: r.turn) for u in units.values()]


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, num_words)))


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(lo, max(lo, hi)))


def random_lengths(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.5, seed: int = 0
) -> Workload:
    """Prompt and output lengths uniform in [len * (1 - r), len * (1 + r)], like vLLM's random dataset."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    reqs = []
    for i in range(num_prompts):
        n_in, n_out = _lengths(rng, input_len, range_ratio), _lengths(rng, output_len, range_ratio)
        reqs.append(BenchRequest(f"random-{i}", n_out, prompt=_text(rng, n_in), prompt_words=n_in))
    params = dict(input_len=input_len, output_len=output_len, range_ratio=range_ratio, seed=seed)
    return Workload("random", tuple(reqs), params)


def fixed(name: str, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> Workload:
    """Every prompt input_len words long, every request asking for output_len tokens."""
    rng = random.Random(seed)
    reqs = tuple(
        BenchRequest(f"{name}-{i}", output_len, prompt=_text(rng, input_len), prompt_words=input_len)
        for i in range(num_prompts)
    )
    return Workload(name, reqs, dict(input_len=input_len, output_len=output_len, seed=seed))


def multi_turn(
    num_conversations: int,
    num_turns: int,
    user_len: int,
    assistant_len: int,
    output_len: int,
    system_len: int = 0,
    seed: int = 0,
) -> Workload:
    """Chat conversations whose turn k resends turns 1..k-1: each prompt extends the previous one's prefix.

    The assistant turns in the history are generated here, not taken from the server's replies, so every
    server sees exactly the same prompts.
    """
    rng = random.Random(seed)
    reqs = []
    for c in range(num_conversations):
        history: list[tuple[str, str]] = [("system", _text(rng, system_len))] if system_len else []
        words = system_len
        for t in range(num_turns):
            history.append(("user", _text(rng, user_len)))
            words += user_len
            reqs.append(
                BenchRequest(
                    f"conv{c}-turn{t}", output_len, messages=tuple(history), prompt_words=words,
                    session=f"conv{c}", turn=t,
                )
            )
            history.append(("assistant", _text(rng, assistant_len)))
            words += assistant_len
    params = dict(
        num_conversations=num_conversations, num_turns=num_turns, user_len=user_len,
        assistant_len=assistant_len, output_len=output_len, system_len=system_len, seed=seed,
    )
    return Workload("multi-turn", tuple(reqs), params)


def shared_prefix(num_prompts: int, system_len: int, question_len: int, output_len: int, seed: int = 0) -> Workload:
    """Chat requests that all share one long system prompt, each with its own short question."""
    rng = random.Random(seed)
    system = _text(rng, system_len)
    reqs = tuple(
        BenchRequest(
            f"shared-{i}", output_len, messages=(("system", system), ("user", _text(rng, question_len))),
            prompt_words=system_len + question_len,
        )
        for i in range(num_prompts)
    )
    params = dict(system_len=system_len, question_len=question_len, output_len=output_len, seed=seed)
    return Workload("shared-prefix", reqs, params)


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))


def sharegpt_like(
    num_prompts: int, scale: float = 1.0, max_input: int = 1024, max_output: int = 1024, seed: int = 0
) -> Workload:
    """ShareGPT-like prompt/output lengths from log-normals (see SHAREGPT_*); scale shrinks both means."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num_prompts):
        n_in = _lognormal(rng, SHAREGPT_INPUT_MEAN * scale, SHAREGPT_INPUT_SIGMA, 4, max_input)
        n_out = _lognormal(rng, SHAREGPT_OUTPUT_MEAN * scale, SHAREGPT_OUTPUT_SIGMA, 4, max_output)
        reqs.append(BenchRequest(f"sharegpt-{i}", n_out, prompt=_text(rng, n_in), prompt_words=n_in))
    params = dict(
        input_mean=SHAREGPT_INPUT_MEAN, input_sigma=SHAREGPT_INPUT_SIGMA, output_mean=SHAREGPT_OUTPUT_MEAN,
        output_sigma=SHAREGPT_OUTPUT_SIGMA, scale=scale, max_input=max_input, max_output=max_output, seed=seed,
    )
    return Workload("sharegpt", tuple(reqs), params)


def code_edit(num_prompts: int, output_len: int, seed: int = 0) -> Workload:
    """Chat requests whose user message is a Python file and a rename in it: the answer repeats the prompt.

    The renames cycle from `seed` on; every prompt shares the file, as edits of one file do.
    """
    reqs = []
    for i in range(num_prompts):
        text = code_task(*RENAMES[(seed + i) % len(RENAMES)])
        reqs.append(BenchRequest(f"code-edit-{i}", output_len, messages=(("user", text),),
                                 prompt_words=len(text.split())))
    return Workload("code-edit", tuple(reqs), dict(output_len=output_len, seed=seed))


def chat(num_prompts: int, output_len: int, seed: int = 0) -> Workload:
    """Plain chat questions (prompts.CHAT, cycled from `seed` on), each tagged with its number so no two are equal."""
    reqs = []
    for i in range(num_prompts):
        text = f"{CHAT[(seed + i) % len(CHAT)]} (#{i})"
        reqs.append(BenchRequest(f"chat-{i}", output_len, messages=(("user", text),), prompt_words=len(text.split())))
    return Workload("chat", tuple(reqs), dict(output_len=output_len, seed=seed))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The knobs `bench serve` exposes, shared by every workload generator."""

    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.5
    short_len: int = 32
    long_len: int = 1024
    num_turns: int = 4
    system_len: int = 512
    scale: float = 1.0
    seed: int = 0


def build(name: str, spec: WorkloadSpec) -> Workload:
    """Build the named workload (one of WORKLOADS) from spec."""
    s = spec
    if name == "random":
        return random_lengths(s.num_prompts, s.input_len, s.output_len, s.range_ratio, s.seed)
    if name == "short":
        return fixed("short", s.num_prompts, s.short_len, s.output_len, s.seed)
    if name == "long":
        return fixed("long", s.num_prompts, s.long_len, s.output_len, s.seed)
    if name == "multi-turn":
        convs = max(1, s.num_prompts // s.num_turns)
        return multi_turn(convs, s.num_turns, s.input_len, s.output_len, s.output_len, s.system_len, s.seed)
    if name == "shared-prefix":
        return shared_prefix(s.num_prompts, s.system_len, max(1, s.input_len // 4), s.output_len, s.seed)
    if name == "sharegpt":
        return sharegpt_like(s.num_prompts, s.scale, seed=s.seed)
    if name == "code-edit":
        return code_edit(s.num_prompts, s.output_len, s.seed)
    if name == "chat":
        return chat(s.num_prompts, s.output_len, s.seed)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
