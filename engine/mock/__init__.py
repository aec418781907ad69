"""The mock engine: the real scheduler and block manager with a timing model instead of a model (no MLX here)."""

from trillm.engine.mock.events import EngineObserver, KVEvent, StepLoad, StepReport
from trillm.engine.mock.model import MockLoadedModel, MockModelSpec, make_mock_engine
from trillm.engine.mock.runner import MockRunner, Recording
from trillm.engine.mock.timing import (
    InterpolatedModel, LinearCostModel, PerfModel, PolynomialModel, StepShape, load_perf_model, save_profile,
)
from trillm.engine.mock.tokenizer import MockTokenizer
from trillm.engine.mock.trace import TraceRequest, load_trace, prompt_tokens, save_trace, synthetic_trace

__all__ = [
    "EngineObserver", "InterpolatedModel", "KVEvent", "LinearCostModel", "MockLoadedModel", "MockModelSpec",
    "MockRunner", "MockTokenizer", "PerfModel", "PolynomialModel", "Recording", "StepLoad", "StepReport",
    "StepShape", "TraceRequest", "load_perf_model", "load_trace", "make_mock_engine", "prompt_tokens",
    "save_profile", "save_trace", "synthetic_trace",
]
