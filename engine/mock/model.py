"""The mock engine: a real LLMEngine (Scheduler, BlockManager, detokenizer) with a MockRunner and a
MockTokenizer, sized like a real model but loading nothing."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trillm.engine.config import EngineConfig
from trillm.engine.kv_cache import KVLayout
from trillm.engine.mock.runner import MockRunner, Recording
from trillm.engine.mock.timing import LinearCostModel, PerfModel, PolynomialModel, load_perf_model
from trillm.engine.mock.tokenizer import MockTokenizer
from trillm.engine.tokenizer import TokenizerLike

if TYPE_CHECKING:
    from trillm.engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class MockModelSpec:
    """The facts of the model being imitated (default: SmolLM2-135M-Instruct in float32)."""

    name: str = "SmolLM2-135M-Instruct-mock"
    vocab_size: int = 49152
    max_model_len: int = 8192
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    hidden_size: int = 576
    num_params: int = 134_515_008
    dtype_bytes: int = 4

    @property
    def kv_bytes_per_token(self) -> int:
        return KVLayout.uniform(self.num_layers, self.num_kv_heads, self.head_dim).bytes_per_block(1, _DType(self.dtype_bytes))

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def roofline(self, **hardware: float) -> LinearCostModel:
        """A first-principles timing model (see LinearCostModel.from_roofline for the hardware knobs)."""
        return LinearCostModel.from_roofline(
            weight_bytes=self.weight_bytes, kv_bytes_per_token=self.kv_bytes_per_token, num_params=self.num_params,
            num_layers=self.num_layers, hidden_size=self.hidden_size, **hardware,
        )


@dataclass(frozen=True, slots=True)
class _DType:
    """Stands in for an mx.Dtype where the engine only reads its size."""

    size: int


@dataclass(frozen=True)
class MockModelFacts:
    """The engine's ModelFacts (engine/runner.py) of a model that has no weights."""

    tokenizer: TokenizerLike
    model_id: str
    name: str
    eos_token_ids: frozenset[int]
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: _DType
    spec: MockModelSpec = field(default_factory=MockModelSpec)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @classmethod
    def of(cls, spec: MockModelSpec, tokenizer: TokenizerLike | None = None) -> MockModelFacts:
        """tokenizer: any other one (its vocabulary must be spec.vocab_size); default the MockTokenizer."""
        tok = tokenizer if tokenizer is not None else MockTokenizer(spec.vocab_size)
        if tok.vocab_size != spec.vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} tokens, the spec {spec.vocab_size}")
        return cls(tok, mock_model_id(spec), spec.name, tok.eos_token_ids, spec.max_model_len,
                   spec.num_layers, spec.num_kv_heads, spec.head_dim, _DType(spec.dtype_bytes), spec)


def mock_model_id(spec: MockModelSpec) -> str:
    return f"mock:{spec.name}:{spec.vocab_size}"


def mock_tokenizer_for(model_id: str) -> MockTokenizer | None:
    """The default MockTokenizer of a mock engine with this model_id (None for any other model). A mock built
    with another tokenizer has the same id: whoever relies on this checks it against the engine."""
    kind, _, rest = model_id.partition(":")
    vocab = rest.rpartition(":")[2]
    if kind != "mock" or not vocab.isdigit():
        return None
    try:
        return MockTokenizer(int(vocab))
    except ValueError:
        return None


def make_mock_engine(
    config: EngineConfig | None = None,
    *,
    spec: MockModelSpec = MockModelSpec(),
    perf: PerfModel | None = None,
    seed: int = 0,
    speedup: float = 1.0,
    recording: Recording | None = None,
    sleep: Callable[[float], None] | None = None,
    tokenizer: TokenizerLike | None = None,
    spec_acceptance: float = 0.7,
    spec_draft_cost: float = 0.0,
) -> LLMEngine:
    """An LLMEngine whose runner is a MockRunner (perf defaults to the spec's roofline model).

    sleep=None: each step's duration only travels with its results (an inline driver awaits it);
    sleep=time.sleep: collecting a step blocks until its duration has passed (real time on an engine thread).
    spec_acceptance: with --speculative (any method), the chance that each proposed token is accepted.
    spec_draft_cost: a draft model's forward as a fraction of the target's (0: proposals are free, as n-gram's).
    """
    from trillm.engine.llm_engine import LLMEngine

    model = perf if perf is not None else spec.roofline()
    vocab = spec.vocab_size

    def factory(num_blocks: int) -> MockRunner:
        return MockRunner(model, vocab_size=vocab, num_blocks=num_blocks, seed=seed, speedup=speedup,
                          recording=recording, sleep=sleep, spec_acceptance=spec_acceptance,
                          spec_draft_cost=spec_draft_cost)

    return LLMEngine(config or EngineConfig(), loaded=MockModelFacts.of(spec, tokenizer), runner_factory=factory)


def add_mock_arguments(parser: argparse.ArgumentParser) -> None:
    """The mock engine's flags (its timing model and tokens), shared by `serve --mock` and `simulate`."""
    g = parser.add_argument_group("mock engine")
    g.add_argument("--profile", default=None, help="profile JSON from `trillm bench profile` (else a roofline model)")
    g.add_argument("--perf", choices=("linear", "interpolated", "polynomial"), default="linear",
                   help="with --profile: its linear fit or interpolation; polynomial: Dynamo's default constants")
    g.add_argument("--mem-bandwidth-gbps", type=float, default=100.0, help="roofline: memory bandwidth")
    g.add_argument("--tflops", type=float, default=4.0, help="roofline: compute")
    g.add_argument("--recording", default=None, help="JSONL of prompt/output token ids to replay")
    g.add_argument("--mock-seed", type=int, default=0, help="seed of the mock's tokens")
    g.add_argument("--spec-acceptance", type=float, default=0.7,
                   help="with --speculative (any method): the chance that each proposed token is accepted; a "
                        "speculating row's verify costs its proposed tokens at the prefill's per-token rate")
    g.add_argument("--spec-draft-cost", type=float, default=0.0,
                   help="with --speculative: a draft model's decode step as a fraction of the target's; proposing k "
                        "tokens costs k such steps of the speculating rows (0: free proposals, as prompt lookup)")


def perf_from_args(args: argparse.Namespace, spec: MockModelSpec) -> PerfModel:
    if args.profile:
        return load_perf_model(args.profile, args.perf)
    if args.perf == "polynomial":
        return PolynomialModel()
    return spec.roofline(mem_bandwidth_gbps=args.mem_bandwidth_gbps, tflops=args.tflops)


def mock_engine_factory(args: argparse.Namespace, config: EngineConfig, *, speedup: float = 1.0,
                        spec: MockModelSpec = MockModelSpec()) -> Callable[[], LLMEngine]:
    """Build mock engines from `add_mock_arguments` flags (loads the profile and the recording once, here)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    perf = perf_from_args(args, spec)
    recording = Recording.load(args.recording) if args.recording else None

    def factory() -> LLMEngine:
        return make_mock_engine(config, spec=spec, perf=perf, seed=args.mock_seed, speedup=speedup,
                                recording=recording, spec_acceptance=args.spec_acceptance,
                                spec_draft_cost=args.spec_draft_cost)

    return factory
