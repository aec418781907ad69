"""schemathesis against the published /openapi.json of a live `trillm serve --mock`: bodies that follow the
schema and bodies that break it, for every POST endpoint; none may get a 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.generation.case import Case

from live_process import Server, trillm

PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/messages",
         "/v1/messages/count_tokens", "/v1/responses"]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    # Fast steps and a small max_tokens cap keep the schema's valid bodies quick to serve.
    server = Server(trillm("--mock", "--speedup", "1000", "--max-tokens-limit", "32", "--served-model-name", "m"))
    try:
        yield server.started_sync()
    finally:
        server.kill()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path", PATHS)
def test_schema_driven_bodies_never_get_a_5xx(server_url: str, path: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(server_url + "/openapi.json")
    operation = schema[path]["POST"]
    statuses: dict[int, int] = {}
    accepted: list[str] = []  # negative cases the server took: the failure shows them (they are rare, random)

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Case) -> None:
        response = case.call(timeout=30)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if mode is GenerationMode.NEGATIVE and response.status_code < 300 and len(accepted) < 3:
            accepted.append(f"body={case.body!r:.400} headers={case.headers!r:.200} query={case.query!r:.200}")
        case.validate_response(response, checks=[not_a_server_error])

    check()
    assert sum(statuses.values()) >= 10, statuses  # it really sent requests
    if mode is GenerationMode.NEGATIVE:
        assert set(statuses) <= {400, 404, 413, 415}, (statuses, accepted)


def test_catch_all_members_do_not_overlap_the_named_ones(server_url: str) -> None:
    """A named item kind validates under exactly one member of the published oneOf (the catch-all excludes the
    named kinds), as the server's tagged unions route it: else schemathesis's negative bodies (ambiguous under
    oneOf) get 200s."""
    spec = httpx.get(server_url + "/openapi.json").json()
    schema = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**schema, "components": spec["components"]})
    body = {"input": [{"type": "function_call_output", "call_id": "0", "output": "x", "status": "y"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "tools": [{"type": "function", "name": "f"}]}
    assert [e.message for e in validator.iter_errors(body)] == []
    assert httpx.post(server_url + "/v1/responses", json=body | {"max_output_tokens": 2}).status_code == 200


def test_a_bare_named_anthropic_block_is_not_also_the_catch_all(server_url: str) -> None:
    """{"type": "redacted_thinking"} (its data defaults) fits the named member only, as the server routes it."""
    spec = httpx.get(server_url + "/openapi.json").json()
    schema = spec["paths"]["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**schema, "components": spec["components"]})
    body = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "redacted_thinking"}, {"type": "text", "text": "a"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "b"}]}]}]}
    assert [e.message for e in validator.iter_errors(body)] == []
    assert httpx.post(server_url + "/v1/messages", json=body).status_code == 200
    image = body | {"messages": [{"role": "user", "content": [{"type": "image"}]}]}
    assert [e.message for e in validator.iter_errors(image)] == []  # the catch-all takes the other kinds
    assert httpx.post(server_url + "/v1/messages", json=image).status_code == 400  # (refused: text only)
