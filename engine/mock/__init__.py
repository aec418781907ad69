"""The mock engine: the real LLMEngine, Scheduler and BlockManager with a timing model instead of a model.

It loads no weights: a `MockRunner` prices each step with a `PerfModel` and makes up (or replays) tokens, and a
`MockTokenizer` stands in for the model's. `trillm serve --mock` serves it; `trillm simulate` (trillm.bench)
replays request traces on it in virtual time. Imports: trillm.engine only.
"""

from trillm.engine.mock.model import (
    MockModelFacts, MockModelSpec, add_mock_arguments, make_mock_engine, mock_engine_factory, mock_model_id,
    mock_tokenizer_for, perf_from_args,
)
from trillm.engine.mock.runner import MockRunner, Recording
from trillm.engine.mock.timing import (
    InterpolatedModel, LinearCostModel, PerfModel, PolynomialModel, StepShape, load_perf_model, save_profile,
)
from trillm.engine.mock.tokenizer import MockTokenizer
from trillm.engine.mock.trace import (
    TraceRequest, load_trace, multi_turn_trace, prompt_tokens, save_trace, synthetic_trace,
)

__all__ = [
    "InterpolatedModel", "LinearCostModel", "MockModelFacts", "MockModelSpec", "MockRunner", "MockTokenizer",
    "PerfModel", "PolynomialModel", "Recording", "StepShape", "TraceRequest", "add_mock_arguments",
    "load_perf_model", "load_trace", "make_mock_engine", "mock_engine_factory", "mock_model_id", "mock_tokenizer_for", "multi_turn_trace",
    "perf_from_args",
    "prompt_tokens", "save_profile", "save_trace", "synthetic_trace",
]
