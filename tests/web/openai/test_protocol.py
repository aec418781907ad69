"""Request parsing and response building (pure functions), and the CLI's argument handling."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trillm.engine.admission import RequestLimits
from trillm.engine.errors import InvalidRequest
from trillm.engine.mock.tokenizer import MockTokenizer
from trillm.engine.outputs import FinishReason, RequestOutput, TokenLogprob, Usage
from trillm.web.cli import build_parser, main
from trillm.web.errors import parse_body
from trillm.web.openai.request import GenerationRequest, Limits, parse_generation
from trillm.web.openai.response import response_builder
from trillm.web.openai.schema import ChatCompletionRequest, CompletionRequest

TOK = MockTokenizer(1000)


MODEL = RequestLimits(max_model_len=100, block_size=16, num_usable_blocks=1000, vocab_size=TOK.vocab_size,
                      max_waiting=10)


def parse(body: dict[str, Any], kind: str = "chat", limits: Limits = Limits()) -> GenerationRequest:
    """Through the same two steps as the server: the declared body model, then the translation."""
    schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
    return parse_generation(parse_body(schema, json.dumps(body)), "m", TOK, MODEL, limits)


def test_sampling_parameters_map_to_engine_names() -> None:
    req = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1,
                 "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                 "logit_bias": {"5": -100}, "stop": "x", "seed": 3, "n": 2, "logprobs": True, "top_logprobs": 3,
                 "stream": True, "stream_options": {"include_usage": True}})
    p0, p1 = req.params
    assert req.prompt_token_ids == TOK.apply_chat_template([{"role": "user", "content": "hi"}])
    assert (p0.max_tokens, p0.temperature, p0.top_p, p0.top_k, p0.min_p) == (7, 0.5, 0.9, 4, 0.1)
    assert (p0.presence_penalty, p0.frequency_penalty, p0.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p0.logit_bias == ((5, -100.0),) and p0.stop == ("x",) and p0.logprobs and p0.top_logprobs == 3
    assert (p0.seed, p1.seed) == (3, 4) and req.stream and req.include_usage


def test_max_tokens_defaults_and_limits() -> None:
    assert parse({"prompt": "abc"}, "completion").params[0].max_tokens == 16
    chat = parse({"messages": [{"role": "user", "content": "a"}]})
    assert chat.params[0].max_tokens == 100 - len(chat.prompt_token_ids)
    assert parse({"messages": [{"role": "user", "content": "a"}]}, limits=Limits(max_tokens_limit=5)).params[0].max_tokens == 5
    with pytest.raises(InvalidRequest, match="at most 5"):
        parse({"prompt": "a", "max_tokens": 6}, "completion", Limits(max_tokens_limit=5))
    with pytest.raises(InvalidRequest, match="at most 2"):
        parse({"prompt": "a b c"}, "completion", Limits(max_prompt_tokens=2))


@pytest.mark.parametrize("body", [
    {"messages": []}, {"messages": [{"content": "x"}]}, {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": "x"}], "n": 0},
    {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": True},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
    {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}},
])
def test_bad_chat_bodies_are_invalid_requests(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        parse(body)


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], ["a", [1]], [[1], []], [[10**6]], [10**6], [True]])
def test_bad_completion_prompts(prompt: Any) -> None:
    with pytest.raises(InvalidRequest):
        parse({"prompt": prompt}, "completion")


def test_token_id_prompt_and_batch_of_one() -> None:
    assert parse({"prompt": [5, 6, 7]}, "completion").prompt_token_ids == [5, 6, 7]
    assert parse({"prompt": ["ab"]}, "completion").prompt_token_ids == TOK.encode("ab", add_special_tokens=True)


def test_merge_outputs_concatenates_and_keeps_the_latest_state() -> None:
    u1, u2 = Usage(3, 1, 0), Usage(3, 3, 0)
    a = RequestOutput("r", (10,), "a", None, u1, (TokenLogprob(10, -1.0),))
    b = RequestOutput("r", (11, 12), "bc", FinishReason.LENGTH, u2, (TokenLogprob(11, -2.0), TokenLogprob(12, -3.0)))
    m = RequestOutput.concat([a, b])
    assert (m.new_token_ids, m.new_text, m.finish_reason, m.usage) == ((10, 11, 12), "abc", FinishReason.LENGTH, u2)
    assert [lp.token_id for lp in m.logprobs or ()] == [10, 11, 12]


def test_n_choices_usage_counts_the_prompt_once() -> None:
    req = parse({"prompt": "ab", "n": 2}, "completion")
    b = response_builder(req, ("x", "y"), TOK)
    b.add(RequestOutput("x", (100,), "a", FinishReason.STOP, Usage(3, 1, 2)))
    b.add(RequestOutput("y", (100, 101), "ab", FinishReason.LENGTH, Usage(3, 2, 2)))
    resp = b.response()
    assert [c["finish_reason"] for c in resp["choices"]] == ["stop", "length"]
    assert resp["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 2}}


def test_cli_serve_flags_fill_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    from trillm.engine.config import EngineConfig, engine_config_from_args

    args = build_parser().parse_args(["serve", "--model", "a", "--model", "b", "--port", "9000", "--api-key", "k",
                                      "--max-num-seqs", "8", "--no-prefix-caching", "--max-tokens-limit", "64"])
    assert args.model == ["a", "b"] and args.port == 9000 and args.api_key == "k" and args.max_tokens_limit == 64
    config = engine_config_from_args(args, "a")
    assert config == EngineConfig(model="a", max_num_seqs=8, enable_prefix_caching=False)  # the rest: defaults
    assert main(["serve", "--model", "a", "--served-model-name", "x", "--served-model-name", "y"]) == 2
    assert "one --served-model-name per --model" in capsys.readouterr().err
    assert main(["serve", "--mock", "--model", "a"]) == 2
    assert main(["bench", "--help"]) == 0
    sim = build_parser().parse_args(["simulate", "--synthetic", "--max-num-seqs", "4", "--perf", "polynomial"])
    assert engine_config_from_args(sim).max_num_seqs == 4 and sim.perf == "polynomial"
