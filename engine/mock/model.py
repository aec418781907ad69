"""The mock engine: a real LLMEngine (Scheduler, BlockManager, detokenizer) with a MockRunner and a
MockTokenizer, sized like a real model but loading nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trillm.engine.config import EngineConfig
from trillm.engine.mock.runner import MockRunner, Recording
from trillm.engine.mock.timing import LinearCostModel, PerfModel
from trillm.engine.mock.tokenizer import MockTokenizer

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
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

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
class MockLoadedModel:
    """Duck-types engine.loader.LoadedModel (which imports MLX) with no weights: model is None."""

    tokenizer: MockTokenizer
    model_id: str
    name: str
    eos_token_ids: frozenset[int]
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: _DType
    spec: MockModelSpec = field(default_factory=MockModelSpec)
    model: None = None

    @property
    def num_parameters(self) -> int:
        return self.spec.num_params

    @property
    def num_bytes(self) -> int:
        return self.spec.weight_bytes

    @classmethod
    def of(cls, spec: MockModelSpec) -> MockLoadedModel:
        tok = MockTokenizer(spec.vocab_size)
        return cls(tok, f"mock:{spec.name}:{spec.vocab_size}", spec.name, tok.eos_token_ids, spec.max_model_len,
                   spec.num_layers, spec.num_kv_heads, spec.head_dim, _DType(spec.dtype_bytes), spec)


def make_mock_engine(
    config: EngineConfig | None = None,
    *,
    spec: MockModelSpec = MockModelSpec(),
    perf: PerfModel | None = None,
    seed: int = 0,
    speedup: float = 1.0,
    recording: Recording | None = None,
    sleep: Callable[[float], None] | None = None,
) -> LLMEngine:
    """An LLMEngine whose runner is a MockRunner (perf defaults to the spec's roofline model).

    sleep=None: the runner only records each step's duration in `engine.runner.last_step_s` (a trio driver
    awaits it); sleep=time.sleep: the step blocks for it (real time on an engine thread).
    """
    from trillm.engine.llm_engine import LLMEngine  # imports MLX; the rest of the mock does not

    model = perf if perf is not None else spec.roofline()
    vocab = spec.vocab_size

    def factory(num_blocks: int) -> MockRunner:
        return MockRunner(model, vocab_size=vocab, num_blocks=num_blocks, seed=seed, speedup=speedup,
                          recording=recording, sleep=sleep)

    return LLMEngine(config or EngineConfig(), loaded=MockLoadedModel.of(spec), runner_factory=factory)  # type: ignore[arg-type]
